"""Senders and receivers: the protocol state machines driven over a STOMP link and files.

``send_file`` reads a file one chunk at a time and never holds more than one chunk;
``receive_stream`` writes each chunk at its offset and never holds more than the
broker's prefetch window. Both keep a durable checkpoint, so a killed process, a
lost connection and a restarted broker all end in the same place: reconnect, reload
the checkpoint, continue.
"""

from __future__ import annotations

import collections
import concurrent.futures
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from airflow_provider_amqstream import protocol as p
from airflow_provider_amqstream.transport import AccessDenied, BrokerParams, ConnectionLost, StompLink, TransportError

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
EventSink = Callable[[str, dict[str, Any]], None]
STATE_DIR_NAME = ".amqstream"


class StreamError(RuntimeError):
    """A stream cannot be completed as it is; the text names stream, offset and remedy."""


class StreamStalled(StreamError):
    """Nothing arrived for the idle timeout; re-running continues where it stopped."""


@dataclass
class TransferResult:
    """What one send or receive did. ``bytes_transferred`` counts only this run."""

    stream_id: str
    destination: str
    name: str
    bytes: int
    chunks: int
    sha256: str
    seconds: float
    mode: str
    resumed_from: int = 0
    bytes_transferred: int = 0
    path: str | None = None
    started_at: float = 0.0
    finished_at: float = 0.0
    duplicates: int = 0
    rerequests: int = 0
    rejected: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Checkpoint(Protocol):
    """Where a sender keeps its resume point. The CLI uses a file; Airflow adds the
    task state store so a retry on another worker finds it."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, data: dict[str, Any], *, final: bool = False) -> None: ...


class FileCheckpoint:
    """A JSON file replaced atomically, fsynced so a crash never leaves half a state."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StreamError(f"resume state {self.path} is unreadable ({exc}); delete it to start over") from exc

    def save(self, data: dict[str, Any], *, final: bool = False) -> None:
        _atomic_json(self.path, data)


def default_state_dir() -> Path:
    env = os.environ.get("AMQSTREAM_STATE_DIR")
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "amqstream" / "send"


def _atomic_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class _Backoff:
    """Reconnect pacing with a deadline: 0.5 s doubling to 5 s."""

    def __init__(self, what: str, url: str, timeout: float) -> None:
        self.what, self.url, self.timeout = what, url, timeout
        self.deadline = time.monotonic() + timeout
        self.delay = 0.5
        self.attempts = 0

    def wait(self, exc: BaseException) -> None:
        self.attempts += 1
        if time.monotonic() + self.delay > self.deadline:
            raise StreamError(
                f"{self.what}: gave up reconnecting to {self.url} after {self.timeout:.0f}s "
                f"({self.attempts} attempts); last error: {exc}. Re-run to continue from the checkpoint."
            ) from exc
        log.warning("%s: %s; reconnecting in %.1fs", self.what, exc, self.delay)
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, 5.0)

    def reset(self) -> None:
        self.deadline = time.monotonic() + self.timeout
        self.delay = 0.5


