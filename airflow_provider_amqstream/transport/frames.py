"""A linear-time, bounded STOMP frame reader for stomp.py's transport: the parsing.

stomp.py 9.0 appends each socket read to an immutable buffer and rescans it from the
start whenever a read contains a NUL byte, so reading a binary frame costs the square of
its size (a 16 MiB body takes ~0.7 s). This reader parses a frame's header once, has a
large body read straight into a buffer of its content-length, and bounds everything a peer
controls: the header section (read past, not refused, when too large) and the body size.
Bytes in, frames out, no I/O: the socket side is
:class:`~airflow_provider_amqstream.transport.connection.FastTransport`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from stomp import exception as stomp_exc
from stomp.utils import HEARTBEAT_FRAME, Frame, parse_frame

log = logging.getLogger(__name__)


class FrameParser:
    """STOMP frames out of the bytes the transport appends to :attr:`buf`, taken by
    :meth:`extract`. Anything malformed, or a ``content-length`` over the cap, raises
    stomp.py's ``ConnectionClosedException``, which ends the connection."""

    _MAX_HEADER = 64 * 1024
    # The shipped broker refuses frames over 9 MiB (maxDataLength); an external one may
    # allow more, up to this.
    _MAX_BODY = 64 * 1024 * 1024

    # A header line longer than this is dropped whole (ActiveMQ accepts 10 KiB per header).
    _MAX_LINE = 16 * 1024

    def __init__(self) -> None:
        self.buf = bytearray()
        # Set while reading past a header section over _MAX_HEADER: the lines kept so far.
        self._cut: list[bytes] | None = None
        self._cut_size = 0
        self._dropped = 0
        self._in_long_line = False
        # A cut frame's head, already consumed from the buffer, waiting for its body.
        self._pending: Frame | None = None

    def _head(self, buf: bytearray) -> tuple[Frame, int] | None:
        """The frame's command and headers, and where its body starts in ``buf``; None if
        more bytes are needed. A header section over the cap is not a reason to drop the
        connection (the broker would hand us the same message again, for ever): it is read
        past line by line, keeping what fits, and the frame is marked ``amqs_truncated`` so
        the protocol refuses it like any malformed message."""
        if self._pending is not None:
            head, self._pending = self._pending, None
            return head, 0
        if self._cut is None:
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
            self._cut, self._cut_size, self._dropped = [], 0, 0
        return self._read_cut(buf, self._cut)

    def _read_cut(self, buf: bytearray, cut: list[bytes]) -> tuple[Frame, int] | None:
        """Read past an over-long header section line by line, keeping in ``cut`` the lines
        that fit; the frame's head once its blank line arrives, None until then."""
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                if len(buf) > self._MAX_LINE:  # the rest of an over-long line: drop as it comes
                    self._dropped += len(buf)
                    self._in_long_line = True
                    del buf[:]
                return None
            line = bytes(buf[:nl]).rstrip(b"\r")
            del buf[:nl + 1]
            if self._in_long_line:
                self._in_long_line = False
                self._dropped += len(line)
                continue
            if line:
                if len(line) > self._MAX_LINE or self._cut_size + len(line) > self._MAX_HEADER:
                    self._dropped += len(line)
                else:
                    cut.append(line)
                    self._cut_size += len(line) + 1
                continue
            self._cut = None
            head = parse_frame(b"\n".join(cut))
            if head is None:
                raise stomp_exc.ConnectionClosedException()
            head.headers["amqs_truncated"] = f"{self._dropped} bytes of headers dropped"
            log.warning("a %s frame's header section was over %d bytes; %d bytes of it were dropped",
                        head.cmd, self._MAX_HEADER, self._dropped)
            return head, 0

    # One loop over the buffer whose breaks are the parser's states (wait for bytes, body on
    # the wire, cut head kept): split up, each piece would return a state to switch on again.
    def extract(self, read_body: Callable[[Frame, bytearray, int], None] | None) -> list[Frame]:  # noqa: C901
        """Every complete frame in the buffer (bare EOLs become heart-beats).

        :param read_body: on a blocking socket, the transport's reader of a body larger than
            the buffer holds: given the frame, its body's bytes buffered so far and its size, it
            reads the rest straight from the socket into the frame, then the frame's NUL, and
            leaves the buffer with what follows. None on a non-blocking (TLS) socket: the frame
            waits in the buffer for more bytes.
        """
        buf = self.buf
        out: list[Frame] = []
        while buf:
            skip = 0
            while self._cut is None and self._pending is None and skip < len(buf) and buf[skip] in (10, 13):
                skip += 1
            if skip:
                del buf[:skip]
                out.append(HEARTBEAT_FRAME)
                continue
            found = self._head(buf)
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
                    if read_body is None:
                        if start == 0:  # a cut head is no longer in the buffer: keep it
                            self._pending = head
                        break  # TLS: the select loop calls again when more arrives
                    # Large body still on the wire: fetch it directly, then its NUL.
                    read_body(head, buf[start:], end - start)
                    out.append(head)
                    break
                if buf[end] != 0:
                    raise stomp_exc.ConnectionClosedException()
                head.body = bytes(buf[start:end])
            else:
                end = buf.find(b"\x00", start)
                if end < 0:
                    if start == 0:
                        self._pending = head
                    break
                head.body = bytes(buf[start:end])
            out.append(head)
            del buf[:end + 1]
        return out
