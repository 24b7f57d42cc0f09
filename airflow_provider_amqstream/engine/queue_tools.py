"""Looking at and moving whole messages on the broker, for the ``streams`` views and actions.

What the broker lets a STOMP client do, and what that costs:

* A **queue browser** shows messages without consuming or reordering anything, but at most
  ``maxBrowsePageSize`` of them from the head of the queue (16 in the shipped config); a
  selector filters only those. :func:`browse` therefore says when what it saw may be cut.
* A **consumer with a selector** is blinded the same way (the broker pages in
  ``maxPageSize`` messages and dispatches from those only). :func:`take_matching` finds
  messages deeper in a queue by rotating it: what does not match goes to the tail (re-sent
  with every ``amqs_*`` header, confirmed, then acknowledged), so that only the queues
  whose order means nothing may be swept (the parked and quarantine queues; never the queue
  of offers, whose re-sent copies would carry the sweeping user's stamp).
* A **move** (:func:`move_queue`) re-sends each message elsewhere, stamped by the broker with
  the moving user (``JMSXUserID``).

Everything here is a building block of the ``streams`` views (read only) and actions.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_amqstream.exceptions import AccessDenied, DestinationFull
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import quarantine as qr
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.errors import cap_refusal
from airflow_provider_amqstream.transport.link import Link, Message, open_link
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)

# What a queue browser sees at most in the shipped broker config (maxBrowsePageSize), and a
# selector consumer (maxPageSize). An external broker may differ: callers may pass their own.
BROWSE_LIMIT = 16
# Set on a message a sweep passed to the tail of its queue: meeting it again means the sweep
# went round once. Overwritten by the next sweep; nothing else reads it.
H_SWEEP = "amqs_sweep"
# How long a browse waits for the next message before giving up on the end marker.
BROWSE_STEP = 5.0
# Messages a move sends per receipt (its subscription's prefetch is twice this).
MOVE_WINDOW = 8


@dataclass
class Browsed:
    """What a browse of one queue showed.

    :param truncated: the broker may hold more than it showed (as many as a browser sees at
        most were shown, or a selector was applied to only the first page).
    :param denied: the broker refused this user the queue (the text says so); nothing seen.
    :param full: the queue does not exist and its owner's cap forbids making it (the text says so).
    """

    frames: list[Any] = field(default_factory=list)
    truncated: bool = False
    denied: str = ""
    full: str = ""


@dataclass
class QueueSession(AbstractContextManager["QueueSession"]):
    """One STOMP connection for the views and actions, reopened after the broker refused a
    queue (ActiveMQ closes the connection after an authorization error), so one refused
    queue does not hide the others.

    :param browse_limit: how many messages a queue browser sees at most on this broker.
    """

    params: BrokerParams
    client_id: str = field(default="amqstream-streams", kw_only=True)
    browse_limit: int = field(default=BROWSE_LIMIT, kw_only=True)
    _link: Link | None = field(default=None, init=False, repr=False)

    @property
    def link(self) -> Link:
        if self._link is None or not self._link.connected:
            self.reset()
            self._link = open_link(self.params, client_id=self.client_id).open()
        return self._link

    def reset(self) -> None:
        """Drop the connection (after a refusal); the next use opens a new one."""
        if self._link is not None:
            self._link.close()
            self._link = None

    def __exit__(self, *exc: object) -> None:
        self.reset()

    def browse(self, queue: str, *, selector: str | None = None,
               keep_body: Callable[[Any], bool] | None = None) -> Browsed:
        """The messages on ``queue`` now, head first, without consuming or reordering any.

        :param selector: applied by the broker to the first page only.
        :param keep_body: keep the body of the frames for which this returns True (the rest
            are dropped as they arrive, so a browse of large messages holds no bulk data).
        """
        try:
            link = self.link
            sub = link.subscribe(queue, browser=True, selector=selector, prefetch=self.browse_limit)
            frames = []
            try:
                while (frame := link.get(BROWSE_STEP, sub)) is not None and frame.headers.get("browser") != "end":
                    if keep_body is None or not keep_body(frame):
                        frame.body = b""
                    frames.append(frame)
            finally:
                link.unsubscribe(sub)
        except AccessDenied as exc:
            self.reset()
            return Browsed(denied=str(exc))
        except DestinationFull as exc:
            # The queue does not exist and its cap forbids making it (a stream quarantined
            # past its sender's cap on DLQ.NAME.amqs.<sender>.>: the broker dropped its chunks).
            self.reset()
            return Browsed(full=str(exc))
        return Browsed(frames, truncated=bool(selector) or len(frames) >= self.browse_limit)

    def require_read(self, queues: Iterable[str]) -> None:
        """Fail before anything moves if the user may not read one of ``queues`` (a browse needs
        read): a refusal half-way would leave an action half done. A selector that matches
        nothing: no message comes back."""
        for queue in queues:
            browsed = self.browse(queue, selector=f"{hdr.H_KIND} = '-'")
            if browsed.denied:
                raise AccessDenied(f"{browsed.denied} Nothing was changed: this needs read and write on {queue} "
                                   "(on the embedded broker, the administrator's rights).")
            if browsed.full:
                raise cap_refusal(self.params, browsed.full)


def copy_headers(frame: Any, **extra: str) -> dict[str, str]:
    """The headers a copy of ``frame`` carries: its ``amqs_*`` headers (the protocol's, and
    whatever the views added) and the JMS group headers the protocol sets on chunks (the
    broker does not show them on STOMP frames, so they are rebuilt), plus ``extra`` (an
    empty value removes one).
    """
    h = {k: str(v) for k, v in frame.headers.items() if k.startswith("amqs_")}
    h.pop(H_SWEEP, None)
    kind = h.get(hdr.H_KIND)
    if kind in (hdr.Kind.DATA.value, hdr.Kind.END.value, hdr.Kind.OFFER.value) and h.get(hdr.H_STREAM):
        h[hdr.H_GROUP_ID] = h[hdr.H_STREAM]
        if kind == hdr.Kind.DATA.value and h.get(hdr.H_SEQ):
            h[hdr.H_GROUP_SEQ] = h[hdr.H_SEQ]
        elif kind == hdr.Kind.END.value:
            h[hdr.H_GROUP_SEQ] = "-1"
    for k, v in extra.items():
        if v:
            h[k] = v
        else:
            h.pop(k, None)
    return h


def take_matching(link: Link, queue: str, match: Callable[[Message], bool], *, selector: str,
                  sweep: bool, quiet: float = 1.0,
                  stamp: Callable[[Message], dict[str, str]] | None = None) -> tuple[list[Message], str]:
    """The messages on ``queue`` that ``match``, delivered to ``link`` and held
    unacknowledged, and the subscription holding them: the caller acknowledges them, or
    unsubscribes (or closes) to send them back to the queue.

    First a consumer with ``selector`` (quick, but it sees only the first page of the
    queue); with ``sweep``, if that found nothing, the queue is rotated once: every other
    message is passed to its tail (see the module doc), with the headers ``stamp`` gives it
    (so what its broker stamp said survives the re-send).

    :param selector: the JMS selector equivalent to ``match``.
    :param quiet: seconds without a message that mean the queue has no more for us.
    """
    # Prefetch above one: the found messages stay held (unacknowledged) while we look on.
    sub = link.subscribe(queue, prefetch=BROWSE_LIMIT, selector=selector)
    found: list[Message] = []
    while (frame := link.get(quiet if not found else min(quiet, 0.3), sub)) is not None:
        if match(frame):
            found.append(frame)
    if not found and sweep:
        link.unsubscribe(sub)
        token = secrets.token_hex(8)
        sub = link.subscribe(queue, prefetch=BROWSE_LIMIT)
        while (frame := link.get(quiet, sub)) is not None:
            if frame.headers.get(H_SWEEP) == token:
                break  # round once: it goes back, unacknowledged, when the subscription ends
            if match(frame):
                found.append(frame)
                continue
            extra = stamp(frame) if stamp else {}
            link.send_confirmed(queue, bytes(frame.body or b""), {**copy_headers(frame, **extra), H_SWEEP: token})
            link.ack(frame)
    return found, sub


@dataclass
class Moved:
    """What :func:`move_queue` did: messages and body bytes moved, and those dropped."""

    messages: int = 0
    bytes: int = 0
    dropped: int = 0
    dropped_bytes: int = 0


def move_queue(link: Link, source: str, target: str | None, *,
               decide: Callable[[Any], dict[str, str] | None] | None = None, quiet: float = 1.0) -> Moved:
    """Move every message on ``source`` to ``target`` (None: take them and drop them), until
    ``source`` stays quiet for ``quiet`` seconds.

    Each copy carries the original's ``amqs_*`` headers and body; ``decide(frame)`` may add
    headers (a dict) or drop the message instead (None). The originals of a window are
    acknowledged once a receipt confirmed their copies: a crash leaves a copy too many, never
    none.
    """
    out = Moved()
    pending: list[Any] = []
    sub = link.subscribe(source, prefetch=2 * MOVE_WINDOW)

    def confirmed() -> None:
        for f in pending:
            link.ack(f)
        pending.clear()

    try:
        while (frame := link.get(quiet, sub)) is not None:
            body = bytes(frame.body or b"")
            extra = decide(frame) if decide else {}
            if target is None or extra is None:
                out.dropped += 1
                out.dropped_bytes += len(body)
                link.ack(frame)
                continue
            out.messages += 1
            out.bytes += len(body)
            rid = link.send(target, body, copy_headers(frame, **extra), receipt=out.messages % MOVE_WINDOW == 0)
            pending.append(frame)
            if rid is not None:
                link.wait_receipt(rid)
                confirmed()
        if pending:
            # A receipt for a frame that touches no destination confirms every frame sent
            # before it: the broker handles one connection's frames in order.
            link.round_trip()
            confirmed()
    finally:
        link.unsubscribe(sub)
    return out


def take_copies(link: Link, queue: str, dest: Destination, stream_id: str, *, quarantine: bool,
                quiet: float, user: str = "") -> tuple[list[Any], str]:
    """Take every copy of ``stream_id``'s offer off a parked or quarantine queue (swept:
    their order means nothing); on a quarantine queue, only copies filed from ``dest``, and
    a copy passed to the tail keeps who filed it. Returns the copies, unacknowledged, and
    the subscription holding them (see :func:`take_matching`).

    :param user: the sweeping user (a copy it re-sent keeps who filed it; another's header is not believed).
    """
    def ours(frame: Any) -> bool:
        h = frame.headers
        return h.get(hdr.H_STREAM) == stream_id and (
            not quarantine or str(h.get(hdr.H_QUARANTINED_FROM) or dest) == str(dest))

    stamp = ((lambda f: {qr.H_QUARANTINED_USER: qr.quarantined_by_user(f.headers, sweeper=user)})
             if quarantine else None)
    return take_matching(link, queue, ours, selector=qr.copies_selector(stream_id), sweep=True, quiet=quiet,
                         stamp=stamp)
