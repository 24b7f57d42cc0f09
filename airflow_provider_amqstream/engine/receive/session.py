"""The receiving end: the streams offered on a destination, one at a time, over one
connection, and what happens when one of them fails.

The policy in one sentence: a stream that can never succeed is quarantined, a stream
that cannot go on now yields its place (parked with a backoff, its partial data kept:
:mod:`~airflow_provider_amqstream.engine.receive.offers`), and only failures of the
receiver's own (connection, authorization, local disk) stop it. Each cause and its action:
docs/protocol.md, "When a stream fails".
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.receive import inline
from airflow_provider_amqstream.engine.receive.claims import find_received, find_received_many
from airflow_provider_amqstream.engine.receive.inline import InlineGroup
from airflow_provider_amqstream.engine.receive.manifest import Batches
from airflow_provider_amqstream.engine.receive.offers import MAX_YIELDS, Offers
from airflow_provider_amqstream.engine.receive.stream import (
    Poisoned,
    ReceiveOptions,
    StreamReceiver,
    consumer_name,
    drain_queue,
    receiver_token,
)
from airflow_provider_amqstream.engine.records import TransferResult, read_json, write_json
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.engine.store import open_store, prune_quietly
from airflow_provider_amqstream.exceptions import (
    ProtocolError,
    StreamError,
    StreamFailure,
    StreamNoRoom,
    StreamQuarantined,
    StreamRefused,
    StreamStalled,
    StreamYielded,
    TransportError,
)
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import paths, seal
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.messages import Delivered, StreamOffer, read_offer
from airflow_provider_amqstream.protocol.names import Destination, validate_stream_id
from airflow_provider_amqstream.protocol.outcomes import Outcome, yielded
from airflow_provider_amqstream.transport.link import Link, Message, open_link
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.retry import Reconnect

log = logging.getLogger(__name__)

_Offer = Delivered[StreamOffer, Message]


def receive_stream(
    params: BrokerParams,
    source: str,
    out_dir: str | os.PathLike[str],
    *,
    stream_id: str | None = None,
    options: ReceiveOptions | None = None,
) -> TransferResult | None:
    """Receive the next stream offered on ``source`` (or the one named ``stream_id``)
    into ``out_dir``; return None if none was offered within ``wait_timeout``.

    The file appears in ``out_dir`` only once every byte is on disk and its SHA-256
    matches the sender's. Partial data and the resume state live in
    ``out_dir/.amqstream/``; another receiver given the same directory continues it. A
    stream that fails is handled by the policy above first (quarantined, or yielded), then
    raised: :class:`StreamQuarantined`, :class:`StreamStalled` or :class:`StreamNoRoom`.
    """
    got = _receive(params, source, out_dir, options, _Report(stream_id, left=1, fail_fast=True))
    return got[0] if got else None


def receive_streams(
    params: BrokerParams,
    source: str,
    out_dir: str | os.PathLike[str],
    *,
    count: int | None = None,
    stream_id: str | None = None,
    options: ReceiveOptions | None = None,
    on_result: Callable[[TransferResult], None] | None = None,
    on_failure: Callable[[StreamFailure], None] | None = None,
) -> list[TransferResult]:
    """Receive streams until ``count`` arrived, until ``wait_timeout`` passes with no
    offer, or until ``options.stop_after`` seconds have passed or ``options.stop_when`` says
    so; return them. One connection serves them all. A stream that fails is reported to
    ``on_failure`` and the receive goes on (but for the one named ``stream_id``: that stream
    is the whole job, and its failure is raised).

    :param count: how many streams to receive (None: until the wait runs out).
    :param stream_id: receive only this stream.
    :param on_result: called with each stream received; when given, results are handed to it
        alone and the returned list stays empty, so memory stays flat over any number.
    :param on_failure: called with each stream quarantined or yielded.
    """
    return _receive(params, source, out_dir, options,
                    _Report(stream_id, left=count, on_result=on_result, on_failure=on_failure))


def _receive(params: BrokerParams, source: str, out_dir: str | os.PathLike[str], options: ReceiveOptions | None,
             report: _Report) -> list[TransferResult]:
    opts = _connection_defaults(options or ReceiveOptions(), params)
    dest = Destination.parse(source)
    stream_id = report.stream_id
    if stream_id:
        validate_stream_id(stream_id)
    out = Path(out_dir)
    sdir = StateDir.create(out)
    inline.sweep_temporaries(sdir)
    prune_quietly(open_store(sdir, opts.records_retention_days))
    batches = Batches(out, sdir, retention_days=opts.records_retention_days, min_free=opts.min_free_bytes)
    batches.load()  # what senders left is bounded before anything else takes room
    what = f"receiving {'stream ' + stream_id if stream_id else 'streams'} from {dest}"
    # A receiver fails at once on a broker it never reached (transport/retry.py says why).
    reconnect = Reconnect(what, params.url, opts.reconnect_timeout, wait_at_start=False)
    wait = opts.wait_timeout
    until = None if opts.stop_after is None else time.monotonic() + opts.stop_after
    report.batches, report.opts = batches, opts
    while True:
        try:
            with open_link(params, client_id=f"amqs-recv-{socket.gethostname()}-{os.getpid()}") as link:
                reconnect.connected()
                offers = Offers(link, dest, stream_id, opts)
                session = ReceiveSession(link, dest, out, sdir, opts=opts, offers=offers, batches=batches)
                while not report.satisfied():
                    if until is not None and time.monotonic() >= until:
                        return report.results
                    offer = offers.next(_deadline(wait, until))
                    if offer is None:
                        return report.results
                    wait = opts.wait_timeout
                    report.add(session.settle(offer, report.left))
                    reconnect.progressed()
                return report.results
        except TransportError as exc:
            # The offer we held goes back to the queue with the connection.
            reconnect.failed(exc)
        # After a reconnect our own unacknowledged offer is redelivered, but not at once.
        wait = max(wait, 30.0) if wait is not None else None


def _connection_defaults(opts: ReceiveOptions, params: BrokerParams) -> ReceiveOptions:
    """``opts`` with the connection's extras where the caller chose nothing."""
    if opts.records_retention_days is None and params.records_retention_days is not None:
        opts = replace(opts, records_retention_days=params.records_retention_days)
    if opts.min_rate is None and params.min_rate is not None:
        opts = replace(opts, min_rate=params.min_rate)
    if (not opts.keys and params.keys) or (params.seal_required and not opts.seal_required):
        opts = replace(opts, keys=opts.keys or params.keys, seal_required=opts.seal_required or params.seal_required)
    return opts


