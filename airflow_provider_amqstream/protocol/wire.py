"""The amqstream chunk protocol's messages: pure, no I/O (docs/protocol.md, "Messages").

A stream is one ``offer`` on the destination the user named, ``data`` messages (one per
chunk, placed by offset, never by arrival order, so a broker that reorders, redelivers or
duplicates cannot corrupt the file) and one ``end`` with the SHA-256 of the whole, on a
per-stream queue (:meth:`Destination.data_queue`); in ``handshake`` mode receivers also
answer on a control queue (``hello``, ``ack``, ``rereq``, ``done``).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from airflow_provider_amqstream.exceptions import LocalProtocolError, ProtocolError, RemoteProtocolError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol.codec import ChunkCodec, crc32
from airflow_provider_amqstream.protocol.names import Destination, validate_stream_id
from airflow_provider_amqstream.protocol.outcomes import H_QUARANTINE_CAUSE, Outcome
from airflow_provider_amqstream.protocol.seal import H_SEAL, MAX_SEAL_HEADER, Seal

_DIGITS = re.compile(r"[0-9]{1,20}")


_OWNER_ELEMENT_RE = re.compile(r"_|_h[0-9a-f]{40}|(?:[A-Za-z0-9-]|_[0-9a-f]{2}){1,64}")


@dataclass(frozen=True)
class StreamSpec:
    """What an offer announces; both ends derive chunk boundaries from it."""

    stream_id: str
    name: str
    size: int
    chunk_size: int
    mode: hdr.Mode = hdr.Mode.STREAM

    def __post_init__(self) -> None:
        validate_stream_id(self.stream_id)
        if not isinstance(self.size, int) or self.size < 0:
            raise ProtocolError(f"stream {self.stream_id}: size must be a non-negative integer")
        if not isinstance(self.chunk_size, int) or not 1 <= self.chunk_size <= hdr.MAX_CHUNK_SIZE:
            raise ProtocolError(
                f"stream {self.stream_id}: chunk size {self.chunk_size} is outside 1..{hdr.MAX_CHUNK_SIZE}"
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

    def to_json(self) -> dict[str, Any]:
        """The spec as both ends' saved states hold it (with the protocol version)."""
        return {"version": hdr.PROTOCOL_VERSION, "stream_id": self.stream_id, "name": self.name, "size": self.size,
                "chunk_size": self.chunk_size, "mode": self.mode.value}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StreamSpec:
        return cls(data["stream_id"], data["name"], int(data["size"]), int(data["chunk_size"]), hdr.Mode(data["mode"]))


def _base(spec: StreamSpec, kind: hdr.Kind) -> dict[str, str]:
    return {hdr.H_VERSION: str(hdr.PROTOCOL_VERSION), hdr.H_KIND: kind.value, hdr.H_STREAM: spec.stream_id,
            hdr.H_GROUP_ID: spec.stream_id}


def offer_headers(spec: StreamSpec, destination: Destination, window: int = hdr.DEFAULT_WINDOW, *, sender: str,
                  reoffer: bool = False, origin: str | None = None, subdir: str = "",
                  seal: Seal | None = None) -> dict[str, str]:
    """The offer announcing a stream. A ``reoffer`` follows a sender's re-run: it may have
    repeated messages a receiver already consumed, so whoever published the stream
    clears them; nobody starts a reception from a re-offer. ``origin`` identifies the
    sender's file (see :data:`H_ORIGIN`); ``subdir`` the relative directory it goes to
    (see :data:`H_DIR`). ``sender`` is the user the sender logs in as, which names its
    data queue (:meth:`Destination.data_queue`). ``seal`` (a sealed stream's) adds its
    wrapped keys and sealed header, which holds ``subdir`` in its place (see :meth:`Seal.create`)."""
    h = _base(spec, hdr.Kind.OFFER)
    if seal is not None:
        h[H_SEAL] = seal.header
    elif subdir:
        h[hdr.H_DIR] = subdir
    if reoffer:
        h[hdr.H_REOFFER] = "1"
    if origin:
        h[hdr.H_ORIGIN] = origin
    h.update({hdr.H_MODE: spec.mode.value, hdr.H_NAME: spec.name, hdr.H_SIZE: str(spec.size),
              hdr.H_CHUNK_SIZE: str(spec.chunk_size), hdr.H_CHUNKS: str(spec.chunks),
              hdr.H_DATA_DEST: destination.data_queue(spec.stream_id, sender)})
    if spec.mode is hdr.Mode.HANDSHAKE:
        h[hdr.H_REPLY_TO] = destination.control_queue(spec.stream_id)
        h[hdr.H_WINDOW] = str(window)
    return h


