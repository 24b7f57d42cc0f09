"""Small files that arrive inside their offers, made durable as a group.

A bulk landing directory is mostly small files, and a receiver that fsyncs each one's
data, its directory entry and its completion record pays three disk flushes per file:
on this machine that was 41 % of a 1,000-file receive. A group of inline offers (up to
:data:`GROUP_FILES` files or :data:`GROUP_BYTES`) is written first and made durable in
three steps for the whole group, each one a single ``syncfs`` of the filesystem (an
``fsync`` of every file and directory where ``syncfs`` is missing):

1. every file's bytes, under a temporary name in ``.amqstream/``;
2. every file renamed to its published name;
3. every completion record and claim (one append per bucket of the record store).

Only then are the offers acknowledged. A crash before step 3 leaves no record, so the
redelivered offer is received again; the order means no record ever describes a file
whose bytes or name might not be on disk.

A pack (several inline offers in one message) is taken apart into :class:`PackMember`
offers, each settled like an inline offer of its own (a sealed pack opened first); the
pack message is acknowledged when the last of them is. Until then a crash or a yield sends
the whole pack back, and its members already published come back as duplicates, which are
acknowledged and not written again.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.receive.claims import done_records
from airflow_provider_amqstream.engine.receive.partial_file import Room, final_name
from airflow_provider_amqstream.engine.receive.stream import ReceiveOptions, open_subdir
from airflow_provider_amqstream.engine.records import TransferResult, open_private
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.engine.store import unlink_missing_ok, write_all
from airflow_provider_amqstream.exceptions import StreamError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import paths
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.messages import Delivered, StreamOffer
from airflow_provider_amqstream.protocol.seal import Identity
from airflow_provider_amqstream.transport.link import Message

# A group is bounded in files (offers held unacknowledged, each with its file open until the
# group's flush) and in bytes held in memory. A receiver that falls behind finds all it was
# prefetched waiting: 128 takes the eight packs of 16 files of 64 KiB in one group, three
# flushes for them instead of six (at 64, a 1,000-file receive under load spent 1.5 s of
# its 16 in syncfs).
GROUP_FILES = 128
GROUP_BYTES = 16 * 1024 * 1024
# Inline offers and packs the broker may hand this receiver before it acknowledges any
# (each at most 1 MiB). A receiver that stops (SIGSTOP, an unread stdout) keeps them, and the
# broker counts them against the queue's memory limit together with what it has paged in
# for them, up to 16 pending dispatch and 16 in its cursor: 31 messages were seen. At 32 MB
# with 16 here, that filled the limit in 1 of 6 runs and every sender to the queue waited;
# now at most 40 MiB of the 64 MB limit (broker/conf/activemq.xml.tmpl). A group of 128 small
# files is still eight packs.
PREFETCH = 8


# Extended attribute naming the stream a published inline file came from (where the
# filesystem keeps user attributes; elsewhere a redelivered file gets a collision name).
MARK = "user.amqstream.stream"


@dataclass(eq=False)
class _Pack:
    message: Message
    left: int  # members not yet settled
    sealed: bool


@dataclass(slots=True, eq=False)
class PackMember:
    """One file of a pack, with the headers and body of the inline offer it is."""

    headers: dict[str, str]
    body: memoryview
    pack: _Pack


def unpack(message: Message, identities: list[Identity]) -> list[PackMember] | None:
    """The members of a pack message (a sealed one opened with ``identities``), or None for a
    sealed pack none of them opens; raises ProtocolError for a malformed or altered pack."""
    headers, body = message.headers, message.body or b""
    sealed = bw.is_sealed_pack(headers)
    members = bw.open_pack(headers, body, identities) if sealed else bw.read_pack(headers, body)
    if members is None:
        return None
    pack = _Pack(message, len(members), sealed)
    return [PackMember(headers, body, pack) for headers, body in members]


def sealed(offer: Message) -> bool:
    """Whether ``offer`` came sealed: a member of a sealed pack (no inline offer is sealed)."""
    return isinstance(offer, PackMember) and offer.pack.sealed


def shown(offer: Message) -> dict[str, Any]:
    """The headers of ``offer`` that may go back to the broker (in a quarantine copy): a sealed
    pack member's without what its seal hid."""
    return bw.sealed_member_view(offer.headers) if sealed(offer) else dict(offer.headers)


