"""The amqstream chunk protocol: pure state machines, no I/O.

Read ``docs/protocol.md`` for the wire format. In short, a stream is:

* one ``offer`` message on the destination the user named (``/queue/landing``): it
  announces the stream (id, file name, size, chunk size) and where its chunks are;
* ``data`` messages on a per-stream queue ``<destination>.amqs.<stream id>``, one per
  chunk, each carrying its 1-based sequence number, byte offset and CRC-32;
* one ``end`` message on the same per-stream queue with the SHA-256 of the whole file.

A file no larger than one chunk may instead travel *inline*: one offer carrying the
file as its body, with the CRC-32 of that body and the file's SHA-256 in its headers,
and no data queue at all (:func:`inline_offer`, :func:`read_inline`). Several inline
offers may travel together as one *pack* message: a JSON index of their headers, then
their bodies (:func:`pack_message`, :func:`read_pack`); each member is checked as the
inline offer it is.

A receiver takes one offer at a time (prefetch 1, acknowledged only when the file is
published), so it never has two streams open, and a crashed receiver's offer goes back
to the queue for the next one. Chunks are placed by offset, never by arrival order, so
a broker that reorders, redelivers or duplicates cannot corrupt the file.

In ``handshake`` mode (seed 004) the sender also listens: receivers answer the offer
with ``hello`` on a control queue, acknowledge each window with ``ack``, ask for a
resend from a sequence number with ``rereq``, and say ``done``. That gives consumer
discovery, a window of chunks per acknowledgement, recovery of lost or corrupted
chunks from the live sender, and topics where every subscriber gets the whole file.

This module decides; the engine (``engine/``) reads files, writes files and talks to
the broker. Everything here can be unit-tested without a network or a disk.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

PROTOCOL_VERSION = 1

# Header names are valid JMS identifiers, so `amqs_stream = 'x'` works as a selector.
H_VERSION = "amqs_version"
H_KIND = "amqs_kind"
H_STREAM = "amqs_stream"
H_MODE = "amqs_mode"
H_NAME = "amqs_name"
H_SIZE = "amqs_size"
H_CHUNK_SIZE = "amqs_chunk_size"
H_CHUNKS = "amqs_chunks"
H_DATA_DEST = "amqs_data_dest"
H_SEQ = "amqs_seq"
H_OFFSET = "amqs_offset"
H_CRC = "amqs_crc32"
H_SHA256 = "amqs_sha256"
# Standard JMS group properties: a plain JMS consumer can reassemble with these alone.
H_ENCODING = "amqs_encoding"
H_REPLY_TO = "amqs_reply_to"
H_WINDOW = "amqs_window"
H_REOFFER = "amqs_reoffer"
# Optional: the subdirectory of the receiver's output directory the file goes to, relative,
# components separated by "/" (a directory send keeps its tree).
H_DIR = "amqs_dir"
H_CONSUMER = "amqs_consumer"
H_NEXT_SEQ = "amqs_next_seq"
# Who made the stream: a digest of the sender's file identity and destination. A stream id
# names a stream; the origin tells a repeat of it from another stream that reused the id.
H_ORIGIN = "amqs_origin"
# Handshake mode: a receiver's secret for one stream, sent only on the control queue (which
# other receivers cannot read), so the sender can tell its receiver from an impostor.
H_TOKEN = "amqs_token"
# "1": the offer carries the whole file (at most one chunk) as its body; no data queue.
H_INLINE = "amqs_inline"
# A batch message: its id (also in amqs_stream, so selectors on it see one), part k of n.
H_BATCH = "amqs_batch"
H_PART = "amqs_part"
H_PARTS = "amqs_parts"
# A pack (several small files in one message): how many, the length of its JSON index at
# the start of the body, and its members' stream ids as "|a|b|" (for a selector's LIKE).
H_PACK_FILES = "amqs_pack_files"
H_PACK_INDEX = "amqs_pack_index"
H_PACK_IDS = "amqs_pack_ids"
H_PACK_LEN = "amqs_pack_len"
# Added by a receiver that quarantines a stream, on the copy of its offer it files away.
H_QUARANTINE_REASON = "amqs_quarantine_reason"
H_QUARANTINED_FROM = "amqs_quarantined_from"
H_QUARANTINED_BY = "amqs_quarantined_by"
H_QUARANTINED_AT = "amqs_quarantined_at"
H_GROUP_ID = "JMSXGroupID"
H_GROUP_SEQ = "JMSXGroupSeq"

DEFAULT_CHUNK_SIZE = 1024 * 1024
DEFAULT_WINDOW = 16
# Receiver batch: half the broker's page size (maxPageSize=16 in the shipped config).
DEFAULT_RECEIVE_BATCH = 8
# ActiveMQ's STOMP connector refuses frames over maxDataLength (64 MiB in our config);
# stay well below it so headers and a TLS record never push a chunk over.
MAX_CHUNK_SIZE = 32 * 1024 * 1024
MAX_STREAM_ID = 128
MAX_NAME_BYTES = 255
MAX_DIR_BYTES = 1024
# A batch list is split into parts of at most this many files (each a JSON line of ~250 bytes),
# and a receiver refuses a part whose body is larger than MAX_BATCH_BODY.
BATCH_PART_FILES = 2000
MAX_BATCH_BODY = 2 * 1024 * 1024
MAX_BATCH_PARTS = 10_000
MAX_DIR_DEPTH = 16
# A pack holds at most this many files, and its index at most MAX_PACK_INDEX bytes (each
# member's offer headers, a few hundred bytes; the sender stops a pack well before).
MAX_PACK_FILES = 64
MAX_PACK_INDEX = 256 * 1024
MAX_PACK_MEMBER_HEADERS = 32
MAX_DIR_COMPONENT_BYTES = 200
# How far past the first missing chunk a chunk may be. Delivery reorders within a few
# prefetch windows; further ahead is a sender playing games (each chunk ahead of a gap is
# kept in the resume state, which is rewritten every batch).
MAX_AHEAD = 1024
# Set by the transport on a frame whose header section it had to cut (see transport.py).
H_TRUNCATED = "amqs_truncated"

# fullmatch only: `$` also matches before a trailing newline, which would reach file names.
_STREAM_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DEST_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DIGITS = re.compile(r"[0-9]{1,20}")


class ProtocolError(ValueError):
    """A message or argument breaks the protocol; the text names the stream and field."""


class Kind(str, Enum):
    OFFER = "offer"
    DATA = "data"
    END = "end"
    # Receiver -> sender, handshake mode only; each carries amqs_consumer and amqs_next_seq.
    HELLO = "hello"
    ACK = "ack"
    REREQ = "rereq"
    DONE = "done"
    # Sender -> receivers, on the destination after a batch's offers: its file list.
    BATCH = "batch"
    # Sender -> receivers, on the destination: several inline offers in one message.
    PACK = "pack"


CONTROL_KINDS = frozenset({Kind.HELLO, Kind.ACK, Kind.REREQ, Kind.DONE})


class Mode(str, Enum):
    """When the receiver may see a stream.

    ``stream``: the offer goes first, so a receiver can write while the sender sends.
    ``atomic``: the offer goes last, after the broker confirmed every chunk, so no
    receiver ever starts on a stream whose producer died (seed 000's transaction,
    without holding the stream in broker memory: chunks wait in KahaDB).
    ``handshake``: the sender waits for receivers to answer the offer and paces itself
    by their acknowledgements (seed 004); required for topics.
    """

    STREAM = "stream"
    ATOMIC = "atomic"
    HANDSHAKE = "handshake"


# --------------------------------------------------------------------------- names
def validate_stream_id(stream_id: str) -> str:
    """Return ``stream_id`` if it is safe as a queue-name suffix and a file name."""
    if not isinstance(stream_id, str) or not stream_id:
        raise ProtocolError("stream id must be a non-empty string")
    if len(stream_id) > MAX_STREAM_ID or not _STREAM_ID_RE.fullmatch(stream_id) or ".." in stream_id:
        raise ProtocolError(
            f"stream id {stream_id!r} is not valid: use 1-{MAX_STREAM_ID} characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit, and no '..'"
        )
    return stream_id


def derive_stream_id(file_name: str, identity: str) -> str:
    """A stable stream id for a file: readable prefix plus a hash of ``identity``.

    The same file (same identity: path, size, mtime) gets the same id, which is what
    lets a re-run of an interrupted send find its own resume point.
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", file_name).strip("._-")[:48] or "stream"
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{stem}-{digest}"


