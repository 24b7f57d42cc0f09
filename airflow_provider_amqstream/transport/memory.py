"""An in-memory broker and link: the engine's logic in unit tests, without ActiveMQ.

It behaves as the parts of ActiveMQ the engine relies on do: queues deliver each message
to one subscriber at a time, up to its prefetch of unacknowledged messages; an
acknowledged message is gone, a refused one (NACK) moves
to ``DLQ.<queue>``, and what a subscriber leaves unacknowledged (it unsubscribes, closes or
loses its connection) goes back to the head of its queue, marked redelivered. Selectors
are the subset of JMS selectors the provider writes (``=``, ``<>``, ``IS [NOT] NULL``,
``[NOT] IN``, ``[NOT] LIKE ... ESCAPE``, ``AND``, ``OR``, ``NOT``, parentheses) with SQL's
three-valued logic; ``JMSMessageID`` is the message id. Every message is stamped with the
sending user (``JMSXUserID``) as a broker with ``populateJMSXUserID`` does. A test can drop every connection
(:meth:`MemoryBroker.drop`) to exercise reconnects.

Nothing is persistent and there are no topics, flow control or paging: those are the real
broker's, proved by the integration tests.
"""

from __future__ import annotations

import collections
import itertools
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from stomp.utils import Frame

from airflow_provider_amqstream.exceptions import (
    BrokerUnreachable,
    ConnectionLost,
    DestinationFull,
    DestinationRefused,
    TransportError,
)
from airflow_provider_amqstream.transport.params import BrokerParams

Headers = Mapping[str, Any]
Predicate = Callable[[Headers], "bool | None"]


@dataclass
class _Message:
    headers: dict[str, Any]
    body: bytes
    redelivered: bool = False


@dataclass
class _Sub:
    link: MemoryLink
    sub_id: str
    queue: str
    prefetch: int
    match: Predicate
    unacked: dict[str, _Message] = field(default_factory=dict)