# =============================================================================== send
def send_file(
    params: BrokerParams,
    path: str | os.PathLike[str],
    destination: str,
    *,
    stream_id: str | None = None,
    name: str | None = None,
    chunk_size: int | None = None,
    window: int | None = None,
    mode: str | p.Mode = p.Mode.STREAM,
    checkpoint: Checkpoint | None = None,
    restart: bool = False,
    progress: Progress | None = None,
    reconnect_timeout: float = 120.0,
    request_timeout: float = 60.0,
    discovery_window: float = 2.0,
    ack_timeout: float = 120.0,
    compression: str | None = None,
) -> TransferResult:
    """Send one file as a stream; resume from the checkpoint if an earlier run stopped.

    :param params: broker connection settings.
    :param path: the file to send.
    :param destination: ``/queue/NAME`` (or ``/topic/NAME``) where receivers listen.
    :param stream_id: stream id; by default derived from path, size, mtime and
        destination, so the same call after a crash finds its checkpoint.
    :param chunk_size: bytes per chunk message (default 1 MiB).
    :param window: chunks per broker confirmation (default 16).
    :param mode: ``stream`` (receivers may start at once) or ``atomic`` (receivers see
        the stream only once every chunk is stored).
    :param checkpoint: where the resume point lives (default: a file in the state dir).
    :param restart: ignore an existing checkpoint and send from the first byte.
    :param progress: called with (bytes confirmed, total bytes) after each window.
    :param reconnect_timeout: how long to keep trying to reach a lost broker.
    :param request_timeout: handshake mode: seconds to wait for the first receiver to answer.
    :param discovery_window: handshake mode on a topic: seconds to keep collecting
        receivers after the first answered.
    :param ack_timeout: handshake mode: seconds without any word from a receiver that is
        still short of the end before giving up.
    :param compression: ``"zstd"`` to compress each chunk that shrinks by 5 % or more
        (CSV, JSON: ~3.5x at ~280 MiB/s per core); None sends every chunk as it is.
    """
    started = time.time()
    t0 = time.monotonic()
    src = Path(path)
    try:
        st_ = src.stat()
    except OSError as exc:
        raise StreamError(f"cannot read {src}: {exc.strerror}") from exc
    if not src.is_file():
        raise StreamError(f"{src} is not a regular file")
    dest = p.Destination.parse(destination)
    if dest.kind != "queue" and p.Mode(mode) is not p.Mode.HANDSHAKE:
        raise StreamError(f"{dest}: a topic has no stored backlog per subscriber here; send to a topic "
                          "with mode='handshake' (every subscriber that answers gets the whole file)")
    identity = _file_identity(src, st_)
    sid = p.validate_stream_id(stream_id) if stream_id else default_stream_id(src, dest, st_)
    window = _first(window, params.window, p.DEFAULT_WINDOW)
    if window < 1:
        raise StreamError(f"window must be at least 1, got {window}")
    codec = p.ChunkCodec(compression if compression is not None else params.compression)
    ckpt = checkpoint or FileCheckpoint(default_state_dir() / f"{sid}.json")
    state = None if restart else _load_sender_state(ckpt)
    # A re-run that names no chunk size continues with the interrupted run's.
    default_chunk = state.spec.chunk_size if state is not None else None
    chunk_size = _first(chunk_size, default_chunk, params.chunk_size, p.DEFAULT_CHUNK_SIZE)
    spec = p.StreamSpec(sid, name or src.name, st_.st_size, chunk_size, p.Mode(mode))

    if state is not None and (state.identity != identity or state.spec != spec
                              or state.destination != str(dest)):
        raise StreamError(
            f"stream {sid}: an interrupted transfer with this id was for a different file, "
            f"destination or chunk size ({state.destination}, {state.spec.size} bytes); "
            "pass restart=True (--restart) to send it again from the start, or use a new stream id"
        )
    if state is None:
        state = p.SenderState(spec, str(dest), identity)
        # Recorded before the first message leaves: a re-run must find this stream's spec
        # (chunk size above all) even if we die before the broker confirms anything, or it
        # could offer the same stream id with different chunk boundaries.
        ckpt.save(state.to_json(), final=True)
    resumed_from = state.confirmed_offset
    if state.done:
        log.info("stream %s to %s was already sent completely", sid, dest)
        return TransferResult(sid, str(dest), spec.name, spec.size, spec.chunks, state.sha256 or "",
                              0.0, spec.mode.value, resumed_from, 0, str(src), started, time.time())
    if resumed_from:
        log.info("stream %s: resuming at byte %d of %d", sid, resumed_from, spec.size)

    data_q = dest.data_queue(sid)
    backoff = _Backoff(f"sending stream {sid} to {dest}", params.url, reconnect_timeout)
    sent_bytes = 0
    hs_timeouts = (request_timeout, discovery_window, ack_timeout)
    rerequests = [0]
    while True:
        try:
            if spec.mode is p.Mode.HANDSHAKE:
                sent_bytes += _send_handshake_attempt(params, src, dest, state, ckpt, window, progress,
                                                      hs_timeouts, rerequests, codec)
            else:
                sent_bytes += _send_attempt(params, src, dest, data_q, state, ckpt, window, progress, codec)
            break
        except AccessDenied:
            raise
        except ConnectionLost as exc:
            backoff.wait(exc)
        except TransportError as exc:
            if backoff.attempts == 0 and state.confirmed_seq == 0 and not state.offer_sent:
                raise
            backoff.wait(exc)
    ckpt.save(state.to_json(), final=True)
    secs = time.monotonic() - t0
    return TransferResult(sid, str(dest), spec.name, spec.size, spec.chunks, state.sha256 or "", secs,
                          spec.mode.value, resumed_from, sent_bytes, str(src), started, time.time(),
                          rerequests=rerequests[0])