@dataclass(frozen=True)
class Destination:
    """A STOMP destination on ActiveMQ: ``/queue/NAME`` or ``/topic/NAME``."""

    kind: str
    name: str

    @classmethod
    def parse(cls, text: str) -> Destination:
        """Accept ``/queue/x``, ``/topic/x``, ``queue://x``, ``topic://x`` or bare ``x`` (queue)."""
        raw = (text or "").strip()
        kind, name = "queue", raw
        for prefix, k in (("/queue/", "queue"), ("/topic/", "topic"),
                          ("queue://", "queue"), ("topic://", "topic")):
            if raw.startswith(prefix):
                kind, name = k, raw[len(prefix):]
                break
        if not name or len(name) > 200 or not _DEST_NAME_RE.fullmatch(name):
            raise ProtocolError(
                f"destination {text!r} is not valid: use /queue/NAME or /topic/NAME where NAME "
                "has only A-Z a-z 0-9 . _ -"
            )
        return cls(kind, name)

    def __str__(self) -> str:
        return f"/{self.kind}/{self.name}"

    def data_queue(self, stream_id: str) -> str:
        """Where one stream's chunks and end marker go: a queue, or for a topic a
        per-stream topic so every subscriber gets every chunk."""
        return f"/{self.kind}/{self.name}.amqs.{validate_stream_id(stream_id)}"

    def control_queue(self, stream_id: str) -> str:
        """Where receivers answer the sender in handshake mode (always a queue). Its own
        name element, not a suffix of the data queue's, so that a broker ACL (whose
        wildcards match prefixes only) can let senders read it without reading data."""
        return f"/queue/{self.name}.amqs_ctl.{validate_stream_id(stream_id)}"


_UNSAFE_CHARS = set('<>:"|?*\\')
_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(10)), *(f"LPT{i}" for i in range(10))}


def _clean_component(part: str) -> str:
    part = "".join(ch for ch in part if ch.isprintable() and ch not in _UNSAFE_CHARS)
    # Until stable: ". .bashrc" must not become ".bashrc", nor ". .." become "..".
    while part != (stripped := part.strip().lstrip(".")):
        part = stripped
    if part and part.split(".", 1)[0].upper() in _RESERVED:
        part = "_" + part
    return part


def safe_subdir(raw: str | None, stream_id: str) -> tuple[str, ...]:
    """The components of an offer's ``amqs_dir``, each made safe as names are; refuses
    (ProtocolError) what cannot be a relative path inside the output directory.

    Refused: an absolute path, an empty, ``.`` or ``..`` component, a component that is
    empty once cleaned or longer than 200 bytes, more than 16 levels, more than 1024 bytes.
    Leading dots are dropped, so nothing can land in (or shadow) ``.amqstream``.
    """
    text = str(raw or "")
    if not text:
        return ()
    if len(text.encode("utf-8", "surrogatepass")) > MAX_DIR_BYTES:
        raise ProtocolError(f"stream {stream_id}: {H_DIR} is longer than {MAX_DIR_BYTES} bytes")
    text = text.replace("\\", "/")
    if text.startswith("/") or re.match(r"^[A-Za-z]:", text):
        raise ProtocolError(f"stream {stream_id}: {H_DIR}={text[:80]!r} is absolute; it must be relative")
    parts = text.split("/")
    if len(parts) > MAX_DIR_DEPTH:
        raise ProtocolError(f"stream {stream_id}: {H_DIR} has {len(parts)} levels, more than {MAX_DIR_DEPTH}")
    out = []
    for part in parts:
        if part in ("", ".", ".."):
            raise ProtocolError(f"stream {stream_id}: {H_DIR}={text[:80]!r} has an empty, '.' or '..' component")
        clean = _clean_component(part)
        if not clean or len(clean.encode("utf-8", "surrogatepass")) > MAX_DIR_COMPONENT_BYTES:
            raise ProtocolError(f"stream {stream_id}: {H_DIR} component {part[:40]!r} is empty once cleaned or "
                                f"longer than {MAX_DIR_COMPONENT_BYTES} bytes")
        out.append(clean)
    return tuple(out)


def safe_file_name(name: str, stream_id: str) -> str:
    """Turn a file name from the wire into one that cannot leave the output directory.

    Keeps only the last path component, drops control and shell-hostile characters,
    leading dots (no ``..``, no hidden files that shadow our state directory) and
    reserved device names, and caps the length at 200 UTF-8 bytes.
    """
    base = str(name).replace("\\", "/").rsplit("/", 1)[-1]
    base = _clean_component(base)
    if not base:
        base = stream_id
    raw = base.encode("utf-8", "ignore")
    if len(raw) > 200:
        stem, dot, ext = base.rpartition(".")
        ext_b = (dot + ext).encode("utf-8", "ignore")[:20] if stem else b""
        base = raw[: 200 - len(ext_b)].decode("utf-8", "ignore") + ext_b.decode("utf-8", "ignore")
    return base