def control_headers(spec: StreamSpec, kind: hdr.Kind, consumer: str, next_seq: int, token: str) -> dict[str, str]:
    """A receiver's message to the sender: where it stands (``next_seq``: first chunk
    it does not have on disk), and its ``token`` for this stream."""
    if kind not in hdr.CONTROL_KINDS:
        raise LocalProtocolError(f"stream {spec.stream_id}: {kind.value} is not a control message")
    h = _base(spec, kind)
    del h[hdr.H_GROUP_ID]
    h.update({hdr.H_CONSUMER: consumer, hdr.H_NEXT_SEQ: str(next_seq), hdr.H_TOKEN: token})
    return h


def data_message(spec: StreamSpec, seq: int, body: bytes, codec: ChunkCodec | None = None,
                 seal: Seal | None = None) -> tuple[dict[str, str], bytes | bytearray]:
    """Headers and wire body of chunk ``seq``. The CRC-32 covers the wire body, so
    corruption is caught before anything is decompressed. ``seal`` (a sealed stream's)
    seals the encoded body, binding its encoding, and adds its nonce header instead of the
    CRC-32: the seal's tag refuses all a CRC would, and each end saves ~0.1 CPU-s per GiB."""
    offset, length = spec.chunk_span(seq)
    if len(body) != length:
        raise LocalProtocolError(
            f"stream {spec.stream_id}: chunk {seq} at offset {offset} has {len(body)} bytes, "
            f"expected {length} (did the file change while it was being sent?)"
        )
    wire: bytes | bytearray
    wire, encoding = codec.encode(body) if codec else (body, None)
    sealed: dict[str, str] = {}
    if seal is not None:
        wire, sealed = seal.chunk(seq, seq == spec.chunks, wire, encoding)
    h = _base(spec, hdr.Kind.DATA)
    h.update(sealed or {hdr.H_CRC: str(crc32(wire))})
    h.update({hdr.H_SEQ: str(seq), hdr.H_GROUP_SEQ: str(seq), hdr.H_OFFSET: str(offset)})
    if encoding:
        h[hdr.H_ENCODING] = encoding
    return h, wire