def _file_identity(src: Path, st_: os.stat_result) -> str:
    return f"{src.resolve()}|{st_.st_size}|{st_.st_mtime_ns}"


def default_stream_id(path: str | os.PathLike[str], destination: str | p.Destination,
                      st_: os.stat_result | None = None) -> str:
    """The stream id a send gets when none is given: the same file (path, size, mtime) to
    the same destination always gets the same id, so a re-run finds its checkpoint; the
    same file to another destination is another stream.

    :param path: the file to send.
    :param destination: where it goes.
    :param st_: the file's stat result, if the caller has it.
    """
    src = Path(path)
    identity = _file_identity(src, st_ or src.stat())
    return p.derive_stream_id(src.name, f"{identity}|{p.Destination.parse(str(destination))}")


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


def _load_sender_state(ckpt: Checkpoint) -> p.SenderState | None:
    data = ckpt.load()
    if not data:
        return None
    try:
        return p.SenderState.from_json(data)
    except (KeyError, ValueError, TypeError) as exc:
        raise StreamError(f"resume state is invalid ({exc}); pass restart=True to start over") from exc


def _send_attempt(params: BrokerParams, src: Path, dest: p.Destination, data_q: str,
                  state: p.SenderState, ckpt: Checkpoint, window: int,
                  progress: Progress | None, codec: p.ChunkCodec) -> int:
    """One connected attempt; returns bytes sent in it. Resumes at the confirmed chunk."""
    spec = state.spec
    sent = 0
    rerun = state.offer_sent or state.confirmed_seq > 0
    with StompLink(params, client_id=f"amqs-send-{spec.stream_id}-{os.getpid()}") as link:
        if spec.mode is p.Mode.STREAM and not state.offer_sent:
            link.send_confirmed(str(dest), b"", p.offer_headers(spec, dest))
            state.offer_sent = True
            ckpt.save(state.to_json())
        hasher = hashlib.sha256()
        with open(src, "rb") as fh:
            _hash_prefix(fh, hasher, state.confirmed_offset)
            fh.seek(state.confirmed_offset)
            # Two windows in flight: the broker stores one while we send the next.
            pending: collections.deque[tuple[str, int]] = collections.deque()
            for seq in range(state.confirmed_seq + 1, spec.chunks + 1):
                body = fh.read(spec.chunk_span(seq)[1])
                hasher.update(body)
                want = seq % window == 0 or seq == spec.chunks
                headers, wire = p.data_message(spec, seq, body, codec)
                rid = link.send(data_q, wire, headers, receipt=want)
                sent += len(body)
                if rid:
                    pending.append((rid, seq))
                while len(pending) > (1 if seq < spec.chunks else 0):
                    rid0, seq0 = pending.popleft()
                    link.wait_receipt(rid0)
                    state.confirm(seq0)
                    ckpt.save(state.to_json())
                    if progress:
                        progress(state.confirmed_offset, spec.size)
            if _fstat_changed(fh, spec):
                raise StreamError(f"stream {spec.stream_id}: {src} changed while it was being sent; "
                                  "the stream is incomplete. Re-send with restart=True once it is stable.")
        if not state.end_sent:
            state.sha256 = hasher.hexdigest()
            link.send_confirmed(data_q, b"", p.end_headers(spec, state.sha256))
            state.end_sent = True
            ckpt.save(state.to_json())
        if not state.offer_sent:
            link.send_confirmed(str(dest), b"", p.offer_headers(spec, dest))
            state.offer_sent = True
        elif rerun:
            # We may have repeated chunks or the end marker that a receiver already
            # consumed and published; the re-offer sends it back to clear them.
            link.send_confirmed(str(dest), b"", p.offer_headers(spec, dest, reoffer=True))
        if progress:
            progress(spec.size, spec.size)
    return sent


