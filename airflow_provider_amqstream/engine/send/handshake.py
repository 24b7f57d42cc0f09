"""Handshake mode, the sender's side (seed 004): offer, wait for receivers, send paced by
their answers.

Receivers drive resumption: each reports the first chunk it lacks, so a restarted
receiver, a lost chunk and a restarted sender all become "send from chunk k". The
receiver's side (hello, ack, rereq, done) is a few lines in ``stream_receiver.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.records import hash_prefix
from airflow_provider_amqstream.exceptions import StreamError
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.handshake import HandshakeSender
from airflow_provider_amqstream.protocol.state import SenderState
from airflow_provider_amqstream.transport.link import open_link
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


def send_handshake_attempt(params: BrokerParams, src: Path, dest: p.Destination, state: SenderState,
                           save: Callable[..., None], window: int, progress: Progress | None,
                           timeouts: tuple[float, float, float], rerequests: list[int],
                           codec: p.ChunkCodec, origin: str) -> int:
    """One connected attempt; returns the bytes it sent. ``timeouts`` are the request
    timeout, the discovery window (topics) and the ack timeout, in seconds."""
    request_timeout, discovery_window, ack_timeout = timeouts
    spec, sid = state.spec, state.spec.stream_id
    if state.sha256 is None:
        # Rewinds make a running hash impossible; hash the file once up front instead.
        hasher = hashlib.sha256()
        with open(src, "rb") as fh:
            hash_prefix(fh, hasher, spec.size)
        state.sha256 = hasher.hexdigest()
        save()
    data_dest = dest.data_queue(sid)
    sent = 0
    with open_link(params, client_id=f"amqs-send-{sid}-{os.getpid()}") as link:
        link.subscribe(dest.control_queue(sid), ack="auto", prefetch=64)
        if not state.offer_sent:
            # Nobody can answer an offer that does not exist yet: whatever waits on the
            # control queue now was written by someone guessing the stream id.
            forged = 0
            until = time.monotonic() + 1.0  # bounded: an impostor may keep writing
            while time.monotonic() < until and link.get(0.2) is not None:
                forged += 1
            if forged:
                log.warning("stream %s: discarded %d control messages sent to %s before the offer existed",
                            sid, forged, dest.control_queue(sid))
        # A topic keeps no offer for subscribers that come later: offer on every attempt.
        if dest.kind == "topic" or not state.offer_sent:
            link.send_confirmed(str(dest), b"", p.offer_headers(spec, dest, window, origin=origin))
            state.offer_sent = True
            save()
        hs = HandshakeSender(spec, window, point_to_point=dest.kind == "queue")

        def hear(frame: Any) -> bool:
            """Take a control message; a malformed or foreign one is logged and ignored, so
            nobody but our receivers can stop, rewind or finish this sender."""
            try:
                return hs.on_control(frame.headers, now=time.monotonic()) is not None
            except p.ProtocolError as exc:
                log.warning("stream %s: ignored a control message on %s: %s", sid, dest.control_queue(sid), exc)
                return False

        deadline = time.monotonic() + request_timeout
        while not hs.positions:
            frame = link.get(max(0.05, deadline - time.monotonic()))
            if frame is not None:
                hear(frame)
            elif time.monotonic() >= deadline:
                raise StreamError(
                    f"stream {sid}: no receiver answered the offer on {dest} within {request_timeout:.0f}s. "
                    "The offer stays queued; re-run the sender once a receiver is running.")
        if dest.kind == "topic":
            until = time.monotonic() + discovery_window
            while (left := until - time.monotonic()) > 0:
                frame = link.get(left)
                if frame is not None:
                    hear(frame)
        fd = os.open(src, os.O_RDONLY)
        try:
            heard = time.monotonic()
            while not hs.all_done:
                while (frame := link.get(0)) is not None:
                    if hear(frame):
                        heard = time.monotonic()
                try:
                    seq = hs.next_chunk()
                except p.ProtocolError as exc:
                    raise StreamError(f"{exc}; a receiver of {dest} keeps rewinding (see its log)") from None
                if seq is not None:
                    offset, length = spec.chunk_span(seq)
                    body = os.pread(fd, length, offset)
                    headers, wire = p.data_message(spec, seq, body, codec)
                    link.send(data_dest, wire, headers)
                    sent += len(body)
                    continue
                if hs.take_end():
                    link.send(data_dest, b"", p.end_headers(spec, state.sha256))
                    continue
                frame = link.get(1.0)
                if frame is not None and hear(frame):
                    heard = time.monotonic()
                    if progress:
                        progress(spec.offset_of(hs.slowest), spec.size)
                elif time.monotonic() - heard > ack_timeout:
                    lagging = sorted(c for c in hs.positions if c not in hs.finished)
                    raise StreamError(
                        f"stream {sid}: receiver(s) {', '.join(lagging)} stopped answering at chunk {hs.slowest} "
                        f"of {spec.chunks} for {ack_timeout:.0f}s; re-run the sender to continue when they return")
        finally:
            os.close(fd)
            rerequests[0] += hs.rewinds
    state.end_sent = True
    if progress:
        progress(spec.size, spec.size)
    return sent
