"""The amqstream chunk protocol: pure state machines, no I/O.

Read ``docs/protocol.md`` for the wire format. In short, a stream is:

* one ``offer`` message on the destination the user named (``/queue/landing``): it
  announces the stream (id, file name, size, chunk size) and where its chunks are;
* ``data`` messages on a per-stream queue ``<destination>.amqs.<sender>.<stream id>``
  (:meth:`Destination.data_queue`), one per chunk, each carrying its 1-based sequence number, byte offset and CRC-32;
* one ``end`` message on the same per-stream queue with the SHA-256 of the whole file.

A receiver takes one offer at a time (prefetch 1, acknowledged only when the file is
published), so it never has two streams open, and a crashed receiver's offer goes back
to the queue for the next one. Chunks are placed by offset, never by arrival order, so
a broker that reorders, redelivers or duplicates cannot corrupt the file.

In ``handshake`` mode the sender also listens: receivers answer the offer
with ``hello`` on a control queue, acknowledge each window with ``ack``, ask for a
resend from a sequence number with ``rereq``, and say ``done``. That gives consumer
discovery, a window of chunks per acknowledgement, recovery of lost or corrupted
chunks from the live sender, and topics where every subscriber gets the whole file.

Here: header names, stream ids and destinations, :class:`StreamSpec`, the messages
(offer, data, end, control) and their parsers, per-chunk compression
(:class:`ChunkCodec`) and the offer selector. Beside it, in the same pure layer and
built on this module:

* ``state.py``: what each end knows for sure about one stream: the sender's
  confirmed chunks (:class:`SenderState`) and the receiver's verdict on each data
  message and its durable chunks (:class:`ReceiverState`);
* ``handshake.py``: the sender's state machine in handshake mode (whom to send
  which chunk next);
* ``bulk.py``: the many-files wire format: small files inline in their offers,
  several inline offers in one pack, and a batch's file list;
* ``paths.py``: a file name and subdirectory off the wire made into a local path
  that cannot leave the output directory.

This module decides; the engine (``engine/``) reads files, writes files and talks to
the broker. Everything here can be unit-tested without a network or a disk.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, ParamSpec, TypeVar

from airflow_provider_amqstream.exceptions import LocalProtocolError, ProtocolError, RemoteProtocolError
from airflow_provider_amqstream.protocol.outcomes import H_QUARANTINE_CAUSE, Outcome

PROTOCOL_VERSION = 1
# STOMP's registered port: here, the one layer both the transport and the embedded broker
# may import (they are independent siblings).
DEFAULT_PORT = 61613

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
# A pack (see bulk.py): its members' stream ids as "|a|b|", for the LIKE in
# offer_selector.
H_PACK_IDS = "amqs_pack_ids"
# Added by a receiver that quarantines a stream, on the copy of its offer it files away.
H_QUARANTINE_REASON = "amqs_quarantine_reason"
H_QUARANTINED_FROM = "amqs_quarantined_from"
H_QUARANTINED_BY = "amqs_quarantined_by"
H_QUARANTINED_AT = "amqs_quarantined_at"
# A yielded stream's offer, put back at the tail of its queue by a receiver: not taken
# before this time (epoch seconds), how often it yielded, and who offered it first.
H_NOT_BEFORE = "amqs_not_before"
H_YIELDS = "amqs_yields"
H_YIELD_REASON = "amqs_yield_reason"
H_FIRST_SENDER = "amqs_first_sender"
# Where a stream's partial data is: a note a receiver leaves on Destination.held_queue
# before it takes any chunk, naming its host, output directory and partial file, so a
# receiver elsewhere (a retry on another worker) can say where the first bytes went.
H_HELD_HOST = "amqs_held_host"
H_HELD_DIR = "amqs_held_dir"
H_HELD_PART = "amqs_held_part"
H_HELD_SINCE = "amqs_held_since"
H_GROUP_ID = "JMSXGroupID"
H_GROUP_SEQ = "JMSXGroupSeq"
# The sender as the broker authenticated it, stamped on every message by a broker with
# populateJMSXUserID and useAuthenticatedPrincipalForJMSXUserID (the shipped config); ActiveMQ
# 5.17 shows it on STOMP MESSAGE frames under this name. Read it with sender_of only.
H_USER_ID = "JMSXUserID"
# Our user names are at most 64 characters; an external broker's (a JAAS principal) may be
# longer. A longer stamp is treated as none, not cut: a cut name could be another user's.
MAX_USER_ID = 256

DEFAULT_CHUNK_SIZE = 1024 * 1024
DEFAULT_WINDOW = 16
# Receiver batch: half the broker's page size (maxPageSize=16 in the shipped config).
DEFAULT_RECEIVE_BATCH = 8
# ActiveMQ's STOMP connector refuses frames over maxDataLength (9 MiB in our config: the
# largest chunk and its headers, and no more: a receiver may be handed several frames of
# that size before it can refuse any, and the broker pages in 16 per destination; 32 MiB
# chunks from a send-only user ran the shipped broker out of heap).
MAX_CHUNK_SIZE = 8 * 1024 * 1024
MAX_STREAM_ID = 128
MAX_NAME_BYTES = 255
# How far past the first missing chunk a chunk may be. Delivery reorders within a few
# prefetch windows; further ahead is a sender playing games (each chunk ahead of a gap is
# kept in the resume state, which is rewritten every batch).
MAX_AHEAD = 1024
# Set by the transport (frames.py) on a frame whose header section it had to cut; the
# transport does not import the protocol, so frames.py spells the name out.
H_TRUNCATED = "amqs_truncated"

# fullmatch only: `$` also matches before a trailing newline, which would reach file names.
_STREAM_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DEST_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_DIGITS = re.compile(r"[0-9]{1,20}")


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
    receiver ever starts on a stream whose producer died (a transaction,
    without holding the stream in broker memory: chunks wait in KahaDB).
    ``handshake``: the sender waits for receivers to answer the offer and paces itself
    by their acknowledgements; required for topics.
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


def derive_stream_id(file_name: str, identity: str, key: bytes = b"") -> str:
    """A stable stream id for a file: readable prefix plus a keyed hash of ``identity``.

    The same file (same identity: path, size, mtime) gets the same id, which is what
    lets a re-run of an interrupted send find its own resume point. With ``key`` (a secret
    only the sender's connection holds) another user who knows the file's name, size,
    mtime and destination still cannot compute the id, so cannot offer it first.
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", file_name).strip("._-")[:48] or "stream"
    return f"{stem}-{keyed_digest(identity, key)[:16]}"


def keyed_digest(text: str, key: bytes = b"") -> str:
    """Hex HMAC-SHA256 of ``text`` under ``key``; plain SHA-256 without a key.

    :param text: what the digest identifies.
    :param key: the sender's id key, or empty where no secret is known.
    """
    data = text.encode("utf-8", "surrogatepass")
    return hmac.new(key, data, hashlib.sha256).hexdigest() if key else hashlib.sha256(data).hexdigest()


def owner_element(user: str) -> str:
    """The name element standing for ``user`` in its data queues' names: a name of
    A-Z a-z 0-9 and ``-`` as it is; any other character as ``_`` and two hex digits per
    UTF-8 byte (``a.b`` -> ``a_2eb``), so no two users share an element and a dot in a
    name cannot reach into another user's prefix; ``_`` alone for no user; a name longer
    than 64 characters once escaped as ``_h`` and 40 hex digits of its SHA-256.

    :param user: the user name as the broker stamps it (``JMSXUserID``), or "".
    """
    if not user:
        return "_"
    element = "".join(c if c.isascii() and (c.isalnum() or c == "-") else
                      "".join(f"_{b:02x}" for b in c.encode("utf-8", "surrogatepass")) for c in user)
    if len(element) > 64:
        return "_h" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return element


_OWNER_ELEMENT_RE = re.compile(r"_|_h[0-9a-f]{40}|(?:[A-Za-z0-9-]|_[0-9a-f]{2}){1,64}")


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

    def data_queue(self, stream_id: str, sender: str) -> str:
        """Where one stream's chunks and end marker go: a queue, or for a topic a
        per-stream topic so every subscriber gets every chunk. Under its sender's own
        prefix (:func:`owner_element`), so a broker can grant each user, and cap, only its
        own data queues (``NAME.amqs.<owner>.>``).

        :param stream_id: the stream's id.
        :param sender: the user the broker knows the sender as ("" for none).
        """
        return f"/{self.kind}/{self.name}.amqs.{owner_element(sender)}.{validate_stream_id(stream_id)}"

    def parked_queue(self) -> str:
        """Where receivers park the offers of streams that gave way (queues only). Its own
        name element, so a broker ACL can let receivers write it and no sender."""
        return f"/queue/{self.name}.amqs_parked"

    def control_queue(self, stream_id: str) -> str:
        """Where receivers answer the sender in handshake mode (always a queue). Its own
        name element, not a suffix of the data queue's, so that a broker ACL (whose
        wildcards match prefixes only) can let senders read it without reading data."""
        return f"/queue/{self.name}.amqs_ctl.{validate_stream_id(stream_id)}"

    def quarantine_queue(self, quarantine: str | None = None) -> str:
        """Where receivers file the streams of this destination that can never succeed:
        ``quarantine`` if one was named (``--quarantine``), else the broker's dead-letter
        queue of the destination itself (``/queue/DLQ.NAME``).

        :param quarantine: the quarantine queue receivers were given, if any.
        """
        return str(Destination.parse(quarantine)) if quarantine else dead_letter_queue(str(self))

    def staging_queue(self, stream_id: str) -> str:
        """Where ``redrive`` gathers a stream's chunks while it checks them (under ``DLQ.``,
        which only administrators read: nothing else takes them from there)."""
        return f"/queue/DLQ.{self.name}.amqs_redrive.{validate_stream_id(stream_id)}"

    def stream_queues(self, stream_id: str, senders: Iterable[str]) -> list[str]:
        """Every queue that may hold chunks of ``stream_id``: its data queue under each sender
        it is known by (data queues are named after their sender) and the dead letters of each."""
        return [q for s in sorted(set(senders))
                for q in (self.data_queue(stream_id, s), dead_letter_queue(self.data_queue(stream_id, s)))]

    def held_queue(self, stream_id: str) -> str:
        """Where receivers note that they hold a stream's partial data (queues only; one
        note per receiving directory, removed when the stream is published or quarantined).
        Its own name element: receivers write it, senders need not see it."""
        return f"/queue/{self.name}.amqs_held.{validate_stream_id(stream_id)}"


def dead_letter_queue(queue: str) -> str:
    """Where the broker moves what is refused on ``queue`` (a ``/queue/NAME`` string): its
    own ``DLQ.NAME`` (the shipped broker's per-destination dead-letter strategy)."""
    return "/queue/DLQ." + queue.split("/", 2)[2]


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


try:
    # The same CRC-32 as zlib's (the wire's amqs_crc), from ISA-L: ~9 GB/s against zlib's ~2 on
    # this project's machines, which is ~0.4 CPU-s less per GiB on each end.
    from isal.isal_zlib import crc32 as _crc32  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # isal is a dependency; a platform without its wheel still works, slower
    _crc32 = zlib.crc32


def crc32(body: bytes | memoryview) -> int:
    """The CRC-32 (zlib's polynomial) of a chunk's wire body."""
    return int(_crc32(body)) & 0xFFFFFFFF


ENCODINGS = ("zstd",)
# What a sender may be asked for: a wire encoding always tried, "auto" (compress what shrinks,
# stop trying on data that does not) or "none".
COMPRESSION_SETTINGS = ("auto", *ENCODINGS, "none")
# Compress what pays: each byte not carried saves the broker ~9 CPU-s/GiB, and data that does not
# shrink costs one failed attempt per 64 chunks (docs/decisions/broker-tuning.md).
DEFAULT_COMPRESSION = "auto"
# Below this saving a chunk goes raw: decompressing it would cost more than it saves.
_MIN_SAVING = 0.95
# "auto" keeps a chunk compressed only if it shrank to half or less. At level -3 zstd costs
# the sender ~1.8 CPU-s per GiB it reads on this project's 2-core machines and the receiver
# ~0.9, and each GiB not carried saves the broker ~3 (docs/decisions/broker-tuning.md): below
# 2x the whole path would spend more CPU than it saves (on one machine).
_AUTO_SAVING = 0.5
# zstd's level for "auto" on chunks of _AUTO_FAST_FROM bytes or more: -3 shrank 1 GiB of CSV
# in 1 MiB chunks to 0.42 of its size where level 1 reached 0.27, at two thirds of the
# sender's CPU, and moved it end to end 8 % faster with sender, broker and receiver on one
# 2-core machine. Smaller bodies (pack members, small chunk sizes) keep level 1: negative
# levels shrink them too little to pass _AUTO_SAVING (4 KiB of the same CSV: 0.53 at -3,
# 0.32 at 1), and what they cost is per file, not per byte. "zstd" is asked for where bytes
# cost more than CPU (a slow link to the broker), so it is level 1 throughout.
_AUTO_LEVEL = -3
_AUTO_FAST_FROM = 256 * 1024
_ZSTD_LEVEL = 1
# "auto" after a chunk that did not shrink: sends the next 1, 2, 4 ... chunks raw without
# trying, at most this many, so incompressible data costs one failed attempt per 64 chunks
# (zstd gives up on random bytes at ~2 GB/s) and a file whose compressible part comes later
# is still found.
_AUTO_MAX_SKIP = 64


def normalise_compression(setting: str | None) -> str | None:
    """The compression a sender was asked for, checked: ``"auto"``, an encoding of
    :data:`ENCODINGS`, or None for none. ``"none"`` (any case) is None; None stays None
    (callers that mean "the default" pass :data:`DEFAULT_COMPRESSION`).

    :param setting: what the caller, the CLI or the connection's extra said.
    """
    if setting is None:
        return None
    value = str(setting).strip().lower()
    if value == "none":
        return None
    if value not in COMPRESSION_SETTINGS:
        raise LocalProtocolError(f"compression {setting!r} is not supported; use one of "
                            f"{', '.join(COMPRESSION_SETTINGS)}")
    return value


class ChunkCodec:
    """Optional per-chunk zstd compression on the sending side.

    ``"zstd"`` tries every chunk at level 1 and sends raw any that does not shrink by 5 %.
    ``"auto"`` compresses chunks of 256 KiB or more at the faster level -3 (smaller ones at
    level 1), keeps a chunk compressed only if it shrank to half or less, and after one that
    did not, skips trying for a growing number of chunks (1, 2, 4 ... 64): CSV or JSON is
    compressed from its first chunk, random or already compressed data costs one failed
    attempt per 64 chunks. Either way each chunk says on the wire whether it is compressed
    (``amqs_enc``), so receivers need no setting, and every receiver since per-chunk zstd
    decodes both levels.
    """

    def __init__(self, encoding: str | None) -> None:
        setting = normalise_compression(encoding)
        # The setting, as passed on to send_file (a bulk send does, per large file): "none",
        # not None, which would mean "the connection's" there.
        self.encoding = setting or "none"
        self._auto = setting == "auto"
        self._c = self._fast = None
        self._skip = self._backoff = 0
        if setting is not None:
            import zstandard

            self._c = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
            if self._auto:
                self._fast = zstandard.ZstdCompressor(level=_AUTO_LEVEL)

    def encode(self, body: bytes) -> tuple[bytes, str | None]:
        """The chunk's wire body and its encoding (None: sent as it is)."""
        if self._c is None or len(body) < 512:
            return body, None
        if self._skip:
            self._skip -= 1
            return body, None
        compressor = self._fast if self._fast is not None and len(body) >= _AUTO_FAST_FROM else self._c
        packed = compressor.compress(body)
        if len(packed) > len(body) * (_AUTO_SAVING if self._auto else _MIN_SAVING):
            if self._auto:
                self._backoff = min(max(1, 2 * self._backoff), _AUTO_MAX_SKIP)
                self._skip = self._backoff
            return body, None
        self._backoff = 0
        return packed, "zstd"

    @staticmethod
    def decode(encoding: str, wire: bytes | memoryview, length: int) -> bytes:
        """Decompress one chunk; raises ProtocolError on anything but exactly ``length`` bytes.

        The frame must declare its content size, and it must be ``length``: python-zstandard
        allocates what a frame declares whatever ``max_output_size`` says (a 17-byte frame
        declaring 1 TiB ended in MemoryError), so the declaration is checked first.
        """
        if encoding != "zstd":
            raise RemoteProtocolError(f"unknown chunk encoding {encoding[:20]!r}")
        import zstandard

        data = bytes(wire)
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise RemoteProtocolError(f"zstd chunk has no valid frame header: {exc}") from None
        if declared != length:
            what = "no content size" if declared < 0 else f"{declared} bytes"
            raise RemoteProtocolError(f"zstd chunk declares {what}, expected {length}")
        try:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=length)
        except zstandard.ZstdError as exc:
            raise RemoteProtocolError(f"zstd chunk does not decompress: {exc}") from None
        if len(out) != length:
            raise RemoteProtocolError(f"zstd chunk decompresses to {len(out)} bytes, expected {length}")
        return out