def end_headers(spec: StreamSpec, sha256_hex: str, seal: Seal | None = None) -> dict[str, str]:
    """The end marker: the file's SHA-256, or for a stream sealed with ``seal`` its HMAC under
    the stream key (:meth:`Seal.digest`)."""
    h = _base(spec, hdr.Kind.END)
    # JMSXGroupSeq -1 closes the message group in ActiveMQ, freeing the consumer.
    h.update({hdr.H_SIZE: str(spec.size), hdr.H_CHUNKS: str(spec.chunks),
              hdr.H_SHA256: seal.digest(sha256_hex) if seal is not None else sha256_hex, hdr.H_GROUP_SEQ: "-1"})
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
    """The integer header ``name``, checked to be within ``lo..hi``.

    :param stream: what the error names (a stream id, or e.g. "pack-id member 3").
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


def kind_of(headers: Mapping[str, Any]) -> hdr.Kind:
    if hdr.H_TRUNCATED in headers:
        raise RemoteProtocolError(
            f"stream {str(headers.get(hdr.H_STREAM, '?'))[:hdr.MAX_STREAM_ID]}: the message's header section was too "
            f"large and was cut by the receiver ({str(headers[hdr.H_TRUNCATED])[:80]})")
    try:
        return hdr.Kind(headers.get(hdr.H_KIND))
    except ValueError:
        raise RemoteProtocolError(
            f"message is not an amqstream message ({hdr.H_KIND}={str(headers.get(hdr.H_KIND))[:20]!r})"
        ) from None


@from_the_wire
def parse_offer(headers: Mapping[str, Any], offered_on: Destination, *, sender: str) -> tuple[StreamSpec, str]:
    """Validate an offer; return its spec and the data queue it names.

    :param sender: who the broker says offered it (:func:`sender_of`); its data queue must
        be under that user's prefix. "" (the broker stamps no user) accepts any user's.
    """
    stream = str(headers.get(hdr.H_STREAM, "?"))[:hdr.MAX_STREAM_ID]
    if kind_of(headers) is not hdr.Kind.OFFER:
        raise ProtocolError(f"stream {stream}: expected an offer, got {headers.get(hdr.H_KIND)}")
    version = int_header(headers, hdr.H_VERSION, stream, lo=1)
    if version != hdr.PROTOCOL_VERSION:
        raise ProtocolError(
            f"stream {stream}: protocol version {version} is not supported (this receiver "
            f"speaks {hdr.PROTOCOL_VERSION}); upgrade airflow-provider-amqstream"
        )
    try:
        mode = hdr.Mode(headers.get(hdr.H_MODE, hdr.Mode.STREAM.value))
    except ValueError:
        raise ProtocolError(f"stream {stream}: unknown mode {headers.get(hdr.H_MODE)!r}") from None
    name = str(headers.get(hdr.H_NAME) or "")
    if not name or len(name.encode("utf-8", "surrogatepass")) > hdr.MAX_NAME_BYTES:
        raise ProtocolError(f"stream {stream}: file name is missing or longer than {hdr.MAX_NAME_BYTES} bytes")
    spec = StreamSpec(
        stream_id=validate_stream_id(str(headers.get(hdr.H_STREAM, ""))),
        name=name,
        size=int_header(headers, hdr.H_SIZE, stream),
        chunk_size=int_header(headers, hdr.H_CHUNK_SIZE, stream, lo=1, hi=hdr.MAX_CHUNK_SIZE),
        mode=mode,
    )
    chunks = int_header(headers, hdr.H_CHUNKS, stream)
    if chunks != spec.chunks:
        raise ProtocolError(f"stream {stream}: {hdr.H_CHUNKS}={chunks} does not match size and chunk size")
    data_dest = str(headers.get(hdr.H_DATA_DEST, ""))
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
    if mode is not hdr.Mode.HANDSHAKE and offered_on.kind != "queue":
        raise ProtocolError(f"stream {stream}: a {mode.value} stream must use a data queue")
    return spec, data_dest


def offer_origin(headers: Mapping[str, Any]) -> str:
    """The offer's origin digest, or "" when the sender sent none (a plain producer)."""
    origin = str(headers.get(hdr.H_ORIGIN) or "")
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
    value = headers.get(hdr.H_FIRST_SENDER if parked else hdr.H_USER_ID)
    if not isinstance(value, str) or not 0 < len(value) <= hdr.MAX_USER_ID or not value.isprintable():
        return ""
    return value


@from_the_wire
def handshake_terms(headers: Mapping[str, Any], spec: StreamSpec, offered_on: Destination) -> tuple[str, int]:
    """The control queue and sender window a handshake offer names, validated."""
    dest = str(headers.get(hdr.H_REPLY_TO, ""))
    if dest != offered_on.control_queue(spec.stream_id):
        raise ProtocolError(f"stream {spec.stream_id}: handshake offer has no valid {hdr.H_REPLY_TO}")
    # A window past MAX_AHEAD would let an honest sender run further ahead of a gap than
    # any receiver accepts.
    return dest, int_header(headers, hdr.H_WINDOW, spec.stream_id, lo=1, hi=hdr.MAX_AHEAD)