def _send_handshake_attempt(params: BrokerParams, src: Path, dest: p.Destination, state: p.SenderState,
                            ckpt: Checkpoint, window: int, progress: Progress | None,
                            timeouts: tuple[float, float, float], rerequests: list[int],
                            codec: p.ChunkCodec) -> int:
    """Handshake mode (seed 004): offer, wait for receivers, send paced by their answers.

    Receivers drive resumption: each reports the first chunk it lacks, so a restarted
    receiver, a lost chunk and a restarted sender all become "send from chunk k".
    """
    request_timeout, discovery_window, ack_timeout = timeouts
    spec, sid = state.spec, state.spec.stream_id
    if state.sha256 is None:
        # Rewinds make a running hash impossible; hash the file once up front instead.
        hasher = hashlib.sha256()
        with open(src, "rb") as fh:
            _hash_prefix(fh, hasher, spec.size)
        state.sha256 = hasher.hexdigest()
        ckpt.save(state.to_json())
    data_dest = dest.data_queue(sid)
    sent = 0
    with StompLink(params, client_id=f"amqs-send-{sid}-{os.getpid()}") as link:
        link.subscribe(dest.control_queue(sid), ack="auto", prefetch=64)
        # A topic keeps no offer for subscribers that come later: offer on every attempt.
        if dest.kind == "topic" or not state.offer_sent:
            link.send_confirmed(str(dest), b"", p.offer_headers(spec, dest, window))
            state.offer_sent = True
            ckpt.save(state.to_json())
        hs = p.HandshakeSender(spec, window, point_to_point=dest.kind == "queue")
        deadline = time.monotonic() + request_timeout
        while not hs.positions:
            frame = link.get(max(0.05, deadline - time.monotonic()))
            if frame is not None:
                hs.on_control(frame.headers)
            elif time.monotonic() >= deadline:
                raise StreamError(
                    f"stream {sid}: no receiver answered the offer on {dest} within {request_timeout:.0f}s. "
                    "The offer stays queued; re-run the sender once a receiver is running.")
        if dest.kind == "topic":
            until = time.monotonic() + discovery_window
            while (left := until - time.monotonic()) > 0:
                frame = link.get(left)
                if frame is not None:
                    hs.on_control(frame.headers)
        fd = os.open(src, os.O_RDONLY)
        try:
            heard = time.monotonic()
            while not hs.all_done:
                while (frame := link.get(0)) is not None:
                    hs.on_control(frame.headers)
                    heard = time.monotonic()
                seq = hs.next_chunk()
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
                if frame is not None:
                    hs.on_control(frame.headers)
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


def _fstat_changed(fh: Any, spec: p.StreamSpec) -> bool:
    return os.fstat(fh.fileno()).st_size != spec.size


def _hash_prefix(fh: Any, hasher: Any, upto: int, block: int = 4 * 1024 * 1024) -> None:
    """Feed the first ``upto`` bytes of an open file to ``hasher`` (resume path)."""
    fh.seek(0)
    left = upto
    buf = bytearray(block)
    view = memoryview(buf)
    while left > 0:
        n = fh.readinto(view[: min(block, left)])
        if not n:
            raise StreamError(f"{getattr(fh, 'name', 'file')} is shorter than its resume point {upto}")
        hasher.update(view[:n])
        left -= n


# ============================================================================ receive
@dataclass
class ReceiveOptions:
    """Knobs for :func:`receive_stream`.

    :param window: chunks per sync + acknowledgement (the broker prefetch is 2x this).
        Keep it at most half the broker's maxPageSize (16 in the shipped config).
    :param wait_timeout: seconds to wait for a stream to be offered (None: forever).
    :param idle_timeout: seconds without a chunk before the sender is presumed dead.
    :param gap_grace: seconds to wait for late chunks after the end marker.
    :param reconnect_timeout: how long to keep trying to reach a lost broker.
    :param overwrite: replace an existing file of the same name in the output directory.
    :param max_bytes: refuse streams larger than this.
    :param rerequest_after: handshake mode: seconds of silence before asking the sender
        to resend from the first missing chunk.
    """

    window: int = p.DEFAULT_RECEIVE_BATCH
    wait_timeout: float | None = 60.0
    idle_timeout: float = 120.0
    gap_grace: float = 5.0
    reconnect_timeout: float = 120.0
    overwrite: bool = False
    max_bytes: int | None = None
    rerequest_after: float = 2.0
    events: EventSink | None = None
    progress: Progress | None = None


