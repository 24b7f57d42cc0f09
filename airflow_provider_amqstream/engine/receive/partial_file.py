"""The bytes of one stream on disk: the ``.part`` file, its durable record, publishing.

Writes land at their offsets at once; a batch becomes durable when a worker thread has
fdatasynced the file and saved the state that records it, and only then are its
messages acknowledged, so an acknowledged chunk is always on disk. The conversation
with the broker that decides what to write is ``stream.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import itertools
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.records import hash_prefix, open_private, read_json, write_json
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import StreamBusy, StreamError, StreamNoRoom
from airflow_provider_amqstream.protocol import paths
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.state import ReceiverState
from airflow_provider_amqstream.transport.link import Message

log = logging.getLogger(__name__)

# A published name must fit one directory entry (255 bytes on every common filesystem).
_NAME_MAX = 255

# Once a batch is on disk its pages are handed back to the kernel: the receiver never reads
# them again (chunks ahead of a gap stay until the gap fills and they are hashed). The next
# batch's writes then take pages just freed instead of fresh ones, which is cheaper on any
# machine and several times cheaper under a hypervisor that takes free pages back (1 GiB
# written: 1.9 receiver CPU-s against 3.1; docs/decisions/page-reuse.md). A stream far
# larger than memory also no longer pushes everything else out of the page cache.
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", None)


def _drop_cached(fd: int, end: int) -> None:
    """Hand the clean cached pages of the file's first ``end`` bytes back to the kernel."""
    # end > 0: to the kernel, a length of 0 means the whole file.
    if _DONTNEED is not None and end > 0:
        os.posix_fadvise(fd, 0, end, _DONTNEED)


# Besides its data, a published stream costs its completion record and, for a task, its
# claim: lines of ~200 bytes in the record store, whose files (one per bucket and day) take
# blocks and inodes as they are created. Counted as a block and an inode each, which is
# more than they take, so that the reserve holds whichever way the store grows.
RECORD_FILES = 2