def _base(spec: StreamSpec, kind: Kind) -> dict[str, str]:
    return {H_VERSION: str(PROTOCOL_VERSION), H_KIND: kind.value, H_STREAM: spec.stream_id,
            H_GROUP_ID: spec.stream_id}


def offer_headers(spec: StreamSpec, destination: Destination, window: int = DEFAULT_WINDOW, *, sender: str,
                  reoffer: bool = False, origin: str | None = None, subdir: str = "") -> dict[str, str]:
    """The offer announcing a stream. A ``reoffer`` follows a sender's re-run: it may have
    repeated messages a receiver already consumed, so whoever published the stream
    clears them; nobody starts a reception from a re-offer. ``origin`` identifies the
    sender's file (see :data:`H_ORIGIN`); ``subdir`` the relative directory it goes to
    (see :data:`H_DIR`). ``sender`` is the user the sender logs in as, which names its
    data queue (:meth:`Destination.data_queue`)."""
    h = _base(spec, Kind.OFFER)
    if subdir:
        h[H_DIR] = subdir
    if reoffer:
        h[H_REOFFER] = "1"
    if origin:
        h[H_ORIGIN] = origin
    h.update({H_MODE: spec.mode.value, H_NAME: spec.name, H_SIZE: str(spec.size),
              H_CHUNK_SIZE: str(spec.chunk_size), H_CHUNKS: str(spec.chunks),
              H_DATA_DEST: destination.data_queue(spec.stream_id, sender)})
    if spec.mode is Mode.HANDSHAKE:
        h[H_REPLY_TO] = destination.control_queue(spec.stream_id)
        h[H_WINDOW] = str(window)
    return h


