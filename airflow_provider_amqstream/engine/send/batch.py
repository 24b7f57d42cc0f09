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
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.records import TransferResult, open_private
from airflow_provider_amqstream.engine.store import write_all
from airflow_provider_amqstream.exceptions import StreamError

log = logging.getLogger(__name__)

# Confirmations recorded in the ledger per fsync, and the longest they wait for it. A group
# is as many files as may be in flight at once (bulk.MAX_IN_FLIGHT_FILES): a sender that
# dies sends at most that many again, which its receivers take as duplicates. At 64, a
# 1,000-file send of 64 KiB files made 16 fsyncs on its critical path, each a commit of the
# filesystem's journal (tens of ms on a loaded machine); now 4.
LEDGER_GROUP = 256
LEDGER_INTERVAL = 1.0
# Results (and failures) a batch lists in full, the first ones; past them only totals, and
# every file's result in its files list (a file), so memory does not grow with the files.
MAX_KEPT_RESULTS = 1000


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
class BatchStatus:
    """Where a batch stands, passed to the progress callback after each group: totals over
    every file, and the first :data:`MAX_KEPT_RESULTS` results and failures in full."""

    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_done: int = 0
    bytes_sent: int = 0
    failed: int = 0
    files_sent: int = 0
    files_already_sent: int = 0
    results: list[TransferResult] = field(default_factory=list)
    failures: list[FileFailure] = field(default_factory=list)

    def add(self, res: TransferResult) -> None:
        """Count a file confirmed, now or by an earlier run."""
        self.files_done += 1
        self.files_sent += res.status == "complete"
        self.files_already_sent += res.status == "already_sent"
        self.bytes_done += res.bytes
        self.bytes_sent += res.bytes_transferred
        if len(self.results) < MAX_KEPT_RESULTS:
            self.results.append(res)

    def fail(self, failure: FileFailure) -> None:
        self.failed += 1
        if len(self.failures) < MAX_KEPT_RESULTS:
            self.failures.append(failure)


@dataclass
class BulkResult:
    """What a batch send did: its :class:`BatchStatus`, with the results and failures it kept.
    ``files_list`` is a JSON-lines file with every file's result (one
    ``TransferResult.to_json()`` per line, plus ``dir``)."""

    batch_id: str
    destination: str
    results: list[TransferResult]
    failures: list[FileFailure]
    seconds: float
    status: BatchStatus
    broker: str = ""
    files_list: str | None = None

    @property
    def failed(self) -> int:
        """How many files failed (``failures`` may list only the first of them)."""
        return self.status.failed

    @property
    def complete(self) -> bool:
        """Whether ``results`` and ``failures`` list every file."""
        return self.status.files_done == len(self.results) and self.status.failed == len(self.failures)

    def totals(self) -> dict[str, Any]:
        t = self.status
        return {
            "status": "totals", "batch_id": self.batch_id, "destination": self.destination, "broker": self.broker,
            "files": t.files_done + t.failed, "files_sent": t.files_sent, "files_already_sent": t.files_already_sent,
            "files_failed": t.failed, "bytes": t.bytes_done, "bytes_transferred": t.bytes_sent,
            "seconds": round(self.seconds, 3), "files_per_second": round(t.files_done / max(self.seconds, 1e-6), 1),
            "mib_per_second": round(t.bytes_sent / max(self.seconds, 1e-6) / 2**20, 1), "files_list": self.files_list,
        }


@dataclass
class BatchFile:
    """A file to send and the relative directory (``a/b``) it lands in on the receiving side."""

    path: Path
    subdir: str = ""
    # The path resolved, when the walk that found it knows it (see _tree).
    real: Path | None = None


# Names a directory walk sorts at once. A directory's files are read in runs of this many, in
# the order the file system lists them, each run sorted: a directory of 300,000 files held all
# its names (a sender's peak RSS went 29 -> 50 MiB from 1,000 to 100,000 files). A directory
# of at most this many entries comes out in name order; a larger one in an order that is the
# same on every walk of it while it is unchanged (resumes go by stream id, not position).
WALK_RUN = 4096


def _files(d: Path, rel: str) -> Generator[tuple[Path, str, bool], None, list[str] | None]:
    """The regular files in ``d`` (with ``rel``, and whether each is a link), one sorted run at
    a time; returns its subdirectories' names, or None if there are more than a run of them.
    The directory entry says what each is (no stat of its own, but for a link)."""
    dirs: list[str] | None = []
    run: list[tuple[str, bool]] = []
    with os.scandir(d) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                if dirs is not None:
                    dirs.append(e.name)
                    dirs = dirs if len(dirs) <= WALK_RUN else None
            elif e.is_file():
                run.append((e.name, e.is_symlink()))
                if len(run) == WALK_RUN:
                    run.sort()
                    yield from ((d / name, rel, link) for name, link in run)
                    run = []
        run.sort()
        yield from ((d / name, rel, link) for name, link in run)
    return dirs


def _subdirs(d: Path, names: list[str] | None) -> Iterator[str]:
    """``names`` sorted; None: ``d``'s subdirectories read in sorted runs (the directory stays
    open while the walk is under it: only for one of more than a run of subdirectories)."""
    if names is not None:
        yield from sorted(names)
        return
    run: list[str] = []
    with os.scandir(d) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                run.append(e.name)
                if len(run) == WALK_RUN:
                    yield from sorted(run)
                    run = []
        yield from sorted(run)


