"""The stomp.py connection a session runs on: its socket, opening it, closing it.

:class:`FastTransport` is stomp.py's transport reading frames through
:class:`~airflow_provider_amqstream.transport.frames.FrameParser`, with our own TLS handshake;
:class:`Connection12` speaks STOMP 1.2 over it. :func:`open_connection` connects to the
first broker host that answers (TLS if asked) and, when the broker refuses, says why: a
refused login, nothing listening, a failed TLS handshake, or a port that does not speak STOMP.
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import socket
import ssl
import sys
import time
from typing import Any

from stomp import exception as stomp_exc
from stomp.connect import BaseConnection
from stomp.protocol import Protocol12
from stomp.transport import Transport
from stomp.utils import Frame, PollableQueue, convert_frame, pack

from airflow_provider_amqstream.exceptions import BrokerUnreachable, TransportError
from airflow_provider_amqstream.transport.frames import FrameParser
from airflow_provider_amqstream.transport.inbox import Inbox
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)


def _not_lost_connection_noise(record: logging.LogRecord) -> bool:
    """Drops stomp.py's ``error sending frame`` record: it comes with a traceback (``OSError:
    [Errno 9] Bad file descriptor`` when the broker went away) and was the first line a user
    saw of a lost connection, while the session raises :class:`ConnectionLost` for the same
    failure and the engine reports it (what was lost, and that it reconnects)."""
    return record.msg != "error sending frame"


# stomp.py logs every connect at INFO ("established connection to host ..."); in task logs
# that is noise. Quieted unless someone configured the logger on purpose.
_stomp_log = logging.getLogger("stomp.py")
if _stomp_log.level == logging.NOTSET:
    _stomp_log.setLevel(logging.WARNING)
if _not_lost_connection_noise not in _stomp_log.filters:
    _stomp_log.addFilter(_not_lost_connection_noise)


class FastTransport(Transport):
    """stomp.py's transport with a linear-time frame reader (why: transport/frames.py); on a
    blocking socket a body is read with ``recv_into`` straight into a buffer of its size.

    :param hosts: (host, port) pairs tried in order.
    :param timeout: seconds one host may take to accept the TCP connection and, with TLS,
        to complete the handshake.
    :param tls: speak TLS to every host with this context (see :func:`tls_context`); None for plain TCP.
    """

    # Headers and small frames are read through this fixed buffer. A large recv size here
    # made every read allocate (and shrink) a megabyte, and those odd-sized leftovers
    # fragmented the heap: a receiver's peak RSS crept up with file size.
    _SCRATCH = 64 * 1024

    def __init__(self, hosts: list[tuple[str, int]], *, timeout: float | None = None,
                 tls: ssl.SSLContext | None = None, **kwargs: Any) -> None:
        super().__init__(hosts, timeout=timeout, **kwargs)
        self._amqs_frames = FrameParser()
        self._amqs_scratch = bytearray(self._SCRATCH)
        self._amqs_bodies: collections.deque[bytearray] = collections.deque(maxlen=self._SPARE_BODIES)
        self._amqs_hosts = list(hosts)
        self._amqs_timeout = timeout
        self._amqs_tls = tls
        self.tcp_errors: list[str] = []
        self.tls_errors: list[str] = []
        if tls is not None:
            # Marks the hosts as TLS for stomp.py's disconnect_socket, which then closes the
            # session with a TLS close_notify; the handshake itself is ours (attempt_connection).
            self.set_ssl(for_hosts=self._amqs_hosts)

    def attempt_connection(self) -> None:
        """stomp.py's attempt_connection, keeping why each host failed.

        stomp.py 9.0 builds its own SSL context, whose host-name check can only be turned off
        together with certificate verification (``verify=False``); ``check_hostname=False``
        must keep the chain checked against ``ca_file``. And its own loop only logs why a
        host refused, then sleeps before it gives up: the caller must know whether any host
        accepted TCP at all (nothing did: no broker is up yet, worth waiting for). The hosts
        are tried once each, in order, as stomp.py does with ``reconnect_attempts_max=1``;
        the reasons are kept in :attr:`tcp_errors` and :attr:`tls_errors`.
        """
        self.connection_error = False
        self.tcp_errors, self.tls_errors = [], []
        for host, port in self._amqs_hosts:
            if not self.running:
                break
            try:
                # The timeout covers the handshake too: a plaintext port may never answer it.
                sock = socket.create_connection((host, port), self._amqs_timeout)
            except OSError as exc:
                self.tcp_errors.append(f"{host}:{port}: {_reason(exc)}")
                continue
            # Small frames (an ACK, a SUBSCRIBE) must leave at once: with Nagle's algorithm an
            # ACK waited for the broker's delayed TCP acknowledgement (~40 ms), which was most
            # of the time a receiver spent per stream between one offer and the next.
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                log.debug("cannot set TCP_NODELAY: %s", exc)
            if self._amqs_tls is None:
                # As stomp.py leaves a plain socket: blocking, without a timeout.
                sock.settimeout(None)
            else:
                try:
                    sock = self._amqs_tls.wrap_socket(sock, server_hostname=host)
                except OSError as exc:  # ssl.SSLError and timeouts alike
                    sock.close()
                    self.tls_errors.append(f"{host}:{port}: {exc}")
                    log.debug("TLS handshake with %s:%s failed: %s", host, port, exc)  # the error says it
                    continue
                # What stomp.py does after its own handshake: a TLS socket is read and written
                # non-blocking, through a selector shared with the send queue.
                self.send_queue = PollableQueue()
                self.sel = selectors.DefaultSelector()
                self.sel.register(self.send_queue, selectors.EVENT_READ)
                self.sel.register(sock, selectors.EVENT_READ)
                self.blocking = False
                sock.setblocking(False)
            self.socket = sock
            self.current_host_and_port = (host, port)
            return
        raise stomp_exc.ConnectFailedException()

    def transmit(self, frame: Frame) -> None:
        """Send ``frame``; on a blocking socket, its body straight from the caller's buffer.

        stomp.py joins the header lines and the body into one new ``bytes`` before writing
        it: a copy of every chunk, ~0.1 CPU-s per GiB and a 1 MiB allocation per frame. Here
        the header bytes, the body and the NUL go out together with ``sendmsg``. A TLS
        socket is non-blocking and written by stomp.py's own loop: it keeps stomp.py's path.
        """
        body = frame.body
        if not self.blocking or not body or isinstance(body, str):
            super().transmit(frame)
            return
        # What stomp.py's transmit does first: the listeners' bookkeeping (the heart-beat clock).
        with self._BaseTransport__listeners_change_condition:
            listeners = sorted(self.listeners.items())
        for _, listener in listeners:
            listener.on_send(frame)
        frame.headers["content-length"] = len(body)
        head = pack(convert_frame(Frame(frame.cmd, frame.headers, None))[:-1])
        if self.socket is None:
            raise stomp_exc.NotConnectedException()
        parts = [memoryview(head), memoryview(body).cast("B"), memoryview(b"\x00")]
        # The heart-beat thread writes too: one writer at a time, as stomp.py's send.
        with self._Transport__socket_semaphore:
            while parts:
                sent = self.socket.sendmsg(parts)
                while parts and sent >= len(parts[0]):
                    sent -= len(parts.pop(0))
                if sent:
                    parts[0] = parts[0][sent:]

    def _BaseTransport__read_frames(self) -> None:  # noqa: N802 - overrides a mangled name
        for frame in self._amqs_read():
            self.process_frame(frame, b"")  # the raw text is only used in log lines

    def _amqs_read(self) -> list[Frame]:
        while self.running:
            frames = self._amqs_frames.extract(self._amqs_body if self.blocking else None)
            if frames:
                return frames
            if not self._amqs_fill():
                return []
        return []

    def _amqs_fill(self) -> bool:
        """Append one socket read to the buffer; False if a non-blocking read had nothing."""
        try:
            if self.blocking:
                n = self.socket.recv_into(self._amqs_scratch)
                data: bytes | memoryview = memoryview(self._amqs_scratch)[:n]
            else:
                data = self.receive() or b""
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return False
        except stomp_exc.InterruptedException:
            return True
        except OSError:
            data = b""
        if not data:
            if not self.blocking:
                return False
            raise stomp_exc.ConnectionClosedException()
        self._amqs_frames.buf += data
        return True

    def _amqs_body(self, head: Frame, buffered: bytearray, size: int) -> None:
        """Read the rest of a large body straight from the socket into its own buffer, then
        the frame's NUL (see :meth:`FrameParser.extract`)."""
        body = self._amqs_buffer(size)
        have = len(buffered)
        body[:have] = buffered
        view = memoryview(body)
        while have < size:
            try:
                n = self.socket.recv_into(view[have:])
            except OSError:
                n = 0
            if not n:
                raise stomp_exc.ConnectionClosedException()
            have += n
        head.body = body
        buf = self._amqs_frames.buf
        del buf[:]
        while not buf:
            if not self._amqs_fill():
                raise stomp_exc.ConnectionClosedException()
        if buf[0] != 0:
            raise stomp_exc.ConnectionClosedException()
        del buf[:1]

    # Body buffers kept for reuse: a receiver holds a few chunks at a time (Inbox.HIGH_WATER).
    _SPARE_BODIES = 4

    def _amqs_buffer(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes for a body that recv_into fills whole: one of ours that
        nobody else holds any more (the engine drops a chunk once it is written), else new.
        A new bytearray is zeroed first: ~4 % of a receiver's CPU for 1 MiB chunks."""
        for buf in self._amqs_bodies:
            # Our deque's reference and getrefcount's argument: no frame, view or queue has it.
            if len(buf) == size and sys.getrefcount(buf) == 3:
                return buf
        buf = bytearray(size)
        self._amqs_bodies.append(buf)  # past _SPARE_BODIES, the oldest is let go
        return buf


class Connection12(BaseConnection, Protocol12):
    """StompConnection12 built on :class:`FastTransport` to ``params``' hosts (TLS if it asks)."""

    def __init__(self, params: BrokerParams) -> None:
        transport = FastTransport(
            list(params.hosts), prefer_localhost=False, try_loopback_connect=False,
            reconnect_attempts_max=1, timeout=params.connect_timeout, auto_decode=False,
            recv_bytes=1024 * 1024, tls=tls_context(params) if params.tls else None,
        )
        BaseConnection.__init__(self, transport)
        Protocol12.__init__(self, transport, (params.heartbeat_ms, params.heartbeat_ms), auto_content_length=True,
                            heart_beat_receive_scale=2.5)

    def connect(self, *args: Any, **kwargs: Any) -> None:
        self.transport.start()
        Protocol12.connect(self, *args, **kwargs)

    def disconnect(self, receipt: str | None = None, headers: Any = None, **kw: Any) -> None:
        Protocol12.disconnect(self, receipt, headers, **kw)
        self.transport.stop()


def tls_context(params: BrokerParams) -> ssl.SSLContext:
    """The client TLS context for ``params``: the broker's certificate chain is always
    verified (against ``ca_file``, else the system's CAs); its host name unless
    ``check_hostname`` is off. Raises :class:`TransportError` naming a file it cannot use."""
    p = params
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname on
    try:
        if p.ca_file:
            context.load_verify_locations(p.ca_file)
        else:
            context.load_default_certs()
    except (OSError, ValueError) as exc:
        raise TransportError(f"TLS for {p.url}: cannot use ca_file {p.ca_file}: {_reason(exc)}") from exc
    if p.cert_file:
        try:
            context.load_cert_chain(p.cert_file, p.key_file or None)
        except (OSError, ValueError) as exc:
            raise TransportError(f"TLS for {p.url}: cannot use cert_file {p.cert_file} / key_file "
                                 f"{p.key_file or '(in cert_file)'}: {_reason(exc)}") from exc
    elif p.key_file:
        raise TransportError(f"TLS for {p.url}: key_file is set without cert_file")
    # Off: any certificate the CA signed is accepted whatever name it bears (verify_mode stays
    # CERT_REQUIRED). Python refuses the reverse order, CERT_NONE with the check on.
    context.check_hostname = p.check_hostname
    return context


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or getattr(exc, "reason", None) or str(exc) or type(exc).__name__


def open_connection(params: BrokerParams, inbox: Inbox, client_id: str | None) -> Connection12:
    """A STOMP 1.2 connection to the first of ``params.hosts`` that accepts us, its frames
    going to ``inbox``; raises :class:`TransportError` saying why none did
    (:class:`BrokerUnreachable` when no broker answered at all); ``client_id`` is the name the
    broker logs."""
    p = params
    conn = Connection12(p)
    conn.set_listener("amqstream", inbox)
    # ActiveMQ refuses a second connection with a client-id already in use; the
    # suffix keeps threads of one process (and a fast reconnect) apart.
    headers = {"client-id": f"{client_id}-{os.urandom(3).hex()}"} if client_id else {}
    started = time.monotonic()
    try:
        # Not stomp.py's wait=True: it waits for CONNECTED without any bound, so a port that
        # accepts TCP and never answers (not STOMP, or a broker stuck starting) hung us for ever.
        conn.connect(p.login, p.password, wait=False, headers=headers,
                     **({"host": p.vhost} if p.vhost else {}))
    except stomp_exc.ConnectFailedException as exc:
        quiet_close(conn)
        transport = conn.transport
        if transport.socket is None and len(transport.tcp_errors) == len(p.hosts):  # no host accepted TCP
            raise BrokerUnreachable(
                f"cannot reach any broker at {p.url} ({'; '.join(transport.tcp_errors)[:400]}). Is it running? "
                "`amqstream broker start` starts the embedded one.") from exc
        raise TransportError(refusal_reason(p, inbox.errors, transport.tls_errors)) from exc
    except (OSError, stomp_exc.StompException) as exc:
        quiet_close(conn)
        raise TransportError(f"cannot connect to {p.url}: {exc or type(exc).__name__}") from exc
    answered = inbox.await_connected(timeout=p.connect_timeout)
    if answered and not inbox.errors and not inbox.lost and conn.is_connected():
        return conn
    quiet_close(conn)
    elapsed = time.monotonic() - started
    if inbox.errors or not answered:
        raise TransportError(refusal_reason(p, inbox.errors, elapsed=elapsed))
    # Closed without a word: a plaintext client on a TLS port (or another protocol's). Not
    # waited for as a broker that is starting: ActiveMQ refuses connections until it serves.
    raise TransportError(
        f"broker {p.url} accepted TCP and closed the connection {elapsed:.1f}s later: it did not complete the "
        "STOMP handshake. Is it a STOMP port (not OpenWire or TLS)?")


def refusal_reason(params: BrokerParams, errors: list[str], tls_errors: list[str] | None = None, *,
                   elapsed: float | None = None) -> str:
    """Why a broker that accepted TCP did not take us: its ERROR frames if it sent any, else
    a TLS handshake that failed, else a STOMP handshake that never completed (waited
    ``elapsed`` seconds, default the connect timeout)."""
    p = params
    errs = "; ".join(errors)
    if errs:
        low = errs.lower()
        if "password" in low or "user name" in low or "security" in low or "auth" in low:
            return (f"broker {p.url} refused login for user {p.login or '(none)'}: {errs.rstrip('. ')}. "
                    "Check the connection's login and password.")
        return f"broker {p.url} refused the connection: {errs}"
    if p.tls and tls_errors:
        names = (" and names the host connected to (or switch check_hostname off)" if p.check_hostname
                 else "")
        return (f"TLS handshake with {p.url} failed ({'; '.join(tls_errors)[:600]}): check that the port "
                f"speaks TLS and that ca_file trusts the broker certificate{names}")
    waited = p.connect_timeout if elapsed is None else elapsed
    return (f"broker {p.url} accepted TCP but did not complete the STOMP handshake within {waited:.0f}s: "
            "is it a STOMP port (not OpenWire or TLS)? connect_timeout sets how long to wait.")


def quiet_close(conn: Connection12) -> None:
    """Close ``conn`` as far as it goes; a failure is logged (at debug), not raised."""
    try:
        if conn.is_connected():
            conn.disconnect()
        else:
            conn.transport.stop()
    except Exception as exc:  # closing is best effort; report, never hide
        log.debug("closing STOMP connection: %s", exc)