def receive_stream(params: BrokerParams, source: str, out_dir: str | os.PathLike[str], *,
                   stream_id: str | None = None, options: ReceiveOptions | None = None) -> TransferResult | None:
    """Receive the next stream offered on ``source`` (or the one named ``stream_id``)
    into ``out_dir``; return None if none was offered within ``wait_timeout``.

    The file appears in ``out_dir`` only once every byte is on disk and its SHA-256
    matches the sender's. Partial data and the resume state live in
    ``out_dir/.amqstream/``; another receiver given the same directory continues it.
    """
    opts = options or ReceiveOptions()
    dest = p.Destination.parse(source)
    if stream_id:
        p.validate_stream_id(stream_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / STATE_DIR_NAME).mkdir(exist_ok=True)
    what = f"receiving {'stream ' + stream_id if stream_id else 'a stream'} from {dest}"
    backoff = _Backoff(what, params.url, opts.reconnect_timeout)
    wait = opts.wait_timeout
    first = True
    while True:
        try:
            with StompLink(params, client_id=f"amqs-recv-{socket.gethostname()}-{os.getpid()}") as link:
                backoff.reset()
                return _receive_attempt(link, dest, out, stream_id, opts, wait)
        except AccessDenied:
            raise
        except ConnectionLost as exc:
            backoff.wait(exc)
        except TransportError as exc:
            if first:
                raise
            backoff.wait(exc)
        first = False
        # After a reconnect our own unacknowledged offer is redelivered at once.
        wait = max(wait or 0.0, 30.0) if wait is not None else None


def _emit(opts: ReceiveOptions, kind: str, **data: Any) -> None:
    if opts.events:
        opts.events(kind, {"time": time.time(), **data})


def _receive_attempt(link: StompLink, dest: p.Destination, out: Path, stream_id: str | None,
                     opts: ReceiveOptions, wait: float | None) -> TransferResult | None:
    selector = f"{p.H_KIND} = 'offer'"
    if stream_id:
        selector += f" AND {p.H_STREAM} = '{stream_id}'"
    # Prefetch 1 and no ack until publication: this receiver holds one offer, so the
    # broker hands it no other stream, and the offer returns to the queue if we die.
    link.subscribe(str(dest), prefetch=1, selector=selector)
    _emit(opts, "waiting", source=str(dest))
    deadline = None if wait is None else time.monotonic() + wait
    while True:
        offer = _get(link, None if deadline is None else max(0.0, deadline - time.monotonic()))
        if offer is None:
            return None
        if not offer.headers.get(p.H_REOFFER):
            break
        _clear_leftovers(link, dest, out, offer, opts)
    try:
        spec, data_q = p.parse_offer(offer.headers, dest)
        terms = p.handshake_terms(offer.headers, spec, dest) if spec.mode is p.Mode.HANDSHAKE else None
    except p.ProtocolError as exc:
        # A malformed offer would come back forever: NACK it (the broker moves it to the
        # DLQ) and say so.
        link.nack(offer)
        raise StreamError(f"rejected an invalid offer on {dest} (moved to the broker's DLQ): {exc}") from exc
    if opts.max_bytes is not None and spec.size > opts.max_bytes:
        link.nack(offer)
        raise StreamError(f"stream {spec.stream_id} on {dest} is {spec.size} bytes, over the limit of "
                          f"{opts.max_bytes}; it was refused (moved to the broker's DLQ)")
    return _StreamReceiver(link, dest, out, spec, data_q, opts, terms).run(offer)


def _clear_leftovers(link: StompLink, dest: p.Destination, out: Path, offer: Any, opts: ReceiveOptions) -> None:
    """Handle a re-offer. If this directory published the stream, drain what the sender's
    re-run repeated; if it holds the stream's partial data, its receiver drains when it
    publishes. Either way acknowledge the re-offer, and never start a reception from it."""
    sid = str(offer.headers.get(p.H_STREAM, ""))
    try:
        p.validate_stream_id(sid)
    except p.ProtocolError:
        link.nack(offer)
        return
    if (out / STATE_DIR_NAME / f"{sid}.done").exists():
        drained = _drain_leftovers(link, dest.data_queue(sid))
        _emit(opts, "leftovers_cleared", stream_id=sid, messages=drained)
    link.ack(offer)


def _drain_leftovers(link: StompLink, data_q: str, quiet: float = 0.3) -> int:
    """Acknowledge whatever is left on a published stream's data queue (repeats from a
    sender's re-run) until it stays quiet for ``quiet`` seconds."""
    sub = link.subscribe(data_q, prefetch=16)
    n = 0
    while (frame := link.get(quiet)) is not None:
        link.ack(frame)
        n += 1
    link.unsubscribe(sub)
    return n


def _get(link: StompLink, timeout: float | None) -> Any:
    if timeout is None:
        while True:
            frame = link.get(30.0)
            if frame is not None:
                return frame
    return link.get(timeout)