class MemoryBroker:
    """One in-memory broker, found by links through the host name in their settings.

    :param name: the host name links use to reach it (see :meth:`params`).
    """

    _brokers: dict[str, MemoryBroker] = {}
    _names = itertools.count(1)

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"memory-{next(self._names)}"
        self.cond = threading.Condition()
        self.queues: dict[str, collections.deque[_Message]] = collections.defaultdict(collections.deque)
        self.subs: list[_Sub] = []
        self.links: list[MemoryLink] = []
        self._ids = itertools.count(1)
        # Destination -> how many sends to it are still refused, as a broker whose memory
        # limit stays full refuses them.
        self.refusals: dict[str, int] = {}
        self.uncreatable: dict[str, int] = {}
        MemoryBroker._brokers[self.name] = self

    def params(self, user: str | None, **kw: Any) -> BrokerParams:
        """Connection settings that reach this broker as ``user``."""
        return BrokerParams(hosts=((self.name, 0),), login=user, backend="memory", **kw)

    def close(self) -> None:
        """Forget this broker: links that look for it afterwards fail to connect."""
        MemoryBroker._brokers.pop(self.name, None)

    # -- what tests look at ----------------------------------------------------------
    def messages(self, destination: str) -> list[tuple[dict[str, Any], bytes]]:
        """What waits on a queue now (not what is delivered and unacknowledged)."""
        with self.cond:
            return [(dict(m.headers), m.body) for m in self.queues.get(_queue(destination), ())]

    def refuse(self, destination: str, times: int) -> None:
        """Refuse the next ``times`` sends to ``destination`` with :class:`DestinationFull`."""
        with self.cond:
            self.refusals[destination] = times

    def refuse_creating(self, destination: str, times: int) -> None:
        """Refuse the next ``times`` subscriptions to ``destination`` with
        :class:`DestinationRefused`, as ActiveMQ refuses a queue past its owner's cap."""
        with self.cond:
            self.uncreatable[destination] = times

    def drop(self) -> None:
        """Every connection is lost at once (a broker restart, without losing messages)."""
        with self.cond:
            for link in list(self.links):
                self._disconnect(link)
                link.lost = True
            self.cond.notify_all()

    # -- the broker's work, under self.cond ----------------------------------------------
    def _send(self, link: MemoryLink, destination: str, body: bytes | bytearray, headers: Headers) -> None:
        name = _queue(destination)
        if self.refusals.get(destination, 0) > 0:
            self.refusals[destination] -= 1
            raise DestinationFull(f"memory broker {self.name} refused messages to {destination}: its memory is full")
        kept = {k: str(v) for k, v in headers.items() if k not in ("receipt", "persistent", "JMSXUserID")}
        msg = _Message(kept, bytes(body))
        msg.headers.update({"message-id": f"ID:{self.name}-{next(self._ids)}", "destination": destination,
                            "timestamp": str(int(time.time() * 1000))})
        if link.params.login:
            msg.headers["JMSXUserID"] = link.params.login
        self.queues[name].append(msg)
        self._dispatch(name)

    def _dispatch(self, name: str) -> None:
        queue = self.queues.get(name)
        subs = [s for s in self.subs if s.queue == name]
        if not queue or not subs:
            return
        kept: collections.deque[_Message] = collections.deque()
        for msg in queue:
            sub = next((s for s in subs if len(s.unacked) < s.prefetch and s.match(msg.headers)), None)
            if sub is None:
                kept.append(msg)
            else:
                self._deliver(sub, msg)
                subs.remove(sub)
                subs.append(sub)  # round robin among those that can take one
        self.queues[name] = kept

    def _deliver(self, sub: _Sub, msg: _Message) -> None:
        ack = f"{sub.sub_id}-{next(self._ids)}"
        sub.unacked[ack] = msg
        headers = {**msg.headers, "subscription": sub.sub_id, "ack": ack}
        if msg.redelivered:
            headers["redelivered"] = "true"
        sub.link.inbox.append(Frame("MESSAGE", headers, msg.body))
        self.cond.notify_all()

    def _settle(self, link: MemoryLink, ack: str, *, refuse: bool) -> None:
        sub = next((s for s in self.subs if s.link is link and ack in s.unacked), None)
        if sub is None:
            raise TransportError(f"memory broker {self.name}: no unacknowledged message {ack}")
        msg = sub.unacked.pop(ack)
        if refuse:
            msg.redelivered = False
            self.queues[f"DLQ.{sub.queue}"].append(msg)
            self._dispatch(f"DLQ.{sub.queue}")
        self._dispatch(sub.queue)

    def _unsubscribe(self, sub: _Sub) -> None:
        self.subs.remove(sub)
        sub.link.inbox = collections.deque(f for f in sub.link.inbox if f.headers.get("subscription") != sub.sub_id)
        if sub.unacked:
            for msg in sub.unacked.values():
                msg.redelivered = True
            self.queues[sub.queue].extendleft(reversed(sub.unacked.values()))
            self._dispatch(sub.queue)

    def _disconnect(self, link: MemoryLink) -> None:
        for sub in [s for s in self.subs if s.link is link]:
            self._unsubscribe(sub)
        if link in self.links:
            self.links.remove(link)


