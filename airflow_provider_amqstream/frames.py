"""A linear-time, bounded STOMP frame reader for stomp.py's transport.

stomp.py 9.0 appends each socket read to an immutable buffer and rescans it from the
start whenever a read contains a NUL byte, so reading a binary frame costs the square of
its size (a 16 MiB body takes ~0.7 s). This reader parses a frame's header once, reads a
large body straight into a buffer of its content-length, and bounds everything a peer
controls: the header section (read past, not refused, when too large) and the body size.
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Any

from stomp import exception as stomp_exc
from stomp.transport import Transport
from stomp.utils import HEARTBEAT_FRAME, Frame, parse_frame

log = logging.getLogger(__name__)


class FastTransport(Transport):
    """stomp.py's transport with a linear-time frame reader.

    stomp.py 9.0 appends each socket read to an immutable buffer and rescans it from
    the start whenever a read contains a NUL byte, so reading a binary frame costs the
    square of its size (a 16 MiB body takes ~0.7 s). Here a frame's header is parsed
    once, and on a blocking socket its body is read with ``recv_into`` straight into a
    buffer of its content-length: one copy, no rescans.
    """

    _MAX_HEADER = 64 * 1024
    # The broker refuses frames over 64 MiB (maxDataLength); allow headroom, no more.
    _MAX_BODY = 80 * 1024 * 1024

    # Headers and small frames are read through this fixed buffer. A large recv size here
    # made every read allocate (and shrink) a megabyte, and those odd-sized leftovers
    # fragmented the heap: a receiver's peak RSS crept up with file size.
    _SCRATCH = 64 * 1024

    # A header line longer than this is dropped whole (ActiveMQ accepts 10 KiB per header).
    _MAX_LINE = 16 * 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._amqs_buf = bytearray()
        self._amqs_scratch = bytearray(self._SCRATCH)
        # Set while reading past a header section over _MAX_HEADER: the lines kept so far.
        self._amqs_cut: list[bytes] | None = None
        self._amqs_cut_size = 0
        self._amqs_dropped = 0
        self._amqs_in_long_line = False
        # A cut frame's head, already consumed from the buffer, waiting for its body.
        self._amqs_pending: Frame | None = None

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
            frames = self._amqs_extract()
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
        self._amqs_buf += data
        return True

    def _amqs_body(self, head: Frame, buffered: bytearray, size: int) -> None:
        """Read the rest of a large body straight from the socket into its own buffer."""
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

    def _amqs_head(self, buf: bytearray) -> tuple[Frame, int] | None:
        """The frame's command and headers, and where its body starts in ``buf``; None if
        more bytes are needed. A header section over the cap is not a reason to drop the
        connection (the broker would hand us the same message again, for ever): it is read
        past line by line, keeping what fits, and the frame is marked ``amqs_truncated`` so
        the protocol refuses it like any malformed message."""
        if self._amqs_pending is not None:
            head, self._amqs_pending = self._amqs_pending, None
            return head, 0
        if self._amqs_cut is None:
            head_end, sep = buf.find(b"\n\n", 0, self._MAX_HEADER), 2
            crlf = buf.find(b"\r\n\r\n", 0, self._MAX_HEADER)
            if crlf >= 0 and (head_end < 0 or crlf < head_end):
                head_end, sep = crlf, 4
            if head_end >= 0:
                head = parse_frame(bytes(buf[:head_end]))
                if head is None:
                    raise stomp_exc.ConnectionClosedException()
                return head, head_end + sep
            if len(buf) < self._MAX_HEADER:
                return None
            self._amqs_cut, self._amqs_cut_size, self._amqs_dropped = [], 0, 0
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > self._MAX_LINE:  # the rest of an over-long line: drop as it comes
                    self._amqs_dropped += len(buf)
                    self._amqs_in_long_line = True
                    del buf[:]
                return None
            line = bytes(buf[:nl]).rstrip(b"\r")
            del buf[:nl + 1]
            if self._amqs_in_long_line:
                self._amqs_in_long_line = False
                self._amqs_dropped += len(line)
                continue
            if line:
                if len(line) > self._MAX_LINE or self._amqs_cut_size + len(line) > self._MAX_HEADER:
                    self._amqs_dropped += len(line)
                else:
                    self._amqs_cut.append(line)
                    self._amqs_cut_size += len(line) + 1
                continue
            kept, self._amqs_cut = self._amqs_cut, None
            head = parse_frame(b"\n".join(kept))
            if head is None:
                raise stomp_exc.ConnectionClosedException()
            head.headers["amqs_truncated"] = f"{self._amqs_dropped} bytes of headers dropped"
            log.warning("a %s frame's header section was over %d bytes; %d bytes of it were dropped",
                        head.cmd, self._MAX_HEADER, self._amqs_dropped)
            return head, 0

    def _amqs_extract(self) -> list[Frame]:
        """Every complete frame in the buffer (bare EOLs become heart-beats)."""
        buf = self._amqs_buf
        out: list[Frame] = []
        while buf:
            skip = 0
            while self._amqs_cut is None and self._amqs_pending is None and skip < len(buf) and buf[skip] in (10, 13):
                skip += 1
            if skip:
                del buf[:skip]
                out.append(HEARTBEAT_FRAME)
                continue
            found = self._amqs_head(buf)
            if found is None:
                break
            head, start = found
            length = head.headers.get("content-length")
            if length is not None:
                # isdigit() alone takes "²", which int() then refuses: ASCII digits only.
                if not (length.isascii() and length.isdigit()) or int(length) > self._MAX_BODY:
                    raise stomp_exc.ConnectionClosedException()  # never allocate what a peer claims
                end = start + int(length)
                if len(buf) <= end:
                    if not self.blocking:
                        if start == 0:  # a cut head is no longer in the buffer: keep it
                            self._amqs_pending = head
                        break  # TLS: the select loop calls again when more arrives
                    # Large body still on the wire: fetch it directly, then its NUL.
                    self._amqs_body(head, buf[start:], end - start)
                    del buf[:]
                    while not buf:
                        if not self._amqs_fill():
                            raise stomp_exc.ConnectionClosedException()
                    if buf[0] != 0:
                        raise stomp_exc.ConnectionClosedException()
                    del buf[:1]
                    out.append(head)
                    break
                if buf[end] != 0:
                    raise stomp_exc.ConnectionClosedException()
                head.body = bytes(buf[start:end])
            else:
                end = buf.find(b"\x00", start)
                if end < 0:
                    if start == 0:
                        self._amqs_pending = head
                    break
                head.body = bytes(buf[start:end])
            out.append(head)
            del buf[:end + 1]
        return out