def control_headers(spec: StreamSpec, kind: Kind, consumer: str, next_seq: int, token: str) -> dict[str, str]:
    """A receiver's message to the sender: where it stands (``next_seq``: first chunk
    it does not have on disk), and its ``token`` for this stream."""
    if kind not in CONTROL_KINDS:
        raise LocalProtocolError(f"stream {spec.stream_id}: {kind.value} is not a control message")
    h = _base(spec, kind)
    del h[H_GROUP_ID]
    h.update({H_CONSUMER: consumer, H_NEXT_SEQ: str(next_seq), H_TOKEN: token})
    return h


def data_headers(spec: StreamSpec, seq: int, body: bytes | memoryview) -> dict[str, str]:
    """Headers of an uncompressed chunk; see :func:`data_message` for the general case."""
    return data_message(spec, seq, bytes(body))[0]


def data_message(spec: StreamSpec, seq: int, body: bytes, codec: ChunkCodec | None = None,
                 seal: Callable[[int, bytes, str | None], tuple[bytes, dict[str, str]]] | None = None,
                 ) -> tuple[dict[str, str], bytes]:
    """Headers and wire body of chunk ``seq``. The CRC-32 covers the wire body, so
    corruption is caught before anything is decompressed (or opened). ``seal`` (seal.py's
    ``Seal.sealer``) seals the encoded body, binding its encoding, and adds its nonce header."""
    offset, length = spec.chunk_span(seq)
    if len(body) != length:
        raise LocalProtocolError(
            f"stream {spec.stream_id}: chunk {seq} at offset {offset} has {len(body)} bytes, "
            f"expected {length} (did the file change while it was being sent?)"
        )
    wire, encoding = codec.encode(body) if codec else (body, None)
    sealed: dict[str, str] = {}
    if seal is not None:
        wire, sealed = seal(seq, wire, encoding)
    h = _base(spec, Kind.DATA)
    h.update(sealed)
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


