"""The stomp.py connection a session runs on: its socket, opening it, closing it.

:class:`FastTransport` is stomp.py's transport reading frames through
:class:`~airflow_provider_amqstream.transport.frames.FrameParser`, with our own TLS handshake;
:class:`Connection12` speaks STOMP 1.2 over it. :func:`open_connection` connects to the
first broker host that answers (TLS if asked) and, when the broker refuses, says why: a
refused login, nothing listening, a failed TLS handshake, or a port that does not speak STOMP.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import ssl
from typing import Any

from stomp import exception as stomp_exc
from stomp.connect import BaseConnection
from stomp.protocol import Protocol12
from stomp.transport import Transport
from stomp.utils import Frame, PollableQueue

from airflow_provider_amqstream.exceptions import TransportError
from airflow_provider_amqstream.transport.frames import FrameParser
from airflow_provider_amqstream.transport.inbox import Inbox
from airflow_provider_amqstream.transport.params import BrokerParams

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

    :param hosts: (host, port) pairs tried in order.
    :param timeout: seconds one host may take to accept the TCP connection and, with TLS,
        to complete the handshake.
    :param tls: speak TLS to every host with this context (see :func:`tls_context`); None for plain TCP.
    :param kwargs: passed to stomp.py's ``Transport``.
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
        self._amqs_hosts = list(hosts)
        self._amqs_timeout = timeout
        self._amqs_tls = tls
        self.tls_errors: list[str] = []
        if tls is not None:
            # Marks the hosts as TLS for stomp.py's disconnect_socket, which then closes the
            # session with a TLS close_notify; the handshake itself is ours (_amqs_connect_tls).
            self.set_ssl(for_hosts=self._amqs_hosts)

    def attempt_connection(self) -> None:
        if self._amqs_tls is None:
            super().attempt_connection()
        else:
            self._amqs_connect_tls(self._amqs_tls)
        # Small frames (an ACK, a SUBSCRIBE) must leave at once: with Nagle's algorithm an
        # ACK waited for the broker's delayed TCP acknowledgement (~40 ms), which was most
        # of the time a receiver spent per stream between one offer and the next.
        if self.socket is not None:
            try:
                self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                log.debug("cannot set TCP_NODELAY: %s", exc)

    def _amqs_connect_tls(self, context: ssl.SSLContext) -> None:
        """stomp.py's attempt_connection for TLS hosts, with ``context``.

        stomp.py 9.0 builds its own SSL context, whose host-name check can only be turned off
        together with certificate verification (``verify=False``); ``check_hostname=False``
        must keep the chain checked against ``ca_file``. The hosts are tried once each, in
        order, as stomp.py does with ``reconnect_attempts_max=1``; why each failed is kept in
        :attr:`tls_errors` for the error message.

        :param context: the client context (:func:`tls_context`).
        """
        self.connection_error = False
        self.tls_errors = []
        for host, port in self._amqs_hosts:
            if not self.running:
                break
            try:
                # The timeout covers the handshake too: a plaintext port may never answer it.
                sock = socket.create_connection((host, port), self._amqs_timeout)
            except OSError as exc:
                self.tls_errors.append(f"{host}:{port}: {exc}")
                continue
            try:
                tls_sock = context.wrap_socket(sock, server_hostname=host)
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
            self.sel.register(tls_sock, selectors.EVENT_READ)
            self.blocking = False
            tls_sock.setblocking(False)
            self.socket = tls_sock
            self.current_host_and_port = (host, port)
            return
        raise stomp_exc.ConnectFailedException()

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
    :param timeout: how long one host may take to accept the TCP connection (and to complete
        the TLS handshake), in seconds.
    :param tls: speak TLS to every host with this context; None for plain TCP.
    """

    def __init__(self, hosts: list[tuple[str, int]], heartbeats: tuple[int, int], timeout: float,
                 tls: ssl.SSLContext | None = None) -> None:
        transport = FastTransport(
            hosts, prefer_localhost=False, try_loopback_connect=False,
            reconnect_attempts_max=1, timeout=timeout, auto_decode=False,
            recv_bytes=1024 * 1024, tls=tls,
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


def tls_context(params: BrokerParams) -> ssl.SSLContext:
    """The client TLS context for ``params``: the broker's certificate chain is always
    verified (against ``ca_file``, else the system's CAs); its host name unless
    ``check_hostname`` is off. Raises :class:`TransportError` naming a file it cannot use.

    :param params: the connection settings (``ca_file``, ``cert_file``, ``key_file``, ``check_hostname``).
    """
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
    going to ``inbox``; raises :class:`TransportError` saying why none did.

    :param params: where and how to connect.
    :param inbox: the connection's listener.
    :param client_id: a name the broker logs for this connection.
    """
    p = params
    conn = Connection12(list(p.hosts), (p.heartbeat_ms, p.heartbeat_ms), p.connect_timeout,
                        tls=tls_context(p) if p.tls else None)
    conn.set_listener("amqstream", inbox)
    # ActiveMQ refuses a second connection with a client-id already in use; the
    # suffix keeps threads of one process (and a fast reconnect) apart.
    headers = {"client-id": f"{client_id}-{os.urandom(3).hex()}"} if client_id else {}
    try:
        conn.connect(p.login, p.password, wait=True, headers=headers,
                     **({"host": p.vhost} if p.vhost else {}))
    except stomp_exc.ConnectFailedException as exc:
        if not conn.transport.tls_errors:  # a failed handshake sent no STOMP reason to wait for
            inbox.await_refusal(timeout=REFUSAL_GRACE)
        quiet_close(conn)
        raise TransportError(refusal_reason(p, inbox.errors, conn.transport.tls_errors)) from exc
    except (OSError, stomp_exc.StompException) as exc:
        quiet_close(conn)
        raise TransportError(f"cannot connect to {p.url}: {exc or type(exc).__name__}") from exc
    if inbox.errors or not conn.is_connected():
        quiet_close(conn)
        raise TransportError(refusal_reason(p, inbox.errors))
    return conn


def refusal_reason(params: BrokerParams, errors: list[str], tls_errors: list[str] | None = None) -> str:
    """Why a connect failed: the broker's ERROR frames if it sent any, else what a probe of
    its ports tells.

    :param params: where we tried to connect.
    :param errors: the texts of the ERROR frames the broker sent.
    :param tls_errors: why each host's TCP connect or TLS handshake failed, if TLS was asked for.
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
        why = f" ({'; '.join(tls_errors)[:600]})" if tls_errors else ""
        names = (" and names the host connected to (or switch check_hostname off)" if p.check_hostname
                 else "")
        return (f"TLS handshake with {p.url} failed{why}: check that the port speaks TLS and "
                f"that ca_file trusts the broker certificate{names}")
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
