"""Records that must outlive a crash, in a compact store with retention: a receiver's
completion records and claims, a sender's finished checkpoints.

Layout ``records/<YYYYMMDD>/<bb>/<host>-<pid>-<random>.log``: retention drops whole UTC
days; a look-up reads one bucket (CRC-32 of kind and key) per day, by ``mmap.find`` in logs
of at most :data:`LOG_LIMIT` and bisection in the sorted runs a full log becomes, so memory
and time are flat in the number of records; each file has one writer, so nothing relies on
``O_APPEND`` or locks, which NFS does not keep. A line is
``<kind><key>\\t<JSON>\\t<CRC-32>\\n``; a torn or corrupt one is skipped, never spoils another.
Past days are compacted into sorted files a look-up bisects. Why this layout, and what it
costs: docs/decisions/records-store.md.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import json
import logging
import mmap
import os
import secrets
import shutil
import socket
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STORE_DIR_NAME = "records"
# Records older than this many days are pruned (and no longer seen by look-ups).
DEFAULT_RETENTION_DAYS = 30.0
DAY = 86400
# The longest line a look-up decodes (a longer one is garbage).
MAX_LINE = 64 * 1024
# A writer's log of a bucket this large is sorted into a run (see RecordStore._seal): what a
# look-up scans is at most this much per writer and bucket, the rest it bisects.
LOG_LIMIT = 128 * 1024
# Listings a look-up makes when files it listed were merged away before it opened them.
RELISTS = 100
# Buckets per day. Fewer buckets mean fewer files and directories (each costs a block of
# 4 KiB or more: at 10,000 streams 256 buckets cost ~150 bytes a stream, 64 ~65, 32 ~33);
# more mean less read per look-up (1/BUCKETS of the records within retention).
BUCKETS = 32
# One encoder: json.dumps with separators builds a new one per call (a third of a write).
_ENCODER = json.JSONEncoder(separators=(",", ":"))

DONE = "d"  # a receiver published a stream: key = stream id
CLAIM = "c"  # a receiving task took a stream: key = the claim label, value = [stream id, at]
SENT = "s"  # a sender's checkpoint of a stream the broker confirmed whole: key = checkpoint name

# A day is compacted this long after it ended (UTC): a put that chose its day before midnight
# has long been written, and hosts sharing the store over NFS may disagree on the time by a bit.
COMPACT_AFTER = 3600
SORTED = ".sorted"
PAST = "past"  # the merged past days, beside the day directories

def bucket(kind: str, key: str) -> str:
    return f"{zlib.crc32(f'{kind}{key}'.encode('utf-8', 'surrogatepass')) % BUCKETS:02x}"


def _check_key(key: str) -> str:
    if not key or "\t" in key or "\n" in key or len(key) > 1024:
        raise ValueError(f"a record key must be 1-1024 characters without tab or newline, got {key[:80]!r}")
    return key


def encode(kind: str, key: str, value: Any) -> bytes:
    body = f"{kind}{_check_key(key)}\t{_ENCODER.encode(value)}".encode()
    return body + b"\t%08x\n" % zlib.crc32(body)


def decode(line: bytes) -> tuple[str, Any] | None:
    """(kind and key, value) of an intact line (without its newline), None for a torn one."""
    body, sep, crc = line.rpartition(b"\t")
    if not sep or len(crc) != 8:
        return None
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        head, value = body.decode().split("\t", 1)
        return head, json.loads(value)
    except ValueError:
        return None


def writer_name() -> str:
    """This process's file name in a bucket: host, pid and randomness (a pid is reused
    across hosts and over time)."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}.log"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _day(t: float) -> str:
    return time.strftime("%Y%m%d", time.gmtime(t))


def _merge_key(line: bytes) -> tuple[bytes, bytes]:
    # By head (kind and key) first: a key may hold bytes below the tab that follows it.
    head, _, rest = line.partition(b"\t")
    return head, rest


def _first_at_least(data: Any, target: bytes) -> int:
    """Offset of the first line of sorted ``data`` whose head (kind and key) is not below
    ``target`` (``len(data)`` if none). Every line start below ``lo`` has a smaller head; the
    line at ``hi`` (if any) has not."""
    lo, hi = 0, len(data)
    while lo < hi:
        mid = (lo + hi) // 2
        nl = data.rfind(b"\n", lo, mid)
        start = lo if nl < 0 else nl + 1
        stop = data.find(b"\n", start)
        if stop < 0:
            return hi  # only a torn tail is left (a renamed file has none): the end
        if data[start:stop].partition(b"\t")[0] < target:
            lo = stop + 1
        else:
            hi = start
    return lo


