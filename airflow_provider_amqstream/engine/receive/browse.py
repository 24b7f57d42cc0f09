"""OfferBrowser: look at the offers waiting on a destination over one kept connection.

Triggers poll; a poll that opened a connection each time filled task logs with connect
lines and cost the broker a login per look. This keeps one STOMP session per watcher,
opens a fresh one only after the old one is lost, and browses (ActiveMQ queue browsers
consume nothing), so whoever receives a stream still finds its offer.

The one thing it takes is junk: a message on the queue of offers that is no valid offer.
The broker lets a browser see only the first ``maxBrowsePageSize`` waiting messages (16 in
the shipped config), so junk nobody takes would hide every offer behind it from a watcher
when no receiver runs to quarantine it. The watcher files it away as a receiver would.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from airflow_provider_amqstream.exceptions import AccessDenied, ProtocolError, TransportError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.outcomes import Outcome
from airflow_provider_amqstream.protocol.seal import H_SEAL
from airflow_provider_amqstream.transport.link import Link, Message, open_link
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.retry import transient

log = logging.getLogger(__name__)

# The message ids a broker gives (ActiveMQ: ID:host-port-time-n:n:n:n:n) and nothing that
# could end a quoted selector literal: a junk message is only taken by an id of this shape.
_MESSAGE_ID = re.compile(r"ID:[A-Za-z0-9:._-]{1,200}")
# Quarantined junk logged one by one, then counted at most this often (seconds).
_SAY_EACH = 10
_SAY_EVERY = 60.0


@dataclass(frozen=True)
class Offer:
    """One stream offered on a destination, as the trigger reports it."""

    stream_id: str
    name: str
    size: int
    chunks: int
    mode: str
    destination: str
    sender: str | None
    offered_at: int | None

    def payload(self) -> dict[str, Any]:
        return asdict(self)


def parse_visible_offer(headers: Mapping[str, Any], dest: Destination,
                        stamped: Mapping[str, Any] | None = None, *, parked: bool = False) -> Offer:
    """Validate an offer seen by a browser; raise :class:`ProtocolError` for a bad one.

    :param stamped: the headers of the message the broker delivered, when ``headers`` are a
        pack member's (which its sender wrote): who sent it and when come from these only.
    :param parked: it was seen in the destination's parked queue (its first sender is named).
    """
    sender, offered_at = _stamp(headers if stamped is None else stamped, parked)
    spec, _ = p.parse_offer(headers, dest, sender=sender or "")
    return Offer(spec.stream_id, spec.name, spec.size, spec.chunks, spec.mode.value, str(dest), sender, offered_at)


def _stamp(stamped: Mapping[str, Any], parked: bool = False) -> tuple[str | None, int | None]:
    """Who sent a message and when (milliseconds), by the broker's stamp: never an amqs_*
    header, which is whatever the sender wrote."""
    raw_ts = str(stamped.get("timestamp", ""))
    return p.sender_of(stamped, parked=parked) or None, int(raw_ts) if raw_ts.isdigit() and len(raw_ts) <= 16 else None


class OfferBrowser:
    """Browse the offers on ``source`` through one kept STOMP session (blocking; call it
    from a worker thread in a trigger).

    :param browse_timeout: seconds to wait for the broker's end-of-browse marker.
    """

    def __init__(self, params: BrokerParams, source: str, *, browse_timeout: float = 30.0) -> None:
        self.params = params
        self.dest = Destination.parse(source)
        if self.dest.kind != "queue":
            raise ValueError(f"{source}: only a queue can be watched for offers (a topic keeps no backlog to browse)")
        self.browse_timeout = browse_timeout
        self.link: Link | None = None
        self.opened = 0  # sessions opened so far: one, unless the broker went away
        self.quarantine = self.dest.quarantine_queue()  # /queue/DLQ.<name>, where receivers file junk by default
        self.quarantined = 0  # junk messages filed away so far
        self._bad_seen: set[str] = set()
        self._junk: dict[str, str] = {}  # message id -> why it is no offer
        self._may_take = True  # False once the broker refused us the queue or the quarantine
        self._said = (0, 0.0)  # quarantined count and time of the last log line about it

    def _session(self) -> Link:
        if self.link is not None and self.link.connected:
            return self.link
        if self.link is not None:
            log.warning("connection to %s for watching %s was lost; reconnecting", self.params.url, self.dest)
            self.close()
        link = open_link(self.params, client_id=f"amqs-watch-{socket.gethostname()}-{os.getpid()}")
        link.open()
        self.link = link
        self.opened += 1
        return link

    def transient(self, exc: BaseException) -> bool:
        """Whether another look can help after ``exc`` (transport/retry.py): a watcher, like a
        receiver, fails at once on a broker it never reached."""
        return transient(exc, reached=self.opened > 0, wait_at_start=False)

    def look(self, stream_id: str | None = None, skip: tuple[str, ...] = ()) -> list[Offer]:
        """The valid offers visible on the destination now (for ``stream_id`` only, if given;
        else leaving out the streams in ``skip``). Parked streams wait in another queue and
        are not seen: no receiver takes them before their time.

        Raises :class:`TransportError` if the broker cannot be reached; the next call
        reconnects. Invalid messages seen on the destination are quarantined, each reported
        once (see the module's docstring).
        """
        selector = p.offer_selector(stream_id or None)
        link = self._session()
        try:
            if self.params.network:
                self._draw_here(link, selector)
            # Watching all: browse everything, since the broker pages in only the first few
            # messages before a selector is applied, and what is not an offer must be seen
            # to be taken out of the way (see the module's docstring).
            offers = self._browse(link, selector if stream_id else None, str(self.dest))
            if self._junk:
                self._take_junk(link)
            if stream_id:
                if not offers:
                    # A receiver asking for this stream takes it from the parked queue at once.
                    offers = self._browse(link, selector, self.dest.parked_queue())
                offers = [o for o in offers if o.stream_id == stream_id]
            elif skip:
                offers = [o for o in offers if o.stream_id not in skip]
        except TransportError:
            # Lost, refused or stuck: whatever state the session is in, the next look
            # starts from a fresh one.
            self.close()
            raise
        return offers

    def _draw_here(self, link: Link, selector: str) -> None:
        """In a network of brokers, make offers waiting at another broker come to this one.

        A bridge forwards a queue's messages only to where a consumer is, and a browser does
        not count. So subscribe as a consumer for a moment, then leave without acknowledging
        anything: what the bridge forwarded meanwhile stays on this broker, where the browse
        sees it and a receiver takes it. Nothing is consumed."""
        sub = link.subscribe(str(self.dest), selector=selector, prefetch=1)
        try:
            link.get(1.0, subscription=sub)
        finally:
            link.unsubscribe(sub)

    def _browse(self, link: Link, selector: str | None, queue: str) -> list[Offer]:
        sub = link.subscribe(queue, selector=selector, browser=True, prefetch=64)
        parked = queue != str(self.dest)
        offers: list[Offer] = []
        deadline = time.monotonic() + self.browse_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(f"broker {self.params.url} did not finish browsing {self.dest} "
                                     f"within {self.browse_timeout:.0f}s")
            frame = link.get(left)
            if frame is None or frame.headers.get("subscription") != sub:
                continue
            if frame.headers.get("browser") == "end":
                break
            if frame.headers.get(hdr.H_REOFFER):
                continue  # nobody starts a reception from a re-offer: not an arrival
            if parked and p.sender_of(frame.headers) not in ("", self.params.user):
                continue  # parked by another user: a receiver files it away (receive/offers.py)
            try:
                if frame.headers.get(hdr.H_KIND) == hdr.Kind.BATCH.value:
                    # Its file list is for its receivers (sealed, only they can read and judge it): only a
                    # broken one is junk.
                    if not frame.headers.get(H_SEAL):
                        bw.parse_batch(frame.headers, frame.body or b"")
                elif bw.is_pack(frame.headers):
                    offers.extend(self._members(frame))
                else:
                    offers.append(parse_visible_offer(frame.headers, self.dest, parked=parked))
            except ProtocolError as exc:
                self._report_bad(frame.headers, exc, junk=not parked)
        link.unsubscribe(sub)
        return offers

    def _take_junk(self, link: Link) -> None:
        """File the junk the last browse saw in the quarantine queue: one subscription that
        matches only those messages (by the ids the broker gave them), each copied with the
        reason and then acknowledged. What another consumer took meanwhile is simply not
        there. A broker that refuses us the queue or the quarantine ends the taking, once,
        with a warning; watching goes on."""
        junk, self._junk = self._junk, {}  # gathered only while _may_take
        ids = ", ".join(f"'{mid}'" for mid in junk)
        sub = None
        try:
            sub = link.subscribe(str(self.dest), selector=f"JMSMessageID IN ({ids})", prefetch=len(junk))
            for _ in range(len(junk)):
                frame = link.get(2.0, subscription=sub)
                if frame is None:
                    break
                reason = junk.get(str(frame.headers.get("message-id", "")), "not a valid offer")
                link.send_confirmed(self.quarantine, b"", p.quarantined_headers(
                    frame.headers, cause=Outcome.INVALID, reason=f"invalid offer (seen by a watcher): {reason}",
                    source=str(self.dest),
                    by=socket.gethostname(), at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    sender=p.sender_of(frame.headers)))
                link.ack(frame)
                self.quarantined += 1
                self._say_quarantined(str(frame.headers.get("message-id", "?")), reason)
        except AccessDenied as exc:
            self._refused(exc)
        finally:
            if sub is not None and link.connected:
                link.unsubscribe(sub)

    def _say_quarantined(self, message_id: str, reason: str) -> None:
        # A flood of junk must not flood a triggerer's log: the first few one by one, then
        # a count now and then.
        if self.quarantined <= _SAY_EACH:
            log.warning("invalid message %s on %s quarantined to %s: %s", message_id, self.dest, self.quarantine,
                        reason)
            self._said = (self.quarantined, time.monotonic())
        elif time.monotonic() - self._said[1] >= _SAY_EVERY:
            log.warning("%d more invalid messages on %s quarantined to %s (%d in all; the reason is in each "
                        "message's amqs_quarantine_reason)", self.quarantined - self._said[0], self.dest,
                        self.quarantine, self.quarantined)
            self._said = (self.quarantined, time.monotonic())

    def _refused(self, exc: AccessDenied) -> None:
        self._may_take = False
        log.warning("cannot quarantine invalid messages on %s to %s (%s); they stay where they are and may hide "
                    "offers behind them from this watcher until a receiver takes them; grant this user read on "
                    "%s and write on %s", self.dest, self.quarantine, exc, self.dest, self.quarantine)

    def _members(self, frame: Message) -> list[Offer]:
        """The valid offers inside a pack: one per file, as receivers will take them (raises
        :class:`ProtocolError` for a pack that cannot be read)."""
        if bw.is_sealed_pack(frame.headers):
            # Only its receivers can read its index: each file as a sealed stream's offer shows it.
            sender, at = _stamp(frame.headers)
            return [Offer(m[hdr.H_STREAM], m[hdr.H_NAME], int(m[hdr.H_SIZE]), int(m[hdr.H_CHUNKS]), m[hdr.H_MODE],
                          str(self.dest), sender, at) for m in bw.sealed_member_offers(frame.headers)]
        found = []
        for headers, _ in bw.read_pack(frame.headers, frame.body or b""):
            try:
                # Who sent it and when are the broker's word about the pack, not its index's.
                found.append(parse_visible_offer(headers, self.dest, stamped=frame.headers))
            except ProtocolError as exc:
                self._report_bad({**headers, "message-id": f"{frame.headers.get('message-id', '')}/"
                                  f"{headers.get(hdr.H_STREAM, '')}"}, exc)
        return found

    def _report_bad(self, headers: Mapping[str, Any], exc: ProtocolError, *, junk: bool = False) -> None:
        key = str(headers.get("message-id", ""))[:200]
        if junk and self._may_take and _MESSAGE_ID.fullmatch(key):
            self._junk[key] = str(exc)
            return  # said when it is quarantined
        if key in self._bad_seen:
            return
        if len(self._bad_seen) >= 10_000:  # a flood of junk must not grow a long-lived trigger
            self._bad_seen.clear()
        self._bad_seen.add(key)
        log.warning("ignoring an invalid offer on %s (it stays there for a receiver to reject): %s", self.dest, exc)

    def close(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.close()