_P = ParamSpec("_P")
_T = TypeVar("_T")


def from_the_wire(parse: Callable[_P, _T]) -> Callable[_P, _T]:
    """Mark ``parse`` as reading what a peer sent: a protocol error in it is the peer's
    (:class:`RemoteProtocolError`), also when a check shared with our own arguments (a stream
    id, a destination, a spec) found it."""

    @functools.wraps(parse)
    def read(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return parse(*args, **kwargs)
        except (RemoteProtocolError, LocalProtocolError):
            raise
        except ProtocolError as exc:
            raise RemoteProtocolError(str(exc)) from None

    return read


def int_header(headers: Mapping[str, Any], name: str, stream: str, *, lo: int = 0,
               hi: int = 2**63 - 1) -> int:
    """The integer header ``name``, checked to be within ``lo..hi``; raises ProtocolError
    naming ``stream`` and the header otherwise.

    :param headers: the message's headers.
    :param name: the header to read.
    :param stream: what the error names (a stream id, or e.g. "pack-id member 3").
    :param lo: the smallest value accepted.
    :param hi: the largest value accepted.
    """
    raw = headers.get(name)
    if raw is None:
        raise RemoteProtocolError(f"stream {stream}: header {name} is missing")
    # ASCII digits only: int() also takes "+2", " 4", "0_0" and other scripts' digits.
    if not _DIGITS.fullmatch(str(raw)):
        raise RemoteProtocolError(f"stream {stream}: header {name}={str(raw)[:40]!r} is not an integer "
                            "(non-negative, ASCII digits only)")
    value = int(str(raw))
    if not lo <= value <= hi:
        raise RemoteProtocolError(f"stream {stream}: header {name}={value} is outside {lo}..{hi}")
    return value


def kind_of(headers: Mapping[str, Any]) -> Kind:
    if H_TRUNCATED in headers:
        raise RemoteProtocolError(
            f"stream {str(headers.get(H_STREAM, '?'))[:MAX_STREAM_ID]}: the message's header section was too large "
            f"and was cut by the receiver ({str(headers[H_TRUNCATED])[:80]})")
    try:
        return Kind(headers.get(H_KIND))
    except ValueError:
        raise RemoteProtocolError(
            f"message is not an amqstream message ({H_KIND}={str(headers.get(H_KIND))[:20]!r})"
        ) from None


@from_the_wire
def parse_offer(headers: Mapping[str, Any], offered_on: Destination, *, sender: str) -> tuple[StreamSpec, str]:
    """Validate an offer; return its spec and the data queue it names.

    :param headers: the offer's headers.
    :param offered_on: the destination it was offered on.
    :param sender: who the broker says offered it (:func:`sender_of`); its data queue must
        be under that user's prefix. "" (the broker stamps no user) accepts any user's.
    """
    stream = str(headers.get(H_STREAM, "?"))[:MAX_STREAM_ID]
    if kind_of(headers) is not Kind.OFFER:
        raise ProtocolError(f"stream {stream}: expected an offer, got {headers.get(H_KIND)}")
    version = int_header(headers, H_VERSION, stream, lo=1)
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
        size=int_header(headers, H_SIZE, stream),
        chunk_size=int_header(headers, H_CHUNK_SIZE, stream, lo=1, hi=MAX_CHUNK_SIZE),
        mode=mode,
    )
    chunks = int_header(headers, H_CHUNKS, stream)
    if chunks != spec.chunks:
        raise ProtocolError(f"stream {stream}: {H_CHUNKS}={chunks} does not match size and chunk size")
    data_dest = str(headers.get(H_DATA_DEST, ""))
    # Exactly the queue the offer's own destination and its sender imply: an offer naming
    # any other would make the receiver read (with its own rights) from somewhere the
    # sender chose, another user's stream included.
    if sender:
        expected = offered_on.data_queue(spec.stream_id, sender)
        if data_dest != expected:
            raise ProtocolError(f"stream {stream}: data destination {data_dest[:120]!r} is not this stream's "
                                f"queue on {offered_on}, which for its sender {sender[:64]!r} (the broker's "
                                f"stamp) is {expected!r}; the sender must log in as the user the broker stamps")
    else:
        prefix, suffix = f"/{offered_on.kind}/{offered_on.name}.amqs.", f".{spec.stream_id}"
        owner = data_dest[len(prefix):-len(suffix)]
        if not (data_dest.startswith(prefix) and data_dest.endswith(suffix) and _OWNER_ELEMENT_RE.fullmatch(owner)):
            raise ProtocolError(f"stream {stream}: data destination {data_dest[:120]!r} is not this stream's "
                                f"queue on {offered_on}")
    if mode is not Mode.HANDSHAKE and offered_on.kind != "queue":
        raise ProtocolError(f"stream {stream}: a {mode.value} stream must use a data queue")
    return spec, data_dest