class _StreamReceiver:
    """Receives one offered stream into ``out``; see :func:`receive_stream`."""

    def __init__(self, link: StompLink, dest: p.Destination, out: Path, spec: p.StreamSpec,
                 data_q: str, opts: ReceiveOptions, handshake: tuple[str, int] | None = None) -> None:
        self.link, self.dest, self.out, self.spec, self.data_q, self.opts = link, dest, out, spec, data_q, opts
        # Handshake mode: where to tell the sender our position, and how often. The sender
        # stops a window ahead of us, so acknowledge every half window to keep it busy.
        self.reply_to = handshake[0] if handshake else None
        self.batch = max(1, min(opts.window, handshake[1] // 2)) if handshake else opts.window
        # Stable across restarts: a receiver that comes back for the same directory is the
        # same consumer to the sender, and its new position replaces its old one.
        where = hashlib.sha256(str(out.resolve()).encode("utf-8", "surrogatepass")).hexdigest()[:12]
        self.consumer = f"{socket.gethostname()}:{where}"
        self.rejected = 0
        self.new, self.unacked, self.inflight = [], [], None
        self.data_sub: str | None = None
        sdir = out / STATE_DIR_NAME
        self.part = sdir / f"{spec.stream_id}.part"
        self.state_file = sdir / f"{spec.stream_id}.json"
        self.done_file = sdir / f"{spec.stream_id}.done"
        self.what = f"stream {spec.stream_id} ({data_q})"

    def run(self, offer: Any) -> TransferResult:
        spec, opts = self.spec, self.opts
        started = time.time()
        t0 = time.monotonic()
        if self.done_file.exists():
            # The stream was published before and the offer came again (sender re-run
            # after its final receipt was lost): acknowledge, write nothing.
            info = json.loads(self.done_file.read_text())
            self._tell(p.Kind.DONE, spec.chunks + 1)
            if not self.reply_to:
                _drain_leftovers(self.link, self.data_q)
            self.link.ack(offer)
            _emit(opts, "duplicate_offer", stream_id=spec.stream_id)
            return TransferResult(**{**info, "seconds": 0.0, "bytes_transferred": 0,
                                     "started_at": started, "finished_at": time.time()})
        self.fd = os.open(self.part, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for cp
        try:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StreamError(f"{self.what} is being received by another process into {self.out}") from None
            self.state = self._load_state()
            self._reserve_space()
            resumed_from = self.state.contiguous_bytes
            _emit(opts, "stream_open", stream_id=spec.stream_id, resumed_from=resumed_from)
            self.hasher = hashlib.sha256()
            with os.fdopen(os.dup(self.fd), "rb", buffering=0) as rfh:
                _hash_prefix(rfh, self.hasher, self.state.contiguous_bytes)
            self.hashed_to = self.state.next_seq  # first chunk not yet in the hash
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="amqs-sync") as self.pool:
                try:
                    written = self._drain()
                finally:
                    self._settle_quietly()
            self.state.verify(self.hasher.hexdigest())
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        final = self._final_path()
        os.replace(self.part, final)
        _fsync_dir(self.out)
        result = TransferResult(
            spec.stream_id, str(self.dest), spec.name, spec.size, spec.chunks, self.hasher.hexdigest(),
            time.monotonic() - t0, spec.mode.value, resumed_from, written, str(final), started,
            time.time(), self.state.duplicates, rejected=self.rejected)
        _atomic_json(self.done_file, result.to_json())
        self.state_file.unlink(missing_ok=True)
        self._tell(p.Kind.DONE, spec.chunks + 1)
        if not self.reply_to:
            # Repeats from a sender's re-run may follow the end marker; clear them now.
            if self.data_sub:
                self.link.unsubscribe(self.data_sub)
            _drain_leftovers(self.link, self.data_q)
        self.link.ack(offer)
        _emit(opts, "stream_close", stream_id=spec.stream_id, path=str(final))
        return result

    def _reserve_space(self) -> None:
        """Allocate the whole file now: a full disk fails here, naming the stream, rather
        than hours in; and later syncs need not flush a growing size."""
        size = self.spec.size
        if size == 0 or os.fstat(self.fd).st_size >= size:
            return
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            free = shutil.disk_usage(self.out).free
            raise StreamError(
                f"{self.what}: cannot reserve {size} bytes in {self.out} ({exc.strerror}; {free} bytes free). "
                "Free space or choose another output directory, then re-run to continue."
            ) from exc

    def _load_state(self) -> p.ReceiverState:
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return p.ReceiverState(self.spec)
        except (OSError, ValueError) as exc:
            raise StreamError(f"{self.what}: resume state {self.state_file} is unreadable ({exc}); "
                              "delete it and the .part file to receive from the start") from exc
        state = p.ReceiverState.from_json(data)
        if state.spec != self.spec:
            raise StreamError(f"{self.what}: resume state {self.state_file} belongs to a different "
                              "stream with the same id; delete it to receive from the start")
        log.info("%s: resuming with %d of %d bytes on disk", self.what, state.received_bytes, self.spec.size)
        return state

    def _drain(self) -> int:
        """Receive chunks until complete; return bytes written by this run."""
        link, opts, spec, state = self.link, self.opts, self.spec, self.state
        if state.complete:
            return 0
        # Two batches in flight: one being synced while the next arrives. The broker keeps
        # paged in (maxPageSize, 16 in our config) every message we have not acknowledged,
        # so a batch must stay below that or dispatch stops until we commit: batches of 8
        # ran at ~4x the speed of 16 here, 32 at a tenth. A deeper prefetch (4 batches)
        # was no faster and cost 15 MiB of peak memory.
        self.data_sub = link.subscribe(self.data_q, prefetch=2 * self.batch)
        # Subscribed first, then hello: on a topic the sender's chunks must find us listening.
        self._tell(p.Kind.HELLO, state.next_seq)
        quiet_since = time.monotonic()
        written = 0
        last_progress = 0.0
        while not state.complete:
            timeout = opts.gap_grace if state.expected_sha256 else opts.idle_timeout
            if self.reply_to:
                timeout = opts.rerequest_after
            busy = self.unacked or self.inflight
            # With work pending, a short pause means the broker is waiting for our acks.
            frame = link.get(min(timeout, 0.05) if busy else timeout)
            if frame is None:
                if busy:
                    self._commit(wait=True)
                    continue
                if self.reply_to and time.monotonic() - quiet_since < opts.idle_timeout:
                    # Lost chunk, dropped end marker or a restarted sender: ask again from the gap.
                    self._tell(p.Kind.REREQ, state.next_seq)
                    continue
                if self.reply_to:
                    timeout = opts.idle_timeout
                if state.expected_sha256 and not self.reply_to:
                    raise StreamError(
                        f"{self.what}: end marker arrived but {state.describe_missing()} never did; "
                        f"they were consumed by another client or moved to a DLQ. The partial file is kept "
                        f"in {self.part}; re-send the stream (amqstream send --restart) to complete it."
                    )
                raise StreamStalled(
                    f"{self.what}: nothing arrived for {timeout:.0f}s at byte {state.contiguous_bytes} of "
                    f"{spec.size}; is the sender still running? Re-run the receiver to continue from there."
                )
            quiet_since = time.monotonic()
            try:
                d = state.decide(frame.headers, frame.body)
            except p.ProtocolError as exc:
                self._reject(frame)
                raise StreamError(f"{self.what}: {exc}; the message was rejected (moved to the broker's DLQ)") from exc
            if d.verdict is p.Verdict.CORRUPT and self.reply_to:
                # A live sender can resend it: drop this copy (to the DLQ) and ask again.
                self.rejected += 1
                log.warning("%s: %s; asking the sender to resend", self.what, d.reason)
                self._reject(frame)
                self._tell(p.Kind.REREQ, state.next_seq)
                continue
            if d.verdict is p.Verdict.CORRUPT:
                self._reject(frame)
                raise StreamError(f"{self.what}: {d.reason}; nothing of it was written and the file will not "
                                  f"be published. Re-send the stream (amqstream send --restart).")
            if d.verdict is p.Verdict.WRITE:
                data = frame.body if d.data is None else d.data
                try:
                    os.pwrite(self.fd, data, d.offset)
                except OSError as exc:
                    raise self._disk_error(exc, f"writing chunk {d.seq} at offset {d.offset} of {self.part}") from exc
                state.mark_written(d.seq)
                written += len(data)
                self._hash_along(d.seq, data)
                self.new.append(d.seq)
            # Only the ack header is needed from here on: let the body go now rather than
            # hold a batch of megabytes until the batch is synced.
            frame.body = b""
            self.unacked.append(frame)
            ending = d.verdict is p.Verdict.END or (state.expected_sha256 and state.all_written)
            if len(self.unacked) >= self.batch or ending:
                self._commit(wait=bool(ending))
                if opts.progress and time.monotonic() - last_progress > 0.5:
                    last_progress = time.monotonic()
                    opts.progress(state.received_bytes, spec.size)
        if opts.progress:
            opts.progress(spec.size, spec.size)
        return written

    def _hash_along(self, seq: int, data: bytes | memoryview) -> None:
        """Feed the whole-file hash with every chunk that is now contiguous. The hash lives
        in memory only (a resumed run rehashes the prefix from disk), so written is enough;
        chunks that arrived ahead of a gap are read back from the page cache."""
        state = self.state
        while self.hashed_to <= self.spec.chunks and (
                state.has(self.hashed_to) or self.hashed_to in state.written):
            if self.hashed_to == seq:
                self.hasher.update(data)
            else:
                off, length = self.spec.chunk_span(self.hashed_to)
                self.hasher.update(os.pread(self.fd, length, off))
            self.hashed_to += 1

    # Commit protocol: sync the batch's data and the state that records it (worker thread),
    # then mark it durable and acknowledge it (this thread). Acknowledging only after the
    # sync means an acknowledged chunk is always on disk; the sync of one batch overlaps
    # the arrival of the next.
    new: list[int]
    unacked: list[Any]
    inflight: tuple[concurrent.futures.Future[None], list[int], list[Any]] | None

    def _commit(self, *, wait: bool) -> None:
        self._settle()
        if not self.unacked:
            return
        snapshot = p.ReceiverState.from_json(self.state.to_json())
        for seq in self.new:
            snapshot.mark_durable(seq)
        fut = self.pool.submit(self._sync, snapshot.to_json() if self.new else None)
        self.inflight = (fut, self.new, self.unacked)
        self.new, self.unacked = [], []
        if wait:
            self._settle()

    def _sync(self, snapshot: dict[str, Any] | None) -> None:
        if snapshot is not None:
            os.fdatasync(self.fd)
            _atomic_json(self.state_file, snapshot)

    def _settle(self) -> None:
        """Finish the commit in flight, if any."""
        if self.inflight is None:
            return
        fut, new, unacked = self.inflight
        self.inflight = None
        try:
            fut.result()
        except OSError as exc:
            raise self._disk_error(exc, f"syncing {self.part} and recording progress in {self.state_file}") from exc
        for seq in new:
            self.state.mark_durable(seq)
        for frame in unacked:
            self.link.ack(frame)
        self._tell(p.Kind.ACK, self.state.next_seq)

    def _disk_error(self, exc: OSError, doing: str) -> StreamError:
        free = shutil.disk_usage(self.out).free
        return StreamError(
            f"{self.what}: {doing} failed: {exc.strerror or exc} ({free} bytes free in {self.out}). Nothing "
            f"past byte {self.state.contiguous_bytes} was acknowledged, so the broker keeps the rest, and the "
            f"partial file is kept; free space and re-run the receiver to continue from there."
        )

    def _settle_quietly(self) -> None:
        """On the way out after an error: keep what is durable, but never mask the error."""
        try:
            self._settle()
        except Exception as exc:
            log.warning("%s: could not finish the last commit while stopping: %s", self.what, exc)

    def _reject(self, bad: Any) -> None:
        """Keep the good chunks received so far, then refuse ``bad``; the shipped broker
        config moves it to the DLQ, where a person can inspect it."""
        self._commit(wait=True)
        self.link.nack(bad)

    def _tell(self, kind: p.Kind, next_seq: int) -> None:
        """Handshake mode: report our position to the sender (no-op otherwise)."""
        if self.reply_to:
            self.link.send(self.reply_to, b"", p.control_headers(self.spec, kind, self.consumer, next_seq),
                           persistent=False)

    def _final_path(self) -> Path:
        name = p.safe_file_name(self.spec.name, self.spec.stream_id)
        final = self.out / name
        if final.exists() and not self.opts.overwrite:
            stem, dot, ext = name.rpartition(".")
            final = self.out / (f"{stem}.{self.spec.stream_id}.{ext}" if stem else f"{name}.{self.spec.stream_id}")
        return final


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_received(out_dir: str | os.PathLike[str], stream_id: str) -> dict[str, Any] | None:
    """The completion record of ``stream_id`` if ``out_dir`` already published it, else None.

    The record is what the receiver stored in ``out_dir/.amqstream/<stream_id>.done``
    (a :class:`TransferResult` as JSON).
    """
    done = Path(out_dir) / STATE_DIR_NAME / f"{p.validate_stream_id(stream_id)}.done"
    try:
        text = done.read_text()
    except FileNotFoundError:
        return None
    return dict(json.loads(text))