def offer_selector(stream_id: str | None = None) -> str:
    """The selector for offered streams: any offer or pack; with ``stream_id``, that
    stream's offer or a pack carrying it (the id is validated, so it holds no quote and
    only ``_`` needs escaping for LIKE)."""
    if stream_id is None:
        return f"{hdr.H_KIND} IN ('{hdr.Kind.OFFER.value}', '{hdr.Kind.PACK.value}')"
    sid = validate_stream_id(stream_id)
    escaped = sid.replace("_", "!_")
    return (f"({hdr.H_KIND} = '{hdr.Kind.OFFER.value}' AND {hdr.H_STREAM} = '{sid}') OR "
            f"({hdr.H_KIND} = '{hdr.Kind.PACK.value}' AND {hdr.H_PACK_IDS} LIKE '%|{escaped}|%' ESCAPE '!')")


def parked_until(headers: Mapping[str, Any]) -> float:
    """When a parked offer may be taken again (epoch seconds); 0.0 for an offer that is not
    parked. A value that is not a number counts as not parked: whoever sent it gains
    nothing, since a stream taken early only yields again."""
    raw = str(headers.get(hdr.H_NOT_BEFORE) or "")
    try:
        value = float(raw) if len(raw) <= 24 else 0.0
    except ValueError:  # "" too
        return 0.0
    return value if math.isfinite(value) else 0.0


def yields_of(headers: Mapping[str, Any]) -> int:
    """How many times the stream behind an offer yielded (0 when never, or unreadable)."""
    raw = str(headers.get(hdr.H_YIELDS) or "")
    return int(raw) if _DIGITS.fullmatch(raw) and len(raw) < 6 else 0


def parked_headers(headers: Mapping[str, Any], *, sender: str, not_before: float | None = None,
                   reason: str = "") -> dict[str, str]:
    """The headers of an offer put in its destination's parked queue: its own ``amqs_*``
    headers and its first sender; after a yield (``not_before`` given) also when it may be
    taken again, the yield count and why. Without ``not_before`` (an offer passed along) the
    time and count it has are kept.

    :param sender: who offered it first (:func:`sender_of`).
    :param not_before: epoch seconds before which no receiver takes it, for a new yield.
    :param reason: why the stream yielded (cut to 500 characters).
    """
    out = {k: str(v) for k, v in headers.items() if k.startswith("amqs_")}
    if not_before is not None:
        out.update({hdr.H_NOT_BEFORE: f"{not_before:.3f}", hdr.H_YIELDS: str(yields_of(headers) + 1),
                    hdr.H_YIELD_REASON: reason[:500]})
    if sender:
        out[hdr.H_FIRST_SENDER] = sender
    else:
        out.pop(hdr.H_FIRST_SENDER, None)
    return out


def quarantined_headers(headers: Mapping[str, Any], *, cause: Outcome, reason: str, source: str, by: str, at: str,
                        sender: str) -> dict[str, str]:
    """The headers of the copy of a message filed in a quarantine queue: its own ``amqs_*``
    headers (each cut to 1,024 characters, ``amqs_seal`` to 4,096; no earlier verdict kept)
    and why, from where, by which host and when.

    :param cause: why, as the failure table names it (``amqs_quarantine_cause``).
    :param reason: why it can never succeed, for people (cut to 2,000 characters).
    :param source: the destination it was taken from.
    :param by: the host that filed it.
    :param at: when, as an ISO 8601 time.
    :param sender: who offered it (:func:`sender_of`), kept as its first sender, in place of
        any the offer carried (only receivers write a quarantine queue, so it is believed
        there, and names the stream's data queues); "" for unknown.
    """
    out = {k: str(v)[:MAX_SEAL_HEADER if k == H_SEAL else 1024] for k, v in headers.items()
           if k.startswith("amqs_") and not k.startswith("amqs_quarantine") and k != hdr.H_FIRST_SENDER}
    out.update({H_QUARANTINE_CAUSE: cause.value, hdr.H_QUARANTINE_REASON: reason[:2000], hdr.H_QUARANTINED_FROM: source,
                hdr.H_QUARANTINED_BY: by, hdr.H_QUARANTINED_AT: at})
    if sender:
        out[hdr.H_FIRST_SENDER] = sender
    return out