# --------------------------------------------------------------------------- stream
@dataclass(frozen=True)
class StreamSpec:
    """What an offer announces; both ends derive chunk boundaries from it."""

    stream_id: str
    name: str
    size: int
    chunk_size: int
    mode: Mode = Mode.STREAM

    def __post_init__(self) -> None:
        validate_stream_id(self.stream_id)
        if not isinstance(self.size, int) or self.size < 0:
            raise ProtocolError(f"stream {self.stream_id}: size must be a non-negative integer")
        if not isinstance(self.chunk_size, int) or not 1 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise ProtocolError(
                f"stream {self.stream_id}: chunk size {self.chunk_size} is outside 1..{MAX_CHUNK_SIZE}"
            )

    @property
    def chunks(self) -> int:
        return -(-self.size // self.chunk_size)

    def chunk_span(self, seq: int) -> tuple[int, int]:
        """Byte offset and length of chunk ``seq`` (1-based)."""
        if not 1 <= seq <= self.chunks:
            raise ProtocolError(f"stream {self.stream_id}: chunk {seq} is outside 1..{self.chunks}")
        offset = (seq - 1) * self.chunk_size
        return offset, min(self.chunk_size, self.size - offset)

    def offset_of(self, seq: int) -> int:
        """Byte offset where chunk ``seq`` starts; ``chunks + 1`` gives the size."""
        return min((seq - 1) * self.chunk_size, self.size)


def crc32(body: bytes | memoryview) -> int:
    return zlib.crc32(body) & 0xFFFFFFFF


ENCODINGS = ("zstd",)
# Below this saving a chunk goes raw: decompressing it would cost more than it saves.
_MIN_SAVING = 0.95


class ChunkCodec:
    """Optional per-chunk compression (zstd level 1). A chunk that does not shrink by at
    least 5 % is sent raw, so incompressible data costs one quick failed attempt."""

    def __init__(self, encoding: str | None) -> None:
        if encoding not in (None, *ENCODINGS):
            raise ProtocolError(f"compression {encoding!r} is not supported; use one of {ENCODINGS} or none")
        self.encoding = encoding
        self._c = self._d = None
        if encoding == "zstd":
            import zstandard

            self._c = zstandard.ZstdCompressor(level=1)
            self._d = zstandard.ZstdDecompressor()

    def encode(self, body: bytes) -> tuple[bytes, str | None]:
        if self._c is None or len(body) < 512:
            return body, None
        packed = self._c.compress(body)
        if len(packed) > len(body) * _MIN_SAVING:
            return body, None
        return packed, self.encoding

    @staticmethod
    def decode(encoding: str, wire: bytes | memoryview, length: int) -> bytes:
        """Decompress one chunk; raises ProtocolError on anything but exactly ``length`` bytes.

        The frame must declare its content size, and it must be ``length``: python-zstandard
        allocates what a frame declares whatever ``max_output_size`` says (a 17-byte frame
        declaring 1 TiB ended in MemoryError), so the declaration is checked first.
        """
        if encoding != "zstd":
            raise ProtocolError(f"unknown chunk encoding {encoding[:20]!r}")
        import zstandard

        data = bytes(wire)
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"zstd chunk has no valid frame header: {exc}") from None
        if declared != length:
            what = "no content size" if declared < 0 else f"{declared} bytes"
            raise ProtocolError(f"zstd chunk declares {what}, expected {length}")
        try:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=length)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"zstd chunk does not decompress: {exc}") from None
        if len(out) != length:
            raise ProtocolError(f"zstd chunk decompresses to {len(out)} bytes, expected {length}")
        return out


def _base(spec: StreamSpec, kind: Kind) -> dict[str, str]:
    return {H_VERSION: str(PROTOCOL_VERSION), H_KIND: kind.value, H_STREAM: spec.stream_id,
            H_GROUP_ID: spec.stream_id}


def offer_headers(spec: StreamSpec, destination: Destination, window: int = DEFAULT_WINDOW, *,
                  reoffer: bool = False, origin: str | None = None, subdir: str = "") -> dict[str, str]:
    """The offer announcing a stream. A ``reoffer`` follows a sender's re-run: it may have
    repeated messages a receiver already consumed, so whoever published the stream
    clears them; nobody starts a reception from a re-offer. ``origin`` identifies the
    sender's file (see :data:`H_ORIGIN`); ``subdir`` the relative directory it goes to
    (see :data:`H_DIR`)."""
    h = _base(spec, Kind.OFFER)
    if subdir:
        h[H_DIR] = subdir
    if reoffer:
        h[H_REOFFER] = "1"
    if origin:
        h[H_ORIGIN] = origin
    h.update({H_MODE: spec.mode.value, H_NAME: spec.name, H_SIZE: str(spec.size),
              H_CHUNK_SIZE: str(spec.chunk_size), H_CHUNKS: str(spec.chunks),
              H_DATA_DEST: destination.data_queue(spec.stream_id)})
    if spec.mode is Mode.HANDSHAKE:
        h[H_REPLY_TO] = destination.control_queue(spec.stream_id)
        h[H_WINDOW] = str(window)
    return h


def control_headers(spec: StreamSpec, kind: Kind, consumer: str, next_seq: int, token: str) -> dict[str, str]:
    """A receiver's message to the sender: where it stands (``next_seq``: first chunk
    it does not have on disk), and its ``token`` for this stream."""
    if kind not in CONTROL_KINDS:
        raise ProtocolError(f"stream {spec.stream_id}: {kind.value} is not a control message")
    h = _base(spec, kind)
    del h[H_GROUP_ID]
    h.update({H_CONSUMER: consumer, H_NEXT_SEQ: str(next_seq), H_TOKEN: token})
    return h


def data_headers(spec: StreamSpec, seq: int, body: bytes | memoryview) -> dict[str, str]:
    """Headers of an uncompressed chunk; see :func:`data_message` for the general case."""
    return data_message(spec, seq, bytes(body))[0]


