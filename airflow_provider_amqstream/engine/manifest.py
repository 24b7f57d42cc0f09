"""Batch manifests on the receiving side: once every file a sender's batch message lists
is published in this output directory, write ``out_dir/<batch id>.manifest.jsonl``.

A batch message may arrive before or after its files are published (several receivers,
a stream that yielded), so its parts are kept in ``.amqstream/batches/`` until the last
listed stream is published here. The manifest is written to a temporary file in the
state directory, fsynced and renamed into place: a reader sees all of it or none.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from airflow_provider_amqstream import bulk_wire as bw
from airflow_provider_amqstream import protocol as p
from airflow_provider_amqstream.engine.records import open_private, read_json, write_json

log = logging.getLogger(__name__)


def manifest_path(out_dir: str | os.PathLike[str], batch_id: str) -> Path:
    """Where the manifest of ``batch_id`` appears once the batch is complete in ``out_dir``."""
    return Path(out_dir) / f"{p.validate_stream_id(batch_id)}.manifest.jsonl"


class Batches:
    """The batches this output directory waits on, and which of their streams are missing."""

    def __init__(self, out: Path, sdir: Path) -> None:
        self.out, self.dir = out, sdir / "batches"
        self.missing: dict[str, set[str]] = {}
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        if not self.dir.is_dir():
            return
        for f in sorted(self.dir.glob("*.1.json")):
            self._check(f.name.removesuffix(".1.json"))

    def record(self, batch_id: str, part: int, parts: int, entries: list[bw.BatchEntry]) -> Path | None:
        """Keep one part; return the manifest's path if the batch is now complete."""
        self._load()
        write_json(self.dir / f"{batch_id}.{part}.json", {
            "batch_id": batch_id, "part": part, "parts": parts,
            "entries": [{"stream_id": e.stream_id, "bytes": e.size, "sha256": e.sha256} for e in entries]})
        return self._check(batch_id)

    def published(self, stream_id: str) -> list[Path]:
        """A stream was published here; return the manifests this completed."""
        self._load()
        done = []
        for batch_id, missing in list(self.missing.items()):
            missing.discard(stream_id)
            if not missing:
                path = self._check(batch_id)
                if path is not None:
                    done.append(path)
        return done

    def _parts(self, batch_id: str) -> list[dict[str, Any]] | None:
        first = read_json(self.dir / f"{batch_id}.1.json")
        if first is None:
            return None
        parts = [first]
        for k in range(2, int(first["parts"]) + 1):
            data = read_json(self.dir / f"{batch_id}.{k}.json")
            if data is None:
                return None
            parts.append(data)
        return parts

    def _check(self, batch_id: str) -> Path | None:
        try:
            parts = self._parts(batch_id)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("batch %s: its recorded list in %s is unreadable (%s); no manifest", batch_id, self.dir, exc)
            return None
        if parts is None:
            return None
        entries = [e for part in parts for e in part["entries"]]
        records = {}
        missing = set()
        for e in entries:
            rec = read_json(self.dir.parent / f"{e['stream_id']}.done")
            if rec is None:
                missing.add(e["stream_id"])
            else:
                records[e["stream_id"]] = rec
        if missing:
            self.missing[batch_id] = missing
            return None
        self.missing.pop(batch_id, None)
        return self._write(batch_id, entries, records, len(parts))

    def _write(self, batch_id: str, entries: list[dict[str, Any]], records: dict[str, dict[str, Any]],
               nparts: int) -> Path:
        lines = []
        for e in entries:
            rec = records[e["stream_id"]]
            if rec.get("sha256") != e["sha256"] or int(rec.get("bytes", -1)) != int(e["bytes"]):
                log.warning("batch %s: stream %s was published with sha256 %s, the batch lists %s", batch_id,
                            e["stream_id"], rec.get("sha256"), e["sha256"])
            rel = os.path.relpath(str(rec["path"]), self.out)
            lines.append(json.dumps({"path": rel, "bytes": rec["bytes"], "sha256": rec["sha256"],
                                     "stream_id": e["stream_id"]}, ensure_ascii=False))
        final = manifest_path(self.out, batch_id)
        tmp = self.dir / f"{batch_id}.manifest.tmp"
        tmp.unlink(missing_ok=True)
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            os.fsync(fh.fileno())
        # A rename replaces whatever holds the name (a link included), never follows it.
        os.replace(tmp, final)
        for k in range(1, nparts + 1):
            (self.dir / f"{batch_id}.{k}.json").unlink(missing_ok=True)
        log.info("batch %s complete: %d files; manifest %s", batch_id, len(lines), final)
        return final
