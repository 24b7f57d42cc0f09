"""STOMP 1.2 transport over stomp.py: connection settings, one inbox listener, receipts.

Nothing here knows about streams or files. It gives the engine four things:
``send`` (optionally with a receipt), ``wait_receipt``, ``subscribe``/``ack`` and
``get`` (the next message, with a timeout). A dropped connection surfaces as
:class:`ConnectionLost` from any of them; the engine reconnects and resumes from
its durable state, so reconnect and crash recovery are the same code path.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import re
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import stomp
from stomp import exception as stomp_exc
from stomp.connect import BaseConnection
from stomp.protocol import Protocol12
from stomp.utils import Frame

from airflow_provider_amqstream.frames import FastTransport

log = logging.getLogger(__name__)
# stomp.py logs every connect at INFO ("established connection to host ..."); in task logs
# that is noise. Quieted unless someone configured the logger on purpose.
if logging.getLogger("stomp.py").level == logging.NOTSET:
    logging.getLogger("stomp.py").setLevel(logging.WARNING)

DEFAULT_PORT = 61613


class TransportError(ConnectionError):
    """The broker could not be reached or refused us; the text names the broker URL."""


class ConnectionLost(TransportError):
    """An established connection dropped (broker restart, network, heartbeat timeout)."""


class AccessDenied(TransportError):
    """The broker refused this user an operation on a destination; retrying cannot help."""


class DestinationFull(TransportError):
    """The broker refused a message because the destination's memory limit stayed full
    through its flow-control wait: its receivers are not taking messages (stopped, or
    slower than its senders). Nothing confirmed is lost, and retrying later can succeed."""


def check_uri_credentials(uri: str, where: str = "the connection URI") -> None:
    """Refuse a URI whose user or password holds a character that ends the authority.

    urllib then reads part of the password as the port, path or query, and every error
    from there on would quote it. Say what to do and quote nothing.
    """
    rest = uri.split("://", 1)[-1]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in rest[len(authority):]:
        raise ValueError(f"{where}: the user or password contains '/', '?', '#' or '@' that must be "
                         "percent-encoded (%2F, %3F, %23, %40); the URI is not shown because it holds a password")


@dataclass(frozen=True)
class BrokerParams:
    """How to reach the broker(s). Built from an Airflow connection or a URI.

    :param hosts: (host, port) pairs tried in order; more than one gives failover.
    :param heartbeat_ms: STOMP heart-beat interval both ways; 0 disables.
    :param chunk_size: default chunk size for streams sent through this connection.
    :param window: default number of chunks per confirmation window / prefetch.
    :param network: the broker is one of a network of brokers; a trigger watching for offers
        then also draws offers waiting at the other brokers to this one (a queue browser
        alone makes no bridge forward anything).
    """

    hosts: tuple[tuple[str, int], ...] = (("127.0.0.1", DEFAULT_PORT),)
    login: str | None = None
    password: str | None = field(default=None, repr=False)
    vhost: str | None = None
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    check_hostname: bool = True
    heartbeat_ms: int = 10_000
    connect_timeout: float = 15.0
    receipt_timeout: float = 60.0
    chunk_size: int | None = None
    window: int | None = None
    compression: str | None = None
    network: bool = False

    @property
    def url(self) -> str:
        """Broker address for messages and logs; never contains the password."""
        scheme = "stomp+ssl" if self.tls else "stomp"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.hosts)

    @classmethod
    def from_parts(cls, host: str | None, port: int | None, login: str | None,
                   password: str | None, extra: Mapping[str, Any] | None) -> BrokerParams:
        """Build from Airflow connection fields: ``host`` may list ``h1,h2:61614``."""
        extra = dict(extra or {})
        default_port = int(port or extra.get("port") or DEFAULT_PORT)
        host_list = str(extra.get("hosts") or host or "127.0.0.1")
        hosts = []
        for item in (h.strip() for h in host_list.split(",")):
            if not item:
                continue
            if item.count(":") == 1:
                h, _, p = item.partition(":")
                if not p.isdigit():
                    raise ValueError(f"broker host {item!r}: the port must be a number")
                hosts.append((h, int(p)))
            else:
                hosts.append((item.strip("[]"), default_port))
        if not hosts:
            raise ValueError("an amqstream connection needs at least one broker host")

        def flag(name: str, default: bool) -> bool:
            v = extra.get(name, default)
            return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")

        def num(name: str, default: Any, conv: Any = int) -> Any:
            v = extra.get(name)
            if v in (None, ""):
                return default
            try:
                return conv(v)
            except (TypeError, ValueError):
                kind = "a whole number" if conv is int else "a number"
                raise ValueError(f"connection extra {name!r} must be {kind}, got {str(v)[:40]!r}") from None

        return cls(
            hosts=tuple(hosts), login=login or None, password=password or None,
            vhost=extra.get("vhost") or None, tls=flag("tls", False),
            ca_file=extra.get("ca_file") or None, cert_file=extra.get("cert_file") or None,
            key_file=extra.get("key_file") or None, check_hostname=flag("check_hostname", True),
            heartbeat_ms=num("heartbeat_ms", 10_000), connect_timeout=num("connect_timeout", 15.0, float),
            receipt_timeout=num("receipt_timeout", 60.0, float),
            chunk_size=num("chunk_size", None), window=num("window", None),
            compression=(str(extra["compression"]).lower() or None) if extra.get("compression") not in
            (None, "", "none", "None") else None,
            network=flag("network", False),
        )

    @classmethod
    def from_uri(cls, uri: str) -> BrokerParams:
        """Parse ``amqstream://user:pass@host1,host2:61613?tls=true&window=16``."""
        parts = urlsplit(uri)
        if parts.scheme not in ("amqstream", "stomp", "stomp+ssl"):
            raise ValueError(f"not an amqstream URI (scheme {parts.scheme!r}); use amqstream://host:port")
        check_uri_credentials(uri)
        netloc = parts.netloc.rpartition("@")[2]
        host, port = netloc, None
        if re.search(r":\d+$", netloc):
            host, _, p = netloc.rpartition(":")
            port = int(p)
        elif ":" in netloc.strip("[]") and not netloc.startswith("["):
            raise ValueError(f"the connection URI's port must be a number (host part {netloc[:80]!r})")
        extra = dict(parse_qsl(parts.query))
        if parts.scheme == "stomp+ssl":
            extra.setdefault("tls", "true")
        return cls.from_parts(unquote(host), port, unquote(parts.username or "") or None,
                              unquote(parts.password or "") or None, extra)

    def with_overrides(self, **kw: Any) -> BrokerParams:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


