"""Batch manifests on the receiving side: once every file a sender's batch message lists
is published in this output directory, write the batch's manifest.

Everything here lives under the state directory, where no name a sender chooses can land
(a sender's directories lose their leading dots), and is kept per sender, as the broker
names it (``JMSXUserID``): a second user announcing the same batch id gets a batch of its
own, never a share of another's, and a batch lists only streams its own sender sent.

* ``.amqstream/batches/<sender>/<batch id>.<part>.json``: the parts of a batch still
  waiting for files, at most :data:`MAX_PENDING` batches per directory (the oldest go
  first) and none older than :data:`MAX_AGE`.
* ``.amqstream/manifests/<sender>/<batch id>.manifest.jsonl``: written to a temporary
  file, fsynced and renamed into place, so a reader sees all of it or none. Its rows name
  files relative to the output directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.receive.claims import find_received_many
from airflow_provider_amqstream.engine.records import STATE_DIR_NAME, open_private, read_json, write_json
from airflow_provider_amqstream.exceptions import StreamError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import wire as p

log = logging.getLogger(__name__)

# Batches a directory waits on at once; a sender announcing batches whose files never come
# pushes out its own oldest first (and everyone's, past this many: the figure is per directory).
MAX_PENDING = 64
# A batch whose files have not all come in this long is forgotten.
MAX_AGE = 2 * 86400.0
# Where the broker stamps no sender (an external broker without populateJMSXUserID).
UNIDENTIFIED = "_unidentified"
_PLAIN_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def sender_dir(sender: str) -> str:
    """The directory name a sender's batches and manifests are kept under: its user name
    when that is a plain name, else a digest of it."""
    if not sender:
        return UNIDENTIFIED
    if _PLAIN_USER.fullmatch(sender):
        return sender
    return "u-" + hashlib.sha256(sender.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def manifest_path(out_dir: str | os.PathLike[str], batch_id: str, sender: str = "") -> Path:
    """Where the manifest of ``batch_id`` sent by ``sender`` appears once the batch is
    complete in ``out_dir``.

    :param out_dir: the receiver's output directory.
    :param batch_id: the batch (a sender's ``totals["batch_id"]``).
    :param sender: the sending user as the broker knows it ("" where the broker stamps none).
    """
    return (Path(out_dir) / STATE_DIR_NAME / "manifests" / sender_dir(sender)
            / f"{p.validate_stream_id(batch_id)}.manifest.jsonl")


def find_manifest(out_dir: str | os.PathLike[str], batch_id: str, sender: str | None = None) -> Path | None:
    """The manifest of ``batch_id`` in ``out_dir`` if it is complete, else None.

    Without ``sender``, the batch id must have been completed by one sender only: two users
    completing batches under the same id raise :class:`StreamError` naming them, since
    picking one would hand a job the wrong files.

    :param out_dir: the receiver's output directory.
    :param batch_id: the batch.
    :param sender: the sending user; None for whoever sent it.
    """
    if sender is not None:
        path = manifest_path(out_dir, batch_id, sender)
        return path if path.is_file() else None
    name = f"{p.validate_stream_id(batch_id)}.manifest.jsonl"
    root = Path(out_dir) / STATE_DIR_NAME / "manifests"
    try:
        found = sorted(d / name for d in root.iterdir() if (d / name).is_file())
    except FileNotFoundError:
        return None
    if len(found) > 1:
        raise StreamError(f"batch {batch_id} in {out_dir} was completed by {len(found)} senders "
                          f"({', '.join(f.parent.name for f in found)}); name the one you expect (batch_sender, "
                          "--batch-sender)")
    return found[0] if found else None


class Batches:
    """The batches this output directory waits on, and which of their streams are missing."""

    def __init__(self, out: Path, sdir: Path, *, retention_days: float | None = None) -> None:
        self.out, self.root = out, sdir / "batches"
        self.retention_days = retention_days  # the directory's record retention (None: the default)
        # (sender dir, batch id) -> stream ids still missing; at most MAX_PENDING entries.
        self.missing: dict[tuple[str, str], set[str]] = {}
        self._loaded = False

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for owner, batch_id in self._prune():
            self._check(owner, batch_id)

    def _prune(self) -> list[tuple[str, str]]:
        """The pending batches on disk, newest last, after forgetting those past the age or
        count bound (their parts are removed)."""
        firsts: list[tuple[float, str, str]] = []
        try:
            owners = [d for d in self.root.iterdir() if d.is_dir()]
        except FileNotFoundError:
            return []
        for d in owners:
            for f in d.glob("*.1.json"):
                try:
                    firsts.append((f.stat().st_mtime, d.name, f.name.removesuffix(".1.json")))
                except FileNotFoundError:
                    continue
        firsts.sort()
        cutoff = time.time() - MAX_AGE
        keep = firsts[-MAX_PENDING:]
        for when, owner, batch_id in firsts:
            if when < cutoff or (when, owner, batch_id) not in keep:
                log.warning("batch %s of %s in %s: forgotten, its files did not all come (kept at most %d "
                            "batches for at most %.0f h)", batch_id, owner, self.out, MAX_PENDING, MAX_AGE / 3600)
                self._forget(owner, batch_id)
        return [(o, b) for w, o, b in keep if w >= cutoff]

    def record(self, batch_id: str, part: int, parts: int, entries: list[bw.BatchEntry],
               sender: str = "") -> Path | None:
        """Keep one part of ``sender``'s batch; return the manifest's path if the batch is
        now complete."""
        self._load()
        owner = sender_dir(sender)
        write_json(self.root / owner / f"{batch_id}.{part}.json", {
            "batch_id": batch_id, "part": part, "parts": parts, "sender": sender,
            "entries": [{"stream_id": e.stream_id, "bytes": e.size, "sha256": e.sha256} for e in entries]})
        if part == 1:
            kept = set(self._prune())
            self.missing = {k: v for k, v in self.missing.items() if k in kept}
        return self._check(owner, batch_id)

    def published(self, stream_id: str) -> list[Path]:
        """A stream was published here; return the manifests this completed."""
        self._load()
        done = []
        for key, missing in list(self.missing.items()):
            missing.discard(stream_id)
            if not missing:
                path = self._check(*key)
                if path is not None:
                    done.append(path)
        return done

    def _head(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        """The batch's first part if every part of it is here, else None."""
        first = read_json(self.root / owner / f"{batch_id}.1.json")
        if first is None:
            return None
        for k in range(2, int(first["parts"]) + 1):
            if not (self.root / owner / f"{batch_id}.{k}.json").is_file():
                return None
        return first

    def _entries(self, owner: str, batch_id: str, nparts: int) -> Iterator[dict[str, Any]]:
        """The batch's entries, one part read at a time (a part lists at most
        ``BATCH_PART_FILES``): a batch of a million files is never one list."""
        for k in range(1, nparts + 1):
            data = read_json(self.root / owner / f"{batch_id}.{k}.json")
            if data is None:
                raise ValueError(f"part {k} of {nparts} went missing")
            yield from data["entries"]

    def _with_records(self, owner: str, batch_id: str,
                      nparts: int) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
        """Each entry of the batch with its stream's completion record (None if not received
        here): the records of a part looked up together, one part at a time."""
        part: list[dict[str, Any]] = []
        for e in self._entries(owner, batch_id, nparts):
            part.append(e)
            if len(part) == bw.BATCH_PART_FILES:
                yield from self._records_of(part)
                part = []
        yield from self._records_of(part)

    def _records_of(self, entries: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
        if not entries:
            return
        known = find_received_many(self.out, [e["stream_id"] for e in entries], retention_days=self.retention_days)
        for e in entries:
            yield e, known.get(e["stream_id"])

    def _check(self, owner: str, batch_id: str) -> Path | None:
        key = (owner, batch_id)
        try:
            first = self._head(owner, batch_id)
            if first is None:
                self.missing.pop(key, None)
                return None
            sender = str(first.get("sender") or "")
            nparts = int(first["parts"])
            missing = set()
            for e, rec in self._with_records(owner, batch_id, nparts):
                if rec is None:
                    missing.add(e["stream_id"])
                    continue
                if str(rec.get("sender") or "") != sender:
                    log.warning("batch %s of %s lists stream %s, which %s sent: a batch lists only its own "
                                "sender's files; the batch is dropped", batch_id, owner, e["stream_id"],
                                rec.get("sender") or "an unidentified sender")
                    self._forget(owner, batch_id)
                    return None
            if missing:
                self.missing[key] = missing
                return None
            self.missing.pop(key, None)
            return self._write(owner, batch_id, sender, nparts)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("batch %s of %s: its recorded list in %s is unreadable (%s); no manifest", batch_id, owner,
                        self.root, exc)
            return None

    def _forget(self, owner: str, batch_id: str) -> None:
        self.missing.pop((owner, batch_id), None)
        for f in (self.root / owner).glob(f"{batch_id}.*.json"):
            f.unlink(missing_ok=True)

    def _write(self, owner: str, batch_id: str, sender: str, nparts: int) -> Path:
        """Write the manifest a row at a time, each from the stream's completion record."""
        final = manifest_path(self.out, batch_id, sender)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / owner / f"{batch_id}.manifest.tmp"
        tmp.unlink(missing_ok=True)
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        rows = 0
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for e, rec in self._with_records(owner, batch_id, nparts):
                if rec is None:
                    raise ValueError(f"the completion record of stream {e['stream_id']} went missing")
                if rec.get("sha256") != e["sha256"] or int(rec.get("bytes", -1)) != int(e["bytes"]):
                    log.warning("batch %s: stream %s was published with sha256 %s, the batch lists %s", batch_id,
                                e["stream_id"], rec.get("sha256"), e["sha256"])
                rel = os.path.relpath(str(rec["path"]), self.out)
                fh.write(json.dumps({"path": rel, "bytes": rec["bytes"], "sha256": rec["sha256"],
                                     "stream_id": e["stream_id"]}, ensure_ascii=False) + "\n")
                rows += 1
            fh.flush()
            os.fsync(fh.fileno())
        # A rename replaces whatever holds the name (a link included), never follows it.
        os.replace(tmp, final)
        for k in range(1, nparts + 1):
            (self.root / owner / f"{batch_id}.{k}.json").unlink(missing_ok=True)
        log.info("batch %s of %s complete: %d files; manifest %s", batch_id, owner, rows, final)
        return final