def _deadline(wait: float | None, until: float | None) -> float | None:
    """When to stop waiting for the next offer (monotonic): ``wait`` seconds from now, and
    no later than ``until``; None for never."""
    limits = (until, None if wait is None else time.monotonic() + wait)
    return min((t for t in limits if t is not None), default=None)


@dataclass
class _Report:
    """Where each outcome of a receive goes: results kept or reported, failures reported
    or raised, batches told of each stream published."""

    stream_id: str | None
    left: int | None = None  # streams still to receive (None: no limit)
    fail_fast: bool = False
    on_result: Callable[[TransferResult], None] | None = None
    on_failure: Callable[[StreamFailure], None] | None = None
    # The receive's own, set once it has resolved its options and loaded its batches.
    batches: Batches = field(init=False)
    opts: ReceiveOptions = field(init=False)
    results: list[TransferResult] = field(default_factory=list)

    def satisfied(self) -> bool:
        """Whether the receive is done: no stream ``left`` to receive, or ``stop_when`` says so."""
        if self.left is not None and self.left <= 0:
            return True
        return self.opts.stop_when is not None and self.opts.stop_when()

    def add(self, outcomes: list[TransferResult | StreamError | None]) -> None:
        failed: StreamError | None = None
        for outcome in outcomes:
            if outcome is None:
                continue
            if self.stream_id and _stream_of(outcome) != self.stream_id:
                # Another file of the pack that carried ours: received all the same.
                told = (f"stream {outcome.stream_id} was received too ({outcome.status}, {outcome.path})"
                        if isinstance(outcome, TransferResult) else str(outcome))
                log.info("%s (it came in the same pack as stream %s)", told, self.stream_id)
                continue
            if isinstance(outcome, TransferResult):
                for manifest in self.batches.published(outcome.stream_id):
                    self.opts.emit("batch_complete", manifest=str(manifest))
                if self.left is not None:
                    self.left -= 1
                if self.on_result:
                    self.on_result(outcome)
                else:
                    self.results.append(outcome)
            elif self.fail_fast or self.stream_id:
                failed = failed or outcome
            elif self.on_failure and outcome.failure is not None:
                self.on_failure(outcome.failure)
        if failed is not None:
            raise failed