def offer_origin(headers: Mapping[str, Any]) -> str:
    """The offer's origin digest, or "" when the sender sent none (a plain producer)."""
    origin = str(headers.get(H_ORIGIN) or "")
    return origin if re.fullmatch(r"[0-9a-f]{16,64}", origin) else ""


def sender_of(headers: Mapping[str, Any], *, parked: bool = False) -> str:
    """The user the broker authenticated as this message's sender, or "" when there is none.

    Identity is the broker's stamp (``JMSXUserID``) and nothing else: a header a client
    writes is never identity, whether an ``amqs_*`` header, a pack member's index entry or
    a ``JMSXUserID`` on the client's own SEND frame. A broker with ``populateJMSXUserID``
    overwrites that last one with the authenticated user (tested: a send-only user who wrote
    ``JMSXUserID: admin`` arrived as itself); one without it drops it from STOMP frames. The
    exception is a connection that is, or claims to be, another broker: ActiveMQ keeps the
    stamp it brings (docs/security.md). "" means the sender is unknown (the broker does not
    stamp), never that nobody sent it. A value that is not 1 to ``MAX_USER_ID`` printable
    characters is "" too, rather than a cut-down name that could equal another user's.

    One header is believed besides the stamp: an offer taken from a destination's parked
    queue (:meth:`Destination.parked_queue`), which only receivers may write (the broker's
    ACL), carries its first sender in :data:`H_FIRST_SENDER`; a receiver believes it only on a
    copy stamped with its own user (engine/receive/offers.py).

    :param headers: the headers of a message as the broker delivered it (a MESSAGE frame),
        never those a sender chose (a pack member's, an offer being built).
    :param parked: the message came from a parked queue.
    """
    if parked:
        return _user_id(headers.get(H_FIRST_SENDER))
    return _user_id(headers.get(H_USER_ID))