def _past_lines(path: str, cutoff: bytes) -> Iterator[bytes]:
    """The lines of a merged file (without newlines) of days kept; nothing if it went."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as fh:
        for line in fh:
            if line.endswith(b"\n") and line.split(b"\t", 2)[1] >= cutoff:
                yield line[:-1]


def _read_logs(logs: list[tuple[str, str]]) -> tuple[list[bytes], list[tuple[str, int]]]:
    """The intact lines of ``logs`` ((day, path) pairs) tagged with their day and sorted, and
    each log read with its size then."""
    fresh: list[bytes] = []
    read: list[tuple[str, int]] = []
    for day, path in logs:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            continue  # merged by another compactor meanwhile
        read.append((path, len(data)))
        tag = b"\t" + day.encode() + b"\t"
        # The last piece has no newline (empty, or a torn tail).
        fresh.extend(line.replace(b"\t", tag, 1) for line in data.split(b"\n")[:-1] if decode(line) is not None)
    fresh.sort(key=_merge_key)
    return fresh, read


def _write_sorted(directory: str, fresh: list[bytes], olds: list[str], cutoff: bytes) -> str:
    """Merge ``fresh`` (sorted tagged lines) and the sorted files ``olds`` (lines of days from
    ``cutoff``) into a new sorted file in ``directory``, named by the oldest day it holds,
    durable and in place when this returns; return its path."""
    tmp = f"{directory}/.{secrets.token_hex(8)}.tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as out:
            prev, oldest = b"", b"99999999"
            for line in heapq.merge(fresh, *(_past_lines(p, cutoff) for p in olds), key=_merge_key):
                if line != prev:  # copies of a line (a crash, two compactors) sort next to each other
                    out.write(line + b"\n")
                    prev, oldest = line, min(oldest, line.split(b"\t", 2)[1])
            out.flush()
            os.fsync(out.fileno())
        new = f"{directory}/{oldest.decode()}-{secrets.token_hex(8)}{SORTED}"
        os.rename(tmp, new)
        _fsync_dir(directory)
    except BaseException:
        unlink_missing_ok(tmp)
        raise
    return new


def _listed(bdir: str) -> list[str]:
    try:
        names = sorted(os.listdir(bdir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [f"{bdir}/{n}" for n in names if n.endswith((".log", SORTED))]


@contextlib.contextmanager
def _mapped(path: str) -> Iterator[Any]:
    """``path`` mapped read-only (None if empty): nothing copied into the process, and what
    is mapped is page cache, let go when the look-up ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        if not size:
            yield None
            return
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as data:
            yield data
    finally:
        os.close(fd)


def _scan(data: Any, head: bytes) -> list[Any]:
    """The values of ``head``'s lines in a mapped log (bounded by :data:`LOG_LIMIT`), in order."""
    needle = b"\n" + head + b"\t"
    # The first line has no newline before it: "at" is where a line's newline would be.
    first = data[:len(needle) - 1] == needle[1:]
    at = -1 if first else data.find(needle)
    values: list[Any] = []
    while first or at >= 0:
        first = False
        # A line ends at its newline; one without (a torn tail) is never decoded.
        stop = data.find(b"\n", at + 1)
        if stop < 0:
            break
        if stop - at <= MAX_LINE:
            rec = decode(data[at + 1:stop])
            if rec is not None and rec[0].encode() == head:
                values.append(rec[1])
        at = data.find(needle, stop)
    return values


def _search(data: Any, head: bytes, cutoff: bytes) -> list[Any]:
    """The values of ``head``'s lines of days kept in a mapped sorted file, newest day first,
    found by bisection (O(log n), a few pages touched)."""
    found: list[tuple[bytes, Any]] = []
    at, size = _first_at_least(data, head), len(data)
    while at < size:
        stop = data.find(b"\n", at)
        if stop < 0:
            break
        line_head, _, rest = data[at:stop].partition(b"\t")
        if line_head != head:
            break
        day, _, body = rest.partition(b"\t")
        rec = decode(line_head + b"\t" + body) if day >= cutoff else None
        if rec is not None:
            found.append((day, rec[1]))
        at = stop + 1
    found.sort(key=lambda dv: dv[0], reverse=True)
    return [v for _, v in found]