class Room:
    """What a filesystem has left for streams: bytes and inodes, each less a reserve, with
    every file counted at its real cost (whole blocks, its records, their inodes), so a
    flood of tiny files cannot exhaust the inodes or the blocks that their sizes hide.
    """

    def __init__(self, sdir: StateDir, min_free: int | None) -> None:
        """:param min_free: bytes to leave free (None: 2 % of the filesystem, at most 1 GiB)."""
        st = os.statvfs(sdir)
        self.sdir = sdir
        self.block = st.f_frsize or 4096
        self.free = st.f_bavail * self.block
        self.inodes = st.f_favail
        self.min_free = min(st.f_blocks * self.block // 50, 2**30) if min_free is None else min_free
        # Filesystems that report no inode count (some network ones) have no inode limit to keep.
        self.inode_reserve = max(64, st.f_files // 50) if st.f_files else 0

    def cost(self, size: int, have: int = 0) -> int:
        """Bytes a stream of ``size`` takes, ``have`` of them already allocated."""
        blocks = -(-size // self.block) - have // self.block
        return (max(0, blocks) + RECORD_FILES) * self.block

    def check(self, what: str, size: int, have: int = 0, *, needs: str = "it") -> None:
        """Raise :class:`StreamNoRoom` if a file of ``size`` bytes, ``have`` of them already
        allocated, does not fit (``needs`` names it in the message)."""
        need = self.cost(size, have)
        if self.free - need < self.min_free:
            short = f"needs {need} bytes with its records, {self.free} are free and {self.min_free} kept in reserve"
        elif self.inodes and self.inodes - (1 + RECORD_FILES) < self.inode_reserve:
            short = f"needs {1 + RECORD_FILES} inodes, {self.inodes} are free and {self.inode_reserve} kept in reserve"
        else:
            return
        raise StreamNoRoom(
            f"{what}: {self.sdir.out} has no room for {needs} ({short}); the stream yields its place and is tried "
            "again later. Free space or inodes, lower the reserve (min_free_bytes, --min-free) or receive into "
            "another directory.")

    def take(self, size: int) -> None:
        self.free -= self.cost(size)
        self.inodes -= 1 + RECORD_FILES


class PartialFile:
    """The ``.part`` file of one stream and the durable record of what is in it (the
    module's docstring says when a batch is durable)."""

    def __init__(self, sdir: StateDir, spec: p.StreamSpec, what: str, sender: str = "") -> None:
        self.spec, self.what, self.sdir, self.sender = spec, what, sdir, sender
        self.part = sdir.part(spec.stream_id)
        self.state_file = sdir.resume(spec.stream_id)
        # When this reception began, kept across resumes: `amqstream streams ls` shows it.
        self.started_at = time.time()
        self.fd = -1
        # Whether this process took the partial file's lock: only then is what is on disk ours
        # to shrink after a yield (another receiver process of the directory may hold it).
        self.owned = False
        self.last_write: float | None = None
        self.state = ReceiverState(spec)
        self.hasher = hashlib.sha256()
        self.hashed_to = 1
        self.new: list[int] = []
        # Its one thread starts with the first commit (after open) and ends in close.
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="amqs-sync")
        self.inflight: tuple[concurrent.futures.Future[None], list[int], list[Message]] | None = None

    def open(self, min_free: int | None) -> None:
        created = not os.path.lexists(self.part)
        self.fd = open_private(self.part, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = -1
            raise StreamBusy(f"{self.what} is being received by another process into {self.sdir.out}") from None
        self.owned = True
        # When this stream last made progress, across receiver restarts (None: never, here):
        # a receiver killed while it waited on a silent sender must not make the next one
        # wait from zero. The state file is written only when chunks are committed; the
        # part's own mtime moves with every reservation, and receivers restarted within the
        # idle timeout then waited from zero each time and never gave a silent stream up.
        with contextlib.suppress(FileNotFoundError):
            self.last_write = os.stat(self.state_file).st_mtime
        self.state = self._load_state()
        have = os.fstat(self.fd).st_size
        try:
            self._reserve(have, min_free)
        except StreamNoRoom:
            # Give back what the failed reservation took: fallocate may have filled the disk first.
            if created:
                self.close()
                self.part.unlink(missing_ok=True)
            else:
                os.ftruncate(self.fd, have)
            raise
        with os.fdopen(os.dup(self.fd), "rb", buffering=0) as rfh:
            hash_prefix(rfh, self.hasher, self.state.contiguous_bytes)
        self.hashed_to = self.state.next_seq  # first chunk not yet in the hash

    def _reserve(self, have: int, min_free: int | None) -> None:
        """Allocate the whole file now, so a full disk fails here rather than hours in, and
        later syncs need not flush a growing size. A stream that would leave less than
        ``min_free`` bytes free is refused (:class:`StreamNoRoom`) before anything is
        allocated; after a failed allocation the caller gives back what it may have taken.
        ``have`` is the file's size now (a resumed stream's is already allocated)."""
        size = self.spec.size
        if have < size or have == 0:
            Room(self.sdir, min_free).check(self.what, size, have, needs=f"{size - have} more bytes")
        if size == 0 or have >= size:
            return
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            free = shutil.disk_usage(self.sdir).free
            raise StreamNoRoom(
                f"{self.what}: cannot reserve {size} bytes in {self.sdir.out} ({exc.strerror}; {free} bytes free); "
                "the stream yields its place. Free space or choose another output directory, then re-run.") from exc

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def discard(self) -> None:
        """Remove the partial data and its state (the stream was quarantined)."""
        self.close()
        self.part.unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)

    def shrink(self) -> None:
        """After a yield: keep the chunks on disk, give back the space reserved past the
        last of them (a sender must not hold disk it never filled by going silent), and
        keep nothing at all for a stream with no chunk on disk. A resumed stream reserves
        its size again. A file whose lock this process never took is left as it is."""
        self.close()
        if not self.owned:
            return
        top = max([self.state.next_seq - 1, *self.state.ahead])
        if top == 0:
            self.discard()
            return
        with contextlib.suppress(FileNotFoundError):
            os.truncate(self.part, self.spec.offset_of(top + 1))

    def _load_state(self) -> ReceiverState:
        try:
            data = read_json(self.state_file)
        except (OSError, ValueError) as exc:
            raise StreamError(f"{self.what}: resume state {self.state_file} is unreadable ({exc}); "
                              "delete it and the .part file to receive from the start") from exc
        if data is None:
            return ReceiverState(self.spec)
        if isinstance(data.get("started_at"), (int, float)):
            self.started_at = float(data["started_at"])
        state = ReceiverState.from_json(data)
        if state.spec != self.spec:
            raise StreamError(f"{self.what}: resume state {self.state_file} belongs to a different "
                              "stream with the same id; delete it to receive from the start")
        log.info("%s: resuming with %d of %d bytes on disk", self.what, state.received_bytes, self.spec.size)
        return state

    def write(self, seq: int, offset: int, data: bytes | memoryview) -> None:
        try:
            os.pwrite(self.fd, data, offset)
        except OSError as exc:
            raise self.disk_error(exc, f"writing chunk {seq} at offset {offset} of {self.part}") from exc
        self.state.written.add(seq)
        self._hash_along(seq, data)
        self.new.append(seq)

    def _hash_along(self, seq: int, data: bytes | memoryview) -> None:
        """Feed the whole-file hash with every chunk that is now contiguous. The hash lives
        in memory only (a resumed run rehashes the prefix from disk), so written is enough;
        chunks that arrived ahead of a gap are read back from the page cache."""
        state = self.state
        while self.hashed_to <= self.spec.chunks and (
                state.has(self.hashed_to) or self.hashed_to in state.written):
            if self.hashed_to == seq:
                self.hasher.update(data)
            else:
                off, length = self.spec.chunk_span(self.hashed_to)
                self.hasher.update(os.pread(self.fd, length, off))
            self.hashed_to += 1

    def commit(self, frames: list[Message], on_durable: Callable[[list[Message]], None], *, wait: bool) -> None:
        """Hand the batch (new chunks, and ``frames`` to acknowledge) to the sync thread;
        the previous batch is finished first. ``on_durable`` acknowledges frames."""
        self.settle(on_durable)
        if not frames and not self.new:
            return
        snapshot = ReceiverState.from_json(self.state.to_json())
        for seq in self.new:
            snapshot.mark_durable(seq)
        fut = self.pool.submit(self._sync, {**snapshot.to_json(), "sender": self.sender,
                                            "started_at": self.started_at} if self.new else None,
                               snapshot.contiguous_bytes)
        self.inflight = (fut, self.new, frames)
        self.new = []
        if wait:
            self.settle(on_durable)

    def _sync(self, snapshot: dict[str, Any] | None, durable_to: int) -> None:
        if snapshot is not None:
            os.fdatasync(self.fd)
            _drop_cached(self.fd, durable_to)
            write_json(self.state_file, snapshot)

    def assume_durable(self) -> None:
        """Count the written chunks as durable without syncing them: only for the last batch
        of a stream that is published (fsynced, renamed) before its messages are acknowledged."""
        for seq in self.new:
            self.state.mark_durable(seq)
        self.new = []

    def settle(self, on_durable: Callable[[list[Message]], None]) -> None:
        """Finish the commit in flight, if any."""
        if self.inflight is None:
            return
        fut, new, frames = self.inflight
        self.inflight = None
        try:
            fut.result()
        except OSError as exc:
            raise self.disk_error(exc, f"syncing {self.part} and recording progress in {self.state_file}") from exc
        for seq in new:
            self.state.mark_durable(seq)
        on_durable(frames)

    def disk_error(self, exc: OSError, doing: str) -> StreamError:
        free = shutil.disk_usage(self.sdir).free
        return StreamError(
            f"{self.what}: {doing} failed: {exc.strerror or exc} ({free} bytes free in {self.sdir.out}). Nothing "
            f"past byte {self.state.contiguous_bytes} was acknowledged, so the broker keeps the rest, and the "
            f"partial file is kept; free space and re-run the receiver to continue from there."
        )

    def publish(self, dir_fd: int, name: str) -> None:
        """Rename the verified file to ``name`` in the directory open as ``dir_fd``: the
        rename replaces an entry, never follows a link, and lands in the directory we
        opened even if its path was swapped meanwhile."""
        os.fsync(self.fd)
        _drop_cached(self.fd, self.spec.size)
        self.close()
        os.replace(self.part, name, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
        self.state_file.unlink(missing_ok=True)


# Names a stream derives from its id before it draws random ones: a sender can take any
# name it can predict, so a name it cannot (64 random bits) ends every squat.
_DERIVED_NAMES = 3
_RANDOM_TRIES = 16


def short_id(stream_id: str) -> str:
    """Eight hex digits standing for ``stream_id`` in a collision name."""
    return hashlib.sha256(stream_id.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def final_name(dir_fd: int, spec: p.StreamSpec, *, overwrite: bool) -> str:
    """The name a verified stream is published under in the directory open as ``dir_fd``:
    its sanitised file name; if that is taken (and not ``overwrite``), ``<stem>.<short
    id>.<ext>``, then ``<stem>.<short id>-2.<ext>`` and ``-3``, then ``<stem>.<16 random hex
    digits>.<ext>``. A published file is never replaced unless asked, and no choice of
    names by senders can exhaust the candidates."""
    name = paths.safe_file_name(spec.name, spec.stream_id)
    if overwrite:
        return name
    short = short_id(spec.stream_id)
    # Built one at a time: the plain name is almost always free.
    candidates = itertools.chain(
        (name,), (collision_name(name, short if n == 1 else f"{short}-{n}") for n in range(1, _DERIVED_NAMES + 1)),
        (collision_name(name, secrets.token_hex(8)) for _ in range(_RANDOM_TRIES)))
    for candidate in candidates:
        try:
            os.lstat(candidate, dir_fd=dir_fd)
        except FileNotFoundError:
            return candidate
    raise StreamError(f"stream {spec.stream_id}: {name} and {_DERIVED_NAMES + _RANDOM_TRIES} collision names for "
                      "it, random ones included, are all taken in the output directory; is something creating "
                      "every name it sees there?")


def collision_name(name: str, stream_id: str) -> str:
    """``<stem>.<stream_id>.<ext>`` for a name already taken, cut to fit one directory entry."""
    stem, dot, ext = name.rpartition(".")
    if not stem:
        stem, ext = name, ""
    tail = f".{stream_id}" + (f".{ext}" if ext else "")
    if len(tail.encode("utf-8", "surrogatepass")) > _NAME_MAX - 1:
        tail = f".{stream_id}"
    room = _NAME_MAX - len(tail.encode("utf-8", "surrogatepass"))
    cut = stem.encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore") or "_"
    return cut + tail


# A lock in /proc/locks, "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter
# has "->" after the number): the file's device (hex major:minor) and inode.
_LOCK = re.compile(r"^[0-9]+:\s+(?:->\s+)?(?:\S+\s+){4}([0-9a-f]+):([0-9a-f]+):([0-9]+)\s", re.MULTILINE)


def held_inodes() -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every file some process holds a lock on (``/proc/locks``),
    or None where the kernel does not say. Reading it takes no lock: a receiver trying its
    own lock at that moment is never disturbed."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    return {(int(major, 16), int(minor, 16), int(inode)) for major, minor, inode in _LOCK.findall(text)}


def locked_now(st: os.stat_result, held: set[tuple[int, int, int]]) -> bool:
    """Whether the file ``st`` describes is among ``held`` (:func:`held_inodes`)."""
    return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held