class MemoryLink:
    """A :class:`~airflow_provider_amqstream.transport.link.Link` to a :class:`MemoryBroker`.

    :param params: settings whose first host names the broker (``MemoryBroker.params``).
    """

    def __init__(self, params: BrokerParams) -> None:
        self.params = params
        self.broker: MemoryBroker | None = None
        self.inbox: collections.deque[Frame] = collections.deque()
        self.lost = False
        self._ids = itertools.count(1)

    def open(self) -> MemoryLink:
        name = self.params.hosts[0][0]
        broker = MemoryBroker._brokers.get(name)
        if broker is None:
            raise BrokerUnreachable(f"cannot reach any broker at memory://{name} (no such in-memory broker); "
                                    "is it running?")
        with broker.cond:
            self.broker, self.lost, self.inbox = broker, False, collections.deque()
            broker.links.append(self)
        return self

    def close(self) -> None:
        broker, self.broker = self.broker, None
        if broker is not None:
            with broker.cond:
                broker._disconnect(self)

    def __enter__(self) -> MemoryLink:
        return self.open() if self.broker is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self.broker is not None and not self.lost

    def _live(self) -> MemoryBroker:
        if self.broker is None:
            raise TransportError(f"not connected to {self.params.url}")
        if self.lost:
            raise ConnectionLost(f"connection to {self.params.url} was lost")
        return self.broker

    def send(self, destination: str, body: bytes | bytearray, headers: Mapping[str, str], *,
             receipt: bool = False, persistent: bool = True) -> str | None:
        broker = self._live()
        with broker.cond:
            broker._send(self, destination, body, headers)
        return f"r-{next(self._ids)}" if receipt else None

    def send_confirmed(self, destination: str, body: bytes | bytearray, headers: Mapping[str, str]) -> None:
        self.send(destination, body, headers)

    def wait_receipt(self, rid: str) -> None:
        self._live()

    def round_trip(self) -> None:
        self._live()

    def subscribe(self, destination: str, *, ack: str = "client-individual", prefetch: int = 1,
                  selector: str | None = None, browser: bool = False) -> str:
        broker = self._live()
        match = compile_selector(selector) if selector else (lambda headers: True)
        sub_id = f"s-{next(self._ids)}"
        with broker.cond:
            if broker.uncreatable.get(destination, 0) > 0:
                broker.uncreatable[destination] -= 1
                raise DestinationRefused(f"memory broker {broker.name} refused to create {destination}")
            name = _queue(destination)
            if browser:
                waiting = broker.queues.get(name, ())
                self.inbox.extend(Frame("MESSAGE", {**m.headers, "subscription": sub_id}, m.body)
                                  for m in waiting if match(m.headers))
                self.inbox.append(Frame("MESSAGE", {"subscription": sub_id, "browser": "end"}, b""))
                broker.cond.notify_all()
                return sub_id
            broker.subs.append(_Sub(self, sub_id, name, max(1, prefetch), match))
            broker._dispatch(name)
        return sub_id

    def unsubscribe(self, sub_id: str) -> None:
        broker = self._live()
        with broker.cond:
            sub = next((s for s in broker.subs if s.link is self and s.sub_id == sub_id), None)
            if sub is not None:
                broker._unsubscribe(sub)
            else:  # a browser: drop what it still holds
                self.inbox = collections.deque(f for f in self.inbox if f.headers.get("subscription") != sub_id)

    def ack(self, frame: Any) -> None:
        broker = self._live()
        with broker.cond:
            broker._settle(self, frame.headers["ack"], refuse=False)

    def nack(self, frame: Any) -> None:
        broker = self._live()
        with broker.cond:
            broker._settle(self, frame.headers["ack"], refuse=True)

    def get(self, timeout: float, subscription: str | tuple[str, ...] | None = None) -> Frame | None:
        subs = (subscription,) if isinstance(subscription, str) else subscription
        broker = self._live()
        deadline = time.monotonic() + timeout
        with broker.cond:
            while True:
                if self.lost:
                    raise ConnectionLost(f"connection to {self.params.url} was lost")
                for frame in self.inbox:  # the earliest arrival first, as the STOMP link does
                    if subs is None or frame.headers.get("subscription") in subs:
                        self.inbox.remove(frame)
                        return frame
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                broker.cond.wait(left)


def _queue(destination: str) -> str:
    if not destination.startswith("/queue/"):
        raise TransportError(f"memory broker: {destination!r} is not /queue/NAME (a topic needs the real broker)")
    return destination.removeprefix("/queue/")


# ------------------------------------------------------------------ selectors
_TOKEN = re.compile(r"\s*(?:(?P<token>'(?:[^']|'')*'|<>|[=(),]|[A-Za-z_][A-Za-z0-9_.]*)|(?P<bad>\S))")
_KEYWORDS = {"AND", "OR", "NOT", "IS", "NULL", "IN", "LIKE", "ESCAPE", "TRUE", "FALSE"}