def data_message(spec: StreamSpec, seq: int, body: bytes,
                 codec: ChunkCodec | None = None) -> tuple[dict[str, str], bytes]:
    """Headers and wire body of chunk ``seq``. The CRC-32 covers the wire body, so
    corruption is caught before anything is decompressed."""
    offset, length = spec.chunk_span(seq)
    if len(body) != length:
        raise ProtocolError(
            f"stream {spec.stream_id}: chunk {seq} at offset {offset} has {len(body)} bytes, "
            f"expected {length} (did the file change while it was being sent?)"
        )
    wire, encoding = codec.encode(body) if codec else (body, None)
    h = _base(spec, Kind.DATA)
    h.update({H_SEQ: str(seq), H_GROUP_SEQ: str(seq), H_OFFSET: str(offset),
              H_CRC: str(crc32(wire))})
    if encoding:
        h[H_ENCODING] = encoding
    return h, wire


def end_headers(spec: StreamSpec, sha256_hex: str) -> dict[str, str]:
    h = _base(spec, Kind.END)
    # JMSXGroupSeq -1 closes the message group in ActiveMQ, freeing the consumer.
    h.update({H_SIZE: str(spec.size), H_CHUNKS: str(spec.chunks), H_SHA256: sha256_hex,
              H_GROUP_SEQ: "-1"})
    return h


def inline_offer(spec: StreamSpec, destination: Destination, body: bytes, sha256_hex: str, *,
                 codec: ChunkCodec | None = None, origin: str | None = None,
                 subdir: str = "") -> tuple[dict[str, str], bytes]:
    """Headers and wire body of an offer carrying a whole small file (one chunk at most).

    Small files are most of a bulk landing directory, and each one's data queue would cost
    a receiver a subscription and two more messages; inline, a file is one message."""
    if spec.mode is Mode.HANDSHAKE or spec.chunks > 1:
        raise ProtocolError(f"stream {spec.stream_id}: only a {spec.chunk_size}-byte (one chunk) stream, not in "
                            "handshake mode, can travel inline")
    if len(body) != spec.size:
        raise ProtocolError(f"stream {spec.stream_id}: {len(body)} bytes read, the offer says {spec.size} "
                            "(did the file change while it was being sent?)")
    wire, encoding = codec.encode(body) if codec else (body, None)
    h = offer_headers(spec, destination, origin=origin, subdir=subdir)
    h.update({H_INLINE: "1", H_CRC: str(crc32(wire)), H_SHA256: sha256_hex})
    if encoding:
        h[H_ENCODING] = encoding
    return h, wire


def is_inline(headers: Mapping[str, Any]) -> bool:
    """Whether an offer says it carries its file (any value of :data:`H_INLINE` does; only
    "1" is valid, which :func:`read_inline` checks)."""
    return headers.get(H_INLINE) is not None


def read_inline(headers: Mapping[str, Any], body: bytes | memoryview, spec: StreamSpec) -> bytes:
    """The file an inline offer carries, checked end to end: CRC-32 of the wire body, the
    declared encoding and length, and the SHA-256. Raises ProtocolError for any
    mismatch (the stream can never succeed)."""
    sid = spec.stream_id
    if headers.get(H_INLINE) != "1":
        raise ProtocolError(f"stream {sid}: {H_INLINE}={str(headers.get(H_INLINE))[:20]!r} (only \"1\" is valid)")
    if spec.mode is Mode.HANDSHAKE or spec.chunks > 1:
        raise ProtocolError(f"stream {sid}: an inline offer must be one chunk at most and not in handshake mode "
                            f"({spec.size} bytes in chunks of {spec.chunk_size}, mode {spec.mode.value})")
    sha = str(headers.get(H_SHA256, ""))
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ProtocolError(f"stream {sid}: inline offer has no valid {H_SHA256}")
    crc = _int_header(headers, H_CRC, sid, hi=0xFFFFFFFF)
    if crc32(body) != crc:
        raise ProtocolError(f"stream {sid}: the inline body failed its CRC-32 check")
    encoding = headers.get(H_ENCODING)
    data = ChunkCodec.decode(str(encoding), body, spec.size) if encoding else bytes(body)
    if len(data) != spec.size:
        raise ProtocolError(f"stream {sid}: the inline body has {len(data)} bytes, the offer says {spec.size}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha:
        raise ProtocolError(f"stream {sid}: SHA-256 mismatch: received {actual}, sender reported {sha}; the file "
                            "was not published")
    return data


def _int_header(headers: Mapping[str, Any], name: str, stream: str, *, lo: int = 0,
                hi: int = 2**63 - 1) -> int:
    raw = headers.get(name)
    if raw is None:
        raise ProtocolError(f"stream {stream}: header {name} is missing")
    # ASCII digits only: int() also takes "+2", " 4", "0_0" and other scripts' digits.
    if not _DIGITS.fullmatch(str(raw)):
        raise ProtocolError(f"stream {stream}: header {name}={str(raw)[:40]!r} is not an integer "
                            "(non-negative, ASCII digits only)")
    value = int(str(raw))
    if not lo <= value <= hi:
        raise ProtocolError(f"stream {stream}: header {name}={value} is outside {lo}..{hi}")
    return value


def kind_of(headers: Mapping[str, Any]) -> Kind:
    if H_TRUNCATED in headers:
        raise ProtocolError(
            f"stream {str(headers.get(H_STREAM, '?'))[:MAX_STREAM_ID]}: the message's header section was too large "
            f"and was cut by the receiver ({str(headers[H_TRUNCATED])[:80]})")
    try:
        return Kind(headers.get(H_KIND))
    except ValueError:
        raise ProtocolError(
            f"message is not an amqstream message ({H_KIND}={str(headers.get(H_KIND))[:20]!r})"
        ) from None


def parse_offer(headers: Mapping[str, Any], offered_on: Destination) -> tuple[StreamSpec, str]:
    """Validate an offer; return its spec and the data queue it names."""
    stream = str(headers.get(H_STREAM, "?"))[:MAX_STREAM_ID]
    if kind_of(headers) is not Kind.OFFER:
        raise ProtocolError(f"stream {stream}: expected an offer, got {headers.get(H_KIND)}")
    version = _int_header(headers, H_VERSION, stream, lo=1)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"stream {stream}: protocol version {version} is not supported (this receiver "
            f"speaks {PROTOCOL_VERSION}); upgrade airflow-provider-amqstream"
        )
    try:
        mode = Mode(headers.get(H_MODE, Mode.STREAM.value))
    except ValueError:
        raise ProtocolError(f"stream {stream}: unknown mode {headers.get(H_MODE)!r}") from None
    name = str(headers.get(H_NAME) or "")
    if not name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ProtocolError(f"stream {stream}: file name is missing or longer than {MAX_NAME_BYTES} bytes")
    spec = StreamSpec(
        stream_id=validate_stream_id(str(headers.get(H_STREAM, ""))),
        name=name,
        size=_int_header(headers, H_SIZE, stream),
        chunk_size=_int_header(headers, H_CHUNK_SIZE, stream, lo=1, hi=MAX_CHUNK_SIZE),
        mode=mode,
    )
    chunks = _int_header(headers, H_CHUNKS, stream)
    if chunks != spec.chunks:
        raise ProtocolError(f"stream {stream}: {H_CHUNKS}={chunks} does not match size and chunk size")
    data_dest = str(headers.get(H_DATA_DEST, ""))
    # Exactly the queue the offer's own destination implies: an offer naming any other
    # would make the receiver read (with its own rights) from somewhere the sender chose.
    if data_dest != offered_on.data_queue(spec.stream_id):
        raise ProtocolError(f"stream {stream}: data destination {data_dest[:80]!r} is not this stream's queue "
                            f"on {offered_on}")
    if mode is not Mode.HANDSHAKE and offered_on.kind != "queue":
        raise ProtocolError(f"stream {stream}: a {mode.value} stream must use a data queue")
    return spec, data_dest