def _stream_of(outcome: TransferResult | StreamError) -> str:
    """The id of the stream ``outcome`` is of ("" for a failure that names none)."""
    if isinstance(outcome, TransferResult):
        return outcome.stream_id
    return outcome.failure.stream_id if outcome.failure is not None else ""


class ReceiveSession:
    """One connection's worth of receiving into one output directory: it settles each offer
    the subscriptions hand it (take one stream, or a group of small files), by the policy
    of docs/protocol.md, "When a stream fails": quarantine what can never succeed, park
    what cannot go on now, acknowledge repeats, refuse ids and batches of other users.
    """

    def __init__(self, link: Link, dest: Destination, out: Path, sdir: StateDir, *, opts: ReceiveOptions,
                 offers: Offers, batches: Batches) -> None:
        self.link, self.dest, self.out, self.sdir = link, dest, out, sdir
        self.opts, self.offers, self.batches = opts, offers, batches
        # The completion record (or None) of each stream of a group, looked up together while
        # the group is written; an id not in it is looked up on its own.
        self._known: dict[str, dict[str, Any] | None] = {}

    def settle(self, offer: Message, room: int | None) -> list[TransferResult | StreamError | None]:
        """Settle ``offer`` (with the small files delivered after it, for a group): the
        outcome of each stream, None for one with nothing to report.
        """
        sid = str(offer.headers.get(hdr.H_STREAM, ""))[: hdr.MAX_STREAM_ID]
        foreign = self.offers.foreign(offer)
        if foreign is not None:
            return [self._quarantine(offer, sid, Outcome.FOREIGN_PARKED, foreign)]
        kind = offer.headers.get(hdr.H_KIND)
        if bw.is_pack(offer.headers) or (bw.is_inline(offer.headers) and kind == hdr.Kind.OFFER.value):
            return self.take_inline(self.offers.gather_inline(offer, room))
        if kind == hdr.Kind.BATCH.value:
            return [self._take_batch(offer, sid)]
        if offer.headers.get(hdr.H_REOFFER):
            self._clear_leftovers(offer)
            return [None]
        if bw.is_inline(offer.headers):  # asked for by id, or an inline header of the wrong value
            return self.take_inline([offer])
        return [self.take(offer, sid)]

    def take(self, offer: Message, sid: str) -> TransferResult | StreamError | None:
        """Settle the offer of a stream with a data queue: a result, or a handled failure (to
        report or raise)."""
        sender = self.offers.sender(offer)
        try:
            opened = self._unseal(Delivered(read_offer(offer.headers, self.dest, sender=sender), offer))
        except ProtocolError as exc:
            cause = Outcome.SEAL_BROKEN if isinstance(exc, seal.SealBroken) else Outcome.INVALID
            return self._quarantine(offer, sid, cause, f"invalid offer: {exc}")
        if isinstance(opened, StreamError):
            return opened
        sealed, got = opened
        settled = self._check_offer(got, sender)
        if settled is not None:
            return settled
        if self.offers.stalled_in_round(offer):
            # Fair share: another user's next offer must not wait for a look at each of these.
            return self._yielded(StreamStalled(
                f"stream {got.message.spec.stream_id} ({got.message.data_queue}): parked without a look, its turn "
                f"given to other users' streams: a stream of its sender {sender!r} never began in this round; it is "
                "tried again after its back-off"), sid, 0, offer)
        receiver = StreamReceiver(self.link, self.dest, self.out, self.sdir, got.message, self.opts, sender=sender,
                                  seal=sealed)
        filed = self._filed_before(offer, sid)
        if filed is not None:
            # Filed by a receiver here that died before it had moved the chunks: finish.
            return self._quarantine(offer, sid, **filed, then=receiver.abandon, filed=True)
        try:
            result = receiver.run()
        except Poisoned as bad:
            return self._quarantine(offer, sid, bad.cause, bad.reason, offset=bad.offset, then=receiver.abandon)
        except StreamYielded as exc:
            return self._let_go(exc, sid, receiver, offer)
        self.link.ack(offer)
        return result

    def _unseal(self, got: _Offer) -> tuple[seal.Seal | None, _Offer] | StreamError:
        """A sealed offer's seal and the offer under its real name; the quarantine of one this
        receiver holds no key for, or of an unsealed one where sealing is required."""
        offer, spec, data_q = got.handle, got.message.spec, got.message.data_queue
        sid, header = spec.stream_id, offer.headers.get(seal.H_SEAL)
        if not header and not self.opts.seal_required:
            return None, got
        opened = seal.Seal.open(str(header), list(self.opts.identities), stream_id=sid, size=spec.size,
                                chunk_size=spec.chunk_size) if header else None
        if opened is None:
            return self._unopened(offer, sid, f"stream {sid} ({data_q})", "received")
        sealed, name, subdir = opened
        if not name or len(name.encode("utf-8", "surrogatepass")) > hdr.MAX_NAME_BYTES:
            raise seal.SealBroken(f"stream {sid}: the sealed file name is empty or over {hdr.MAX_NAME_BYTES} bytes")
        if offer.headers.get(hdr.H_DIR) is not None:
            # Not covered by the seal: whoever added it (the broker) would choose where the file lands.
            raise seal.SealBroken(f"stream {sid}: a sealed offer carries {hdr.H_DIR} in clear; its directory "
                                  "travels inside the seal")
        return sealed, replace(got, message=replace(got.message, spec=replace(spec, name=name),
                                                    subdir=paths.safe_subdir(subdir, sid)))

    def _let_go(self, exc: StreamYielded, sid: str, receiver: StreamReceiver, offer: Message) -> StreamError:
        """A stream being received gave way: leave its data queue, keep only its data on disk,
        and park its offer. One that gave way before anything of it came (nothing sent, or no
        data queue) costs its sender the rest of the round (engine/receive/offers.py); one that
        stopped part-way does not: its sender may have died and been re-run with other, good offers."""
        receiver.stop_data()
        receiver.file.shrink()
        receiver.forget_if_empty()
        if isinstance(exc, StreamRefused) or (
            isinstance(exc, StreamStalled) and receiver.offset == 0 and receiver.file.last_write is None
        ):
            self.offers.note_stalled(offer)
        return self._yielded(exc, sid, receiver.offset, offer)

    def _yielded(self, exc: StreamYielded, sid: str, offset: int,
                 message: Message) -> StreamYielded | StreamQuarantined:
        """The stream gives up its place: ``message`` (its offer, or the pack carrying it) is
        parked at the tail of the queue until its back-off ends; after ``MAX_YIELDS`` yields
        the stream is quarantined instead."""
        if p.yields_of(message.headers) + 1 > MAX_YIELDS:
            return self._quarantine(message, sid, Outcome.GAVE_WAY, (
                f"gave way {MAX_YIELDS} times without arriving (last: {exc}); the partial data, if any, is kept in "
                "the output directory's .amqstream"), offset=offset)
        retry = self.offers.park(message, str(exc))
        outcome = yielded(exc)
        failure = StreamFailure(sid, str(self.dest), outcome.label, str(exc), offset, retry_after=retry,
                                cause=outcome.value)
        log.warning("%s (parked in %s for %.0fs)", exc,
                    self.dest.parked_queue() if self.dest.kind == "queue" else self.dest, retry)
        self.opts.emit("stream_yielded", **failure.to_json())
        exc.failure = failure
        return exc

    def _take_batch(self, offer: Message, sid: str) -> StreamError | None:
        """Record one part of a batch list (opened first if sealed); a part that does not fit
        gives way as a stream would."""
        try:
            if offer.headers.get(seal.H_SEAL):
                body = bw.open_batch_part(offer.headers, offer.body or b"", list(self.opts.identities))
            else:
                body = None if self.opts.seal_required else bytes(offer.body or b"")
            if body is None:
                return self._unopened(offer, sid, f"batch list {sid}", "recorded")
            batch_id, part, parts, entries = bw.parse_batch(offer.headers, body)
        except ProtocolError as exc:
            cause = Outcome.SEAL_BROKEN if isinstance(exc, seal.SealBroken) else Outcome.INVALID
            return self._quarantine(offer, sid, cause, f"invalid batch message: {exc}")
        try:
            manifest = self.batches.record(batch_id, part, parts, entries, self.offers.sender(offer))
        except StreamNoRoom as exc:
            return self._yielded(exc, sid, 0, offer)
        self.link.ack(offer)
        self.opts.emit("batch_listed", batch_id=batch_id, part=part, parts=parts, files=len(entries))
        if manifest is not None:
            self.opts.emit("batch_complete", manifest=str(manifest))
        return None

    def _unopened(self, offer: Message, sid: str, what: str, done: str) -> StreamQuarantined:
        """Quarantine ``what`` (a stream, a batch list) this receiver cannot open: unsealed where
        sealing is required, or sealed for keys it does not hold. ``done``: what nothing was."""
        if not offer.headers.get(seal.H_SEAL):
            return self._quarantine(offer, sid, Outcome.UNSEALED, f"{what} is not sealed, and this receiver requires "
                                    f"sealed streams (seal: required); nothing was {done}")
        held = ", ".join(i.source for i in self.opts.identities) or "none"
        return self._quarantine(offer, sid, Outcome.NO_KEY, f"{what} is sealed for keys this receiver does not hold "
                                f"(its key files: {held}); nothing was {done}")

    def _check_offer(self, got: _Offer, sender: str) -> StreamError | TransferResult | None:
        """What every valid offer goes through before anything is received: within limits, not
        received before, not clashing with another stream's partial data. Returns None to go
        on, or the settled outcome (quarantined, or a duplicate acknowledged)."""
        offer, spec = got.handle, got.message.spec
        sid = spec.stream_id
        if self.opts.max_bytes is not None and spec.size > self.opts.max_bytes:
            return self._quarantine(offer, sid, Outcome.MAX_BYTES, f"stream {sid} is {spec.size} bytes, over this "
                                    f"receiver's limit of {self.opts.max_bytes} (max_bytes)")
        done = self._known[sid] if sid in self._known else find_received(
            self.out, sid, retention_days=self.opts.records_retention_days)
        if done is not None:
            owner = str(done.get("sender") or "")
            if owner and sender != owner:
                return self._quarantine(offer, sid, Outcome.ID_OF_OTHER_USER, (
                    f"stream id {sid} belongs to a stream user {owner!r} sent (received as "
                    f"{done.get('path')}); this offer from {sender or 'an unidentified sender'!r} was not "
                    "received. Send with your own stream id."))
            # A repeat has the same size, chunks, chunk size and origin (none on both sides for a
            # producer that sends none).
            if (done["bytes"], done["chunks"], done["chunk_size"], str(done["origin"])) == (
                spec.size, spec.chunks, spec.chunk_size, got.message.origin
            ):
                return self._duplicate(got, done)
            when = datetime.fromtimestamp(float(done.get("finished_at") or 0), timezone.utc).strftime("%Y-%m-%d %H:%M")
            return self._quarantine(offer, sid, Outcome.REUSED_ID, (
                f"stream id {sid} was already used by another stream ({done.get('bytes')} bytes, received "
                f"{when} UTC as {done.get('path')}); this one ({spec.size} bytes) was not received. Re-send it "
                "with a new stream id (the default id is derived from the file and is unique)."))
        clash = _other_partial(self.sdir, spec, sender)
        if clash:
            return self._quarantine(offer, sid, *clash)
        return None

    def _look_up_group(self, offers: list[Message]) -> None:
        """Read the completion records of a group's streams in one pass over their buckets:
        looked up one by one, each offer cost a listing of the store's days and of its
        bucket and a scan of the bucket's files (a third of a 1,000-file receive's
        system calls). Nothing of the group is recorded before it commits, so the answer
        holds while it is written. An id that is not valid, or a store that cannot be read,
        is left to the look-up of each offer, which reports it as before."""
        valid = set()
        for offer in offers:
            with contextlib.suppress(ProtocolError):
                valid.add(validate_stream_id(str(offer.headers.get(hdr.H_STREAM, ""))[: hdr.MAX_STREAM_ID]))
        try:
            found = find_received_many(self.out, valid, retention_days=self.opts.records_retention_days)
        except StreamError:
            return
        self._known = {sid: found.get(sid) for sid in valid}

    def _parse_inline(self, offer: Message, sender: str) -> _Offer | StreamError | TransferResult:
        """An inline offer parsed and checked like any offer, or its outcome."""
        sid = str(offer.headers.get(hdr.H_STREAM, ""))[: hdr.MAX_STREAM_ID]
        try:
            got = Delivered(read_offer(offer.headers, self.dest, sender=sender, inline=True), offer)
        except ProtocolError as exc:
            return self._quarantine(offer, sid, Outcome.INVALID, f"invalid offer: {exc}")
        if self.opts.seal_required and not inline.sealed(offer):  # only a pack is sealed, never one inline offer
            return self._quarantine(offer, sid, Outcome.UNSEALED, f"stream {sid} travelled inline, unsealed, and "
                                    "this receiver requires sealed streams (seal: required); nothing was received")
        settled = self._check_offer(got, sender)
        return got if settled is None else settled

    def take_inline(self, group: list[Message]) -> list[TransferResult | StreamError | None]:
        """Settle a group of inline offers: check and write each, make them durable together
        (see :mod:`~airflow_provider_amqstream.engine.receive.inline`), then acknowledge them."""
        outcomes: list[TransferResult | StreamError | None] = []
        files = InlineGroup(self.out, self.sdir, str(self.dest), self.opts)
        later: list[Message] = []
        yielded: tuple[StreamYielded, str, Message] | None = None
        try:
            offers = self._unpacked(group, outcomes)
            if len(offers) > 1:
                self._look_up_group(offers)
            for offer in offers:
                sid = str(offer.headers.get(hdr.H_STREAM, ""))[: hdr.MAX_STREAM_ID]
                if sid in files.ids:
                    later.append(offer)  # the same stream twice in one group: a repeat, settled after
                    continue
                try:
                    outcome = self._write_inline(files, offer, sid)
                except StreamNoRoom as exc:
                    yielded = (exc, sid, offer)
                    break  # what follows goes back, unacknowledged
                if outcome is not None:
                    outcomes.append(outcome)
            for offer, result in files.commit():
                inline.settle(self.offers.ack, offer)
                # Destination and sizes ride along for whoever counts (airflow_provider_amqstream.metrics).
                self.opts.emit("stream_close", stream_id=result.stream_id, path=str(result.path),
                               destination=str(self.dest), bytes=result.bytes,
                               bytes_transferred=result.bytes_transferred)
                outcomes.append(result)
        finally:
            self._known = {}  # what the group published is recorded now: later offers look it up again
            files.close()
        if yielded is not None:
            return [*outcomes, self._give_way(group, *yielded)]
        for offer in later:
            message = inline.message_of(offer)
            checked = self._parse_inline(offer, self.offers.sender(message))
            if not isinstance(checked, Delivered):
                outcomes.append(checked)
            elif not self.offers.settled(message):  # not published after all: back to the tail
                self.offers.requeue(message)
        return outcomes

    def _write_inline(self, files: InlineGroup, offer: Message, sid: str) -> StreamError | TransferResult | None:
        """Check one inline offer and write its file into ``files``: None when written, else
        its outcome (quarantined, or a repeat). Raises StreamNoRoom when it does not fit."""
        sender = self.offers.sender(inline.message_of(offer))
        got = self._parse_inline(offer, sender)
        if not isinstance(got, Delivered):
            return got
        spec = got.message.spec
        try:
            data = bw.read_inline(offer.headers, offer.body or b"", spec)
            subdir = paths.safe_subdir(offer.headers.get(hdr.H_DIR), spec.stream_id)
            files.add(replace(got, message=replace(got.message, subdir=subdir)), data,
                      sha256=str(offer.headers[hdr.H_SHA256]), sender=sender)
        except ProtocolError as exc:
            return self._quarantine(offer, sid, Outcome.INVALID, str(exc))
        except Poisoned as bad:
            return self._quarantine(offer, sid, bad.cause, bad.reason)
        return None

    def _give_way(self, group: list[Message], exc: StreamYielded, sid: str, offer: Message) -> StreamError:
        """A group's file did not fit: park the message carrying it, and put back the rest of
        the group this receiver did not reach, for this receiver or another."""
        held = inline.message_of(offer)
        outcome = self._yielded(exc, sid, 0, held)
        for message in group:
            if message is not held and not self.offers.settled(message):
                self.offers.requeue(message)
        return outcome

    def _unpacked(self, group: list[Message], outcomes: list[TransferResult | StreamError | None]) -> list[Message]:
        """The group's offers with every pack replaced by its members; a malformed pack is
        quarantined whole (its outcome goes to ``outcomes``)."""
        found: list[Message] = []
        for offer in group:
            if not bw.is_pack(offer.headers):
                found.append(offer)
                continue
            pid = str(offer.headers.get(hdr.H_STREAM, ""))[: hdr.MAX_STREAM_ID]
            try:
                members = inline.unpack(offer, list(self.opts.identities))
            except ProtocolError as exc:
                cause = Outcome.SEAL_BROKEN if isinstance(exc, seal.SealBroken) else Outcome.INVALID
                outcomes.append(self._quarantine(offer, pid, cause, f"invalid pack: {exc}"))
                continue
            if members is None:
                files = offer.headers.get(bw.H_PACK_FILES)
                outcomes.append(self._unopened(offer, pid, f"pack {pid} of {files} files", "received"))
                continue
            found.extend(members)
        return found

    def _duplicate(self, got: _Offer, done: dict[str, Any]) -> TransferResult:
        """The stream was published here before and was offered again (a sender re-run after
        its final receipt was lost, or ``--restart``): acknowledge it, write nothing."""
        offer, spec, terms = got.handle, got.message.spec, got.message.handshake
        if terms:
            # A sender believes only receivers that introduced themselves: hello, then done.
            token = receiver_token(self.sdir, spec.stream_id)
            for kind in (hdr.Kind.HELLO, hdr.Kind.DONE):
                self.link.send(terms[0], b"", p.control_headers(spec, kind, consumer_name(self.out), spec.chunks + 1,
                                                                token), persistent=False)
        elif not bw.is_inline(offer.headers):
            drain_queue(self.link, got.message.data_queue, ack=True)
        inline.settle(self.offers.ack, offer)
        self.opts.emit("duplicate_offer", stream_id=spec.stream_id)
        log.info("stream %s on %s was received before (%s); acknowledged the repeat, wrote nothing", spec.stream_id,
                 self.dest, done.get("path"))
        return TransferResult.from_json({**done, "seconds": 0.0, "bytes_transferred": 0, "started_at": time.time(),
                                         "finished_at": time.time(), "status": Outcome.DUPLICATE.value})

    def _quarantine(self, offer: Message, sid: str, cause: Outcome, reason: str, *, offset: int = 0,
                    then: Callable[[], int] | None = None, filed: bool = False) -> StreamQuarantined:
        """File the offer away with its cause and reason (unless ``filed`` already, by a receiver here
        that died before the end), run ``then`` (it moves the stream's chunks to the DLQ and
        says how many), acknowledge the original, report.

        Filed first, acknowledged last: a receiver killed in between leaves the offer to come
        back with its record already filed. A note here (``<id>.quarantined``, naming the
        offer's message id) tells whoever takes that offer next to finish the move rather
        than look at a stream whose chunks are half gone (it looked stalled, or taken
        elsewhere, and was parked for ever instead)."""
        qdest = self.dest.quarantine_queue(self.opts.quarantine)
        headers = p.quarantined_headers(inline.shown(offer), cause=cause, reason=reason, source=str(self.dest),
                                        by=socket.gethostname(),
                                        at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                        sender=self.offers.sender(inline.message_of(offer)))
        mid = str(offer.headers.get("message-id", ""))
        if not filed:
            self.link.send_confirmed(qdest, b"", headers)
        moved, note = 0, None
        if then is not None:
            # Only a stream being received (its id valid) is given ``then``, and so a note.
            note = self.sdir.quarantined(sid)
            if mid:
                write_json(note, {"message_id": mid, "cause": cause.value, "reason": reason, "offset": offset})
            moved = then()
        inline.settle(self.offers.ack, offer)
        if note is not None:
            note.unlink(missing_ok=True)
        failure = StreamFailure(sid or "?", str(self.dest), "quarantined", reason, offset, qdest, moved,
                                cause=cause.value)
        log.error("stream %s on %s quarantined to %s: %s", sid or "?", self.dest, qdest, reason)
        self.opts.emit("stream_quarantined", **failure.to_json())
        return StreamQuarantined(f"stream {sid or '?'} on {self.dest} was quarantined to {qdest}: {reason}", failure)

    def _filed_before(self, offer: Message, sid: str) -> dict[str, Any] | None:
        """The cause, reason and offset of a quarantine of this very offer (same message id)
        begun here and not finished, or None. A note of another offer is stale: removed."""
        note = self.sdir.quarantined(sid)
        try:
            filed = read_json(note)
            if filed is None:
                return None
            if filed["message_id"] == str(offer.headers.get("message-id", "")):
                return {"cause": Outcome.parse(filed["cause"]) or Outcome.INVALID, "reason": str(filed["reason"]),
                        "offset": int(filed["offset"])}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("stream %s: ignoring an unreadable quarantine note %s: %s", sid, note, exc)
        note.unlink(missing_ok=True)
        return None

    def _clear_leftovers(self, offer: Message) -> None:
        """Handle a re-offer. If this directory published the stream, drain what the sender's
        re-run repeated; if it holds the stream's partial data, its receiver drains when it
        publishes. Either way acknowledge the re-offer, and never start a reception from it."""
        sid = str(offer.headers.get(hdr.H_STREAM, ""))
        try:
            validate_stream_id(sid)
        except ProtocolError as exc:
            self._quarantine(offer, sid[: hdr.MAX_STREAM_ID], Outcome.INVALID, f"invalid re-offer: {exc}")
            return
        def published() -> bool:
            return find_received(self.out, sid, retention_days=self.opts.records_retention_days) is not None

        if not published() and self.sdir.part(sid).exists():
            # Another receiver of this directory is receiving the stream: it publishes, then
            # looks for this mark and drains; we mark first and look again, so one of us does.
            write_json(self.sdir.reoffered(sid), {"at": time.time()})
        if published():
            drained = drain_queue(self.link, self.dest.data_queue(sid, self.offers.sender(offer)), ack=True)
            self.opts.emit("leftovers_cleared", stream_id=sid, messages=drained)
            self.sdir.reoffered(sid).unlink(missing_ok=True)
        self.link.ack(offer)


def _other_partial(sdir: StateDir, spec: p.StreamSpec, sender: str) -> tuple[Outcome, str] | None:
    """A partial reception under this id for a different stream, or another user's: refuse
    the newcomer and leave the other's data alone."""
    try:
        data = read_json(sdir.resume(spec.stream_id))
    except (OSError, ValueError):
        return None  # the receiver reports an unreadable state itself
    if data is None:
        return None
    owner = str(data.get("sender") or "")
    if owner and owner != sender:
        return Outcome.PARTIAL_OF_OTHER_USER, (
            f"stream id {spec.stream_id} has a partial reception of a stream user {owner!r} sent, in {sdir}; "
            f"this offer from {sender or 'an unidentified sender'!r} was not received. Send with your own "
            "stream id."
        )
    if (data.get("size"), data.get("chunk_size"), data.get("name")) == (spec.size, spec.chunk_size, spec.name):
        return None
    return Outcome.PARTIAL_OF_OTHER, (
        f"stream id {spec.stream_id} has a partial reception of another stream ({data.get('name')!r}, "
        f"{data.get('size')} bytes) in {sdir}; this one ({spec.name!r}, {spec.size} bytes) reuses the id. "
        "Re-send it with a new stream id."
    )