def compile_selector(text: str) -> Predicate:
    """A JMS selector (the subset the provider writes) as a predicate over headers: True,
    False, or None for SQL's unknown (a header that is absent)."""
    parser = _Parser(text)
    pred = parser.expr()
    if parser.pos != len(parser.tokens):
        raise ValueError(f"selector {text!r}: unexpected {parser.tokens[parser.pos]!r}")
    return pred


# SQL's three-valued AND and OR are min and max over False < None (unknown) < True.
_RANK = {False: 0, None: 1, True: 2}


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0
        self.tokens: list[str] = []
        for m in _TOKEN.finditer(text):
            if m["bad"]:
                raise ValueError(f"selector {text!r}: cannot read at {text[m.start('bad'):][:20]!r}")
            token = m["token"]
            self.tokens.append(token.upper() if token.upper() in _KEYWORDS else token)

    def _skip(self, value: str) -> bool:
        """Take the next token if it is ``value``."""
        found = self.pos < len(self.tokens) and self.tokens[self.pos] == value
        self.pos += found
        return found

    def _take(self, value: str | None = None) -> str:
        if self.pos >= len(self.tokens) or (value is not None and self.tokens[self.pos] != value):
            raise ValueError(f"selector {self.text!r}: expected {value or 'more'}")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def _chain(self, word: str, operand: Callable[[], Predicate], join: Callable[..., Any]) -> Predicate:
        parts = [operand()]
        while self._skip(word):
            parts.append(operand())
        return lambda h: join((part(h) for part in parts), key=_RANK.__getitem__)

    def expr(self) -> Predicate:
        return self._chain("OR", self._and, max)

    def _and(self) -> Predicate:
        return self._chain("AND", self._not, min)

    def _not(self) -> Predicate:
        if self._skip("NOT"):
            inner = self._not()
            return lambda h: None if (v := inner(h)) is None else not v
        return self._cmp()

    def _literal(self) -> str:
        value = self._take()
        if not value.startswith("'"):
            raise ValueError(f"selector {self.text!r}: expected a literal, got {value!r}")
        return value[1:-1].replace("''", "'")

    # One grammar rule (parenthesis, IS [NOT] NULL, [NOT] IN, [NOT] LIKE, = and <>): a branch per production.
    def _cmp(self) -> Predicate:
        if self._skip("("):
            inner = self.expr()
            self._take(")")
            return inner
        ident = self._take()
        # JMSMessageID is the one JMS header field a STOMP frame carries under its own name.
        ident = "message-id" if ident == "JMSMessageID" else ident
        if self._skip("IS"):
            present = self._skip("NOT")
            self._take("NULL")
            return lambda h: (ident in h) == present
        negate = self._skip("NOT")
        if self._skip("LIKE"):
            pattern = self._literal()
            rx = _like(pattern, self._literal() if self._skip("ESCAPE") else None)
            return lambda h: None if ident not in h else bool(rx.fullmatch(str(h[ident]))) != negate
        if self._skip("IN"):
            self._take("(")
            values = [self._literal()]
            while self._skip(","):
                values.append(self._literal())
            self._take(")")
        else:  # = and <> are IN and NOT IN with one value
            op = self._take()
            if op not in ("=", "<>"):
                raise ValueError(f"selector {self.text!r}: expected =, <>, IN, LIKE or IS after {ident}, got {op!r}")
            negate, values = negate != (op == "<>"), [self._literal()]
        return lambda h: None if ident not in h else (str(h[ident]) in values) != negate


def _like(pattern: str, escape: str | None) -> re.Pattern[str]:
    # Pieces: an escaped character (the escape and the one it escapes), else one character.
    pieces = re.findall(f"{re.escape(escape)}.|." if escape else ".", pattern, re.S)
    wild = {"%": ".*", "_": "."}
    return re.compile("".join(wild.get(p) or re.escape(p[-1]) for p in pieces), re.S)
