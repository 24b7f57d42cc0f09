"""Which offers a receiver is handed, and how a stream that cannot go on now gives way.

Liveness is held by the broker, not by a receiver's memory: a stream that yields is parked
on ``NAME.amqs_parked`` with a time before which no receiver takes it, and every receiver
sweeps that queue between offers; a parked copy is believed only when the broker stamped it
with this receiver's own user. Offers are served in rounds, fairly per sender. The rules,
and why each holds: docs/protocol.md, "When a stream fails" and "Receiver".

Both subscriptions to the queue of offers together match every message on it (inline
offers on one, everything else on the other), so no message can sit unmatched at its head
and hide those behind it from the broker's paging (``maxPageSize``): junk reaches a
receiver and is quarantined.
"""

from __future__ import annotations

import logging
import math
import time

from airflow_provider_amqstream.engine.receive import inline
from airflow_provider_amqstream.engine.receive.stream import ReceiveOptions
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.link import Link, Message

log = logging.getLogger(__name__)

# Longest a yielded stream is parked, however often it yields.
MAX_YIELD_BACKOFF = 3600.0
# A stream that yielded this often without arriving is quarantined instead (with the
# default back-off that is about two days): parked offers may not circle for ever.
MAX_YIELDS = 48
# Seconds between two sweeps of the parked queue while offers keep coming (longer if a
# sweep took longer): the bound on how late a parked stream is taken after its time.
SWEEP_PAUSE = 2.0
# How long a sweep waits for the next parked offer after passing one: they are handed over
# within a millisecond or two of acknowledging the previous one.
_SWEEP_STEP = 0.2
# Seconds without a fresh offer that end a round (module doc): a pause of the broker's
# longer than this ends one early, which costs one more look per user.
_DRY = 1.0
# Most users remembered in one round (each is a name): past it the round starts
# afresh, which costs at worst one more look per user.
_MAX_STALLED = 4096