def offer_origin(headers: Mapping[str, Any]) -> str:
    """The offer's origin digest, or "" when the sender sent none (older or plain producers)."""
    origin = str(headers.get(H_ORIGIN) or "")
    return origin if re.fullmatch(r"[0-9a-f]{16,64}", origin) else ""


def handshake_terms(headers: Mapping[str, Any], spec: StreamSpec, offered_on: Destination) -> tuple[str, int]:
    """The control queue and sender window a handshake offer names, validated."""
    dest = str(headers.get(H_REPLY_TO, ""))
    if dest != offered_on.control_queue(spec.stream_id):
        raise ProtocolError(f"stream {spec.stream_id}: handshake offer has no valid {H_REPLY_TO}")
    # A window past MAX_AHEAD would let an honest sender run further ahead of a gap than
    # any receiver accepts.
    return dest, _int_header(headers, H_WINDOW, spec.stream_id, lo=1, hi=MAX_AHEAD)


# --------------------------------------------------------------------------- sender
@dataclass
class SenderState:
    """What the sender knows for sure: the broker has stored chunks ``1..confirmed_seq``.

    Serialised to JSON after every confirmed window; a re-run continues at
    ``confirmed_seq + 1`` instead of at the start of the file.
    """

    spec: StreamSpec
    destination: str
    identity: str
    confirmed_seq: int = 0
    offer_sent: bool = False
    end_sent: bool = False
    sha256: str | None = None

    @property
    def confirmed_offset(self) -> int:
        return self.spec.offset_of(self.confirmed_seq + 1)

    @property
    def done(self) -> bool:
        return self.end_sent and (self.offer_sent or self.spec.mode is Mode.STREAM)

    def confirm(self, seq: int) -> None:
        if seq < self.confirmed_seq or seq > self.spec.chunks:
            raise ProtocolError(
                f"stream {self.spec.stream_id}: confirmation for chunk {seq} is out of order "
                f"(confirmed {self.confirmed_seq} of {self.spec.chunks})"
            )
        self.confirmed_seq = seq

    def to_json(self) -> dict[str, Any]:
        s = self.spec
        return {"version": PROTOCOL_VERSION, "stream_id": s.stream_id, "name": s.name,
                "size": s.size, "chunk_size": s.chunk_size, "mode": s.mode.value,
                "destination": self.destination, "identity": self.identity,
                "confirmed_seq": self.confirmed_seq, "offer_sent": self.offer_sent,
                "end_sent": self.end_sent, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SenderState:
        spec = StreamSpec(data["stream_id"], data["name"], int(data["size"]),
                          int(data["chunk_size"]), Mode(data["mode"]))
        st = cls(spec, data["destination"], data["identity"])
        st.confirm(int(data["confirmed_seq"]))
        st.offer_sent, st.end_sent = bool(data["offer_sent"]), bool(data["end_sent"])
        st.sha256 = data.get("sha256")
        return st


@dataclass
class HandshakeSender:
    """The sender's side of handshake mode: whom to send what next.

    Receivers report their position (``next_seq``: first chunk not on their disk). The
    sender sends in order from ``send_seq`` but never more than ``window`` chunks past
    the slowest receiver; a ``hello`` or ``rereq`` below ``send_seq`` rewinds it, which
    is both how lost chunks are recovered and how either end resumes.

    A receiver joins with ``hello`` and is bound to that message's token; its later
    messages with another token are ignored, as are messages from receivers that never
    said hello. On a queue only the
    receiver holding the offer can answer, so the sender serves one receiver: another
    replaces it only after it was silent for ``takeover_after`` seconds (it died and its
    offer moved). On a topic every receiver counts. Re-sent chunks are bounded by
    ``max_resend``: a receiver that rewinds for ever stops the sender.
    """

    spec: StreamSpec
    window: int
    point_to_point: bool = True
    takeover_after: float = 10.0
    positions: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    tokens: dict[str, str] = field(default_factory=dict)
    heard: dict[str, float] = field(default_factory=dict)
    send_seq: int = 1
    end_due: bool = True
    rewinds: int = 0
    resent: int = 0
    highest_sent: int = 0
    ignored: int = 0

    @property
    def max_resend(self) -> int:
        return 2 * self.spec.chunks + 64

    def on_control(self, headers: Mapping[str, Any], *, now: float) -> Kind | None:
        """Take one control message; return its kind, or None if it was ignored (not from a
        receiver this sender serves). Raises ProtocolError on a malformed message."""
        sid = self.spec.stream_id
        if headers.get(H_STREAM) != sid:
            raise ProtocolError(f"stream {sid}: control message for another stream arrived")
        kind = kind_of(headers)
        if kind not in CONTROL_KINDS:
            raise ProtocolError(f"stream {sid}: {kind.value} arrived on the control queue")
        consumer = str(headers.get(H_CONSUMER) or "")
        if not consumer or len(consumer) > 200:
            raise ProtocolError(f"stream {sid}: control message without a valid {H_CONSUMER}")
        token = str(headers.get(H_TOKEN) or "")
        if not re.fullmatch(r"[0-9a-f]{32}", token):
            raise ProtocolError(f"stream {sid}: control message from {consumer[:80]!r} without a valid {H_TOKEN}")
        pos = _int_header(headers, H_NEXT_SEQ, sid, lo=1, hi=self.spec.chunks + 1)
        if not self._admit(kind, consumer, token, now):
            self.ignored += 1
            return None
        self.heard[consumer] = now
        if kind is Kind.DONE:
            self.finished.add(consumer)
            self.positions[consumer] = self.spec.chunks + 1
            return kind
        self.finished.discard(consumer)
        if kind is Kind.ACK:
            self.positions[consumer] = max(self.positions.get(consumer, 1), pos)
            return kind
        self.positions[consumer] = pos
        if pos < self.send_seq:
            self.send_seq = pos
            self.rewinds += 1
        # A receiver that asks again from some point may have missed the end marker too.
        self.end_due = True
        return kind

    def _admit(self, kind: Kind, consumer: str, token: str, now: float) -> bool:
        known = self.tokens.get(consumer)
        if known is not None:
            return known == token
        if kind is not Kind.HELLO:
            return False  # a receiver introduces itself before anything else
        if self.point_to_point and self.tokens:
            last = max(self.heard.values(), default=now)
            if now - last < self.takeover_after:
                return False
            # The receiver we served went silent: it died, and this one took over its offer.
            self.positions.clear()
            self.finished.clear()
            self.tokens.clear()
        self.tokens[consumer] = token
        return True

    @property
    def slowest(self) -> int:
        return min(self.positions.values()) if self.positions else 1

    def next_chunk(self) -> int | None:
        """The chunk to send now, or None if the window is full or all were sent."""
        if not self.positions or self.send_seq > self.spec.chunks:
            return None
        if self.send_seq >= self.slowest + self.window:
            return None
        seq = self.send_seq
        self.send_seq += 1
        if seq <= self.highest_sent:
            self.resent += 1
            if self.resent > self.max_resend:
                raise ProtocolError(
                    f"stream {self.spec.stream_id}: receivers asked for {self.resent} chunks again, more than "
                    f"{self.max_resend} for a {self.spec.chunks}-chunk stream; stopping rather than resend for ever")
        self.highest_sent = max(self.highest_sent, seq)
        return seq

    def take_end(self) -> bool:
        """Whether the end marker should be sent now (after the last chunk, again after a rewind)."""
        if self.positions and self.send_seq > self.spec.chunks and self.end_due:
            self.end_due = False
            return True
        return False

    @property
    def all_done(self) -> bool:
        return bool(self.positions) and set(self.positions) <= self.finished


# --------------------------------------------------------------------------- receiver
class Verdict(str, Enum):
    WRITE = "write"          # new chunk: write it at its offset, then acknowledge
    DUPLICATE = "duplicate"  # already have it: acknowledge, write nothing
    CORRUPT = "corrupt"      # CRC mismatch: never write; the file cannot be published
    END = "end"              # end marker: remember the SHA-256


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    seq: int = 0
    offset: int = 0
    reason: str = ""
    data: bytes | memoryview | None = None  # the chunk's bytes to write (decompressed)


@dataclass
class ReceiverState:
    """Which chunks of one stream are on disk, and whether the stream can be published.

    ``next_seq`` is the first chunk not yet durable; every chunk below it is on disk.
    ``ahead`` holds durable chunks past a gap (out-of-order delivery). ``written``
    holds chunks written but not yet fsynced; it is never saved, so a crash never
    claims data that may not be on disk.
    """

    spec: StreamSpec
    next_seq: int = 1
    ahead: set[int] = field(default_factory=set)
    expected_sha256: str | None = None
    duplicates: int = 0
    written: set[int] = field(default_factory=set)

    def decide(self, headers: Mapping[str, Any], body: bytes | memoryview) -> Decision:
        """Classify one message of this stream's data queue. Raises ProtocolError on
        a message that cannot belong to the stream (wrong id, bad offsets, wrong length)."""
        sid = self.spec.stream_id
        if headers.get(H_STREAM) != sid:
            raise ProtocolError(
                f"stream {sid}: message for stream {str(headers.get(H_STREAM))[:MAX_STREAM_ID]!r} "
                "arrived on its data queue"
            )
        kind = kind_of(headers)
        if kind is Kind.END:
            size = _int_header(headers, H_SIZE, sid)
            chunks = _int_header(headers, H_CHUNKS, sid)
            sha = str(headers.get(H_SHA256, ""))
            if size != self.spec.size or chunks != self.spec.chunks:
                raise ProtocolError(
                    f"stream {sid}: end marker says {size} bytes in {chunks} chunks, the offer "
                    f"said {self.spec.size} in {self.spec.chunks}"
                )
            if not re.fullmatch(r"[0-9a-f]{64}", sha):
                raise ProtocolError(f"stream {sid}: end marker has no valid {H_SHA256}")
            self.expected_sha256 = sha
            return Decision(Verdict.END)
        if kind is not Kind.DATA:
            raise ProtocolError(f"stream {sid}: unexpected {kind.value} message on the data queue")
        seq = _int_header(headers, H_SEQ, sid, lo=1, hi=max(self.spec.chunks, 1))
        if seq > self.spec.chunks:
            raise ProtocolError(f"stream {sid}: chunk {seq} is past the last chunk {self.spec.chunks}")
        if seq >= self.next_seq + MAX_AHEAD:
            raise ProtocolError(f"stream {sid}: chunk {seq} is {seq - self.next_seq} chunks past the first missing "
                                f"chunk {self.next_seq} (at most {MAX_AHEAD} are accepted ahead of a gap)")
        offset, length = self.spec.chunk_span(seq)
        claimed = _int_header(headers, H_OFFSET, sid)
        if claimed != offset:
            raise ProtocolError(f"stream {sid}: chunk {seq} claims offset {claimed}, expected {offset}")
        if self.has(seq) or seq in self.written:
            self.duplicates += 1
            return Decision(Verdict.DUPLICATE, seq, offset)
        crc = _int_header(headers, H_CRC, sid, hi=0xFFFFFFFF)
        if crc32(body) != crc:
            return Decision(Verdict.CORRUPT, seq, offset,
                            f"chunk {seq} at offset {offset} failed its CRC-32 check")
        encoding = headers.get(H_ENCODING)
        if encoding:
            try:
                body = ChunkCodec.decode(str(encoding), body, length)
            except ProtocolError as exc:
                return Decision(Verdict.CORRUPT, seq, offset, f"chunk {seq} at offset {offset}: {exc}")
        if len(body) != length:
            return Decision(Verdict.CORRUPT, seq, offset,
                            f"chunk {seq} at offset {offset} has {len(body)} bytes, expected {length}")
        return Decision(Verdict.WRITE, seq, offset, data=body)

    def has(self, seq: int) -> bool:
        return seq < self.next_seq or seq in self.ahead

    def mark_written(self, seq: int) -> None:
        """Chunk ``seq`` was written but is not yet known to be on disk."""
        self.written.add(seq)

    def mark_durable(self, seq: int) -> list[int]:
        """Record chunk ``seq`` as on disk; return the chunks that became contiguous
        with the durable prefix, in order."""
        self.written.discard(seq)
        if self.has(seq):
            return []
        if seq != self.next_seq:
            self.ahead.add(seq)
            return []
        advanced = [seq]
        self.next_seq += 1
        while self.next_seq in self.ahead:
            self.ahead.discard(self.next_seq)
            advanced.append(self.next_seq)
            self.next_seq += 1
        return advanced

    @property
    def contiguous_bytes(self) -> int:
        return self.spec.offset_of(self.next_seq)

    @property
    def received_bytes(self) -> int:
        return self.contiguous_bytes + sum(self.spec.chunk_span(s)[1] for s in self.ahead)

    @property
    def all_chunks(self) -> bool:
        return self.next_seq > self.spec.chunks

    @property
    def all_written(self) -> bool:
        """Every chunk is durable or written (``written`` never overlaps the durable set)."""
        return self.next_seq - 1 + len(self.ahead) + len(self.written) >= self.spec.chunks

    @property
    def complete(self) -> bool:
        return self.all_chunks and self.expected_sha256 is not None

    def missing_ranges(self) -> list[tuple[int, int]]:
        """Missing chunk ranges as inclusive (first, last) pairs."""
        ranges: list[tuple[int, int]] = []
        seq = self.next_seq
        for have in sorted(self.ahead) + [self.spec.chunks + 1]:
            if have > seq:
                ranges.append((seq, have - 1))
            seq = have + 1
        return ranges

    def describe_missing(self) -> str:
        parts = []
        for first, last in self.missing_ranges()[:5]:
            lo = self.spec.offset_of(first)
            hi = self.spec.offset_of(last + 1)
            parts.append(f"chunks {first}-{last} (bytes {lo}-{hi - 1})")
        more = len(self.missing_ranges()) - 5
        return ", ".join(parts) + (f" and {more} more ranges" if more > 0 else "")

    def verify(self, actual_sha256: str) -> None:
        if not self.complete:
            raise ProtocolError(f"stream {self.spec.stream_id}: cannot verify an incomplete stream")
        if actual_sha256 != self.expected_sha256:
            raise ProtocolError(
                f"stream {self.spec.stream_id}: SHA-256 mismatch: received {actual_sha256}, "
                f"sender reported {self.expected_sha256}; the file was not published"
            )

    def to_json(self) -> dict[str, Any]:
        s = self.spec
        return {"version": PROTOCOL_VERSION, "stream_id": s.stream_id, "name": s.name,
                "size": s.size, "chunk_size": s.chunk_size, "mode": s.mode.value,
                "next_seq": self.next_seq, "ahead": sorted(self.ahead),
                "expected_sha256": self.expected_sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReceiverState:
        spec = StreamSpec(data["stream_id"], data["name"], int(data["size"]),
                          int(data["chunk_size"]), Mode(data["mode"]))
        st = cls(spec, int(data["next_seq"]), set(int(x) for x in data["ahead"]),
                 data.get("expected_sha256"))
        if not 1 <= st.next_seq <= spec.chunks + 1 or any(not st.next_seq < a <= spec.chunks for a in st.ahead):
            raise ProtocolError(f"stream {spec.stream_id}: resume state is inconsistent")
        return st


# --------------------------------------------------------------------------- batches
def batch_messages(batch_id: str, entries: list[Mapping[str, Any]]) -> list[tuple[dict[str, str], bytes]]:
    """The messages announcing a batch: its files as JSON lines (``stream_id``, ``dir``,
    ``name``, ``bytes``, ``sha256``), split into parts of at most ``BATCH_PART_FILES``."""
    validate_stream_id(batch_id)
    parts = [entries[i:i + BATCH_PART_FILES] for i in range(0, len(entries), BATCH_PART_FILES)] or [[]]
    out = []
    for k, part in enumerate(parts, 1):
        body = b"".join(json.dumps({f: e[f] for f in ("stream_id", "dir", "name", "bytes", "sha256")},
                                   ensure_ascii=False).encode() + b"\n" for e in part)
        h = {H_VERSION: str(PROTOCOL_VERSION), H_KIND: Kind.BATCH.value, H_STREAM: batch_id, H_BATCH: batch_id,
             H_PART: str(k), H_PARTS: str(len(parts))}
        out.append((h, body))
    return out


@dataclass(frozen=True)
class BatchEntry:
    """One file of a batch as the receiver checked it: where it must land, what it holds."""

    stream_id: str
    subdir: tuple[str, ...]
    name: str
    size: int
    sha256: str


def parse_batch(headers: Mapping[str, Any], body: bytes) -> tuple[str, int, int, list[BatchEntry]]:
    """Validate a batch message; return its id, part number, number of parts and entries."""
    batch_id = str(headers.get(H_BATCH, ""))[:MAX_STREAM_ID]
    try:
        validate_stream_id(batch_id)
    except ProtocolError:
        raise ProtocolError(f"batch message has an invalid {H_BATCH} {batch_id!r}") from None
    if str(headers.get(H_STREAM, "")) != batch_id:
        raise ProtocolError(f"batch {batch_id}: {H_STREAM} must equal {H_BATCH}")
    parts = _int_header(headers, H_PARTS, batch_id, lo=1, hi=MAX_BATCH_PARTS)
    part = _int_header(headers, H_PART, batch_id, lo=1, hi=parts)
    if len(body) > MAX_BATCH_BODY:
        raise ProtocolError(f"batch {batch_id}: part {part} is {len(body)} bytes, over {MAX_BATCH_BODY}")
    entries = []
    for n, line in enumerate(bytes(body).splitlines(), 1):
        if len(entries) >= BATCH_PART_FILES:
            raise ProtocolError(f"batch {batch_id}: part {part} lists more than {BATCH_PART_FILES} files")
        try:
            raw = json.loads(line)
            sid = validate_stream_id(str(raw["stream_id"]))
            size = raw["bytes"]
            if not isinstance(size, int) or isinstance(size, bool):
                raise ValueError("bytes is not an integer")
            sha = str(raw["sha256"])
            name = str(raw["name"])
            subdir = safe_subdir(str(raw.get("dir") or ""), sid)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"batch {batch_id}: part {part} line {n} is not a valid entry ({exc})") from None
        if size < 0 or not re.fullmatch(r"[0-9a-f]{64}", sha) or not name:
            raise ProtocolError(f"batch {batch_id}: part {part} line {n} has a bad size, sha256 or name")
        entries.append(BatchEntry(sid, subdir, name, size, sha))
    return batch_id, part, parts, entries


# --------------------------------------------------------------------------- packs
def pack_message(members: Sequence[tuple[Mapping[str, str], bytes]]) -> tuple[dict[str, str], bytes]:
    """Headers and body of a pack: several inline offers (``(headers, wire body)`` as
    :func:`inline_offer` makes them) in one message.

    Per message, the broker journals, dispatches and acknowledges; for 64 KiB files
    that cost more than the bytes, so a bulk sender puts up to a few dozen small files in
    one message. The body is a JSON index (each member's offer headers plus
    :data:`H_PACK_LEN`, its wire length) followed by the members' wire bodies in order.
    The pack's own id is derived from its members' ids."""
    if not 1 <= len(members) <= MAX_PACK_FILES:
        raise ProtocolError(f"a pack holds 1..{MAX_PACK_FILES} files, not {len(members)}")
    ids = [str(h[H_STREAM]) for h, _ in members]
    # JMS properties (the group id) mean nothing inside a pack: only amqs_* headers go in.
    index = json.dumps([{**{k: v for k, v in h.items() if k.startswith("amqs_")}, H_PACK_LEN: str(len(w))}
                        for h, w in members], separators=(",", ":"),
                       ensure_ascii=False).encode()
    if len(index) > MAX_PACK_INDEX:
        raise ProtocolError(f"the index of a pack of {len(members)} files is {len(index)} bytes, over {MAX_PACK_INDEX}")
    body = b"".join([index, *(w for _, w in members)])
    pack_id = "pk-" + hashlib.sha256("|".join(ids).encode()).hexdigest()[:32]
    return {H_VERSION: str(PROTOCOL_VERSION), H_KIND: Kind.PACK.value, H_STREAM: pack_id, H_INLINE: "1",
            H_PACK_FILES: str(len(members)), H_PACK_INDEX: str(len(index)), H_PACK_IDS: "|" + "|".join(ids) + "|",
            H_CRC: str(crc32(body))}, body


def is_pack(headers: Mapping[str, Any]) -> bool:
    return headers.get(H_KIND) == Kind.PACK.value


def read_pack(headers: Mapping[str, Any], body: bytes | memoryview) -> list[tuple[dict[str, str], memoryview]]:
    """The members of a pack: each one's offer headers and wire body, to be checked as an
    inline offer of its own (:func:`parse_offer`, :func:`read_inline`), so one bad file
    fails alone. Raises ProtocolError if the pack itself is malformed (then no member can
    be trusted)."""
    pid = str(headers.get(H_STREAM, "?"))[:MAX_STREAM_ID]
    if kind_of(headers) is not Kind.PACK:
        raise ProtocolError(f"pack {pid}: expected a pack, got {str(headers.get(H_KIND))[:20]!r}")
    version = _int_header(headers, H_VERSION, pid, lo=1)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"pack {pid}: protocol version {version} is not supported (this receiver speaks "
                            f"{PROTOCOL_VERSION}); upgrade airflow-provider-amqstream")
    try:
        validate_stream_id(pid)
    except ProtocolError as exc:
        raise ProtocolError(f"pack: {exc}") from None
    if headers.get(H_INLINE) != "1":
        raise ProtocolError(f"pack {pid}: {H_INLINE}={str(headers.get(H_INLINE))[:20]!r} (a pack must say \"1\")")
    count = _int_header(headers, H_PACK_FILES, pid, lo=1, hi=MAX_PACK_FILES)
    view = memoryview(body)
    index_len = _int_header(headers, H_PACK_INDEX, pid, lo=2, hi=min(MAX_PACK_INDEX, len(view)))
    if crc32(view) != _int_header(headers, H_CRC, pid, hi=0xFFFFFFFF):
        raise ProtocolError(f"pack {pid}: the body failed its CRC-32 check")
    try:
        index = json.loads(bytes(view[:index_len]))
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"pack {pid}: the index is not JSON ({str(exc)[:80]})") from None
    if not isinstance(index, list) or len(index) != count:
        raise ProtocolError(f"pack {pid}: the index must list {count} files ({H_PACK_FILES})")
    members: list[tuple[dict[str, str], memoryview]] = []
    offset = index_len
    for n, raw in enumerate(index, 1):
        if (not isinstance(raw, dict) or len(raw) > MAX_PACK_MEMBER_HEADERS or not all(
                isinstance(k, str) and k.startswith("amqs_") and isinstance(v, str) for k, v in raw.items())):
            raise ProtocolError(f"pack {pid}: member {n} is not a map of at most {MAX_PACK_MEMBER_HEADERS} amqs_* "
                                "string headers")
        length = _int_header(raw, H_PACK_LEN, f"{pid} member {n}", hi=len(view) - offset)
        member = {k: v for k, v in raw.items() if k != H_PACK_LEN}
        if member.get(H_KIND) != Kind.OFFER.value or member.get(H_INLINE) != "1":
            raise ProtocolError(f"pack {pid}: member {n} is not an inline offer")
        members.append((member, view[offset:offset + length]))
        offset += length
    if offset != len(view):
        raise ProtocolError(f"pack {pid}: {len(view) - offset} bytes after the last member")
    ids = "|" + "|".join(m.get(H_STREAM, "") for m, _ in members) + "|"
    if headers.get(H_PACK_IDS) != ids:
        raise ProtocolError(f"pack {pid}: {H_PACK_IDS} does not list exactly its members' stream ids")
    return members


def offer_selector(stream_id: str | None = None) -> str:
    """The selector for offered streams: any offer or pack; with ``stream_id``, that
    stream's offer or a pack carrying it (the id is validated, so it holds no quote and
    only ``_`` needs escaping for LIKE)."""
    if stream_id is None:
        return f"{H_KIND} IN ('{Kind.OFFER.value}', '{Kind.PACK.value}')"
    sid = validate_stream_id(stream_id)
    escaped = sid.replace("_", "!_")
    return (f"({H_KIND} = '{Kind.OFFER.value}' AND {H_STREAM} = '{sid}') OR "
            f"({H_KIND} = '{Kind.PACK.value}' AND {H_PACK_IDS} LIKE '%|{escaped}|%' ESCAPE '!')")