def _tree(top: Path) -> Iterator[tuple[Path, str, bool]]:
    """Every regular file under ``top`` in a stable order, with its directory relative to ``top``
    and whether it is a link (to a regular file): a directory's files, then its subdirectories,
    depth first, each in sorted runs of :data:`WALK_RUN`.

    What it holds is a run of names for each directory on the path down, never one
    directory's names nor the whole tree."""
    # Each directory on the path down, with what is left of its subdirectories.
    stack: list[tuple[Path, str, Iterator[str]]] = []
    d: Path | None = top
    rel = ""
    while d is not None:
        try:
            names = yield from _files(d, rel)
            stack.append((d, rel, _subdirs(d, names)))
        except OSError as exc:
            log.warning("%s: not read (%s); its files are not sent", d, exc.strerror or exc)
        d = None
        while stack and d is None:
            parent, prel, subdirs = stack[-1]
            try:
                name = next(subdirs, None)
            except OSError as exc:
                log.warning("%s: not read (%s); its files are not sent", parent, exc.strerror or exc)
                name = None
            if name is None:
                stack.pop()
            else:
                d, rel = parent / name, f"{prel}/{name}" if prel else name


class FileSet:
    """The files some paths, directories and glob patterns name, in a stable order; iterated
    again, it walks again (a send reads it twice: once to count, once to send) instead of
    listing their files: memory stays flat in the number of files (what one directory's
    names take, at most).

    A directory (with ``recursive``) contributes every regular file under it, keeping its
    path relative to that directory; links to directories are not followed. A pattern
    (``*``, ``?``, ``[``) that is not itself an existing path is expanded here (``**``
    matches across directories); its files land flat. A file reached twice (named and in a
    directory given too, or a link to a file of it) is listed once.

    :param args: files, directories or patterns.
    :param recursive: descend into directories (otherwise a directory is an error).
    """

    def __init__(self, args: Iterable[str | os.PathLike[str]], *, recursive: bool = False) -> None:
        self.args = [os.fspath(a) for a in args]
        self.recursive = recursive
        # Fail on a missing path or a directory without recursive before anything is sent.
        self._plan()

    def _plan(self) -> list[tuple[Path, bool]]:
        """Each file (a pattern's each) and directory named, with whether it is a tree to walk;
        a tree inside another tree given too is walked once, as part of the outer one."""
        plan: list[tuple[Path, bool]] = []
        for text in self.args:
            if not os.path.lexists(text) and any(c in text for c in "*?["):
                files = [(Path(m), False) for m in sorted(glob.glob(text, recursive=True)) if os.path.isfile(m)]
                if not files:
                    raise StreamError(f"no file matches {text!r}")
                plan += files
                continue
            path = Path(text)
            tree = path.is_dir()
            if tree and not self.recursive:
                raise StreamError(f"{path} is a directory; pass recursive=True (--recursive) to send what is in it")
            if not tree and not path.is_file():
                raise StreamError(f"{path} does not exist or is not a regular file")
            plan.append((path, tree))
        return plan

    def __iter__(self) -> Iterator[BatchFile]:
        plan = self._plan()
        trees = [t.resolve() for t, tree in plan if tree]

        def in_tree(key: Path, but: Path | None = None) -> bool:
            return any(t != but and key.is_relative_to(t) for t in trees)

        walked: set[Path] = set()
        named: set[Path] = set()  # files named one by one (or by a pattern): as many as the caller listed
        for what, tree in plan:
            if tree:
                top = what.resolve()
                if top in walked or in_tree(top, but=top):
                    continue  # the same directory twice, or one inside another given too
                walked.add(top)
                for f, subdir, is_link in _tree(what):
                    # The walk follows no directory link, so a file's real path is the real
                    # top's plus the relative one; a link's must be looked up.
                    real = f.resolve() if is_link else top / subdir / f.name
                    # A link to a file that a walk sends as itself is not sent twice.
                    if is_link and in_tree(real):
                        continue
                    yield BatchFile(f, subdir, real)
                continue
            key = what.resolve()
            if key in named or in_tree(key):
                continue
            named.add(key)
            yield BatchFile(what, "")


iter_files = FileSet


class BatchLedger:
    """The confirmed files of one batch: an append-only JSON-lines file, fsynced per group.

    A line torn by a crash is ignored (that file is sent again). ``on_flush`` (the Airflow
    operator's task state store) gets the stream ids recorded so far after each group.
    """

    def __init__(self, path: Path, on_flush: Callable[[list[str]], None] | None = None) -> None:
        self.path, self.on_flush = path, on_flush
        # What load() read (a re-run's confirmed files), and, only for ``on_flush``, which
        # wants them all, the ids recorded since: a first run keeps nothing per file.
        self.records: dict[str, dict[str, Any]] = {}
        self.ids: set[str] = set()
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
        if self.on_flush:
            self.ids.add(record["stream_id"])
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
            self.on_flush(sorted(self.ids | self.records.keys()))
