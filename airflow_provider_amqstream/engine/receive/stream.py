"""One offered stream onto disk: take each message, decide, commit in batches, verify,
publish.

:class:`StreamReceiver` owns the conversation with the broker (which message means what,
when to commit, when to give up); ``partial_file.py`` owns the bytes (reservation,
writes, the running SHA-256, the batch commit that makes acknowledged chunks durable).
Giving up comes in two kinds the caller acts on: :class:`Poisoned` (this stream can
never succeed: quarantine it) and :class:`StreamYielded` (not now: keep the partial data,
let the queue move on).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.keys import read_key_file
from airflow_provider_amqstream.engine.receive import holders
from airflow_provider_amqstream.engine.receive.claims import check_claim, done_records
from airflow_provider_amqstream.engine.receive.partial_file import PartialFile, final_name
from airflow_provider_amqstream.engine.records import TransferResult, open_private
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import (
    ConfigurationError,
    DestinationRefused,
    ProtocolError,
    StreamElsewhere,
    StreamError,
    StreamRefused,
    StreamStalled,
)
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import seal
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.messages import StreamOffer
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.outcomes import Outcome
from airflow_provider_amqstream.protocol.state import Decision, Verdict
from airflow_provider_amqstream.transport.link import Link, Message

log = logging.getLogger(__name__)

# Seconds a new stream's first chunk may take to arrive (bounded by idle_timeout).
FIRST_LOOK = 2.0
# Bytes a second a stream must bring to keep its receiver (ReceiveOptions.min_rate): a
# slow link (128 kbit/s) meets it; a sender that trickles below it, or stops half-way, is
# parked after its short look instead of holding everyone behind it for idle_timeout.
DEFAULT_MIN_RATE = 16 * 1024
# Seconds of waiting any chunk written buys at least: a stream of tiny chunks sent at once
# still waits for the broker's round trip per window, which is not the sender being slow.
CHUNK_CREDIT = 0.03
# Least seconds between two progress readings of a receive (a display throttles further).
PROGRESS_EVERY = 0.5

@dataclass
class ReceiveOptions:
    """Knobs for receiving.

    :param window: chunks per sync + acknowledgement (the broker prefetch is 2x this).
        Keep it at most half the broker's maxPageSize (16 in the shipped config).
    :param wait_timeout: seconds to wait for a stream to be offered (None: forever).
    :param stop_after: take no new stream after this many seconds (one being received is
        finished); without it a steady trickle of offers keeps a drain going for ever.
    :param stop_when: asked after each offer is settled; the receive ends once it says True
        (a batch whose manifest was just written ends a drain then, not a quiet
        ``wait_timeout`` later).
    :param idle_timeout: seconds without a chunk before the sender is presumed gone: the
        stream yields its place (partial data kept) and is tried again later.
    :param gap_grace: seconds to wait for late chunks after the end marker.
    :param reconnect_timeout: how long to keep trying to reach a lost broker.
    :param overwrite: replace an existing file of the same name in the output directory.
    :param max_bytes: quarantine streams larger than this.
    :param min_free_bytes: free space to leave in the output directory; a stream that would
        cross it yields its place instead of starting (None: 2 % of the filesystem, at
        most 1 GiB).
    :param quarantine: where quarantined streams go (default ``/queue/DLQ.<name>``).
    :param yield_backoff: seconds a stream that yielded is skipped by this output
        directory, doubling for each consecutive yield (at most an hour).
    :param rerequest_after: handshake mode: seconds of silence before asking the sender
        to resend from the first missing chunk.
    :param claim: who takes the streams (an Airflow task instance): recorded with each
        stream before its offer is acknowledged, so a retry of that taker can find what an
        earlier try received (:func:`~airflow_provider_amqstream.engine.receive.claims.find_claimed`).
    :param events: called with (event name, data) as streams open, close and fail.
    :param progress: called with (bytes received, total bytes).
    :param records_retention_days: days the output directory's completion records and claims
        are kept (None: 30; 0: for ever). Older ones are pruned as a receiver starts, and a
        stream offered again after its record expired is received again.
    :param min_rate: bytes a second a stream must bring to keep the receiver (None: the
        connection's ``min_rate`` extra, else :data:`DEFAULT_MIN_RATE`; 0: only
        ``idle_timeout`` counts). Each chunk buys its size at this rate in time the receiver
        may wait for the stream (at most the larger of ``FIRST_LOOK`` and a chunk's worth,
        never more than ``idle_timeout``; the receiver's own writing is not counted); a
        stream whose time runs out yields its place. Handshake streams keep ``idle_timeout``.
    :param keys: key files sealed streams are opened with (empty: the connection's ``keys``);
        a sealed stream none of them opens is quarantined (``no_key``).
    :param seal_required: quarantine unsealed streams (``unsealed``); also the connection's
        extra ``seal: required``.
    """

    window: int = hdr.DEFAULT_RECEIVE_BATCH
    wait_timeout: float | None = 60.0
    stop_after: float | None = None
    stop_when: Callable[[], bool] | None = None
    idle_timeout: float = 120.0
    gap_grace: float = 5.0
    reconnect_timeout: float = 120.0
    overwrite: bool = False
    max_bytes: int | None = None
    min_free_bytes: int | None = None
    quarantine: str | None = None
    yield_backoff: float = 300.0
    rerequest_after: float = 2.0
    claim: str | None = None
    events: Callable[[str, dict[str, Any]], None] | None = None
    progress: Callable[[int, int], None] | None = None
    records_retention_days: float | None = None
    min_rate: float | None = None
    keys: tuple[str, ...] = ()
    seal_required: bool = False
    identities: tuple[seal.Identity, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Read once, here: a missing or malformed key file fails the receive before it takes anything.
        self.identities = tuple(read_key_file(k) for k in self.keys)
        if self.claim is not None:
            check_claim(self.claim)
        if self.min_rate is not None and self.min_rate < 0:
            raise ConfigurationError(f"min_rate must be 0 (idle_timeout alone) or more bytes a second, "
                                     f"got {self.min_rate}")
        if self.records_retention_days is not None and self.records_retention_days < 0:
            raise ConfigurationError(f"records_retention_days must be 0 (keep for ever) or more days, "
                                     f"got {self.records_retention_days}")

    def emit(self, kind: str, **data: Any) -> None:
        if self.events:
            self.events(kind, {"time": time.time(), **data})


class Poisoned(Exception):
    """Internal: the stream can never succeed. ``reason`` names what and where, ``cause`` is
    its row of the failure table."""

    def __init__(self, reason: str, offset: int = 0, *, cause: Outcome) -> None:
        super().__init__(reason)
        self.reason, self.offset, self.cause = reason, offset, cause


def consumer_name(out: Path) -> str:
    """A receiver's identity for handshake mode: stable across restarts for one directory,
    so a receiver that comes back is the same consumer to the sender."""
    where = hashlib.sha256(str(out.resolve()).encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{socket.gethostname()}:{where}"


def receiver_token(sdir: StateDir, stream_id: str) -> str:
    """This directory's secret for one stream (handshake mode): an HMAC of the stream id
    under a key kept in ``.amqstream/receiver.key`` (mode 0600), so a receiver that
    restarts, or another process on the same directory, speaks with the same token."""
    key_file = sdir.key
    with contextlib.suppress(FileExistsError), os.fdopen(
            open_private(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
        fh.write(secrets.token_bytes(32))
        fh.flush()
        os.fsync(fh.fileno())
    with os.fdopen(open_private(key_file, os.O_RDONLY), "rb") as fh:
        key = fh.read()
    if len(key) < 32:
        raise StreamError(f"{key_file} is damaged (shorter than 32 bytes); delete it and re-run")
    return hmac.new(key, stream_id.encode(), hashlib.sha256).hexdigest()[:32]


def open_subdir(out: Path, parts: tuple[str, ...], what: str) -> int:
    """A descriptor of ``out/parts...``, creating what is missing, one component at a time
    relative to its parent, never through a symbolic link: a link planted in the output
    directory cannot send a file elsewhere (:class:`Poisoned` names it)."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        walked = out
        for part in parts:
            walked = walked / part
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=fd)
            try:
                sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Poisoned(f"{what}: its directory {walked} is a symbolic link or not a directory; "
                                   "amqstream writes only into real directories under the output directory",
                                   cause=Outcome.INVALID) from None
                raise
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


# Chunk bytes a receiver acknowledges together, at most (at least one chunk): the broker's
# prefetch of a stream's data is twice this (docs/protocol.md, "What a sender can make a
# receiver do"). Eight default chunks of 1 MiB, the default window, fit.
RECEIVE_WINDOW_BYTES = 8 * 1024 * 1024


class StreamReceiver:
    """Receives one offered stream into ``out``; the offer is acknowledged by the caller."""

    def __init__(self, link: Link, dest: Destination, out: Path, sdir: StateDir, offer: StreamOffer,
                 opts: ReceiveOptions, *, sender: str = "", seal: seal.Seal | None = None) -> None:
        spec, handshake, self.data_q = offer.spec, offer.handshake, offer.data_queue
        self.link, self.dest, self.out, self.spec, self.opts = link, dest, out, spec, opts
        self.origin, self.subdir, self.seal = offer.origin, offer.subdir, seal
        self.sdir = sdir
        # Handshake mode: where to tell the sender our position, and how often. The sender
        # stops a window ahead of us, so acknowledge every half window to keep it busy.
        self.reply_to = handshake[0] if handshake else None
        batch = max(1, min(opts.window, handshake[1] // 2)) if handshake else opts.window
        # The broker hands over twice this many chunks before any acknowledgement, each as
        # large as the sender declared: bound it in bytes too, or a sender's 8 MiB chunks
        # would make a receiver hold half a gigabyte.
        self.batch = max(1, min(batch, RECEIVE_WINDOW_BYTES // spec.chunk_size))
        self.consumer = consumer_name(out)
        self.token = receiver_token(sdir, spec.stream_id) if handshake else ""
        self.rejected = 0
        self.unacked: list[Message] = []
        self.refused: list[Message] = []
        self.reported: float | None = None  # when progress was last reported (monotonic)
        self.data_sub: str | None = None
        self.what = f"stream {spec.stream_id} ({self.data_q})"
        # Chunks stamped by anyone but the offer's sender are refused (another user cannot
        # extend or spoil the stream); with no stamps at all there is nothing to compare.
        self.sender = sender
        self.forged = 0
        self.file = PartialFile(sdir, spec, self.what, sender)
        # Where this directory's partial data is, noted on the broker for receivers elsewhere
        # (holders.py): needed only when chunks are acknowledged before the stream is
        # published, i.e. when it spans more than one batch; never on topics (handshake).
        self.notes = not self.reply_to and dest.kind == "queue" and spec.chunks > self.batch
        self.holder = holders.Holder(socket.gethostname(), str(out.resolve()), str(self.file.part.resolve()),
                                     since=time.time())
        self.noted = 0  # notes of this stream known to be on the broker (ours included)
        self.announced = False
        self.rate = DEFAULT_MIN_RATE if opts.min_rate is None else opts.min_rate
        # Seconds the stream may still keep this receiver waiting for it; only time spent
        # waiting on the broker counts (not our own writes and syncs: many small chunks
        # that come as fast as we take them are not a slow sender).
        self.credit = 0.0

    @property
    def offset(self) -> int:
        return self.file.state.contiguous_bytes

    def run(self) -> TransferResult:
        """Receive, verify and publish. Raises :class:`Poisoned`, :class:`StreamYielded`,
        or StreamError / ConnectionLost for failures of our own."""
        spec, opts = self.spec, self.opts
        started = time.time()
        t0 = time.monotonic()
        # Opened before any data moves: a bad target directory quarantines the stream at once.
        try:
            dir_fd = open_subdir(self.out, self.subdir, self.what)
        except OSError as exc:
            raise self.file.disk_error(exc, f"creating {self.out.joinpath(*self.subdir)}") from exc
        try:
            others = self._look_for_holders()
            if others and not os.path.lexists(self.file.part):
                # Its first chunks are on another disk: leave the rest on the broker for them.
                raise StreamElsewhere(holders.elsewhere_report(self.what, self.dest, spec.stream_id, self.out, others,
                                                               data_q=self.data_q))
            self.file.open(opts.min_free_bytes)
            if self.seal is not None:
                self.file.state.opener = self.seal.opener(spec.chunks)
            self._note_holding()
            resumed_from = self.file.state.contiguous_bytes
            opts.emit("stream_open", stream_id=spec.stream_id, resumed_from=resumed_from)
            try:
                written = self._drain()
            finally:
                self._settle_quietly()
            try:
                actual = self.file.hasher.hexdigest()
                self.file.state.verify(self.seal.digest(actual) if self.seal is not None else actual)
            except ProtocolError as exc:
                raise Poisoned(str(exc), self.offset, cause=Outcome.CORRUPT) from None
            name = final_name(dir_fd, spec, overwrite=self.opts.overwrite)
            final = self.out.joinpath(*self.subdir, name)
            self.file.publish(dir_fd, name)
        finally:
            self.file.close()
            os.close(dir_fd)
        result = TransferResult(
            spec.stream_id, str(self.dest), spec.name, spec.size, spec.chunks, self.file.hasher.hexdigest(),
            time.monotonic() - t0, spec.mode.value, resumed_from, written, str(final), started,
            time.time(), self.file.state.duplicates, rejected=self.rejected, chunk_size=spec.chunk_size,
            origin=self.origin, sender=self.sender)
        done_records(self.sdir, str(self.out), [result], claim=opts.claim,
                     retention_days=opts.records_retention_days)
        frames, self.unacked = self.unacked, []
        for frame in frames:
            self.link.ack(frame)
        self.tell(hdr.Kind.DONE, spec.chunks + 1)
        self.stop_data()
        # Repeats from a sender's re-run are cleared when its re-offer arrives (it always
        # ends with one), by whoever takes it and finds this record. If another receiver of
        # this directory took the re-offer while we were still receiving, it left a mark.
        mark = self.sdir.reoffered(spec.stream_id)
        if not self.reply_to and os.path.lexists(mark):
            drain_queue(self.link, self.data_q, ack=True)
            mark.unlink(missing_ok=True)
        self._release_notes()
        # Destination and sizes ride along for whoever counts (airflow_provider_amqstream.metrics).
        opts.emit("stream_close", stream_id=spec.stream_id, path=str(final), destination=str(self.dest),
                  bytes=spec.size, bytes_transferred=written)
        return result

    def stop_data(self) -> None:
        """Leave the data queue; what we did not acknowledge stays there for a later run."""
        if self.data_sub is not None:
            sub, self.data_sub = self.data_sub, None
            self.link.unsubscribe(sub)

    def abandon(self) -> int:
        """After :class:`Poisoned`: refuse every message of the stream we hold and what is
        left on its data queue (the broker moves them to its DLQ), remove the partial
        data. Returns how many messages were refused."""
        self._settle_quietly()
        held = [*self.unacked, *self.refused]
        for frame in held:
            self.link.nack(frame)
        self.unacked, self.refused = [], []
        self.stop_data()
        self.file.discard()
        left = 0 if self.reply_to else drain_queue(self.link, self.data_q, ack=False)
        self._release_notes()
        return len(held) + left

    def _look_for_holders(self) -> list[holders.Holder]:
        """The other receivers that noted holding this stream's partial data."""
        if not self.notes:
            return []
        found = holders.look(self.link, self.dest, self.spec.stream_id)
        self.noted = len(found)
        self.announced = any(h.same_place(self.holder) for h in found)
        return [h for h in found if not h.same_place(self.holder)]

    def _note_holding(self) -> None:
        """Note on the broker (persistent, confirmed), before any chunk is acknowledged, that
        this directory holds the stream's partial data."""
        if self.notes and not self.announced:
            sid = self.spec.stream_id
            self.link.send_confirmed(self.dest.held_queue(sid), b"", self.holder.headers(sid))
            self.announced = True
            self.noted += 1

    def _release_notes(self) -> None:
        """Published or quarantined: nobody's partial data of this stream is of use now."""
        if self.notes and self.noted:
            holders.release(self.link, self.dest, self.spec.stream_id, known=self.noted)
            self.noted, self.announced = 0, False

    def forget_if_empty(self) -> None:
        """After a yield: a directory that kept nothing of the stream withdraws its note."""
        if self.announced and not os.path.lexists(self.file.part):
            holders.release(self.link, self.dest, self.spec.stream_id, only=self.holder, known=self.noted)
            self.noted, self.announced = max(0, self.noted - 1), False

    def _drain(self) -> int:
        """Receive chunks until complete; return bytes written by this run."""
        link, opts, spec, state = self.link, self.opts, self.spec, self.file.state
        if state.complete:
            return 0
        # Two batches in flight: one being synced while the next arrives. The broker keeps
        # paged in (maxPageSize, 16 in our config) every message we have not acknowledged,
        # so a batch must stay below that or dispatch stops until we commit: batches of 8
        # ran at ~4x the speed of 16 here, 32 at a tenth.
        try:
            self.data_sub = link.subscribe(self.data_q, prefetch=2 * self.batch)
        except DestinationRefused:
            raise StreamRefused(
                f"{self.what}: the broker refused to create its data queue, because its sender "
                f"{self.sender or 'an unidentified sender'!r} has as many streams waiting on {self.dest} as the "
                "broker lets one user have, so it sent nothing of this one yet. The sender's receivers must take "
                f"its waiting streams, or the administrator raises its cap (`--max-waiting`) for {self.sender!r}; "
                "the offer is tried again later") from None
        # Subscribed first, then hello: on a topic the sender's chunks must find us listening.
        self.tell(hdr.Kind.HELLO, state.next_seq)
        quiet_since = self._quiet_since()
        look = min(opts.idle_timeout, FIRST_LOOK)
        # Whatever waits in the broker arrives within a moment of subscribing: every run
        # starts with a short look, whatever the stream brought before.
        self.credit = look if self.rate else max(quiet_since + opts.idle_timeout - time.monotonic(), look)
        written = 0
        progress_since: float | None = None
        while not state.complete:
            timeout = self._timeout()
            busy = self.unacked or self.file.inflight
            # With work pending, a short pause means the broker is waiting for our acks.
            began = time.monotonic()
            frame = link.get(min(timeout, 0.05) if busy else timeout, self.data_sub)
            self.credit -= time.monotonic() - began
            if frame is None:
                self._quiet(bool(busy), time.monotonic() - quiet_since, heard=progress_since is not None)
                continue
            # Only progress counts as a live sender: corrupt chunks, repeats or another user's
            # chunks trickled for ever would otherwise hold the stream (and the queue behind
            # it) for as long as they come. The clock starts at this run's first message.
            progress_since = progress_since or time.monotonic()
            if self.sender and p.sender_of(frame.headers) != self.sender:
                self._refuse_foreign(frame)
                self._check_progress(progress_since)
                continue
            d = self._decide(frame)
            if d.verdict in (Verdict.WRITE, Verdict.END):
                quiet_since = progress_since = time.monotonic()
            else:
                quiet_since = time.monotonic()
                self._check_progress(progress_since)
            if d.verdict is Verdict.CORRUPT:
                self._corrupt(frame, d)
                continue
            if d.verdict is Verdict.WRITE:
                data = frame.body if d.data is None else d.data
                self.file.write(d.seq, d.offset, data)
                written += len(data)
                self._earn(len(data))
            # Only the ack header is needed from here on: let the body go now rather than
            # hold a batch of megabytes until the batch is synced.
            frame.body = b""
            self.unacked.append(frame)
            ending = d.verdict is Verdict.END or (state.expected_sha256 and state.all_written)
            if ending and not self.reply_to and state.expected_sha256 and state.all_written:
                # The last batch is made durable by publishing: run() fsyncs the file,
                # renames it and records its completion before these messages are acknowledged, so
                # no state file is written (or synced) for it. A crash before the
                # acknowledgement redelivers the offer, which finds that record: a duplicate.
                self.file.settle(self._durable)
                self.file.assume_durable()
                break
            if len(self.unacked) >= self.batch or ending:
                self._commit(wait=bool(ending))
        if opts.progress:
            opts.progress(spec.size, spec.size)
        return written

    def _quiet_since(self) -> float:
        """When the sender was last heard from, as this run starts (monotonic clock)."""
        last = self.file.last_write
        if last is None and not self.reply_to:
            # A sender offers, then sends its first chunk at once: a stream of which nothing
            # was ever committed here, whose data queue stays empty for a short look, was
            # abandoned before it began (or an earlier receiver was killed while it looked),
            # and waiting the whole idle timeout for each of those would let a sender hold
            # the queue for idle_timeout per offer. (In handshake mode the sender waits for
            # its receivers to gather before the first chunk: no short look there.)
            return time.monotonic() - max(0.0, self.opts.idle_timeout - FIRST_LOOK)
        if last is None:
            return time.monotonic()
        return time.monotonic() - max(0.0, time.time() - last)

    def _timeout(self) -> float:
        if self.reply_to:
            return self.opts.rerequest_after
        if self.file.state.expected_sha256:
            return self.opts.gap_grace
        return max(0.0, self.credit)

    def _earn(self, nbytes: int) -> None:
        """Progress buys waiting time: ``nbytes`` at ``min_rate``, banked at most a chunk's
        worth (or the first look), so a burst cannot pay for a trickle long after."""
        idle = self.opts.idle_timeout
        if not self.rate:
            self.credit = idle
            return
        cap = min(idle, max(min(idle, FIRST_LOOK), self.spec.chunk_size / self.rate))
        self.credit = min(max(self.credit, 0.0) + max(nbytes / self.rate, CHUNK_CREDIT), cap)

    def _quiet(self, busy: bool, silent: float, *, heard: bool) -> None:
        """Nothing arrived within the wait: commit what is pending, ask a live sender again,
        or give the stream up (raises) once the sender has been silent too long.

        :param heard: a message of the stream arrived in this run.
        """
        state = self.file.state
        if busy:
            self._commit(wait=True)
            return
        if self.reply_to and silent < self.opts.idle_timeout:
            # Lost chunk, dropped end marker or a restarted sender: ask again from the gap.
            self.tell(hdr.Kind.REREQ, state.next_seq)
            return
        if state.expected_sha256 and not self.reply_to:
            raise self._missing()
        if not self.reply_to and self.credit > 0:
            return
        # A stream never begun gets a short look (_quiet_since): its silence is not a wait.
        head = f"nothing arrived for {silent:.0f}s"
        if self.rate and not self.reply_to:
            head += (f" (a stream keeps a receiver only while it brings at least {self.rate:.0f} bytes a second, "
                     "min_rate)")
        if not heard and self.file.last_write is None and not self.reply_to:
            head = f"no chunk arrived in a first look of {min(self.opts.idle_timeout, FIRST_LOOK):.1f}s"
        raise StreamStalled(
            f"{self.what}: {head} at byte {state.contiguous_bytes} of "
            f"{self.spec.size}; is the sender still running? The partial data is kept and the stream is "
            "tried again later (a re-run of the sender continues it).")

    def _missing(self) -> Exception:
        """After the end marker some chunks never came. Another receiver took them (its
        directory is not this one) when one noted holding the stream, or when the first chunk
        never came here: keep what this directory has and say where the rest is
        (:class:`StreamElsewhere`). Otherwise they were lost (moved to a DLQ, or never
        sent): :class:`Poisoned`."""
        state, spec = self.file.state, self.spec
        missing = state.describe_missing()
        others = self._look_for_holders() if self.notes else []
        have = spec.chunks - sum(last - first + 1 for first, last in state.missing_ranges())
        kept = f"{have} of its {spec.chunks} chunks ({state.received_bytes} bytes) in {self.file.part}"
        if others:
            return StreamElsewhere(holders.elsewhere_report(self.what, self.dest, spec.stream_id, self.out, others,
                                                            data_q=self.data_q, missing=missing, kept=kept))
        if self.notes and state.next_seq == 1 and state.ahead:
            return StreamElsewhere(holders.unknown_report(self.what, self.dest, spec.stream_id, missing, kept))
        return Poisoned(f"end marker arrived but {missing} never did (consumed by another client or moved to a "
                        "DLQ); the stream cannot be completed", self.offset, cause=Outcome.INCOMPLETE)

    def _decide(self, frame: Message) -> Decision:
        """The protocol's verdict on a message; one that cannot belong to the stream poisons it."""
        try:
            return self.file.state.decide(frame.headers, frame.body)
        except ProtocolError as exc:
            self.refused.append(frame)
            raise Poisoned(str(exc), self.offset, cause=Outcome.INVALID) from None

    def _corrupt(self, frame: Message, d: Decision) -> None:
        """A chunk that failed its check: a live sender (handshake) is asked to resend it;
        otherwise nobody can, and the stream is poisoned (raises)."""
        if not self.reply_to:
            self.refused.append(frame)
            raise Poisoned(d.reason, d.offset, cause=d.cause)
        # A live sender can resend it: drop this copy (to the DLQ) and ask again.
        self.rejected += 1
        log.warning("%s: %s; asking the sender to resend", self.what, d.reason)
        self._commit(wait=True)
        self.link.nack(frame)
        self.tell(hdr.Kind.REREQ, self.file.state.next_seq)

    def _check_progress(self, since: float) -> None:
        late = self.credit <= 0 if not self.reply_to else time.monotonic() - since > self.opts.idle_timeout
        if late:
            raise StreamStalled(
                f"{self.what}: no new data for {time.monotonic() - since:.0f}s at byte "
                f"{self.file.state.contiguous_bytes} of {self.spec.size} ({self.rejected} corrupt and {self.forged} "
                "foreign chunks refused meanwhile); the partial data is kept and the stream is tried again later.")

    def _refuse_foreign(self, frame: Message) -> None:
        """A chunk on this stream's queue that its sender did not send: to the DLQ."""
        self.forged += 1
        if self.forged == 1:
            log.warning("%s: refusing a chunk sent by %r, not by the stream's sender %r (moved to the DLQ); "
                        "further ones are counted", self.what, p.sender_of(frame.headers), self.sender)
        self.link.nack(frame)

    def _commit(self, *, wait: bool) -> None:
        frames, self.unacked = self.unacked, []
        self.file.commit(frames, self._durable, wait=wait)
        # Reported from every commit, not only a full batch's: a slow sender's chunks are
        # committed one by one when the link goes quiet, and its receive must show them too.
        now = time.monotonic()
        if self.opts.progress and (self.reported is None or now - self.reported >= PROGRESS_EVERY):
            self.reported = now
            self.opts.progress(self.file.state.received_bytes, self.spec.size)

    def _durable(self, frames: list[Message]) -> None:
        for frame in frames:
            self.link.ack(frame)
        self.tell(hdr.Kind.ACK, self.file.state.next_seq)

    def _settle_quietly(self) -> None:
        """On the way out after an error: keep what is durable, but never mask the error."""
        try:
            self.file.settle(self._durable)
        except Exception as exc:
            log.warning("%s: could not finish the last commit while stopping: %s", self.what, exc)

    def tell(self, kind: hdr.Kind, next_seq: int) -> None:
        """Handshake mode: report our position to the sender (no-op otherwise)."""
        if self.reply_to:
            headers = p.control_headers(self.spec, kind, self.consumer, next_seq, self.token)
            self.link.send(self.reply_to, b"", headers, persistent=False)



def drain_queue(link: Link, queue: str, *, ack: bool, quiet: float = 0.3, limit: float = 10.0) -> int:
    """Take whatever is left on ``queue`` until it stays quiet for ``quiet`` seconds (at
    most ``limit`` seconds in all): acknowledge it (repeats of a published stream) or
    refuse it (a quarantined stream's chunks; the broker moves them to its DLQ).

    Callers drain after an offer that was sent after everything it clears, so the
    leftovers are stored already and come as one backlog: once an end marker went by,
    50 ms of quiet is enough."""
    try:
        sub = link.subscribe(queue, prefetch=16)
    except DestinationRefused:
        return 0  # the broker would have had to create it: nothing is there
    n = 0
    until = time.monotonic() + limit
    wait = quiet
    try:
        while time.monotonic() < until and (frame := link.get(wait, sub)) is not None:
            (link.ack if ack else link.nack)(frame)
            n += 1
            if frame.headers.get(hdr.H_KIND) == hdr.Kind.END.value:
                wait = min(quiet, 0.05)
    finally:
        link.unsubscribe(sub)
    return n
