"""STOMP 1.2 session over stomp.py: one inbox listener, receipts, subscriptions.

Nothing here knows about streams or files. A dropped connection surfaces as
:class:`ConnectionLost` from any call; the engine reconnects and resumes from its durable
state, so reconnect and crash recovery are the same code path.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import time
from collections.abc import Iterator, Mapping

from stomp import exception as stomp_exc
from stomp.utils import Frame

from airflow_provider_amqstream.exceptions import ConnectionLost, DestinationFull, DestinationRefused, TransportError
from airflow_provider_amqstream.transport.connection import Connection12, open_connection, quiet_close
from airflow_provider_amqstream.transport.errors import access_denied, reported
from airflow_provider_amqstream.transport.inbox import Inbox
from airflow_provider_amqstream.transport.params import BrokerParams


class StompLink:
    """One STOMP 1.2 session with the broker: connecting, the broker's refusals as
    exceptions, sending with receipts, and subscriptions. Not thread-safe; one per
    sender/receiver. ``client_id`` is the name the broker logs for this connection.
    """

    def __init__(self, params: BrokerParams, *, client_id: str | None = None) -> None:
        self.params = params
        self.client_id = client_id
        self._conn: Connection12 | None = None
        self._inbox = Inbox()
        self._ids = itertools.count(1)
        # Frames that arrived for one subscription while the caller read another's. A
        # subscription we left is dropped: the broker redelivers what we did not ack.
        self._stash: dict[str, collections.deque[tuple[int, Frame]]] = {}
        self._arrivals = itertools.count()

    # -- life cycle --------------------------------------------------------------
    def open(self) -> StompLink:
        self._inbox = Inbox()
        self._stash = {}
        self._conn = open_connection(self.params, self._inbox, self.client_id)
        return self

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            quiet_close(conn)

    def __enter__(self) -> StompLink:
        return self.open() if self._conn is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._inbox.lost and self._conn.is_connected()

    def _check_refused(self) -> None:
        """Raise AccessDenied if the broker refused us a destination. Checked before a
        lost connection: ActiveMQ closes the session right after saying why."""
        if denied := access_denied(self.params, self._inbox.errors):
            raise denied

    def _live(self) -> Connection12:
        if self._conn is None:
            raise TransportError(f"not connected to {self.params.url}")
        self._check_refused()
        if self._inbox.lost:
            raise ConnectionLost(f"connection to {self.params.url} was lost")
        if self._inbox.errors:
            raise reported(self.params, self._inbox.errors)
        return self._conn

    @contextlib.contextmanager
    def _lost(self, doing: str) -> Iterator[None]:
        """A socket or stomp.py failure while ``doing`` something is a lost connection."""
        try:
            yield
        except (OSError, stomp_exc.StompException) as exc:
            raise ConnectionLost(f"{doing} on {self.params.url} failed: {exc}") from exc

    # -- operations --------------------------------------------------------------
    def send(self, destination: str, body: bytes | bytearray, headers: Mapping[str, str], *,
             receipt: bool = False, persistent: bool = True) -> str | None:
        conn = self._live()
        h = {**headers, "persistent": "true" if persistent else "false"}
        rid = self._receipt_id() if receipt else None
        if rid:
            h["receipt"] = rid
        with self._lost(f"sending to {destination}"):
            conn.send(destination, body, headers=h)
        return rid

    def send_confirmed(self, destination: str, body: bytes | bytearray, headers: Mapping[str, str]) -> None:
        rid = self._receipt_id()
        self.send(destination, body, {**headers, "receipt": rid})
        self.wait_receipt(rid)

    def _receipt_id(self) -> str:
        return f"r-{next(self._ids)}"

    def wait_receipt(self, rid: str, timeout: float | None = None) -> None:
        """Block until the broker confirmed ``rid``, or raise naming the broker."""
        timeout = self.params.receipt_timeout if timeout is None else timeout
        inbox = self._inbox
        deadline = time.monotonic() + timeout
        with inbox.cond:
            # While anyone waits here the reader thread must not hold back for the consumer:
            # the receipt may be behind unread messages on the wire.
            inbox.receipt_waiters += 1
            inbox.cond.notify_all()
            try:
                while rid not in inbox.receipts:
                    self._check_refused()
                    if inbox.errors:
                        raise reported(self.params, inbox.errors)
                    if inbox.lost:
                        raise ConnectionLost(f"connection to {self.params.url} lost while waiting for receipt {rid}")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ConnectionLost(
                            f"broker {self.params.url} did not confirm receipt {rid} within {timeout:.0f}s")
                    inbox.cond.wait(min(left, 1.0))
                inbox.receipts.discard(rid)
            finally:
                inbox.receipt_waiters -= 1

    def round_trip(self) -> None:
        conn = self._live()
        n = next(self._ids)
        # An empty transaction touches no destination and needs no permission.
        conn.send_frame("BEGIN", {"transaction": f"ping-{n}"})
        conn.send_frame("ABORT", {"transaction": f"ping-{n}", "receipt": f"ping-{n}"})
        self.wait_receipt(f"ping-{n}", 10.0)

    def subscribe(self, destination: str, *, ack: str = "client-individual", prefetch: int = 1,
                  selector: str | None = None, browser: bool = False) -> str:
        conn = self._live()
        sub_id = f"s-{next(self._ids)}"
        headers = {"activemq.prefetchSize": str(prefetch)}
        if selector:
            headers["selector"] = selector
        if browser:
            headers["browser"] = "true"
            ack = "auto"
        # Confirmed, so a refused subscription fails here, naming the destination, rather
        # than as a silent wait for messages that will never come.
        rid = self._receipt_id()
        headers["receipt"] = rid
        with self._lost(f"subscribing to {destination}"):
            conn.subscribe(destination, id=sub_id, ack=ack, headers=headers)
        try:
            self.wait_receipt(rid)
        except DestinationFull as exc:
            # A cap refusal that answered this very subscription: ActiveMQ keeps the session
            # then, and the refusal is that destination's alone, so it no longer stands
            # against the session.
            with self._inbox.cond:
                text = self._inbox.answers.pop(rid, None)
                if text is None or "number of destinations allowed" not in text:
                    raise
                self._inbox.errors.remove(text)
            raise DestinationRefused(f"broker {self.params.url} refused to create {destination}: {text}") from exc
        self._stash[sub_id] = collections.deque()
        return sub_id

    def unsubscribe(self, sub_id: str) -> None:
        self._stash.pop(sub_id, None)
        with self._lost("unsubscribing"):
            self._live().unsubscribe(sub_id)

    def ack(self, frame: Frame) -> None:
        with self._lost("acknowledging"):
            self._live().ack(frame.headers["ack"])

    def nack(self, frame: Frame) -> None:
        with self._lost("rejecting a message"):
            self._live().nack(frame.headers["ack"])

    def get(self, timeout: float, subscription: str | tuple[str, ...] | None = None) -> Frame | None:
        """The next message (for ``subscription``, or any of a tuple of them, if given), or None
        after ``timeout`` seconds; messages of other live subscriptions are kept for them."""
        if subscription is None:
            return self._next(timeout)
        subscriptions = (subscription,) if isinstance(subscription, str) else subscription
        # The earliest arrival first, whichever subscription it came for: a busy
        # subscription must not starve the others.
        waiting = [stash for sub in subscriptions if (stash := self._stash.get(sub))]
        if waiting:
            return min(waiting, key=lambda stash: stash[0][0]).popleft()[1]
        deadline = time.monotonic() + timeout
        while True:
            frame = self._next(max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            sub = frame.headers.get("subscription")
            if sub in subscriptions:
                return frame
            if sub in self._stash:
                self._stash[sub].append((next(self._arrivals), frame))

    def _next(self, timeout: float) -> Frame | None:
        self._check_refused()
        if self._inbox.lost and self._inbox.messages.empty():
            raise ConnectionLost(f"connection to {self.params.url} was lost")
        try:
            frame = self._inbox.messages.get(timeout=timeout)
        except queue.Empty:
            self._live()
            return None
        if frame is None:
            raise ConnectionLost(f"connection to {self.params.url} was lost")
        self._inbox.taken(frame)
        return frame