class _Connection12(BaseConnection, Protocol12):
    """StompConnection12 built on :class:`FastTransport`."""

    def __init__(self, hosts: list[tuple[str, int]], heartbeats: tuple[int, int], timeout: float) -> None:
        transport = FastTransport(
            hosts, prefer_localhost=False, try_loopback_connect=False,
            reconnect_attempts_max=1, timeout=timeout, auto_decode=False,
            recv_bytes=1024 * 1024,
        )
        BaseConnection.__init__(self, transport)
        Protocol12.__init__(self, transport, heartbeats, auto_content_length=True,
                            heart_beat_receive_scale=2.5)

    def connect(self, *args: Any, **kwargs: Any) -> None:
        self.transport.start()
        Protocol12.connect(self, *args, **kwargs)

    def disconnect(self, receipt: str | None = None, headers: Any = None, **kw: Any) -> None:
        Protocol12.disconnect(self, receipt, headers, **kw)
        self.transport.stop()

    @staticmethod
    def is_eol(c: bytes) -> bool:
        return c in (b"\x0a", b"\x0d\x0a")


class _Inbox(stomp.ConnectionListener):
    """The single listener: messages into a queue, receipts into a set, errors kept."""

    # Message bodies delivered but not yet taken by get(), in bytes. Past this the reader
    # thread waits for the consumer, so the rest of a prefetch window stays in the kernel's
    # socket buffer rather than in Python objects: a receiver holds a few chunks, not
    # prefetch x chunk size, and its peak memory no longer depends on how a run's timing
    # happened to bunch deliveries.
    HIGH_WATER = 2 * 2**20
    # The reader also delivers receipts and errors, so it never waits long, and not at all
    # while someone waits for a receipt.
    MAX_HOLD = 0.2

    def __init__(self) -> None:
        self.messages: queue.Queue[Frame | None] = queue.Queue()
        self.receipts: set[str] = set()
        self.errors: list[str] = []
        self.lost = False
        self.cond = threading.Condition()
        self.held = 0
        self.receipt_waiters = 0

    def _can_deliver(self) -> bool:
        return self.held <= self.HIGH_WATER or self.lost or self.receipt_waiters > 0

    def on_message(self, frame: Frame) -> None:
        with self.cond:
            if not self._can_deliver():
                self.cond.wait_for(self._can_deliver, timeout=self.MAX_HOLD)
            self.held += len(frame.body or b"")
        self.messages.put(frame)

    def taken(self, frame: Frame) -> None:
        """get() handed ``frame`` to the consumer."""
        with self.cond:
            self.held -= len(frame.body or b"")
            self.cond.notify_all()

    def on_receipt(self, frame: Frame) -> None:
        with self.cond:
            self.receipts.add(frame.headers.get("receipt-id", ""))
            self.cond.notify_all()

    def on_error(self, frame: Frame) -> None:
        body = frame.body.decode("utf-8", "replace") if isinstance(frame.body, bytes) else str(frame.body)
        msg = frame.headers.get("message", "")
        detail = body.strip().splitlines()[0][:300] if body.strip() else ""
        if detail and detail not in msg:
            msg = f"{msg}: {detail}" if msg else detail
        with self.cond:
            self.errors.append(msg)
            self.cond.notify_all()

    def on_disconnected(self) -> None:
        with self.cond:
            self.lost = True
            self.cond.notify_all()
        self.messages.put(None)

    def await_refusal(self, timeout: float) -> None:
        """Wait until the reader thread has reported an ERROR frame or the socket's end.

        stomp.py wakes a failed ``connect(wait=True)`` *before* it hands the ERROR frame to
        the listeners, so without this the caller races the reader thread and may explain
        a refused login as a silent broker.
        """
        with self.cond:
            self.cond.wait_for(lambda: self.errors or self.lost, timeout=timeout)

    def on_heartbeat_timeout(self) -> None:
        self.on_disconnected()


