"""The stomp.py connection a session runs on: its socket, opening it, closing it.

:class:`FastTransport` is stomp.py's transport reading frames through
:class:`~airflow_provider_amqstream.frames.FrameParser`; :class:`Connection12` speaks STOMP
1.2 over it. :func:`open_connection` connects to the first broker host that answers (TLS
if asked) and, when the broker refuses, says why: a refused login, nothing listening, a
failed TLS handshake, or a port that does not speak STOMP.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from typing import Any

from stomp import exception as stomp_exc
from stomp.connect import BaseConnection
from stomp.protocol import Protocol12
from stomp.transport import Transport
from stomp.utils import Frame

from airflow_provider_amqstream.broker_params import BrokerParams
from airflow_provider_amqstream.frames import FrameParser
from airflow_provider_amqstream.inbox import Inbox
from airflow_provider_amqstream.transport_errors import TransportError

log = logging.getLogger(__name__)
# stomp.py logs every connect at INFO ("established connection to host ..."); in task logs
# that is noise. Quieted unless someone configured the logger on purpose.
if logging.getLogger("stomp.py").level == logging.NOTSET:
    logging.getLogger("stomp.py").setLevel(logging.WARNING)

# How long a refused connect waits for the broker's reason (see Inbox.await_refusal).
REFUSAL_GRACE = 2.0


class FastTransport(Transport):
    """stomp.py's transport with a linear-time frame reader.

    stomp.py 9.0 appends each socket read to an immutable buffer and rescans it from
    the start whenever a read contains a NUL byte, so reading a binary frame costs the
    square of its size (a 16 MiB body takes ~0.7 s). Here a frame's header is parsed
    once, and on a blocking socket its body is read with ``recv_into`` straight into a
    buffer of its content-length: one copy, no rescans.
    """

    # Headers and small frames are read through this fixed buffer. A large recv size here
    # made every read allocate (and shrink) a megabyte, and those odd-sized leftovers
    # fragmented the heap: a receiver's peak RSS crept up with file size.
    _SCRATCH = 64 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._amqs_frames = FrameParser()
        self._amqs_scratch = bytearray(self._SCRATCH)

    def attempt_connection(self) -> None:
        super().attempt_connection()
        # Small frames (an ACK, a SUBSCRIBE) must leave at once: with Nagle's algorithm an
        # ACK waited for the broker's delayed TCP acknowledgement (~40 ms), which was most
        # of the time a receiver spent per stream between one offer and the next.
        if self.socket is not None:
            try:
                self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                log.debug("cannot set TCP_NODELAY: %s", exc)

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
        body = bytearray(size)
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


class Connection12(BaseConnection, Protocol12):
    """StompConnection12 built on :class:`FastTransport`.

    :param hosts: (host, port) pairs tried in order.
    :param heartbeats: the STOMP heart-beat intervals offered and wanted, in milliseconds.
    :param timeout: how long one host may take to accept the TCP connection, in seconds.
    """

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


def open_connection(params: BrokerParams, inbox: Inbox, client_id: str | None) -> Connection12:
    """A STOMP 1.2 connection to the first of ``params.hosts`` that accepts us, its frames
    going to ``inbox``; raises :class:`TransportError` saying why none did.

    :param params: where and how to connect.
    :param inbox: the connection's listener.
    :param client_id: a name the broker logs for this connection.
    """
    p = params
    conn = Connection12(list(p.hosts), (p.heartbeat_ms, p.heartbeat_ms), p.connect_timeout)
    if p.tls:
        for h in p.hosts:
            conn.set_ssl(for_hosts=[h], ca_certs=p.ca_file, cert_file=p.cert_file,
                         key_file=p.key_file, ssl_version=ssl.PROTOCOL_TLS_CLIENT)
    conn.set_listener("amqstream", inbox)
    # ActiveMQ refuses a second connection with a client-id already in use; the
    # suffix keeps threads of one process (and a fast reconnect) apart.
    headers = {"client-id": f"{client_id}-{os.urandom(3).hex()}"} if client_id else {}
    try:
        conn.connect(p.login, p.password, wait=True, headers=headers,
                     **({"host": p.vhost} if p.vhost else {}))
    except stomp_exc.ConnectFailedException as exc:
        inbox.await_refusal(timeout=REFUSAL_GRACE)
        quiet_close(conn)
        raise TransportError(refusal_reason(p, inbox.errors)) from exc
    except (OSError, stomp_exc.StompException) as exc:
        quiet_close(conn)
        raise TransportError(f"cannot connect to {p.url}: {exc or type(exc).__name__}") from exc
    if inbox.errors or not conn.is_connected():
        quiet_close(conn)
        raise TransportError(refusal_reason(p, inbox.errors))
    return conn


def refusal_reason(params: BrokerParams, errors: list[str]) -> str:
    """Why a connect failed: the broker's ERROR frames if it sent any, else what a probe of
    its ports tells.

    :param params: where we tried to connect.
    :param errors: the texts of the ERROR frames the broker sent.
    """
    p = params
    errs = "; ".join(errors)
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


def _port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def quiet_close(conn: Connection12) -> None:
    """Close ``conn`` as far as it goes; a failure is logged (at debug), not raised.

    :param conn: the connection.
    """
    try:
        if conn.is_connected():
            conn.disconnect()
        else:
            conn.transport.stop()
    except Exception as exc:  # closing is best effort; report, never hide
        log.debug("closing STOMP connection: %s", exc)
