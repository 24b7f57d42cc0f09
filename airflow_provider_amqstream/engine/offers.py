"""Which offers a receiver is handed, and how a stream that cannot go on now gives way.

Liveness is held by the queue, not by a receiver's memory. A stream that yields is put
back at the tail of its queue with a time before which no receiver takes it
(``amqs_not_before``, doubling with each yield: :func:`backoff_for`). A receiver that meets
a parked offer before its time passes it to the tail again and takes the next one, so
whatever waits behind any number of parked offers is reached after one send and one
acknowledgement per parked offer ahead of it. Every receiver, restarted or on another
machine, sees the same queue and the same times; no client-side list decides who is
served, and no decision costs a subscription.

Both subscriptions together match every message on the destination (inline offers on
one, everything else on the other), so no message can sit unmatched at the head of the
queue and hide those behind it from the broker's paging (``maxPageSize``): junk reaches
a receiver and is quarantined.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from airflow_provider_amqstream import bulk_wire as bw
from airflow_provider_amqstream import protocol as p
from airflow_provider_amqstream.engine import inline
from airflow_provider_amqstream.engine.stream_receiver import ReceiveOptions
from airflow_provider_amqstream.transport import StompLink

log = logging.getLogger(__name__)

# Longest a yielded stream is parked, however often it yields.
MAX_YIELD_BACKOFF = 3600.0
# A stream that yielded this often without arriving is quarantined instead (with the
# default back-off that is about two days): parked offers may not circle for ever.
MAX_YIELDS = 48
# After passing every waiting offer without taking one (all parked), wait this long, or as
# long as the pass took if longer, before the next pass: at most half the receiver's time
# (and the broker's) goes to passing parked offers, and a new offer waits at most a pause
# and a pass.
LAP_PAUSE = 2.0


def backoff_for(yields: int, first: float) -> float:
    """Seconds a stream is parked after its ``yields``-th yield (1 for the first)."""
    return min(max(1.0, first) * 2 ** min(max(yields, 1) - 1, 20), MAX_YIELD_BACKOFF)


class Offers:
    """The subscriptions that hand this receiver its offers.

    Offers of streams with a data queue come one at a time: prefetch 1 and no
    acknowledgement until the stream is settled, so while the receiver holds one the
    broker gives it no other, and if it dies the offer returns to the queue. Inline offers
    (a small file in the offer) and packs of them come up to a group at a time on a second
    subscription. Parked offers are passed to the tail until their time (module doc).

    :param link: the receiver's connection.
    :param dest: the destination offers come from.
    :param stream_id: take only this stream (at once, even if parked).
    :param opts: the receive options (back-off, events).
    :param me: the receiving user's login: a parked copy we sent carries its first sender.
    """

    def __init__(self, link: StompLink, dest: p.Destination, stream_id: str | None, opts: ReceiveOptions, *,
                 me: str = "") -> None:
        self.link, self.dest, self.stream_id, self.opts, self.me = link, dest, stream_id, opts, me
        self.sub: str | None = None
        # Inline offers (small files in their offer) come through a second subscription with
        # a deeper prefetch, so a group of them can be made durable together.
        self.inline_sub: str | None = None
        # The first parked offer met since one was taken, when that pass began, and the
        # earliest time one of the parked offers met since may be taken: enough to know a
        # pass went all the way round, whatever the number of parked offers.
        self._lap: tuple[str, str] | None = None
        self._lap_began = 0.0
        self._lap_due = math.inf
        self.passed = 0

    def _selector(self, inline_only: bool) -> str:
        if self.stream_id:
            # A packed stream comes with its pack: the whole pack is received.
            return p.offer_selector(self.stream_id)
        if inline_only:
            return f"{bw.H_INLINE} = '1'"
        # Any other value of the header is refused by the receiver, so it must reach one.
        return f"{bw.H_INLINE} IS NULL OR {bw.H_INLINE} <> '1'"

    def _subscribe(self) -> None:
        self.sub = self.link.subscribe(str(self.dest), prefetch=1, selector=self._selector(False))
        if not self.stream_id:
            self.inline_sub = self.link.subscribe(str(self.dest), prefetch=inline.PREFETCH,
                                                  selector=self._selector(True))
        self.opts.emit("waiting", source=str(self.dest))

    def next(self, deadline: float | None) -> Any:
        """The next offer to take, or None at ``deadline`` (monotonic)."""
        if self.sub is None:
            self._subscribe()
        while True:
            left = 30.0 if deadline is None else deadline - time.monotonic()
            subs = (self.inline_sub, self.sub) if self.inline_sub else (self.sub,)
            offer = self.link.get_any(max(0.0, left), subs)  # type: ignore[arg-type]
            if offer is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                continue
            due = p.parked_until(offer.headers)
            if self.stream_id or due <= time.time() or self.dest.kind != "queue":
                self._lap = None
                return offer
            if not self._pass(offer, due, deadline):
                return offer

    def _pass(self, offer: Any, due: float, deadline: float | None) -> bool:
        """Pass a parked offer to the tail; False if it came due meanwhile (take it)."""
        key = (str(offer.headers.get(p.H_STREAM, "")), str(offer.headers.get(p.H_NOT_BEFORE, "")))
        now = time.monotonic()
        if self._lap is None:
            self._lap, self._lap_began, self._lap_due = key, now, due
        elif key == self._lap:
            # Round once without taking anything: everything waiting is parked.
            pause = min(max(LAP_PAUSE, now - self._lap_began), max(0.0, self._lap_due - time.time()))
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - now))
            if pause > 0:
                time.sleep(pause)  # holding this one offer: others still reach other receivers
            if p.parked_until(offer.headers) <= time.time():
                self._lap = None
                return False
            self._lap, self._lap_began, self._lap_due = key, time.monotonic(), due
        else:
            self._lap_due = min(self._lap_due, due)
        self.requeue(offer)
        self.passed += 1
        return True

    def sender(self, offer: Any) -> str:
        """Who offered ``offer``, as the broker says (see :func:`protocol.sender_of`)."""
        return p.sender_of(offer.headers, self.me)

    def requeue(self, message: Any, *, not_before: float | None = None, reason: str = "") -> None:
        """Put ``message`` (an offer or a pack) at the tail of the queue, then acknowledge
        it: confirmed first, so a crash between the two leaves a copy too many (taken as a
        repeat), never none. With ``not_before`` the copy is parked until then."""
        sender = p.sender_of(message.headers, self.me)
        if not_before is None:
            headers = {k: str(v) for k, v in message.headers.items() if k.startswith("amqs_")}
            if sender:
                headers[p.H_FIRST_SENDER] = sender
        else:
            headers = p.parked_headers(message.headers, not_before=not_before, reason=reason, sender=sender)
        self.link.send_confirmed(str(self.dest), bytes(message.body or b""), headers)
        self.link.ack(message)
        inline.mark_settled(message)

    def park(self, message: Any, reason: str) -> float:
        """Give way: park ``message`` at the tail for its next back-off; return the back-off.
        On a topic there is no tail to go to: the offer is dropped for this subscriber (a
        re-run of its sender offers it again)."""
        yields = p.yields_of(message.headers) + 1
        backoff = backoff_for(yields, self.opts.yield_backoff)
        if self.dest.kind != "queue":
            self.link.ack(message)
            inline.mark_settled(message)
            return backoff
        self.requeue(message, not_before=time.time() + backoff, reason=reason)
        return backoff

    def gather_inline(self, first: Any, room: int | None) -> list[Any]:
        """``first`` and the inline offers already delivered after it, up to a group (and
        ``room``: a receiver asked for N streams takes no more). Parked ones met on the way
        are passed to the tail."""
        group, size, files = [first], len(first.body or b""), inline.files_in(first)
        limit = inline.GROUP_FILES if room is None else max(1, min(room, inline.GROUP_FILES))
        while self.inline_sub and files < limit and size < inline.GROUP_BYTES:
            more = self.link.get_any(0.0, (self.inline_sub,))
            if more is None:
                break
            if p.parked_until(more.headers) > time.time():
                self.requeue(more)
                self.passed += 1
                continue
            group.append(more)
            size += len(more.body or b"")
            files += inline.files_in(more)
        return group

    def close(self) -> None:
        """Leave the subscriptions; the broker requeues what we hold unacknowledged."""
        for attr in ("inline_sub", "sub"):
            sub = getattr(self, attr)
            if sub is not None:
                setattr(self, attr, None)
                self.link.unsubscribe(sub)