class StompLink:
    """One STOMP 1.2 session with the broker. Not thread-safe; one per sender/receiver.

    :param params: where and how to connect.
    :param client_id: a name the broker logs for this connection.
    """

    # How long a refused connect waits for the broker's reason (see _Inbox.await_refusal).
    REFUSAL_GRACE = 2.0

    def __init__(self, params: BrokerParams, *, client_id: str | None = None) -> None:
        self.params = params
        self.client_id = client_id
        self._conn: _Connection12 | None = None
        self._inbox = _Inbox()
        self._ids = itertools.count(1)
        # Frames that arrived for one subscription while the caller read another's. A
        # subscription we left is dropped: the broker redelivers what we did not ack.
        self._stash: dict[str, collections.deque[Frame]] = {}

    # -- life cycle --------------------------------------------------------------
    def open(self) -> StompLink:
        p = self.params
        self._inbox = _Inbox()
        self._stash = {}
        conn = _Connection12(list(p.hosts), (p.heartbeat_ms, p.heartbeat_ms), p.connect_timeout)
        if p.tls:
            for h in p.hosts:
                conn.set_ssl(for_hosts=[h], ca_certs=p.ca_file, cert_file=p.cert_file,
                             key_file=p.key_file, ssl_version=ssl.PROTOCOL_TLS_CLIENT)
        conn.set_listener("amqstream", self._inbox)
        # ActiveMQ refuses a second connection with a client-id already in use; the
        # suffix keeps threads of one process (and a fast reconnect) apart.
        headers = {"client-id": f"{self.client_id}-{os.urandom(3).hex()}"} if self.client_id else {}
        try:
            conn.connect(p.login, p.password, wait=True, headers=headers,
                         **({"host": p.vhost} if p.vhost else {}))
        except stomp_exc.ConnectFailedException as exc:
            self._inbox.await_refusal(timeout=self.REFUSAL_GRACE)
            _quiet_close(conn)
            raise TransportError(self._refusal_reason(exc)) from exc
        except (OSError, stomp_exc.StompException) as exc:
            _quiet_close(conn)
            raise TransportError(f"cannot connect to {p.url}: {exc or type(exc).__name__}") from exc
        if self._inbox.errors or not conn.is_connected():
            _quiet_close(conn)
            raise TransportError(self._refusal_reason(None))
        self._conn = conn
        return self

    def _refusal_reason(self, exc: BaseException | None) -> str:
        p = self.params
        errs = "; ".join(self._inbox.errors)
        if errs:
            low = errs.lower()
            if "password" in low or "user name" in low or "security" in low or "auth" in low:
                return (f"broker {p.url} refused login for user {p.login or '(none)'}: {errs.rstrip('. ')}. "
                        "Check the connection's login and password.")
            return f"broker {p.url} refused the connection: {errs}"
        reachable = any(_port_open(h, port) for h, port in p.hosts)
        if not reachable:
            return (f"cannot reach any broker at {p.url} (connection refused or timed out). "
                    "Is it running? `amqstream broker start` starts the embedded one.")
        if p.tls:
            return (f"TLS handshake with {p.url} failed: check that the port speaks TLS and "
                    "that ca_file trusts the broker certificate")
        return (f"broker {p.url} accepted TCP but did not complete the STOMP handshake within "
                f"{p.connect_timeout:.0f}s: is it a STOMP port (not OpenWire or TLS)?")

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            _quiet_close(conn)

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
        denied = [e for e in self._inbox.errors if "not authorized" in e.lower()]
        if denied:
            who = self.params.login or "(anonymous)"
            raise AccessDenied(
                f"broker {self.params.url} refused user {who}: {'; '.join(denied)}. Grant the user this "
                f"destination (embedded broker: `amqstream users add {who} --send DEST` or `--receive DEST`, "
                "then restart it; otherwise an authorizationEntry in the broker's activemq.xml)."
            )

    def _live(self) -> _Connection12:
        if self._conn is None:
            raise TransportError(f"not connected to {self.params.url}")
        self._check_refused()
        if self._inbox.lost:
            raise ConnectionLost(f"connection to {self.params.url} was lost")
        if self._inbox.errors:
            raise self._reported()
        return self._conn

    def _reported(self) -> TransportError:
        """The broker's ERROR frames as one exception (each refused message brings its own
        frame with the same text: it is said once)."""
        errors = list(dict.fromkeys(self._inbox.errors))
        full = next((e for e in errors if "ResourceAllocationException" in e), None)
        if full is not None:
            # ActiveMQ names it: "... to prevent flooding queue://NAME. See http://..."
            m = re.search(r"flooding (queue|topic)://(\S+?)\.?(\s|$)", full)
            where = f" to /{m.group(1)}/{m.group(2)}" if m else ""
            return DestinationFull(
                f"broker {self.params.url} refused messages{where} (ResourceAllocationException): the destination's "
                "memory limit stayed full through the broker's flow-control wait, so its receivers are not taking "
                "messages (stopped, or slower than the senders). Nothing confirmed was lost; resume the receivers, "
                "or raise the destination's memoryLimit on the broker.")
        return TransportError(f"broker {self.params.url} reported: {'; '.join(errors)}")

    # -- operations --------------------------------------------------------------
    def send(self, destination: str, body: bytes, headers: Mapping[str, str], *,
             receipt: bool = False, persistent: bool = True) -> str | None:
        """Send one message; return a receipt id to wait on if ``receipt``."""
        conn = self._live()
        h = dict(headers)
        h["persistent"] = "true" if persistent else "false"
        rid = None
        if receipt:
            rid = self._receipt_id()
            h["receipt"] = rid
        try:
            conn.send(destination, body, headers=h)
        except (OSError, stomp_exc.StompException) as exc:
            raise ConnectionLost(f"sending to {destination} on {self.params.url} failed: {exc}") from exc
        return rid

    def send_confirmed(self, destination: str, body: bytes, headers: Mapping[str, str]) -> None:
        """Send one persistent message and wait until the broker has stored it."""
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
                        raise self._reported()
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

    def subscribe(self, destination: str, *, ack: str = "client-individual", prefetch: int = 1,
                  selector: str | None = None, exclusive: bool = False, browser: bool = False) -> str:
        """Subscribe; with ``browser`` ActiveMQ shows the queue without consuming it and ends
        with a message whose ``browser`` header is ``end``."""
        conn = self._live()
        sub_id = f"s-{next(self._ids)}"
        headers = {"activemq.prefetchSize": str(prefetch)}
        if selector:
            headers["selector"] = selector
        if exclusive:
            headers["activemq.exclusive"] = "true"
        if browser:
            headers["browser"] = "true"
            ack = "auto"
        # Confirmed, so a refused subscription fails here, naming the destination, rather
        # than as a silent wait for messages that will never come.
        rid = self._receipt_id()
        headers["receipt"] = rid
        try:
            conn.subscribe(destination, id=sub_id, ack=ack, headers=headers)
        except (OSError, stomp_exc.StompException) as exc:
            raise ConnectionLost(f"subscribing to {destination} on {self.params.url} failed: {exc}") from exc
        self.wait_receipt(rid)
        self._stash[sub_id] = collections.deque()
        return sub_id

    def unsubscribe(self, sub_id: str) -> None:
        """Leave a subscription; the broker returns its unacknowledged messages to the
        destination (another consumer, or a later subscription, gets them)."""
        self._stash.pop(sub_id, None)
        try:
            self._live().unsubscribe(sub_id)
        except (OSError, stomp_exc.StompException) as exc:
            raise ConnectionLost(f"unsubscribing on {self.params.url} failed: {exc}") from exc

    def ack(self, frame: Frame) -> None:
        try:
            self._live().ack(frame.headers["ack"])
        except (OSError, stomp_exc.StompException) as exc:
            raise ConnectionLost(f"acknowledging on {self.params.url} failed: {exc}") from exc

    def nack(self, frame: Frame) -> None:
        try:
            self._live().nack(frame.headers["ack"])
        except (OSError, stomp_exc.StompException) as exc:
            raise ConnectionLost(f"rejecting a message on {self.params.url} failed: {exc}") from exc

    def get(self, timeout: float, subscription: str | None = None) -> Frame | None:
        """The next message (for ``subscription`` only, if given), or None after ``timeout``
        seconds with nothing."""
        if subscription is None:
            return self._next(timeout)
        return self.get_any(timeout, (subscription,))

    def get_any(self, timeout: float, subscriptions: tuple[str, ...]) -> Frame | None:
        """The next message for any of ``subscriptions`` (the first one's first), or None
        after ``timeout`` seconds; messages of other live subscriptions are kept for them."""
        for sub in subscriptions:
            stash = self._stash.get(sub)
            if stash:
                return stash.popleft()
        deadline = time.monotonic() + timeout
        while True:
            frame = self._next(max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            sub = frame.headers.get("subscription")
            if sub in subscriptions:
                return frame
            if sub in self._stash:
                self._stash[sub].append(frame)

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

    def round_trip(self, timeout: float = 10.0) -> None:
        """Prove the session works end to end: a receipt for a no-op frame."""
        conn = self._live()
        n = next(self._ids)
        # An empty transaction touches no destination and needs no permission.
        conn.send_frame("BEGIN", {"transaction": f"ping-{n}"})
        conn.send_frame("ABORT", {"transaction": f"ping-{n}", "receipt": f"ping-{n}"})
        self.wait_receipt(f"ping-{n}", timeout)


def _port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _quiet_close(conn: _Connection12) -> None:
    try:
        if conn.is_connected():
            conn.disconnect()
        else:
            conn.transport.stop()
    except Exception as exc:  # closing is best effort; report, never hide
        log.debug("closing STOMP connection: %s", exc)