def unlink_missing_ok(path: str | os.PathLike[str]) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (``os.write`` may take less than it is given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class RecordStore:
    """Append-only, bucketed, day-partitioned records; see the module's docstring.

    :param root: the store's directory (``.../records``); made on first write.
    :param retention_days: records older than this are pruned by :meth:`prune` and ignored
        by look-ups; None or 0 keeps them for ever.
    :param clock: the time (tests).
    """

    def __init__(self, root: str | os.PathLike[str], *, retention_days: float | None = DEFAULT_RETENTION_DAYS,
                 clock: Any = time.time) -> None:
        self.root = os.fspath(root)
        self.retention = float(retention_days or 0) * DAY
        self.clock = clock
        self._lock = threading.Lock()
        self._name = writer_name()
        # This writer's logs of the current day, open (at most BUCKETS): bucket -> [fd, path,
        # size]; its sorted runs of the day by bucket, with the logs each holds, largest first.
        self._logs: dict[str, list[Any]] = {}
        self._runs: dict[str, list[tuple[str, int]]] = {}
        self._fd_day = ""
        self._pid = os.getpid()
        self._next_prune = float("inf")  # set by the first prune (the receiver's start)

    def put_many(self, items: Iterable[tuple[str, str, Any]], *, sync: bool = True) -> None:
        """Record each (kind, key, value) of ``items``, durable when this returns if ``sync``;
        grouped by file: one write (and fsync) per bucket touched.

        :param items: kinds :data:`DONE`, :data:`CLAIM` or :data:`SENT`; values any JSON value.
        :param sync: fsync the files (False: the caller flushes the filesystem).
        """
        day = _day(self.clock())
        by_bucket: dict[str, list[bytes]] = {}
        for kind, key, value in items:
            by_bucket.setdefault(bucket(kind, key), []).append(encode(kind, key, value))
        with self._lock:
            for b, lines in by_bucket.items():
                self._append(day, b, b"".join(lines), sync)
        if self.clock() >= self._next_prune:
            prune_quietly(self)

    def _append(self, day: str, b: str, data: bytes, sync: bool) -> None:
        if os.getpid() != self._pid:
            # A forked child (a Celery worker's task) is another writer: files of its own.
            self._pid, self._name = os.getpid(), writer_name()
            self.close()
        if day != self._fd_day:
            self.close()
            self._fd_day = day
        log_ = self._logs.get(b)
        bdir = f"{self.root}/{day}/{b}"
        if log_ is None:
            path = f"{bdir}/{self._name}"
            # O_EXCL: a file of our own name, never one someone planted (nor a link).
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW
            try:
                fd = os.open(path, flags, 0o600)
            except FileNotFoundError:
                os.makedirs(bdir, exist_ok=True)
                fd = os.open(path, flags, 0o600)
            log_ = self._logs[b] = [fd, path, 0]
        try:
            write_all(log_[0], data)
            log_[2] += len(data)
            if sync:
                os.fsync(log_[0])
                if not log_[2] - len(data):
                    # A new file's name (and its new directories') must be durable too.
                    for d in (bdir, os.path.dirname(bdir), self.root):
                        _fsync_dir(d)
        except OSError:
            # Part of a line may be in the file: never append after it (the next record
            # would share its line and be lost with it). New files of our own from now on.
            self.close()
            self._name = writer_name()
            raise
        if log_[2] >= LOG_LIMIT:
            self._seal(day, b)

    def _seal(self, day: str, b: str) -> None:
        """Turn this writer's full log of bucket ``b`` into a sorted run, merged with its runs
        of the day no larger than what is merged (a binary counter: O(log n) runs a bucket,
        each line rewritten O(log n) times), so a look-up bisects instead of scanning a day.
        The run is durable and in place before the log and the runs merged go: a crash leaves
        every record in some file (at worst twice; a merge drops the copy)."""
        fd, path, _size = self._logs[b]
        runs = self._runs.setdefault(b, [])
        merged: list[tuple[str, int]] = []
        logs = 1  # a run's weight: the logs it holds
        while runs and runs[-1][1] <= logs:
            merged.append(runs.pop())
            logs += merged[-1][1]
        try:
            fresh, _ = _read_logs([(day, path)])
            new = _write_sorted(os.path.dirname(path), fresh, [p for p, _ in merged], b"")
        except OSError as exc:
            runs.extend(reversed(merged))
            log.warning("records in %s: could not sort %s (%s); it is searched as it is", self.root, path, exc)
            return
        del self._logs[b]
        os.close(fd)
        self._name = writer_name()  # the next log a new name: a look-up that listed this one finds it gone
        for p in (path, *(p for p, _ in merged)):
            unlink_missing_ok(p)
        runs.append((new, logs))

    def close(self) -> None:
        """Close this writer's open files (a later write opens new ones)."""
        logs, self._logs, self._runs = self._logs, {}, {}
        for fd, _path, _size in logs.values():
            os.close(fd)

    def get(self, kind: str, key: str) -> Any:
        """The newest record of (``kind``, ``key``) within retention, or None."""
        return next(self.get_all(kind, key), None)

    def get_all(self, kind: str, key: str) -> Iterator[Any]:
        """Every record of (``kind``, ``key``) within retention, newest day first."""
        return iter(self._collect(kind, [key], first=False).get(key, []))

    def get_many(self, kind: str, keys: Iterable[str]) -> dict[str, Any]:
        """The newest record of each of ``keys`` that has one: each bucket is listed and each
        of its files mapped once for all of them (a batch's thousands of streams, a receiver's
        group). Memory: the answer."""
        return {key: values[0] for key, values in self._collect(kind, keys, first=True).items()}

    def _collect(self, kind: str, keys: Iterable[str], *, first: bool) -> dict[str, list[Any]]:
        by_bucket: dict[str, list[bytes]] = {}
        for key in keys:
            by_bucket.setdefault(bucket(kind, key), []).append(f"{kind}{_check_key(key)}".encode())
        cutoff = self._cutoff().encode()
        # The days are listed once for every bucket asked about: a receiver's group asks about
        # many buckets at once. A day pruned meanwhile lists as empty, which it is to us.
        days = self._days()
        found: dict[str, list[Any]] = {}
        for b, heads in by_bucket.items():
            for _ in range(RELISTS):
                try:
                    found.update(self._collect_bucket(b, heads, cutoff, days, first=first))
                    break
                except FileNotFoundError:
                    continue  # a file listed was merged into a new one since: list again
            else:
                raise OSError(errno.EAGAIN, f"records of bucket {b} in {self.root} were merged away {RELISTS} "
                                            "times during one look-up; try again")
        return found

    def _collect_bucket(self, b: str, heads: list[bytes], cutoff: bytes, days: list[str], *,
                        first: bool) -> dict[str, list[Any]]:
        """The values of ``heads`` in bucket ``b``'s files, newest day first. Raises
        ``FileNotFoundError`` if a file listed is gone when opened: files are only appended to, and a
        record leaves one only after it is in a newer file (renamed into place first), so a
        look-up that opened every file it listed saw every record there when it listed."""
        found: dict[bytes, list[Any]] = {}
        for path in self._files(b, days):
            todo = [h for h in heads if not (first and h in found)]
            if not todo:
                break
            with _mapped(path) as data:
                for h in todo if data is not None else ():
                    values = _search(data, h, cutoff) if path.endswith(SORTED) else _scan(data, h)
                    if values:
                        found.setdefault(h, []).extend(values)
        return {h[1:].decode(): v for h, v in found.items()}

    def _files(self, b: str, days: list[str]) -> list[str]:
        return [*(p for day in days for p in _listed(f"{self.root}/{day}/{b}")),
                *_listed(f"{self.root}/{PAST}/{b}")]

    def _days(self) -> list[str]:
        try:
            days = [d for d in os.listdir(self.root) if len(d) == 8 and d.isdigit()]
        except FileNotFoundError:
            return []
        cutoff = self._cutoff()
        return sorted((d for d in days if d >= cutoff), reverse=True)

    def _cutoff(self) -> str:
        """The oldest day still kept ("" keeps every day)."""
        return _day(self.clock() - self.retention) if self.retention > 0 else ""

    def prune(self) -> int:
        """Remove the days older than the retention; return how many. Safe to run in several
        processes at once: a day is first renamed to a name of this process's own (atomic,
        also on NFS), so exactly one of them removes it and look-ups stop seeing it at once."""
        if self.retention <= 0:
            return 0
        cutoff = self._cutoff()
        try:
            entries = os.listdir(self.root)
        except FileNotFoundError:
            return 0
        removed = 0
        for d in entries:
            if d.startswith(".expired-"):
                # Left by a pruner that died mid-way: finish its work.
                shutil.rmtree(f"{self.root}/{d}", ignore_errors=True)
                continue
            if not (len(d) == 8 and d.isdigit() and d < cutoff):
                continue
            gone = f"{self.root}/.expired-{d}-{secrets.token_hex(4)}"
            try:
                os.rename(f"{self.root}/{d}", gone)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                    continue  # another pruner took it
                raise
            shutil.rmtree(gone, ignore_errors=True)
            removed += 1
        if removed:
            log.info("records in %s: pruned %d day(s) older than %g days", self.root, removed,
                     self.retention / DAY)
        return removed

    def compact(self) -> int:
        """Merge the days kept that ended :data:`COMPACT_AFTER` ago into the merged file of
        each bucket (see the module's docstring); return how many buckets were merged."""
        last = _day(self.clock() - DAY - COMPACT_AFTER)
        days = [d for d in self._days() if d <= last]
        merged = sum(self._compact_bucket(f"{i:02x}", days) for i in range(BUCKETS))
        for day in days:
            for i in range(BUCKETS):
                with contextlib.suppress(OSError):
                    os.rmdir(f"{self.root}/{day}/{i:02x}")  # empty once merged; a late log keeps it
            with contextlib.suppress(OSError):
                os.rmdir(f"{self.root}/{day}")
        if merged:
            log.info("records in %s: merged %d bucket(s) of %d past day(s)", self.root, merged, len(days))
        return merged

    def _compact_bucket(self, b: str, days: list[str]) -> int:
        pdir = f"{self.root}/{PAST}/{b}"
        try:
            names = os.listdir(pdir)
        except FileNotFoundError:
            names = []
        for name in names:
            # Left by a compactor that died (one still at work is younger than this).
            with contextlib.suppress(OSError):
                if name.endswith(".tmp") and os.lstat(f"{pdir}/{name}").st_mtime < self.clock() - COMPACT_AFTER:
                    os.unlink(f"{pdir}/{name}")
        olds = [f"{pdir}/{n}" for n in sorted(names) if n.endswith(SORTED)]
        files = [(day, path) for day in days for path in _listed(f"{self.root}/{day}/{b}")]
        logs = [(day, path) for day, path in files if path.endswith(".log")]
        runs = [path for _, path in files if path.endswith(SORTED)]
        for day in days:  # a sort its writer did not finish (that day ended an hour ago)
            for tmp in Path(f"{self.root}/{day}/{b}").glob(".*.tmp"):
                unlink_missing_ok(str(tmp))
        cutoff = self._cutoff().encode()
        # A merged file is named by the oldest day it holds: one holding expired days is rewritten.
        if not files and len(olds) <= 1 and all(os.path.basename(p)[:8].encode() >= cutoff for p in olds):
            return 0
        olds += runs
        fresh, read = _read_logs(logs)
        os.makedirs(pdir, exist_ok=True)
        _write_sorted(pdir, fresh, olds, cutoff)
        for path in olds:
            unlink_missing_ok(path)
        for path, size in read:
            with contextlib.suppress(FileNotFoundError):
                # A log written to after we read it keeps its new lines for the next merge.
                if os.lstat(path).st_size == size:
                    os.unlink(path)
        return 1

    def disk_usage(self) -> tuple[int, int]:
        """(bytes allocated on disk, files) of the whole store: for measurements."""
        total = files = 0
        for dirpath, _dirnames, filenames in os.walk(self.root):
            total += os.lstat(dirpath).st_blocks * 512
            for name in filenames:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                files += 1
        return total, files


_STORES: dict[tuple[str, float], RecordStore] = {}
_STORES_LOCK = threading.Lock()


def open_store(state_dir: str | os.PathLike[str], retention_days: float | None = None) -> RecordStore:
    """The process's store of ``state_dir`` (a receiver's ``out_dir/.amqstream``, a sender's),
    in its ``records/``: one per process and directory, so a process writes
    one file per bucket and day however many streams it records (pruning is the caller's:
    :meth:`RecordStore.prune`, which the receiver runs as it starts).

    :param retention_days: days records are kept (None: :data:`DEFAULT_RETENTION_DAYS`;
        0 keeps them for ever).
    """
    days = DEFAULT_RETENTION_DAYS if retention_days is None else float(retention_days)
    if days < 0:
        raise ValueError(f"records_retention_days must be 0 (keep for ever) or more, got {retention_days}")
    key = (os.path.abspath(os.path.join(state_dir, STORE_DIR_NAME)), days)
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = RecordStore(key[0], retention_days=days)
        return _STORES[key]


def prune_quietly(store: RecordStore) -> int:
    """:meth:`RecordStore.prune` and :meth:`RecordStore.compact`, a failure logged (expired or
    unmerged records stay until the next run) rather than stopping a transfer."""
    # The next run when the newest past day may be merged (a long receive runs it from put).
    store._next_prune = (store.clock() // DAY + 1) * DAY + COMPACT_AFTER
    try:
        removed = store.prune()
        store.compact()
        return removed
    except OSError as exc:
        log.warning("records in %s: pruning failed (%s); expired or unmerged records stay until the next run",
                    store.root, exc)
        return 0

