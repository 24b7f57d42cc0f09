"""Handshake mode, the sender's side: offer, wait for receivers, send paced by
their answers.

Receivers drive resumption: each reports the first chunk it lacks, so a restarted
receiver, a lost chunk and a restarted sender all become "send from chunk k". The
receiver's side (hello, ack, rereq, done) is a few lines in ``receive/stream.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

from airflow_provider_amqstream.engine.records import hash_prefix
from airflow_provider_amqstream.engine.send.outbound import ChunkReader, Outbound
from airflow_provider_amqstream.exceptions import ProtocolError, StreamError
from airflow_provider_amqstream.protocol.handshake import HandshakeSender
from airflow_provider_amqstream.transport.link import Link, open_link

log = logging.getLogger(__name__)


def send_handshake_attempt(out: Outbound, timeouts: tuple[float, float, float]) -> None:
    """One connected attempt, the bytes it sends added to ``out.sent`` and the rewinds receivers
    asked for to ``out.rerequests``. ``timeouts`` are the request timeout, the discovery window
    (topics) and the ack timeout, in seconds."""
    state = out.state
    if state.sha256 is None:
        # Rewinds make a running hash impossible; hash the file once up front instead.
        hasher = hashlib.sha256()
        with open(out.src, "rb") as fh:
            hash_prefix(fh, hasher, state.spec.size)
        state.sha256 = hasher.hexdigest()
        out.save()
    with open_link(out.params, client_id=f"amqs-send-{state.spec.stream_id}-{os.getpid()}") as link:
        attempt = _HandshakeAttempt(out, link)
        try:
            attempt.offer()
            attempt.gather(*timeouts[:2])
            attempt.pump(timeouts[2])
        finally:
            out.rerequests += attempt.hs.rewinds
    state.end_sent = True
    if out.progress:
        out.progress(state.spec.size, state.spec.size)


class _HandshakeAttempt:
    """One connection's worth of a handshake-mode send: offer, gather receivers, then send
    each of them what it still misses, paced by their acknowledgements."""

    def __init__(self, out: Outbound, link: Link) -> None:
        self.out, self.link = out, link
        self.spec, self.sid = out.state.spec, out.state.spec.stream_id
        self.control_q = out.dest.control_queue(self.sid)
        self.hs = HandshakeSender(self.spec, out.window, point_to_point=out.dest.kind == "queue")

    def offer(self) -> None:
        """Listen on the control queue, then offer (again, on a topic)."""
        out, link = self.out, self.link
        link.subscribe(self.control_q, ack="auto", prefetch=64)
        if not out.state.offer_sent:
            # Nobody can answer an offer that does not exist yet: whatever waits on the
            # control queue now was written by someone guessing the stream id.
            forged = 0
            until = time.monotonic() + 1.0  # bounded: an impostor may keep writing
            while time.monotonic() < until and link.get(0.2) is not None:
                forged += 1
            if forged:
                log.warning("stream %s: discarded %d control messages sent to %s before the offer existed",
                            self.sid, forged, self.control_q)
        # A topic keeps no offer for subscribers that come later: offer on every attempt.
        if out.dest.kind == "topic" or not out.state.offer_sent:
            link.send_confirmed(str(out.dest), b"", out.offer(out.window, subdir=""))
            out.state.offer_sent = True
            out.save()

    def hear(self, frame: Any) -> bool:
        """Take a control message (None: none came); a malformed or foreign one is logged and
        ignored, so nobody but our receivers can stop, rewind or finish this sender."""
        if frame is None:
            return False
        try:
            return self.hs.on_control(frame.headers, now=time.monotonic()) is not None
        except ProtocolError as exc:
            log.warning("stream %s: ignored a control message on %s: %s", self.sid, self.control_q, exc)
            return False

    def gather(self, request_timeout: float, discovery_window: float) -> None:
        """Wait for the first receiver; on a topic, keep listening for others a while."""
        deadline = time.monotonic() + request_timeout
        while not self.hs.positions:
            frame = self.link.get(max(0.05, deadline - time.monotonic()))
            self.hear(frame)
            if frame is None and time.monotonic() >= deadline:
                raise StreamError(
                    f"stream {self.sid}: no receiver answered the offer on {self.out.dest} within "
                    f"{request_timeout:.0f}s. The offer stays queued; re-run the sender once a receiver is running.")
        if self.out.dest.kind == "topic":
            until = time.monotonic() + discovery_window
            while (left := until - time.monotonic()) > 0:
                self.hear(self.link.get(left))

    def pump(self, ack_timeout: float) -> None:
        """Send chunks and the end marker until every receiver is done."""
        hs, link, spec = self.hs, self.link, self.spec
        with open(self.out.src, "rb") as fh:
            reader = ChunkReader(fh, spec, self.out.codec, seal=self.out.seal)
            heard = time.monotonic()
            while not hs.all_done:
                while (frame := link.get(0)) is not None:
                    if self.hear(frame):
                        heard = time.monotonic()
                if self._send_next(reader):
                    continue
                if self.hear(link.get(1.0)):
                    heard = time.monotonic()
                    if self.out.progress:
                        self.out.progress(spec.offset_of(hs.slowest), spec.size)
                elif time.monotonic() - heard > ack_timeout:
                    lagging = sorted(c for c in hs.positions if c not in hs.finished)
                    raise StreamError(
                        f"stream {self.sid}: receiver(s) {', '.join(lagging)} stopped answering at chunk "
                        f"{hs.slowest} of {spec.chunks} for {ack_timeout:.0f}s; re-run the sender to continue "
                        "when they return")

    def _send_next(self, reader: ChunkReader) -> bool:
        """Send the next chunk or the end marker a receiver needs; False if none is due."""
        data_q = self.out.dest.data_queue(self.sid, self.out.params.user)
        try:
            seq = self.hs.next_chunk()
        except ProtocolError as exc:
            raise StreamError(f"{exc}; a receiver of {self.out.dest} keeps rewinding (see its log)") from None
        if seq is not None:
            chunk = reader.at(seq)
            self.link.send(data_q, chunk.wire, chunk.headers)
            self.out.sent += chunk.length
            return True
        if self.hs.take_end():
            self.link.send(data_q, b"", self.out.end())
            return True
        return False