def _user_id(value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_USER_ID or not value.isprintable():
        return ""
    return value


@from_the_wire
def handshake_terms(headers: Mapping[str, Any], spec: StreamSpec, offered_on: Destination) -> tuple[str, int]:
    """The control queue and sender window a handshake offer names, validated."""
    dest = str(headers.get(H_REPLY_TO, ""))
    if dest != offered_on.control_queue(spec.stream_id):
        raise ProtocolError(f"stream {spec.stream_id}: handshake offer has no valid {H_REPLY_TO}")
    # A window past MAX_AHEAD would let an honest sender run further ahead of a gap than
    # any receiver accepts.
    return dest, int_header(headers, H_WINDOW, spec.stream_id, lo=1, hi=MAX_AHEAD)


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


def parked_until(headers: Mapping[str, Any]) -> float:
    """When a parked offer may be taken again (epoch seconds); 0.0 for an offer that is not
    parked. A value that is not a number counts as not parked: whoever sent it gains
    nothing, since a stream taken early only yields again."""
    raw = str(headers.get(H_NOT_BEFORE) or "")
    if not raw or len(raw) > 24:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def yields_of(headers: Mapping[str, Any]) -> int:
    """How many times the stream behind an offer yielded (0 when never, or unreadable)."""
    raw = str(headers.get(H_YIELDS) or "")
    return int(raw) if _DIGITS.fullmatch(raw) and len(raw) < 6 else 0


def parked_headers(headers: Mapping[str, Any], *, sender: str, not_before: float | None = None,
                   reason: str = "") -> dict[str, str]:
    """The headers of an offer put in its destination's parked queue: its own ``amqs_*``
    headers and its first sender; after a yield (``not_before`` given) also when it may be
    taken again, the yield count and why. Without ``not_before`` (an offer passed along) the
    time and count it has are kept.

    :param headers: the offer as received.
    :param sender: who offered it first (:func:`sender_of`).
    :param not_before: epoch seconds before which no receiver takes it, for a new yield.
    :param reason: why the stream yielded (cut to 500 characters).
    """
    out = {k: str(v) for k, v in headers.items() if k.startswith("amqs_")}
    if not_before is not None:
        out.update({H_NOT_BEFORE: f"{not_before:.3f}", H_YIELDS: str(yields_of(headers) + 1),
                    H_YIELD_REASON: reason[:500]})
    if sender:
        out[H_FIRST_SENDER] = sender
    else:
        out.pop(H_FIRST_SENDER, None)
    return out


def quarantined_headers(headers: Mapping[str, Any], *, cause: Outcome, reason: str, source: str, by: str, at: str,
                        sender: str) -> dict[str, str]:
    """The headers of the copy of a message filed in a quarantine queue: its own ``amqs_*``
    headers (each cut to 1,024 characters; no earlier verdict kept) and why, from where, by
    which host and when.

    :param headers: the message as received.
    :param cause: why, as the failure table names it (``amqs_quarantine_cause``).
    :param reason: why it can never succeed, for people (cut to 2,000 characters).
    :param source: the destination it was taken from.
    :param by: the host that filed it.
    :param at: when, as an ISO 8601 time.
    :param sender: who offered it (:func:`sender_of`), kept as its first sender, in place of
        any the offer carried (only receivers write a quarantine queue, so it is believed
        there, and names the stream's data queues); "" for unknown.
    """
    out = {k: str(v)[:1024] for k, v in headers.items()
           if k.startswith("amqs_") and not k.startswith("amqs_quarantine") and k != H_FIRST_SENDER}
    out.update({H_QUARANTINE_CAUSE: cause.value, H_QUARANTINE_REASON: reason[:2000], H_QUARANTINED_FROM: source,
                H_QUARANTINED_BY: by, H_QUARANTINED_AT: at})
    if sender:
        out[H_FIRST_SENDER] = sender
    return out
