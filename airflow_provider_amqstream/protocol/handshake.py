"""Handshake mode, the sender's side as a pure state machine: whom to send what next.

In ``handshake`` mode receivers answer the offer with ``hello`` on the stream's
control queue, acknowledge each window with ``ack``, ask for a resend from a sequence
number with ``rereq``, and say ``done``. :class:`HandshakeSender` takes those messages and
decides which chunk goes next; ``engine/send/handshake.py`` drives it over the broker. A
control message is read once into a :class:`Control` (:func:`parse_control`); how one is
written (:func:`protocol.control_headers`, :func:`protocol.handshake_terms`) is in
``wire.py`` with the rest of the wire format.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_amqstream.exceptions import ProtocolError, RemoteProtocolError
from airflow_provider_amqstream.protocol.headers import CONTROL_KINDS, H_CONSUMER, H_NEXT_SEQ, H_STREAM, H_TOKEN, Kind
from airflow_provider_amqstream.protocol.wire import StreamSpec, from_the_wire, int_header, kind_of


@dataclass(frozen=True)
class Control:
    """A receiver's control message, checked: its kind (hello, ack, rereq or done), who sent
    it (the consumer's name and the token it said hello with) and the first chunk it lacks."""

    kind: Kind
    consumer: str
    token: str
    next_seq: int


@from_the_wire
def parse_control(headers: Mapping[str, Any], spec: StreamSpec) -> Control:
    """The control message ``headers`` carry for stream ``spec``; raises ProtocolError on a
    malformed one or one for another stream."""
    sid = spec.stream_id
    if headers.get(H_STREAM) != sid:
        raise ProtocolError(f"stream {sid}: control message for another stream arrived")
    kind = kind_of(headers)
    if kind not in CONTROL_KINDS:
        raise ProtocolError(f"stream {sid}: {kind.value} arrived on the control queue")
    consumer = str(headers.get(H_CONSUMER) or "")
    if not consumer or len(consumer) > 200:
        raise ProtocolError(f"stream {sid}: control message without a valid {H_CONSUMER}")
    token = str(headers.get(H_TOKEN) or "")
    if not re.fullmatch(r"[0-9a-f]{32}", token):
        raise ProtocolError(f"stream {sid}: control message from {consumer[:80]!r} without a valid {H_TOKEN}")
    return Control(kind, consumer, token, int_header(headers, H_NEXT_SEQ, sid, lo=1, hi=spec.chunks + 1))


@dataclass
class HandshakeSender:
    """The sender's side of handshake mode: whom to send what next.

    Receivers report their position (``next_seq``: first chunk not on their disk). The
    sender sends in order from ``send_seq`` but never more than ``window`` chunks past
    the slowest receiver; a ``hello`` or ``rereq`` below ``send_seq`` rewinds it, which
    is both how lost chunks are recovered and how either end resumes.

    A receiver joins with ``hello`` and is bound to that message's token; its later
    messages with another token are ignored, as are messages from receivers that never
    said hello. On a queue only the
    receiver holding the offer can answer, so the sender serves one receiver: another
    replaces it only after it was silent for ``takeover_after`` seconds (it died and its
    offer moved). On a topic every receiver counts. Re-sent chunks are bounded by
    ``max_resend``: a receiver that rewinds for ever stops the sender.
    """

    spec: StreamSpec
    window: int
    point_to_point: bool = True
    takeover_after: float = 10.0
    positions: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    tokens: dict[str, str] = field(default_factory=dict)
    heard: dict[str, float] = field(default_factory=dict)
    send_seq: int = 1
    end_due: bool = True
    rewinds: int = 0
    resent: int = 0
    highest_sent: int = 0
    ignored: int = 0

    @property
    def max_resend(self) -> int:
        return 2 * self.spec.chunks + 64

    def on_control(self, headers: Mapping[str, Any], *, now: float) -> Kind | None:
        """Take one control message; return its kind, or None if it was ignored (not from a
        receiver this sender serves). Raises ProtocolError on a malformed message."""
        msg = parse_control(headers, self.spec)
        kind, consumer, pos = msg.kind, msg.consumer, msg.next_seq
        if not self._admit(kind, consumer, msg.token, now):
            self.ignored += 1
            return None
        self.heard[consumer] = now
        if kind is Kind.DONE:
            self.finished.add(consumer)
            self.positions[consumer] = self.spec.chunks + 1
            return kind
        self.finished.discard(consumer)
        if kind is Kind.ACK:
            self.positions[consumer] = max(self.positions.get(consumer, 1), pos)
            return kind
        self.positions[consumer] = pos
        if pos < self.send_seq:
            self.send_seq = pos
            self.rewinds += 1
        # A receiver that asks again from some point may have missed the end marker too.
        self.end_due = True
        return kind

    def _admit(self, kind: Kind, consumer: str, token: str, now: float) -> bool:
        if consumer in self.tokens:
            return self.tokens[consumer] == token
        if kind is not Kind.HELLO:
            return False  # a receiver introduces itself before anything else
        if self.point_to_point and self.tokens:
            last = max(self.heard.values(), default=now)
            if now - last < self.takeover_after:
                return False
            # The receiver we served went silent: it died, and this one took over its offer.
            self.positions.clear()
            self.finished.clear()
            self.tokens.clear()
        self.tokens[consumer] = token
        return True

    @property
    def slowest(self) -> int:
        return min(self.positions.values()) if self.positions else 1

    def next_chunk(self) -> int | None:
        """The chunk to send now, or None if the window is full or all were sent."""
        if not self.positions or self.send_seq > self.spec.chunks:
            return None
        if self.send_seq >= self.slowest + self.window:
            return None
        seq = self.send_seq
        self.send_seq += 1
        if seq <= self.highest_sent:
            self.resent += 1
            if self.resent > self.max_resend:
                raise RemoteProtocolError(
                    f"stream {self.spec.stream_id}: receivers asked for {self.resent} chunks again, more than "
                    f"{self.max_resend} for a {self.spec.chunks}-chunk stream; stopping rather than resend for ever")
        self.highest_sent = max(self.highest_sent, seq)
        return seq

    def take_end(self) -> bool:
        """Whether the end marker should be sent now (after the last chunk, again after a rewind)."""
        if self.positions and self.send_seq > self.spec.chunks and self.end_due:
            self.end_due = False
            return True
        return False

    @property
    def all_done(self) -> bool:
        return bool(self.positions) and set(self.positions) <= self.finished
