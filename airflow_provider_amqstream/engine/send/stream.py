"""The sending end: one file out as a stream, resumable from a durable checkpoint.

``send_file`` reads a file one chunk at a time and never holds more than one chunk. A
lost connection, a restarted broker and a killed process all end the same way:
reconnect, reload the checkpoint, continue at the last chunk the broker confirmed.
Handshake mode (the sender paced by its receivers) lives in ``handshake.py``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.records import (
    Checkpoint,
    FileCheckpoint,
    TransferResult,
    hash_prefix,
)
from airflow_provider_amqstream.engine.send.handshake import send_handshake_attempt
from airflow_provider_amqstream.engine.send.outbound import ChunkReader, Outbound, Progress
from airflow_provider_amqstream.engine.state_dir import SendStateDir
from airflow_provider_amqstream.exceptions import (
    ConfigurationError,
    StreamError,
    TransportError,
)
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import seal
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec
from airflow_provider_amqstream.protocol.names import Destination, derive_stream_id, validate_stream_id
from airflow_provider_amqstream.protocol.state import SenderState
from airflow_provider_amqstream.transport.link import Link, open_link
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.retry import Reconnect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendOptions:
    """How to send, built once (from the CLI's flags, an operator's arguments) and passed
    down unchanged; None takes the connection's setting, else the default.

    :param chunk_size: bytes per chunk message (default 1 MiB); a re-run that names none
        continues with the interrupted run's.
    :param window: chunks per broker confirmation (default 16); a file within one window is
        "small" to a many-file send.
    :param mode: ``stream`` (receivers may start at once), ``atomic`` (receivers see the
        stream only once every chunk is stored) or ``handshake`` (one file at a time). A
        many-file send sends its small files in atomic order whatever the mode.
    :param compression: ``"auto"`` compresses chunks that shrink to half or less (CSV,
        JSON: ~3.5x) and stops trying on data that does not; ``"zstd"`` compresses each chunk
        that shrinks by 5 % or more; ``"none"`` sends every chunk as it is. None: the
        connection's (``auto`` unless its extra says otherwise).
    :param restart: ignore checkpoints (and a batch's ledger) and send from the first byte.
    :param reconnect_timeout: how long to keep trying to reach a lost broker, or one not up yet
        when the send starts (a broker that answers and refuses fails at once).
    :param request_timeout: handshake mode: seconds to wait for the first receiver to answer.
    :param discovery_window: handshake mode on a topic: seconds to keep collecting
        receivers after the first answered.
    :param ack_timeout: handshake mode: seconds without any word from a receiver that is
        still short of the end before giving up.
    :param fail_fast: many files: stop at the first file that fails (default: report it, go on).
    :param manifest: many files: after every file is confirmed, announce the batch (a
        ``batch`` message listing each file's stream id, relative path, size and SHA-256), so
        the receiving side writes ``<batch id>.manifest.jsonl`` once all of them are published.
    :param pack: many files: send files of one chunk or less several to a message (up to
        ``small_files.PACK_FILES``); turn off for receivers that predate packs or that receive
        each file by its stream id into a directory of its own (one asking for a packed
        stream receives the whole pack).
    :param progress: called with (bytes confirmed, total bytes) after each window of one file.
    :param checkpoint_for: where a stream id's resume point lives (default: a file in the
        state dir, one per stream id and broker).
    :param ledger_flush: many files: called with every confirmed stream id after each ledger write.
    :param ledger_seed: many files: stream ids known confirmed from elsewhere (a retry on
        another worker).
    :param seal_to: recipients (``amqs1...``) to seal every stream to (empty: the connection's
        ``seal_to``); a sealed stream's chunks, name and SHA-256 are readable by their key holders only.
    """

    chunk_size: int | None = None
    window: int | None = None
    mode: str | hdr.Mode = hdr.Mode.STREAM
    compression: str | None = None
    restart: bool = False
    reconnect_timeout: float = 120.0
    request_timeout: float = 60.0
    discovery_window: float = 2.0
    ack_timeout: float = 120.0
    fail_fast: bool = False
    manifest: bool = False
    pack: bool = True
    progress: Progress | None = None
    checkpoint_for: Callable[[str], Checkpoint] | None = None
    ledger_flush: Callable[[list[str]], None] | None = None
    ledger_seed: Iterable[str] = ()
    seal_to: tuple[str, ...] = ()


def send_file(
    params: BrokerParams,
    path: str | os.PathLike[str],
    destination: str,
    options: SendOptions | None = None,
    *,
    stream_id: str | None = None,
    name: str | None = None,
    subdir: str = "",
    link: Link | None = None,
) -> TransferResult:
    """Send one file as a stream; resume from the checkpoint if an earlier run stopped.

    :param destination: ``/queue/NAME`` (or ``/topic/NAME``) where receivers listen.
    :param stream_id: stream id; by default derived from path, size, mtime and
        destination, so the same call after a crash finds its checkpoint.
    :param name: the file name announced to receivers (default the base name).
    :param subdir: the relative directory (``a/b``) under the receiver's output directory
        the file goes to (offer header ``amqs_dir``); "" for the directory itself.
    :param link: an open connection to send over (``send_files`` shares one across files);
        a lost connection is then raised, not retried here. Stream and atomic modes only.
    """
    opts = options or SendOptions()
    started = time.time()
    t0 = time.monotonic()
    src = Path(path)
    st_ = regular_file(src)
    dest = Destination.parse(destination)
    kind = hdr.Mode(opts.mode)
    if dest.kind != "queue" and kind is not hdr.Mode.HANDSHAKE:
        raise StreamError(f"{dest}: a topic has no stored backlog per subscriber here; send to a topic "
                          "with mode='handshake' (every subscriber that answers gets the whole file)")
    identity = file_identity(src, st_)
    recipients = seal_recipients(opts, params)
    sid = validate_stream_id(stream_id) if stream_id else default_stream_id(src, dest, st_, key=id_key(params),
                                                                              sealed=bool(recipients))
    window = _first(opts.window, params.window, hdr.DEFAULT_WINDOW)
    if window < 1:
        raise StreamError(f"window must be at least 1, got {window}")
    if kind is hdr.Mode.HANDSHAKE and window > hdr.MAX_AHEAD:
        raise StreamError(f"window {window} is too large for handshake mode: receivers accept chunks at most "
                          f"{hdr.MAX_AHEAD} past their first missing one; use at most {hdr.MAX_AHEAD}")
    codec = ChunkCodec(opts.compression if opts.compression is not None else params.compression)
    ckpt = opts.checkpoint_for(sid) if opts.checkpoint_for else FileCheckpoint(
        SendStateDir().checkpoint(sid, params), retention_days=params.records_retention_days)
    loaded = None if opts.restart else ckpt.load()
    try:
        state = SenderState.from_json(loaded) if loaded else None
    except (KeyError, ValueError, TypeError) as exc:
        raise StreamError(f"resume state is invalid ({exc}); pass restart=True to start over") from exc
    # A re-run that names no chunk size continues with the interrupted run's.
    default_chunk = state.spec.chunk_size if state is not None else None
    chunk_size = _first(opts.chunk_size, default_chunk, params.chunk_size, hdr.DEFAULT_CHUNK_SIZE)
    real_name = name or src.name
    spec = p.StreamSpec(sid, seal.SEALED_NAME if recipients else real_name, st_.st_size, chunk_size, kind)
    sealed = _stream_seal(loaded if state is not None else None, recipients, spec, real_name, subdir)
    extra: dict[str, Any] = {"broker": params.url, "login": params.user}
    if sealed is not None:
        # Kept (0600, in the state dir) until the stream is sent: a resumed send seals under the same key.
        extra.update(seal_key=sealed.key.hex(), seal_header=sealed.header)
    state = _resume_state(state, spec, dest, identity, ckpt, extra)
    resumed_from = state.confirmed_offset
    if state.done:
        return _already_sent(params, src, dest, state, loaded or {}, started, link=link)
    if resumed_from:
        log.info("stream %s: resuming at byte %d of %d", sid, resumed_from, spec.size)

    def save() -> None:
        ckpt.save({**state.to_json(), **extra})

    out = _Attempt(params, src, dest, state, save, window, opts.progress, codec, stream_origin(identity, dest), subdir,
                   sealed)
    reconnect = Reconnect(f"sending stream {sid} to {dest}", params.url, opts.reconnect_timeout)
    if link is not None:
        if spec.mode is hdr.Mode.HANDSHAKE:
            raise StreamError(f"stream {sid}: handshake mode needs a connection of its own")
        out.over(link)
    else:
        resumed_from = _retry(out, reconnect, opts, resumed_from)
    ckpt.save({**state.to_json(), **extra, "seal_key": None, "sent_at": time.time()}, final=True)
    return TransferResult(spec.stream_id, str(dest), real_name, spec.size, spec.chunks, state.sha256 or "",
                          time.monotonic() - t0, spec.mode.value, resumed_from, out.sent, str(src), started,
                          time.time(), rerequests=out.rerequests, chunk_size=spec.chunk_size, origin=out.origin,
                          broker=params.url, retries=reconnect.attempts)


def seal_recipients(opts: SendOptions, params: BrokerParams) -> list[bytes]:
    """The public keys a send seals to, checked before anything is sent; refused when the
    connection requires sealing and names none."""
    recipients = [seal.parse_recipient(t) for t in opts.seal_to or params.seal_to]
    if params.seal_required and not recipients:
        raise ConfigurationError(f"the connection to {params.url} requires sealed streams (extra seal: required): "
                                 "give recipients (seal_to, `--seal-to`), as `amqstream keys show KEYFILE` prints them")
    return recipients


def _stream_seal(loaded: dict[str, Any] | None, recipients: list[bytes], spec: p.StreamSpec,
                 name: str, subdir: str) -> seal.Seal | None:
    """A sealed stream's seal: the interrupted run's (its receivers hold its offer), else a new one."""
    if loaded is not None and bool(loaded.get("seal_header")) != bool(recipients):
        raise StreamError(f"stream {spec.stream_id}: an interrupted transfer with this id was "
                          f"{'' if recipients else 'not '}sealed; pass restart=True (--restart) to send it again "
                          "from the start, or use a new stream id")
    if not recipients:
        return None
    if loaded is not None and loaded.get("seal_key"):
        return seal.Seal(bytes.fromhex(str(loaded["seal_key"])), spec.stream_id, str(loaded["seal_header"]))
    return seal.Seal.create(spec.stream_id, recipients, name=name, size=spec.size, chunk_size=spec.chunk_size,
                            subdir=subdir)


def regular_file(src: Path) -> os.stat_result:
    """``src``'s stat, refused unless it is a regular file (links followed)."""
    try:
        st_ = src.stat()
    except OSError as exc:
        raise StreamError(f"cannot read {src}: {exc.strerror}") from exc
    if not stat.S_ISREG(st_.st_mode):
        raise StreamError(f"{src} is not a regular file")
    return st_


def _resume_state(state: SenderState | None, spec: p.StreamSpec, dest: Destination, identity: str,
                  ckpt: Checkpoint, extra: dict[str, Any]) -> SenderState:
    """The checkpoint's state if it is this very stream, else a new one (recorded at once)."""
    if state is not None and (state.identity != identity or state.spec != spec
                              or state.destination != str(dest)):
        raise StreamError(
            f"stream {spec.stream_id}: an interrupted transfer with this id was for a different file, "
            f"destination or chunk size ({state.destination}, {state.spec.size} bytes); "
            "pass restart=True (--restart) to send it again from the start, or use a new stream id"
        )
    if state is None:
        state = SenderState(spec, str(dest), identity)
        # Recorded before the first message leaves: a re-run must find this stream's spec
        # (chunk size above all) even if we die before the broker confirms anything, or it
        # could offer the same stream id with different chunk boundaries.
        ckpt.save({**state.to_json(), **extra}, final=True)
    return state


def _retry(out: _Attempt, reconnect: Reconnect, opts: SendOptions, resumed_from: int) -> int:
    """Connected attempts, each on a connection of its own, until the stream is sent; return
    the offset this run last resumed at (``resumed_from``, unless a lost connection came after)."""
    state = out.state
    while True:
        before = state.confirmed_seq
        if reconnect.attempts and state.confirmed_offset:
            # After a lost connection the stream goes on from the broker's last confirmation:
            # that is where this run resumed, whatever offset it started at.
            resumed_from = state.confirmed_offset
        try:
            if state.spec.mode is hdr.Mode.HANDSHAKE:
                send_handshake_attempt(out, (opts.request_timeout, opts.discovery_window, opts.ack_timeout))
            else:
                with open_link(out.params, client_id=f"amqs-send-{state.spec.stream_id}-{os.getpid()}") as link:
                    out.over(link)
            return resumed_from
        except TransportError as exc:
            # Attempts open their own connections: the broker was reached if it took the offer.
            reconnect.reached = reconnect.reached or state.offer_sent or state.confirmed_seq > 0
            if state.confirmed_seq > before:
                reconnect.progressed()
            reconnect.failed(exc)


def _already_sent(params: BrokerParams, src: Path, dest: Destination, state: SenderState,
                  record: dict[str, Any], started: float, *, link: Link | None = None) -> TransferResult:
    """The checkpoint says this broker confirmed the whole stream. Still prove the broker
    takes these credentials: a wrong password must fail, not pass as "already sent" (a
    shared ``link`` was proved when it was opened)."""
    spec = state.spec
    if link is None:
        with open_link(params) as own:
            own.round_trip()
    when = record.get("sent_at")
    at = datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if when else "an earlier run"
    log.info("stream %s (%s) was already sent completely to %s on %s at %s; nothing to send "
             "(--restart sends it again)", spec.stream_id, src, dest, params.url, at)
    return TransferResult(spec.stream_id, str(dest), spec.name, spec.size, spec.chunks, state.sha256 or "",
                          0.0, spec.mode.value, state.confirmed_offset, 0, str(src), started, when or time.time(),
                          status="already_sent", chunk_size=spec.chunk_size, broker=params.url)


def file_identity(src: Path, st_: os.stat_result, real: Path | None = None) -> str:
    """``real``: ``src`` resolved already (a directory walk knows it without a lookup per file)."""
    return f"{real or src.resolve()}|{st_.st_size}|{st_.st_mtime_ns}"


def stream_origin(identity: str, dest: Destination) -> str:
    """The ``amqs_origin`` a sender puts on its offer: which file went where."""
    return hashlib.sha256(f"{identity}|{dest}".encode("utf-8", "surrogatepass")).hexdigest()[:32]


def default_stream_id(path: str | os.PathLike[str], destination: str | Destination,
                      st_: os.stat_result | None = None, *, key: bytes = b"", sealed: bool = False) -> str:
    """The stream id a send gets when none is given: the same file (path, size, mtime) to
    the same destination always gets the same id, so a re-run finds its checkpoint; the
    same file to another destination is another stream.

    :param key: the connection's ``id_key``: without it the id is predictable by anyone who
        knows the file, and so can be offered first by another user.
    :param sealed: the stream is sealed: its id shows no part of the file's name.
    """
    src = Path(path)
    identity = file_identity(src, st_ or src.stat())
    dest = Destination.parse(str(destination))
    return derive_stream_id(seal.SEALED_NAME if sealed else src.name, f"{identity}|{dest}", key)


@functools.lru_cache(maxsize=16)
def id_key(params: BrokerParams) -> bytes:
    """The key default stream and batch ids are derived with, from the connection's login
    and password: every worker and retry using the connection derives the same ids (so
    resumes find their checkpoints), and another user, who holds another password, cannot
    compute them to offer them first. A connection without a password gets no key (ids as
    predictable as its broker is open). A changed password means new ids: a send
    interrupted before the change starts over as a new stream.
    """
    if not params.password:
        return b""
    # Slow on purpose (~30 ms, once per connection and process): an id seen on the wire
    # must not make guessing the password that keys it cheap.
    return hashlib.pbkdf2_hmac("sha256", params.password.encode(), f"amqstream-ids|{params.user}".encode(), 100_000)


def _first(*values: int | None) -> int:
    return next(v for v in values if v is not None)


class _Attempt(Outbound):
    """Stream and atomic mode: connected attempts that continue at the confirmed chunk."""

    def _send_chunks(self, link: Link, fh: Any, hasher: Any, data_q: str) -> None:
        """Send every chunk past the confirmed one (each prepared while the one before it goes
        out: ``ChunkReader.ahead``), confirming each window as its receipt comes."""
        state, spec = self.state, self.state.spec
        # Two windows in flight: the broker stores one while we send the next.
        pending: collections.deque[tuple[str, int]] = collections.deque()
        chunks = ChunkReader(fh, spec, self.codec, hasher, self.seal).ahead(state.confirmed_seq + 1)
        with contextlib.closing(chunks):
            for chunk in chunks:
                seq = chunk.seq
                want = seq % self.window == 0 or seq == spec.chunks
                rid = link.send(data_q, chunk.wire, chunk.headers, receipt=want)
                self.sent += chunk.length
                if rid:
                    pending.append((rid, seq))
                while len(pending) > (1 if seq < spec.chunks else 0):
                    rid0, seq0 = pending.popleft()
                    link.wait_receipt(rid0)
                    state.confirm(seq0)
                    self.save()
                    if self.progress:
                        self.progress(state.confirmed_offset, spec.size)

    def over(self, link: Link) -> None:
        """One connected attempt; adds the bytes it sent to ``self.sent``."""
        state, spec, dest = self.state, self.state.spec, self.dest
        data_q = dest.data_queue(spec.stream_id, self.params.user)
        rerun = state.offer_sent or state.confirmed_seq > 0
        if spec.mode is hdr.Mode.STREAM and not state.offer_sent:
            link.send_confirmed(str(dest), b"", self.offer())
            state.offer_sent = True
            self.save()
        hasher = hashlib.sha256()
        with open(self.src, "rb") as fh:
            hash_prefix(fh, hasher, state.confirmed_offset)  # leaves fh there
            self._send_chunks(link, fh, hasher, data_q)
            if os.fstat(fh.fileno()).st_size != spec.size:
                raise StreamError(f"stream {spec.stream_id}: {self.src} changed while it was being sent; the "
                                  "stream is incomplete. Re-send with restart=True once it is stable.")
        if not state.end_sent:
            state.sha256 = hasher.hexdigest()
            link.send_confirmed(data_q, b"", self.end())
            state.end_sent = True
            self.save()
        if not state.offer_sent:
            link.send_confirmed(str(dest), b"", self.offer())
            state.offer_sent = True
        if rerun:
            # We may have repeated chunks or the end marker that a receiver already consumed
            # and published (atomic: chunks after the first end marker would be left behind);
            # the re-offer sends it back to clear them.
            link.send_confirmed(str(dest), b"", self.offer(reoffer=True))
        if self.progress and spec.chunks == 0:
            self.progress(spec.size, spec.size)
