"""Many files out over one connection, pipelined, resumable per file (docs/protocol.md,
"Sender, many files over one connection").

ActiveMQ syncs its journal before it answers a receipt, and a receipt confirms every frame
the connection sent before it, so receipts ride only on every :data:`SEAL_FILES`-th offer
(or after :data:`SEAL_BYTES`): each one asked for makes the broker wait for the disk, which
for 64 KiB files cost three times the rest of the send. Files of one chunk or less travel
in packs (``small_files.py``), the broker's cost being mostly per message. A large file
goes through ``send_file`` over the same connection, with its own checkpoint.

Confirmed files go to one append-only ledger per batch (``SendStateDir.ledger``): a re-run
skips them; a file confirmed but not yet in the ledger when the sender died is sent again,
and its receiver reports a duplicate.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from airflow_provider_amqstream.engine.records import TransferResult, open_private, read_json, sender_store, write_json
from airflow_provider_amqstream.engine.send.batch import (
    BatchFile,
    BatchLedger,
    BatchStatus,
    BulkResult,
    FileFailure,
)
from airflow_provider_amqstream.engine.send.small_files import (
    Outgoing,
    Pack,
    index_bytes,
    inline_member,
    send_few,
)
from airflow_provider_amqstream.engine.send.stream import (
    SendOptions,
    file_identity,
    id_key,
    regular_file,
    seal_recipients,
    send_file,
)
from airflow_provider_amqstream.engine.state_dir import SendStateDir
from airflow_provider_amqstream.exceptions import (
    ProtocolError,
    StreamError,
    TransportError,
)
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import paths
from airflow_provider_amqstream.protocol.codec import ChunkCodec
from airflow_provider_amqstream.protocol.names import Destination, derive_stream_id, validate_stream_id
from airflow_provider_amqstream.protocol.seal import SEALED_NAME, Seal, derived_key
from airflow_provider_amqstream.protocol.wire import StreamSpec
from airflow_provider_amqstream.transport.link import Link, open_link
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.retry import Reconnect

log = logging.getLogger(__name__)

# Files whose receipts may be outstanding at once, and their bytes: enough to keep the
# broker busy while we wait, small enough that a lost connection resends little.
MAX_IN_FLIGHT_FILES = 256
MAX_IN_FLIGHT_BYTES = 64 * 2**20
# Small files sent between two receipts, at most, and their bytes (see above). Both well
# below the in-flight bounds, so a receipt is always outstanding when those are reached.
SEAL_FILES = 32
SEAL_BYTES = 2 * 2**20
BatchProgress = Callable[[BatchStatus], None]


def send_files(
    params: BrokerParams,
    files: Iterable[str | os.PathLike[str] | BatchFile],
    destination: str,
    options: SendOptions | None = None,
    *,
    batch_id: str | None = None,
    progress: BatchProgress | None = None,
    on_result: Callable[[TransferResult], None] | None = None,
    on_failure: Callable[[FileFailure], None] | None = None,
) -> BulkResult:
    """Send many files over one connection; return the totals (and the first
    :data:`~.batch.MAX_KEPT_RESULTS` results in full, and a file listing every one).

    Memory stays flat in the number of files: they are read twice (counted, then sent) one
    at a time, and each result is counted and appended to the files list, not kept.

    :param files: paths, or :class:`BatchFile` (path and relative directory); pass
        :func:`iter_files` for directories and patterns (it walks, holding no list). A
        one-pass iterator is made a list first.
    :param batch_id: names the batch's ledger (letters, digits, ``._-``); default derived
        from the destination and the files, so the same call finds it again. Give one when
        the set of files may change between tries (an Airflow run id).
    :param progress: called with a :class:`BatchStatus` after each group of confirmations.
    """
    opts = options or SendOptions()
    t0 = time.monotonic()
    dest = Destination.parse(destination)
    if hdr.Mode(opts.mode) is hdr.Mode.HANDSHAKE or dest.kind != "queue":
        raise StreamError(f"{dest}: many files in one send go to a queue in stream or atomic mode; "
                          "send handshake-mode files one at a time")
    window = next(v for v in (opts.window, params.window, hdr.DEFAULT_WINDOW) if v is not None)
    chunk = next(v for v in (opts.chunk_size, params.chunk_size, hdr.DEFAULT_CHUNK_SIZE) if v is not None)
    if window < 1 or not 1 <= chunk <= hdr.MAX_CHUNK_SIZE:
        raise StreamError(f"window ({window}) must be at least 1 and chunk size ({chunk}) in 1..{hdr.MAX_CHUNK_SIZE}")
    codec = ChunkCodec(opts.compression if opts.compression is not None else params.compression)
    if iter(files) is files:  # a one-pass iterator: the send reads the files twice
        files = list(files)
    status = BatchStatus(0, 0)

    def fail(path: Path | str, error: str, sid: str = "") -> None:
        failure = FileFailure(str(path), error, sid)
        status.fail(failure)
        log.error("%s: %s", path, error)
        if on_failure:
            on_failure(failure)
        if opts.fail_fast:
            raise StreamError(f"{path}: {error}")

    # Sealed: files of one chunk go in sealed packs, never inline alone; larger ones as sealed
    # streams (small ones back to back under one receipt); the batch's file list is sealed part by part.
    recipients = seal_recipients(opts, params)
    sealed = bool(recipients)
    key = id_key(params)
    status.files_total, status.bytes_total, ids = _survey(files, dest, key, fail if opts.fail_fast else lambda *_: None,
                                                          sealed=sealed)
    if batch_id is None:
        batch_id = f"b-{hashlib.sha256(f'{dest}|{status.files_total}|{ids:x}'.encode()).hexdigest()[:20]}"
    validate_stream_id(batch_id)
    # The first use in a process prunes expired records, checkpoints and ledgers.
    sdir = SendStateDir()
    sender_store(sdir, params.records_retention_days)
    ledger = BatchLedger(sdir.ledger(batch_id, params), opts.ledger_flush)
    # Every file's result of this run, one JSON line each, appended as it is confirmed (the
    # list a task's XCom points to, and what the batch announcement is read from).
    files_list = sdir.files_list(batch_id, params)
    files_list.parent.mkdir(parents=True, exist_ok=True)
    listing = os.fdopen(open_private(files_list, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8")
    ctx = _Ctx(params=params, dest=dest, options=opts, window=window, chunk=chunk, codec=codec, ledger=ledger,
               status=status, listing=listing, progress=progress, on_result=on_result, recipients=recipients,
               seal_secret=_seal_secret(sdir.seal_secret(params)) if sealed else b"")
    done = {} if opts.restart else ledger.load()
    seeded = set() if opts.restart else set(opts.ledger_seed)
    todo = _Todo(ctx.skip_sent(_outgoing(files, dest, key, fail, sealed=sealed), done, seeded))
    try:
        ctx.send_all(todo, fail)
    finally:
        ledger.flush()
        listing.close()
    if opts.manifest:
        _announce(params, dest, batch_id, files_list, count=status.files_done, reconnect_timeout=opts.reconnect_timeout,
                  recipients=recipients)
    elif status.files_done and not ctx.connected:
        # Everything was sent before: still prove the broker takes these credentials, so a
        # wrong password fails rather than passing as "already sent".
        with open_link(params) as link:
            link.round_trip()
    if progress:
        progress(status)
    return BulkResult(batch_id, str(dest), status.results, status.failures, time.monotonic() - t0, status, params.url,
                      files_list=str(files_list))


def _seal_secret(path: Path) -> bytes:
    """The small sealed files' secret: the one earlier runs used (the keys of any chunks they
    left on the broker), else a new one, written 0600 before anything is sent. Touched on use,
    as state files unused for the retention period are pruned."""
    try:
        held = read_json(path)
    except ValueError:  # not JSON (ours are written whole and renamed): replaced below
        held = {}
    text = str((held or {}).get("secret", ""))
    if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
        os.utime(path)
        return bytes.fromhex(text)
    secret = os.urandom(32)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.new")
    write_json(tmp, {"secret": secret.hex()}, mode=0o600)
    try:
        if held is not None:
            os.replace(tmp, path)
            return secret
        try:
            os.link(tmp, path)  # fails if another first sealed send made it meanwhile: theirs is taken
        except FileExistsError:
            return _seal_secret(path)
        return secret
    finally:
        tmp.unlink(missing_ok=True)


def _survey(files: Iterable[str | os.PathLike[str] | BatchFile], dest: Destination,
            key: bytes, fail: Callable[..., None], *, sealed: bool) -> tuple[int, int, int]:
    """The files a send will send, not kept: how many, their bytes, and the sum of their stream ids'
    digests (the same files give the same sum in any order). Each failing one is reported by
    the sending pass; with fail_fast, ``fail`` is the send's report-and-raise: the first is
    reported here and stops the send before anything is sent."""
    count = size = ids = 0
    for e in _outgoing(files, dest, key, fail, sealed=sealed):
        count += 1
        size += e.size
        ids = (ids + int.from_bytes(hashlib.sha256(e.stream_id.encode()).digest()[:16], "big")) % (1 << 128)
    return count, size, ids


def _outgoing(files: Iterable[str | os.PathLike[str] | BatchFile], dest: Destination,
              key: bytes, fail: Callable[..., None], *, sealed: bool = False) -> Iterator[Outgoing]:
    """The files to send, one at a time; those that cannot be sent go to ``fail``. A file is
    named once (see ``FileSet``), so its stream id is too."""
    for item in files:
        bf = item if isinstance(item, BatchFile) else BatchFile(Path(item), "")
        try:
            st_ = regular_file(bf.path)
            paths.safe_subdir(bf.subdir, "local")  # refuse here what any receiver would refuse
            identity = file_identity(bf.path, st_, bf.real)
            stem = SEALED_NAME if sealed else bf.path.name
            sid = derive_stream_id(stem, f"{identity}|{dest}", key)  # as default_stream_id
        except (OSError, StreamError, ProtocolError) as exc:
            fail(bf.path, str(getattr(exc, "strerror", None) or exc))
            continue
        yield Outgoing(bf.path, bf.subdir, sid, st_.st_size, identity)


def _announce(params: BrokerParams, dest: Destination, batch_id: str, files_list: Path, *, count: int,
              reconnect_timeout: float, recipients: list[bytes]) -> None:
    """Send the batch's file list after its offers, read back from ``files_list`` part by part
    (a re-run sends it again: receivers rewrite the same manifest), each part sealed for
    ``recipients`` if there are any."""
    reconnect = Reconnect(f"announcing batch {batch_id} on {dest}", params.url, reconnect_timeout)
    while True:
        try:
            with (open_link(params, client_id=f"amqs-bulk-{os.getpid()}") as link,
                  open(files_list, encoding="utf-8") as fh):
                reconnect.connected()
                for headers, body in bw.iter_batch_messages(batch_id, map(json.loads, fh), count):
                    part: bytes | bytearray = body
                    if recipients:
                        headers, part = bw.seal_batch_part(headers, body, recipients)
                    link.send_confirmed(str(dest), part, headers)
            return
        except TransportError as exc:
            reconnect.failed(exc)


def _already(rec: dict[str, Any], e: Outgoing, dest: Destination, params: BrokerParams) -> TransferResult:
    now = time.time()
    sha = str(rec.get("sha256") or "")
    if not sha:
        # Known confirmed from the task state store, which keeps ids only: hash it here.
        h = hashlib.sha256()
        with open(e.src, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        sha = h.hexdigest()
    return TransferResult(e.stream_id, str(dest), str(rec.get("name") or e.src.name), e.size,
                          int(rec.get("chunks") or 0), sha, 0.0,
                          str(rec.get("mode") or "atomic"), e.size, 0, str(e.src), now, now, status="already_sent",
                          chunk_size=int(rec.get("chunk_size") or 0), broker=params.url)


class _Todo(collections.deque[Outgoing]):
    """The files still to send: those put back (sent, not confirmed, before a lost
    connection) first, then the rest of the walk, read as needed. Looks ahead at most two."""

    def __init__(self, source: Iterator[Outgoing]) -> None:
        super().__init__()
        self.source = source

    def _fill(self, n: int) -> bool:
        while len(self) < n:
            nxt = next(self.source, None)
            if nxt is None:
                return False
            self.append(nxt)
        return True

    def __bool__(self) -> bool:
        return self._fill(1)

    def second(self) -> Outgoing | None:
        return self[1] if self._fill(2) else None

    def popleft(self) -> Outgoing:
        self._fill(1)
        return super().popleft()


class _InFlight:
    """Files sent and not yet confirmed, in the order sent, each with the receipt id asked
    for with it (None: a later receipt confirms it), and their bytes."""

    def __init__(self) -> None:
        self.files: collections.deque[tuple[str | None, Outgoing, TransferResult]] = collections.deque()
        self.bytes = 0

    def add(self, rid: str | None, e: Outgoing, res: TransferResult) -> None:
        self.files.append((rid, e, res))
        self.bytes += e.size

    def pop_last(self) -> Outgoing:
        """Take back the file sent last (its receipt was never asked for)."""
        _, e, _ = self.files.pop()
        self.bytes -= e.size
        return e

    def confirm_oldest(self, link: Link, record: Callable[[Outgoing, TransferResult], None]) -> None:
        """Wait for the oldest receipt asked for; the files it covers (those up to it) leave
        the window confirmed, each to ``record``."""
        rid = next(r for r, _, _ in self.files if r is not None)
        link.wait_receipt(rid)
        while True:
            r, e, res = self.files.popleft()
            self.bytes -= e.size
            res.seconds = time.monotonic() - res.seconds
            res.finished_at = time.time()
            record(e, res)
            if r == rid:
                return


@dataclass
class _Ctx:
    """One batch's sending state across reconnects."""

    params: BrokerParams
    dest: Destination
    options: SendOptions
    window: int
    chunk: int
    codec: ChunkCodec
    ledger: BatchLedger
    status: BatchStatus
    listing: TextIO
    progress: BatchProgress | None
    on_result: Callable[[TransferResult], None] | None
    connected: bool = False  # a connection opened: the broker took these credentials
    last_progress: float = 0.0
    restarted: set[str] = field(default_factory=set)
    recipients: list[bytes] = field(default_factory=list)
    seal_secret: bytes = b""

    def skip_sent(self, entries: Iterable[Outgoing], done: dict[str, dict[str, Any]],
                  seeded: set[str]) -> Iterator[Outgoing]:
        """Record the files the ledger (or the seed) knows confirmed; yield the others."""
        for e in entries:
            rec = done.get(e.stream_id)
            if rec is None and e.stream_id not in seeded:
                yield e
                continue
            res = _already(rec or {}, e, self.dest, self.params)
            self._tally(e, res)

    def send_all(self, todo: _Todo, fail: Callable[..., None]) -> None:
        """Send ``todo`` over as many connections as it takes."""
        status, ledger = self.status, self.ledger
        reconnect = Reconnect(f"sending {status.files_total} files to {self.dest}", self.params.url,
                              self.options.reconnect_timeout)
        while todo:
            done_before = status.files_done
            try:
                with open_link(self.params, client_id=f"amqs-bulk-{os.getpid()}") as link:
                    reconnect.connected()
                    self.connected = True
                    self.run(link, todo, fail)
            except TransportError as exc:
                # A full destination is a receiver that stopped or lags: it takes messages
                # again when it resumes, so it is waited for as a broker that went away.
                if status.files_done > done_before:
                    reconnect.progressed()
                ledger.flush()
                reconnect.failed(exc)

    def run(self, link: Link, todo: _Todo, fail: Callable[..., None]) -> None:
        """Send what is left in ``todo`` over ``link``; a lost connection puts the files
        whose receipts did not arrive back at the front of ``todo``."""
        flight = _InFlight()
        unsealed_files = unsealed_bytes = 0  # small files sent since the last receipt asked for
        pack = Pack(self.recipients)
        try:
            while todo:
                e = todo[0]
                if self._packable(e):
                    self._pack_next(link, todo, pack, flight, fail)
                    continue
                small = self._small(e)
                if not small:  # a large file goes alone, after every small one before it
                    while flight.files:
                        flight.confirm_oldest(link, self._record)
                nxt = todo.second()
                seal = (e.seal or nxt is None or not self._small(nxt)
                        or unsealed_files + 1 >= SEAL_FILES or unsealed_bytes + e.size >= SEAL_BYTES)
                try:
                    sent = self._send_small(link, e, seal) if small else self._send_large(link, e)
                except (OSError, StreamError, ProtocolError) as exc:
                    todo.popleft()
                    fail(e.src, str(getattr(exc, "strerror", None) or exc), e.stream_id)
                    if flight.files and flight.files[-1][0] is None:
                        # The receipt meant for this file must now ride on another: send the
                        # last unconfirmed one again (its receiver reports a duplicate).
                        last = flight.pop_last()
                        last.seal = True
                        todo.appendleft(last)
                    continue
                todo.popleft()
                if isinstance(sent, TransferResult):
                    self._record(e, sent)
                    continue
                rid, res = sent
                flight.add(rid, e, res)
                unsealed_files, unsealed_bytes = (0, 0) if rid else (unsealed_files + 1, unsealed_bytes + e.size)
                self._bound(link, flight)
            while flight.files:
                flight.confirm_oldest(link, self._record)
        except TransportError:
            # Not confirmed (or not even sent): they go again, whole, on the next connection.
            todo.extendleft(e for e, *_ in reversed(pack.files))
            todo.extendleft(e for _, e, _ in reversed(flight.files))
            raise

    def _pack_next(self, link: Link, todo: _Todo, pack: Pack, flight: _InFlight,
                   fail: Callable[..., None]) -> None:
        """Put the next file (of one chunk) in ``pack``; send the pack when it is full or
        when the next file cannot join it."""
        e = todo[0]
        try:
            headers, wire, res = inline_member(e, self.dest, self.chunk, self.codec, self.params)
        except (OSError, StreamError, ProtocolError) as exc:
            todo.popleft()
            fail(e.src, str(getattr(exc, "strerror", None) or exc), e.stream_id)
        else:
            index = index_bytes(headers)
            if not pack.fits(index, wire):
                pack.send(link, self.dest, flight.add)
            todo.popleft()
            pack.add(e, headers, wire, res, index)
        if pack.files and (not todo or not self._packable(todo[0])):
            pack.send(link, self.dest, flight.add)
        self._bound(link, flight)

    def _small(self, e: Outgoing) -> bool:
        """Whether ``e`` fits in one window: sent back to back, confirmed with others."""
        return e.size <= self.window * self.chunk

    def _packable(self, e: Outgoing) -> bool:
        """Whether ``e`` goes in a pack: packs are on and it fits in one chunk."""
        return self.options.pack and e.size <= self.chunk

    def _inline(self, e: Outgoing) -> bool:
        """Whether ``e`` travels in an offer of its own: it fits in one chunk and the send is not
        sealed (a sealed file of one chunk goes in a sealed pack, even alone, or as a stream)."""
        return not self.recipients and e.size <= self.chunk

    def _seal(self, spec: StreamSpec, name: str, subdir: str) -> Seal:
        # The key comes from the sender's secret for this broker: a file sent again after a
        # crash (its chunks may be on the broker already, its offer not) is sealed under the key they were.
        return Seal.create(spec.stream_id, self.recipients, name=name, size=spec.size, chunk_size=spec.chunk_size,
                           subdir=subdir, key=derived_key(self.seal_secret, spec.stream_id))

    def _send_small(self, link: Link, e: Outgoing, seal: bool) -> tuple[str | None, TransferResult]:
        """Send a small file; with ``seal``, ask for the receipt that confirms it and every
        file sent before it (the returned receipt id; else None)."""
        if self._inline(e):  # the file rides in its offer (one message, no data queue)
            headers, wire, res = inline_member(e, self.dest, self.chunk, self.codec, self.params)
            rid = link.send(str(self.dest), wire, headers, receipt=seal)
        else:
            rid, res = send_few(link, e, self.dest, self.chunk, self.codec, receipt=seal,
                                seal=self._seal if self.recipients else None)
        if seal and rid is None:
            raise TransportError(f"no receipt id for the offer of stream {e.stream_id} on {self.params.url}")
        return rid, res

    def _bound(self, link: Link, flight: _InFlight) -> None:
        while len(flight.files) > MAX_IN_FLIGHT_FILES or flight.bytes > MAX_IN_FLIGHT_BYTES:
            flight.confirm_oldest(link, self._record)

    def _send_large(self, link: Link, e: Outgoing) -> TransferResult:
        base = self.status.bytes_done
        # --restart discards a large file's checkpoint once, not again after a reconnect.
        restart = self.options.restart and e.stream_id not in self.restarted
        self.restarted.add(e.stream_id)

        def each(done: int, total: int) -> None:
            now = time.monotonic()
            if self.progress and now - self.last_progress > 1.0:
                self.last_progress = now
                self.status.bytes_done = base + done
                self.progress(self.status)
                self.status.bytes_done = base

        opts = dataclasses.replace(self.options, chunk_size=self.chunk, window=self.window, restart=restart,
                                   progress=each, compression=self.codec.encoding)
        return send_file(self.params, e.src, str(self.dest), opts, stream_id=e.stream_id, subdir=e.subdir, link=link)

    def _record(self, e: Outgoing, res: TransferResult) -> None:
        self.ledger.add({"stream_id": e.stream_id, "path": str(e.src), "subdir": e.subdir, "name": res.name,
                         "bytes": res.bytes, "chunks": res.chunks, "chunk_size": res.chunk_size,
                         "sha256": res.sha256, "mode": res.mode, "sent_at": time.time()})
        self._tally(e, res)
        now = time.monotonic()
        if self.progress and now - self.last_progress > 0.5:
            self.last_progress = now
            self.progress(self.status)

    def _tally(self, e: Outgoing, res: TransferResult) -> None:
        """Count a file confirmed (now or by an earlier run), list it, report it."""
        self.status.add(res)
        self.listing.write(json.dumps({**res.to_json(), "dir": e.subdir}, ensure_ascii=False) + "\n")
        if self.on_result:
            self.on_result(res)