class Offers:
    """The subscriptions that hand this receiver its offers.

    Offers of streams with a data queue come one at a time: prefetch 1 and no
    acknowledgement until the stream is settled, so while the receiver holds one the
    broker gives it no other, and if it dies the offer returns to the queue. Inline offers
    (a small file in the offer) and packs of them come up to a group at a time on a second
    subscription; parked ones from the parked queue, between offers (module doc).

    :param stream_id: take only this stream (at once, even if parked).
    """

    def __init__(self, link: Link, dest: Destination, stream_id: str | None, opts: ReceiveOptions) -> None:
        self.link, self.dest, self.stream_id, self.opts = link, dest, stream_id, opts
        self.sub: str | None = None
        self.inline_sub: str | None = None
        self.parked_sub: str | None = None
        # The parked offer a sweep stopped at: ours (prefetch 1) until the next sweep.
        self.held: Message | None = None
        self.next_sweep = 0.0
        # Whether the queue of offers had nothing for us last time: parked streams whose
        # time has come are then taken back to back, else one per SWEEP_PAUSE, so a backlog
        # of them can neither starve new offers nor be starved by them.
        self.main_idle = False
        # The stamp the broker puts on what this receiver parks: the only one believed there.
        self.me = link.params.user
        # The users whose stream never began in this round (module doc, "Fair share per sender").
        self.stalled: set[str] = set()
        # The delivery handles (``ack`` ids) of the inline group being received that are not
        # acknowledged yet: what a group cut short by a yield still has to give back.
        self.unsettled: set[str] = set()

    def _subscribe(self) -> None:
        # A packed stream asked for by id comes with its pack: the whole pack is received. Any
        # value of the inline header but "1" is refused by the receiver, so it must reach one.
        main = p.offer_selector(self.stream_id) if self.stream_id else f"{bw.H_INLINE} IS NULL OR {bw.H_INLINE} <> '1'"
        self.sub = self.link.subscribe(str(self.dest), prefetch=1, selector=main)
        if not self.stream_id:
            self.inline_sub = self.link.subscribe(str(self.dest), prefetch=inline.PREFETCH,
                                                  selector=f"{bw.H_INLINE} = '1'")
        if self.dest.kind == "queue":
            self.parked_sub = self.link.subscribe(self.dest.parked_queue(), prefetch=1,
                                                  selector=p.offer_selector(self.stream_id) if self.stream_id else None)
        self.opts.emit("waiting", source=str(self.dest))

    def next(self, deadline: float | None) -> Message | None:
        """The next offer to take, or None at ``deadline`` (monotonic)."""
        if self.sub is None:
            self._subscribe()
        while True:
            if self.parked_sub and time.monotonic() >= self.next_sweep:
                # Back to back sweeps only while no fresh offer waits: one that came during the
                # last stream goes first.
                offer = self._fresh(0.0) if self.main_idle else None
                if offer is None:
                    offer = self._sweep()
                if offer is not None:
                    return offer
            left = 30.0 if deadline is None else deadline - time.monotonic()
            if self.parked_sub:
                left = min(left, max(0.0, self.next_sweep - time.monotonic()))
            offer = self._fresh(max(0.0, left))
            if offer is not None:
                return offer
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _fresh(self, timeout: float) -> Message | None:
        """The next offer on the queue of offers within ``timeout``, or None: it ran dry, which
        ends the round."""
        subs = tuple(sub for sub in (self.inline_sub, self.sub) if sub)
        offer = self.link.get(timeout, subs)
        if offer is None and self.stalled and timeout < _DRY:
            # Right after an acknowledgement the next offer is still on its way (prefetch 1),
            # and the broker pages a backlog in from disk: dry only if none comes for a while.
            offer = self.link.get(_DRY - timeout, subs)
        self.main_idle = offer is None
        if offer is None:
            self.stalled.clear()
        return offer

    def stalled_in_round(self, offer: Message) -> bool:
        """Whether ``offer``, fresh from the queue of offers, is of a sender a stream of whom
        never began in this round (its offer then waits its turn parked, unseen). Never on
        a topic, where nothing can be parked: each subscriber has its own copy to look at."""
        return not (self.stream_id or self.parked_sub is None or self._parked(offer)) and (
            self.sender(offer) in self.stalled)

    def note_stalled(self, offer: Message) -> None:
        """A stream of the sender of ``offer`` never began (or its data queue was refused):
        its further fresh offers in this round are parked without a look."""
        sender = self.sender(offer)
        if not sender:
            return  # a broker that stamps nobody cannot tell users apart: no round to keep
        if len(self.stalled) >= _MAX_STALLED:
            self.stalled.clear()
        self.stalled.add(sender)

    def _sweep(self) -> Message | None:
        """Take the first parked offer whose time has come, passing the others to the tail
        of the parked queue; None after a whole round without one (or an empty queue)."""
        began = time.monotonic()
        first: tuple[str, str] | None = None
        due = math.inf
        step = 0.0  # what waits was handed over already (prefetch 1): an empty queue costs nothing
        while True:
            offer, self.held = self.held or self.link.get(step, self.parked_sub), None
            if offer is None:
                break
            step = _SWEEP_STEP
            until = p.parked_until(offer.headers)
            if self.stream_id or until <= time.time() or self.foreign(offer):
                self.next_sweep = time.monotonic() + (0.0 if self.main_idle else SWEEP_PAUSE)
                return offer
            key = (str(offer.headers.get(hdr.H_STREAM, "")), str(offer.headers.get(hdr.H_NOT_BEFORE, "")))
            if key == first:
                self.held = offer  # round once: it stays with us until the next sweep
                break
            first = first or key
            due = min(due, until)
            self.requeue(offer)
        took = time.monotonic() - began
        self.next_sweep = time.monotonic() + min(max(SWEEP_PAUSE, took), max(0.0, due - time.time()))
        return None

    def sender(self, offer: Message) -> str:
        """Who offered ``offer``, as the broker says (see :func:`protocol.sender_of`); of a
        parked copy, the first sender it names only if we parked it ("" otherwise)."""
        if not self._parked(offer):
            return p.sender_of(offer.headers)
        return p.sender_of(offer.headers, parked=True) if self._ours(offer) else ""

    def _parked(self, offer: Message) -> bool:
        """Whether ``offer`` was handed over by the parked queue's subscription (the broker
        names the subscription of each delivery; a pack's member, whose headers are the
        sender's, never was)."""
        return (self.parked_sub is not None and not isinstance(offer, inline.PackMember)
                and offer.headers.get("subscription") == self.parked_sub)

    def _ours(self, offer: Message) -> bool:
        return bool(self.me) and p.sender_of(offer.headers) == self.me

    def foreign(self, offer: Message) -> str | None:
        """Why ``offer``, taken from the parked queue, was not parked by this receiver's user
        and is not received (None: it was, or it is no parked copy, or the broker stamps
        nobody, so that nothing tells)."""
        if not self._parked(offer) or self._ours(offer):
            return None
        stamp = p.sender_of(offer.headers)
        if not stamp:
            return None
        return (f"taken from {self.dest.parked_queue()}, where user {stamp!r} put it, not this receiver's user "
                f"{self.me or '(anonymous)'!r}: any receiving user may write that queue, so only the copies a "
                "receiver's own user parked are believed there (run the receivers of a destination as one user)")

    def requeue(self, message: Message, *, not_before: float | None = None, reason: str = "") -> None:
        """Put ``message`` (an offer or a pack) at the tail of the parked queue, then
        acknowledge it: confirmed first, so a crash between the two leaves a copy too many
        (taken as a repeat), never none. Without ``not_before`` it keeps the time it has
        (none: due at once)."""
        headers = p.parked_headers(message.headers, sender=self.sender(message), not_before=not_before,
                                   reason=reason)
        self.link.send_confirmed(self.dest.parked_queue(), bytes(message.body or b""), headers)
        self.ack(message)

    def park(self, message: Message, reason: str) -> float:
        """Give way: park ``message`` for its next back-off (``yield_backoff``, doubled for each
        earlier yield, at most an hour); return it. On a topic there is nowhere to park: the
        offer is dropped for this subscriber (a re-run of its sender offers it again)."""
        earlier = p.yields_of(message.headers)
        backoff = min(max(1.0, self.opts.yield_backoff) * 2.0 ** min(earlier, 20), MAX_YIELD_BACKOFF)
        if self.dest.kind == "queue":
            self.requeue(message, not_before=time.time() + backoff, reason=reason)
        else:
            self.ack(message)
        return backoff

    def gather_inline(self, first: Message, room: int | None) -> list[Message]:
        """``first`` and the inline offers already delivered after it, up to a group (and
        ``room``: a receiver asked for N streams takes no more)."""
        group, size, files = [first], len(first.body or b""), inline.files_in(first)
        limit = inline.GROUP_FILES if room is None else max(1, min(room, inline.GROUP_FILES))
        while self.inline_sub and files < limit and size < inline.GROUP_BYTES:
            more = self.link.get(0.0, (self.inline_sub,))
            if more is None:
                break
            group.append(more)
            size += len(more.body or b"")
            files += inline.files_in(more)
        self.unsettled = {str(m.headers["ack"]) for m in group}
        return group

    def ack(self, message: Message) -> None:
        """Acknowledge ``message``, an offer or a pack as received."""
        self.link.ack(message)
        self.unsettled.discard(str(message.headers["ack"]))

    def settled(self, message: Message) -> bool:
        """Whether ``message`` of the inline group being received was acknowledged."""
        return str(message.headers["ack"]) not in self.unsettled