def settle(ack: Callable[[Message], None], offer: Message) -> None:
    """Acknowledge (``ack``) an offer that is settled; a pack member's pack once all its members are."""
    if not isinstance(offer, PackMember):
        ack(offer)
        return
    offer.pack.left -= 1
    if offer.pack.left == 0:
        ack(offer.pack.message)


def message_of(offer: Message) -> Message:
    """The message that carries ``offer``: its pack for a pack member, else itself."""
    return offer.pack.message if isinstance(offer, PackMember) else offer


def files_in(message: Message) -> int:
    """How many files a message carries for a group's count: a pack's members, or one."""
    raw = str(message.headers.get(bw.H_PACK_FILES, "1")) if bw.is_pack(message.headers) else "1"
    return min(int(raw), bw.MAX_PACK_FILES) if raw.isdigit() and 0 < len(raw) < 4 else 1


def _load_syncfs() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]  # it returns an int, ctypes' default
    return fn


_SYNCFS = _load_syncfs()


_TEMP = re.compile(r".+\.([0-9]+)-[0-9a-f]{8}\.inline")


def sweep_temporaries(sdir: StateDir) -> None:
    """Remove the temporary files of receivers that died holding a group (their offers came
    back to the queue); those of live receivers sharing the directory stay."""
    for entry in list(os.scandir(sdir)):
        m = _TEMP.fullmatch(entry.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            os.unlink(entry.path)  # its receiver is gone
        except PermissionError:
            continue  # alive, another user's


@dataclass
class _Item:
    offer: Message
    spec: p.StreamSpec
    origin: str
    subdir: tuple[str, ...]
    sha256: str
    temp: str
    fd: int
    started: float
    path: str | None = None
    sender: str = ""


def _published_before(dir_fd: int, name: str, it: _Item) -> bool:
    """Whether the name taken holds this very stream: published by a receiver that died
    before its record was flushed (the file is marked with its stream id, and holds
    the same bytes). Then the redelivered offer takes that name again instead of
    leaving a second copy under a collision name. Another stream's file, even with
    the same bytes, keeps its name to itself."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return False
    with os.fdopen(fd, "rb", buffering=0) as fh:
        try:
            marked = os.getxattr(fd, MARK).decode("ascii", "replace")
        except OSError:
            return False
        if marked != it.spec.stream_id or os.fstat(fd).st_size != it.spec.size:
            return False
        h = hashlib.sha256()
        while block := fh.read(1024 * 1024):
            h.update(block)
        return h.hexdigest() == it.sha256


def _sync(fds: list[int]) -> None:
    """Flush ``fds`` to disk: one syncfs per filesystem where the kernel has it, else each fd."""
    if _SYNCFS is None:
        for fd in fds:
            os.fsync(fd)
        return
    for fd in {os.fstat(fd).st_dev: fd for fd in fds}.values():  # any one fd of a filesystem syncs all of it
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))


class InlineGroup:
    """Inline files written, not yet durable; :meth:`commit` publishes them all.

    :param destination: where the offers came from (for results and messages).
    """

    def __init__(self, out: Path, sdir: StateDir, destination: str, opts: ReceiveOptions) -> None:
        self.out, self.sdir, self.destination, self.opts = out, sdir, destination, opts
        self.items: list[_Item] = []
        self.dir_fds: dict[tuple[str, ...], int] = {}
        self.room = Room(sdir, opts.min_free_bytes)
        self.ids: set[str] = set()

    def add(self, got: Delivered[StreamOffer, Message], data: bytes, *, sha256: str, sender: str = "") -> None:
        """Write one verified file under a temporary name. Raises :class:`StreamNoRoom` if
        it would cross the free-space reserve (nothing written), :class:`Poisoned` for a
        target directory that is a link."""
        spec, subdir = got.message.spec, got.message.subdir
        what = f"stream {spec.stream_id} ({self.destination}, inline)"
        self.room.check(what, spec.size)
        if subdir not in self.dir_fds:
            try:
                self.dir_fds[subdir] = open_subdir(self.out, subdir, what)
            except OSError as exc:
                raise self._disk_error(exc, what, f"creating {self.out.joinpath(*subdir)}") from exc
        temp = f"{spec.stream_id}.{os.getpid()}-{secrets.token_hex(4)}.inline"
        try:
            fd = open_private(f"{self.sdir}/{temp}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as exc:
            raise self._disk_error(exc, what, "creating its file") from exc
        with contextlib.suppress(OSError):  # no user xattrs here: only the take-over after a crash is lost
            os.setxattr(fd, MARK, spec.stream_id.encode("ascii"))
        item = _Item(got.handle, spec, got.message.origin, subdir, sha256, temp, fd, time.time(), sender=sender)
        self.items.append(item)
        self.ids.add(spec.stream_id)
        try:
            write_all(fd, data)
        except OSError as exc:
            raise self._disk_error(exc, what, "writing") from exc
        self.room.take(spec.size)

    def commit(self) -> list[tuple[Message, TransferResult]]:
        """Make every file durable, publish it, record it; return (offer, result) pairs whose
        offers the caller acknowledges. On a disk error nothing is recorded (the offers
        come back) and the error names the group's first stream."""
        if not self.items:
            return []
        try:
            _sync([it.fd for it in self.items])
            for it in self.items:
                dir_fd = self.dir_fds[it.subdir]
                name = final_name(dir_fd, it.spec, overwrite=self.opts.overwrite)
                plain = paths.safe_file_name(it.spec.name, it.spec.stream_id)
                if name != plain and _published_before(dir_fd, plain, it):
                    name = plain
                os.replace(f"{self.sdir}/{it.temp}", name, dst_dir_fd=dir_fd)
                it.path = os.path.join(self.out, *it.subdir, name)
            _sync(list(self.dir_fds.values()))
            results = [(it.offer, self._result(it)) for it in self.items]
            # Without syncfs every record is flushed as written, and the _sync below flushes their
            # names; with syncfs it flushes both.
            done_records(self.sdir, str(self.out), [r for _, r in results], claim=self.opts.claim,
                         sync=_SYNCFS is None, retention_days=self.opts.records_retention_days)
            fd = os.open(self.sdir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                _sync([fd])
            finally:
                os.close(fd)
        except OSError as exc:
            first = self.items[0].spec.stream_id
            raise self._disk_error(exc, f"streams {first} and {len(self.items) - 1} more ({self.destination})",
                                   "publishing") from exc
        finally:
            self.close()
        return results

    def close(self) -> None:
        """Release descriptors and remove temporary files not published."""
        for it in self.items:
            if it.fd >= 0:
                os.close(it.fd)
                it.fd = -1
            if it.path is None:
                unlink_missing_ok(f"{self.sdir}/{it.temp}")
        for fd in self.dir_fds.values():
            os.close(fd)
        self.dir_fds.clear()

    def _result(self, it: _Item) -> TransferResult:
        spec = it.spec
        # A partial reception of this stream through its data queue (sent before without packing) is moot now.
        for leftover in (self.sdir.part(spec.stream_id), self.sdir.resume(spec.stream_id)):
            unlink_missing_ok(leftover)
        now = time.time()
        return TransferResult(spec.stream_id, self.destination, spec.name, spec.size, spec.chunks, it.sha256,
                              now - it.started, spec.mode.value, 0, spec.size, it.path, it.started, now,
                              chunk_size=spec.chunk_size, origin=it.origin, sender=it.sender)

    def _disk_error(self, exc: OSError, what: str, doing: str) -> StreamError:
        return StreamError(f"{what}: {doing} failed: {exc.strerror or exc} ({shutil.disk_usage(self.sdir).free} "
                           f"bytes free in {self.out}). Nothing was acknowledged, so the broker keeps the offers; "
                           "fix the cause and re-run the receiver.")
