"""What a batch of files is: the files (collected from paths, directories and globs, with
their paths relative to a base), what happened to each, and the ledger that lets a re-run
of the batch skip the files the broker already confirmed. The sending is ``bulk.py``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.records import TransferResult, open_private, write_all
from airflow_provider_amqstream.exceptions import StreamError

log = logging.getLogger(__name__)

# Confirmations recorded in the ledger per fsync, and the longest they wait for it.
LEDGER_GROUP = 64
LEDGER_INTERVAL = 1.0


@dataclass
class BatchStatus:
    """Where a batch stands; passed to the progress callback after each group."""

    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_done: int = 0
    bytes_sent: int = 0
    failed: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def rate(self) -> float:
        """MiB/s moved by this run."""
        return self.bytes_sent / max(time.monotonic() - self.started, 1e-6) / 2**20


@dataclass
class FileFailure:
    """A file of the batch that was not sent, and why."""

    path: str
    error: str
    stream_id: str = ""
    status: str = "failed"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BulkResult:
    """One ``TransferResult`` per file sent (or found already sent), failures, totals."""

    batch_id: str
    destination: str
    results: list[TransferResult]
    failures: list[FileFailure]
    seconds: float
    broker: str = ""

    def totals(self) -> dict[str, Any]:
        moved = sum(r.bytes_transferred for r in self.results)
        return {
            "status": "totals", "batch_id": self.batch_id, "destination": self.destination, "broker": self.broker,
            "files": len(self.results) + len(self.failures), "files_sent": sum(
                r.status == "complete" for r in self.results),
            "files_already_sent": sum(r.status == "already_sent" for r in self.results),
            "files_failed": len(self.failures), "bytes": sum(r.bytes for r in self.results),
            "bytes_transferred": moved, "seconds": round(self.seconds, 3),
            "files_per_second": round(len(self.results) / max(self.seconds, 1e-6), 1),
            "mib_per_second": round(moved / max(self.seconds, 1e-6) / 2**20, 1),
        }


@dataclass
class BatchFile:
    """A file to send and the relative directory (``a/b``) it lands in on the receiving side."""

    path: Path
    subdir: str = ""


def _tree(top: Path) -> Iterator[tuple[Path, str]]:
    """Every regular file under ``top`` in a stable order, with its directory relative to ``top``."""
    for root, dirs, names in os.walk(top):
        dirs.sort()
        rel = Path(root).relative_to(top)
        for n in sorted(names):
            f = Path(root) / n
            if f.is_file():
                yield f, "" if rel == Path(".") else rel.as_posix()


def collect_files(args: Iterable[str | os.PathLike[str]], *, recursive: bool = False) -> list[BatchFile]:
    """Expand paths, directories and glob patterns into files, in a stable order.

    A directory (with ``recursive``) contributes every regular file under it, keeping its
    path relative to that directory; links to directories are not followed. A pattern
    (``*``, ``?``, ``[``) that is not itself an existing path is expanded here (``**``
    matches across directories); its files land flat.

    :param args: files, directories or patterns.
    :param recursive: descend into directories (otherwise a directory is an error).
    """
    out: list[BatchFile] = []
    seen: set[Path] = set()

    def add(path: Path, subdir: str) -> None:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            out.append(BatchFile(path, subdir))

    for arg in args:
        text = os.fspath(arg)
        if not os.path.lexists(text) and any(c in text for c in "*?["):
            matches = sorted(glob.glob(text, recursive=True))
            files = [Path(m) for m in matches if os.path.isfile(m)]
            if not files:
                raise StreamError(f"no file matches {text!r}")
            for f in files:
                add(f, "")
            continue
        path = Path(text)
        if path.is_dir():
            if not recursive:
                raise StreamError(f"{path} is a directory; pass recursive=True (--recursive) to send what is in it")
            for f, subdir in _tree(path):
                add(f, subdir)
            continue
        if not path.is_file():
            raise StreamError(f"{path} does not exist or is not a regular file")
        add(path, "")
    return out


def _subdir_of(path: Path, base_dir: Path | None) -> str:
    if base_dir is None:
        return ""
    try:
        rel = path.resolve().parent.relative_to(base_dir.resolve())
    except ValueError:
        raise StreamError(f"{path} is not under the base directory {base_dir}") from None
    return "" if rel == Path(".") else rel.as_posix()


class BatchLedger:
    """The confirmed files of one batch: an append-only JSON-lines file, fsynced per group.

    A line torn by a crash is ignored (that file is sent again). ``on_flush`` (the Airflow
    operator's task state store) gets the stream ids recorded so far after each group.
    """

    def __init__(self, path: Path, on_flush: Callable[[list[str]], None] | None = None,
                 seed: Iterable[str] = ()) -> None:
        self.path, self.on_flush = path, on_flush
        self.records: dict[str, dict[str, Any]] = {}
        self.seed = set(seed)
        self.buffer: list[dict[str, Any]] = []
        self.last_flush = time.monotonic()

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            fd = open_private(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return self.records
        with os.fdopen(fd, "rb") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # the torn last line of a killed run
                if isinstance(rec, dict) and isinstance(rec.get("stream_id"), str):
                    self.records[rec["stream_id"]] = rec
        return self.records

    def add(self, record: dict[str, Any]) -> None:
        self.records[record["stream_id"]] = record
        self.buffer.append(record)
        if len(self.buffer) >= LEDGER_GROUP or time.monotonic() - self.last_flush > LEDGER_INTERVAL:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        if not self.buffer:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            write_all(fd, b"".join(json.dumps(r).encode() + b"\n" for r in self.buffer))
            os.fsync(fd)
        finally:
            os.close(fd)
        self.buffer = []
        if self.on_flush:
            self.on_flush(sorted(self.records))
