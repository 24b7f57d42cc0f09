"""The many-files wire format: small files in their offers, batch manifests, and packs.

A file no larger than one chunk may travel *inline*: one offer carrying the file as its
body, with the CRC-32 of that body and the file's SHA-256 in its headers, and no data
queue at all (:func:`inline_offer`, :func:`read_inline`). Several inline offers may travel
together as one *pack* message: a JSON index of their headers, then their bodies
(:func:`pack_message`, :func:`read_pack`); each member is checked as the inline offer it
is. A sealed send seals each pack whole for its recipients (:func:`open_pack`). After a
batch's offers, the sender lists its files in *batch* messages (:func:`iter_batch_messages`,
:func:`parse_batch`), from which a receiver writes the batch's manifest. The wire format is
in ``docs/protocol.md``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from airflow_provider_amqstream.exceptions import LocalProtocolError, ProtocolError
from airflow_provider_amqstream.protocol.codec import ChunkCodec, crc32
from airflow_provider_amqstream.protocol.headers import (
    H_CHUNK_SIZE,
    H_CHUNKS,
    H_CRC,
    H_DATA_DEST,
    H_ENCODING,
    H_KIND,
    H_MODE,
    H_NAME,
    H_ORIGIN,
    H_PACK_IDS,
    H_SHA256,
    H_SIZE,
    H_STREAM,
    H_VERSION,
    MAX_CHUNK_SIZE,
    MAX_STREAM_ID,
    PROTOCOL_VERSION,
    Kind,
    Mode,
)
from airflow_provider_amqstream.protocol.names import Destination, validate_stream_id
from airflow_provider_amqstream.protocol.paths import safe_subdir
from airflow_provider_amqstream.protocol.seal import H_SEAL, SEALED_NAME, Identity, Seal
from airflow_provider_amqstream.protocol.wire import StreamSpec, from_the_wire, int_header, kind_of, offer_headers

# "1": the offer carries the whole file (at most one chunk) as its body; no data queue.
H_INLINE = "amqs_inline"
# A batch message: its id (also in amqs_stream, so selectors on it see one), part k of n.
H_BATCH = "amqs_batch"
H_PART = "amqs_part"
H_PARTS = "amqs_parts"
# A pack (several small files in one message): how many, the length of its JSON index at
# the start of the body, and in the index each member's wire length. Its members' stream
# ids (H_PACK_IDS) are in headers.py, as wire.py's offer_selector reads them.
H_PACK_FILES = "amqs_pack_files"
H_PACK_INDEX = "amqs_pack_index"
H_PACK_LEN = "amqs_pack_len"
# A sealed pack's members' sizes, "|" separated as H_PACK_IDS (their names are sealed).
H_PACK_SIZES = "amqs_pack_sizes"

# A batch list is split into parts of at most this many files (each a JSON line of ~250 bytes),
# and a receiver refuses a part whose body is larger than MAX_BATCH_BODY.
BATCH_PART_FILES = 2000
MAX_BATCH_BODY = 2 * 1024 * 1024
MAX_BATCH_PARTS = 10_000
# A pack holds at most this many files, and its index at most MAX_PACK_INDEX bytes (each
# member's offer headers, a few hundred bytes; the sender stops a pack well before).
MAX_PACK_FILES = 64
MAX_PACK_INDEX = 256 * 1024
MAX_PACK_MEMBER_HEADERS = 32
# What a sealed pack's member shows in a quarantine copy: what a sealed stream's offer shows.
_SEALED_MEMBER_SHOWS = frozenset({H_VERSION, H_KIND, H_STREAM, H_MODE, H_SIZE, H_CHUNK_SIZE, H_CHUNKS, H_DATA_DEST,
                                  H_ORIGIN, H_INLINE})


# --------------------------------------------------------------------------- inline offers
def inline_offer(spec: StreamSpec, destination: Destination, body: bytes, sha256_hex: str, *, sender: str,
                 codec: ChunkCodec | None = None, origin: str | None = None,
                 subdir: str = "") -> tuple[dict[str, str], bytes]:
    """Headers and wire body of an offer carrying a whole small file (one chunk at most);
    ``sender`` as for :func:`offer_headers`.

    Small files are most of a bulk landing directory, and each one's data queue would cost
    a receiver a subscription and two more messages; inline, a file is one message."""
    if spec.mode is Mode.HANDSHAKE or spec.chunks > 1:
        raise LocalProtocolError(f"stream {spec.stream_id}: only a {spec.chunk_size}-byte (one chunk) stream, not in "
                            "handshake mode, can travel inline")
    if len(body) != spec.size:
        raise LocalProtocolError(f"stream {spec.stream_id}: {len(body)} bytes read, the offer says {spec.size} "
                            "(did the file change while it was being sent?)")
    wire, encoding = codec.encode(body) if codec else (body, None)
    h = offer_headers(spec, destination, sender=sender, origin=origin, subdir=subdir)
    h.update({H_INLINE: "1", H_CRC: str(crc32(wire)), H_SHA256: sha256_hex})
    if encoding:
        h[H_ENCODING] = encoding
    return h, wire


def is_inline(headers: Mapping[str, Any]) -> bool:
    """Whether an offer says it carries its file (any value of :data:`H_INLINE` does; only
    "1" is valid, which :func:`read_inline` checks)."""
    return headers.get(H_INLINE) is not None


@from_the_wire
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
    crc = int_header(headers, H_CRC, sid, hi=0xFFFFFFFF)
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


# --------------------------------------------------------------------------- batches
def iter_batch_messages(batch_id: str, entries: Iterable[Mapping[str, Any]],
                        count: int) -> Iterator[tuple[dict[str, str], bytes]]:
    """The messages announcing a batch: its files as JSON lines (``stream_id``, ``dir``,
    ``name``, ``bytes``, ``sha256``), split into parts of at most ``BATCH_PART_FILES``, one
    part at a time, from ``count`` entries read as needed (a batch of a million files is
    never one list)."""
    validate_stream_id(batch_id)
    parts = max(1, -(-count // BATCH_PART_FILES))
    it = iter(entries)
    for k in range(1, parts + 1):
        # Each entry encoded as it is read: a part holds its lines, not the entries they came from.
        body = b"".join([json.dumps({f: e[f] for f in ("stream_id", "dir", "name", "bytes", "sha256")},
                                    ensure_ascii=False).encode() + b"\n"
                         for e in itertools.islice(it, BATCH_PART_FILES)])
        h = {H_VERSION: str(PROTOCOL_VERSION), H_KIND: Kind.BATCH.value, H_STREAM: batch_id, H_BATCH: batch_id,
             H_PART: str(k), H_PARTS: str(parts)}
        yield h, body


def seal_batch_part(headers: dict[str, str], body: bytes,
                    recipients: list[bytes]) -> tuple[dict[str, str], bytes | bytearray]:
    """A batch part sealed like one chunk of its own stream (the part's names and SHA-256
    would otherwise wait in the broker's store in clear): a fresh key wrapped for
    ``recipients``, bound to the batch id, the part and the number of parts.

    :param headers: the part's headers (:func:`iter_batch_messages`).
    """
    part, parts = int(headers[H_PART]), int(headers[H_PARTS])
    sealed = Seal.create(headers[H_BATCH], recipients, name="batch", size=part, chunk_size=parts)
    wire, nonce = sealed.chunk(1, True, body, None)
    return {**headers, H_SEAL: sealed.header, **nonce}, wire


def open_batch_part(headers: Mapping[str, Any], body: bytes | memoryview,
                    identities: list[Identity]) -> bytes | None:
    """A sealed batch part's JSON lines, or None when no identity holds a key for it; raises
    :class:`~airflow_provider_amqstream.protocol.seal.SealBroken` when it was altered, or
    moved from another part or batch."""
    batch_id = str(headers.get(H_BATCH, ""))[:MAX_STREAM_ID]
    parts = int_header(headers, H_PARTS, batch_id, lo=1, hi=MAX_BATCH_PARTS)
    part = int_header(headers, H_PART, batch_id, lo=1, hi=parts)
    opened = Seal.open(str(headers.get(H_SEAL)), identities, stream_id=batch_id, size=part, chunk_size=parts)
    if opened is None:
        return None
    return bytes(opened[0].open_chunk(1, True, body, headers))  # a copy of at most MAX_BATCH_BODY, per part


@dataclass(frozen=True)
class BatchEntry:
    """One file of a batch as the receiver checked it: where it must land, what it holds."""

    stream_id: str
    subdir: tuple[str, ...]
    name: str
    size: int
    sha256: str


@from_the_wire
def parse_batch(headers: Mapping[str, Any], body: bytes) -> tuple[str, int, int, list[BatchEntry]]:
    """Validate a batch message; return its id, part number, number of parts and entries."""
    batch_id = str(headers.get(H_BATCH, ""))[:MAX_STREAM_ID]
    try:
        validate_stream_id(batch_id)
    except ProtocolError:
        raise ProtocolError(f"batch message has an invalid {H_BATCH} {batch_id!r}") from None
    if str(headers.get(H_STREAM, "")) != batch_id:
        raise ProtocolError(f"batch {batch_id}: {H_STREAM} must equal {H_BATCH}")
    parts = int_header(headers, H_PARTS, batch_id, lo=1, hi=MAX_BATCH_PARTS)
    part = int_header(headers, H_PART, batch_id, lo=1, hi=parts)
    if len(body) > MAX_BATCH_BODY:
        raise ProtocolError(f"batch {batch_id}: part {part} is {len(body)} bytes, over {MAX_BATCH_BODY}")
    entries: list[BatchEntry] = []
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
def pack_message(members: Sequence[tuple[Mapping[str, str], bytes]],
                 recipients: Sequence[bytes] = ()) -> tuple[dict[str, str], bytes | bytearray]:
    """Headers and body of a pack: several inline offers (``(headers, wire body)`` as
    :func:`inline_offer` makes them) in one message, sealed for ``recipients`` if any.

    Per message, the broker journals, dispatches and acknowledges; for 64 KiB files
    that cost more than the bytes, so a bulk sender puts up to a few dozen small files in
    one message. The body is a JSON index (each member's offer headers plus
    :data:`H_PACK_LEN`, its wire length) followed by the members' wire bodies in order.
    The pack's own id is derived from its members' ids.

    Sealed, the body is the index's length (4 bytes) then index and members, all sealed as
    one chunk of the pack's own: the index holds the names, directories and SHA-256s. The
    headers show what a sealed stream's offer shows of each member, its id and size
    (:data:`H_PACK_SIZES`), and one key is wrapped per pack, not per file."""
    if not 1 <= len(members) <= MAX_PACK_FILES:
        raise LocalProtocolError(f"a pack holds 1..{MAX_PACK_FILES} files, not {len(members)}")
    ids = [str(h[H_STREAM]) for h, _ in members]
    # JMS properties (the group id) mean nothing inside a pack: only amqs_* headers go in.
    index = json.dumps([{**{k: v for k, v in h.items() if k.startswith("amqs_")}, H_PACK_LEN: str(len(w))}
                        for h, w in members], separators=(",", ":"),
                       ensure_ascii=False).encode()
    if len(index) > MAX_PACK_INDEX:
        raise LocalProtocolError(f"the index of a pack of {len(members)} files is {len(index)} bytes, "
                                 f"over {MAX_PACK_INDEX}")
    pack_id = "pk-" + hashlib.sha256("|".join(ids).encode()).hexdigest()[:32]
    headers = {H_VERSION: str(PROTOCOL_VERSION), H_KIND: Kind.PACK.value, H_STREAM: pack_id, H_INLINE: "1",
               H_PACK_FILES: str(len(members)), H_PACK_IDS: "|" + "|".join(ids) + "|"}
    if recipients:
        headers[H_PACK_SIZES] = "|" + "|".join(str(h[H_SIZE]) for h, _ in members) + "|"
        sealed = Seal.create(pack_id, list(recipients), name="pack", size=len(members),
                             chunk_size=shown_digest(headers))
        wire, nonce = sealed.chunk(1, True, [struct.pack(">I", len(index)), index, *(w for _, w in members)], None)
        return {**headers, H_SEAL: sealed.header, **nonce}, wire
    body = b"".join([index, *(w for _, w in members)])
    return {**headers, H_PACK_INDEX: str(len(index)), H_CRC: str(crc32(body))}, body


def is_pack(headers: Mapping[str, Any]) -> bool:
    return headers.get(H_KIND) == Kind.PACK.value


def is_sealed_pack(headers: Mapping[str, Any]) -> bool:
    return is_pack(headers) and headers.get(H_SEAL) is not None


@from_the_wire
def read_pack(headers: Mapping[str, Any], body: bytes | memoryview) -> list[tuple[dict[str, str], memoryview]]:
    """The members of an unsealed pack: each one's offer headers and wire body, to be checked
    as an inline offer of its own (:func:`parse_offer`, :func:`read_inline`), so one bad file
    fails alone. Raises ProtocolError if the pack itself is malformed (then no member can
    be trusted), or sealed (see :func:`open_pack`)."""
    pid, count = _pack_header(headers)
    if headers.get(H_SEAL) is not None:
        raise ProtocolError(f"pack {pid} is sealed: only a key holder can read its index")
    view = memoryview(body)
    index_len = int_header(headers, H_PACK_INDEX, pid, lo=2, hi=min(MAX_PACK_INDEX, len(view)))
    if crc32(view) != int_header(headers, H_CRC, pid, hi=0xFFFFFFFF):
        raise ProtocolError(f"pack {pid}: the body failed its CRC-32 check")
    return _members(headers, pid, count, view, index_len)


@from_the_wire
def open_pack(headers: Mapping[str, Any], body: bytes | memoryview,
              identities: list[Identity]) -> list[tuple[dict[str, str], memoryview]] | None:
    """The members of a sealed pack, as :func:`read_pack` gives an unsealed one's; None when no
    identity holds a key for it. Raises :class:`~airflow_provider_amqstream.protocol.seal.SealBroken`
    when it, or the ids and sizes it shows, were altered, or it was moved from another pack; a
    ProtocolError when it opens but its index or members are malformed (its sender sealed them so)."""
    pid, count = _pack_header(headers)
    shown = _shown(headers, pid, count)
    opened = Seal.open(str(headers.get(H_SEAL)), identities, stream_id=pid, size=count,
                       chunk_size=shown_digest(headers))
    if opened is None:
        return None
    plain = memoryview(opened[0].open_chunk(1, True, body, headers))
    # From here on the pack opened: what is wrong inside was sealed so by its sender.
    index_len = int.from_bytes(plain[:4], "big") if len(plain) >= 4 else -1
    if not 2 <= index_len <= min(MAX_PACK_INDEX, len(plain) - 4):
        raise ProtocolError(f"pack {pid}: its index length is {index_len}, outside 2..{len(plain) - 4}")
    members = _members(headers, pid, count, plain[4:], index_len)
    if [m.get(H_SIZE) for m, _ in members] != [str(size) for _, size in shown]:
        raise ProtocolError(f"pack {pid}: {H_PACK_SIZES} are not its members' sizes")
    return members


def shown_digest(headers: Mapping[str, Any]) -> int:
    """What a sealed pack shows of its members (ids and sizes), as the 64-bit number its sealed
    header is bound to: the broker can change neither without the pack failing to open."""
    shown = f"{headers.get(H_PACK_IDS, '')}{headers.get(H_PACK_SIZES, '')}".encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.sha256(shown).digest()[:8], "big")


@from_the_wire
def sealed_members(headers: Mapping[str, Any]) -> list[tuple[str, int]]:
    """What a sealed pack shows of its members without a key: each one's stream id and size,
    checked (a key holder also checks them against the members, :func:`open_pack`)."""
    return _shown(headers, *_pack_header(headers))


def sealed_member_offers(headers: Mapping[str, Any]) -> list[dict[str, str]]:
    """A sealed pack's members as offer headers for the views (``streams ls``, the offer
    watcher): what :func:`sealed_members` shows, named as a sealed stream is, each one an atomic
    inline offer of at most one chunk, as the sender made it."""
    return [{H_KIND: Kind.OFFER.value, H_STREAM: sid, H_NAME: SEALED_NAME, H_SIZE: str(size),
             H_CHUNKS: str(min(size, 1)), H_MODE: Mode.ATOMIC.value, H_INLINE: "1"}
            for sid, size in sealed_members(headers)]


def _shown(headers: Mapping[str, Any], pid: str, count: int) -> list[tuple[str, int]]:
    ids, sizes = (str(headers.get(h, "")).split("|") for h in (H_PACK_IDS, H_PACK_SIZES))
    if len(ids) != count + 2 or len(sizes) != count + 2 or ids[0] or ids[-1] or sizes[0] or sizes[-1]:
        raise ProtocolError(f"pack {pid}: {H_PACK_IDS} and {H_PACK_SIZES} must each list its {count} files "
                            "between bars")
    shown = []
    for sid, size in zip(ids[1:-1], sizes[1:-1], strict=True):
        if not (size.isdigit() and len(size) <= len(str(MAX_CHUNK_SIZE))):
            raise ProtocolError(f"pack {pid}: member {sid[:MAX_STREAM_ID]!r} has a size {size[:20]!r} that is no "
                                "chunk's")
        shown.append((validate_stream_id(sid), int(size)))
    return shown


def _members(headers: Mapping[str, Any], pid: str, count: int, view: memoryview,
             index_len: int) -> list[tuple[dict[str, str], memoryview]]:
    """A pack body's index (its first ``index_len`` bytes of ``view``) and members, checked."""
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
        length = int_header(raw, H_PACK_LEN, f"{pid} member {n}", hi=len(view) - offset)
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


def sealed_member_view(headers: Mapping[str, str]) -> dict[str, str]:
    """What a member of a sealed pack may show outside it (in a quarantine copy): what a sealed
    stream's offer shows, so no name, directory, CRC-32 or SHA-256."""
    return {**{k: v for k, v in headers.items() if k in _SEALED_MEMBER_SHOWS}, H_NAME: SEALED_NAME}


def _pack_header(headers: Mapping[str, Any]) -> tuple[str, int]:
    """A pack's own headers checked: its stream id and how many files it says it holds."""
    pid = str(headers.get(H_STREAM, "?"))[:MAX_STREAM_ID]
    if kind_of(headers) is not Kind.PACK:
        raise ProtocolError(f"pack {pid}: expected a pack, got {str(headers.get(H_KIND))[:20]!r}")
    version = int_header(headers, H_VERSION, pid, lo=1)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"pack {pid}: protocol version {version} is not supported (this receiver speaks "
                            f"{PROTOCOL_VERSION}); upgrade airflow-provider-amqstream")
    try:
        validate_stream_id(pid)
    except ProtocolError as exc:
        raise ProtocolError(f"pack: {exc}") from None
    if headers.get(H_INLINE) != "1":
        raise ProtocolError(f"pack {pid}: {H_INLINE}={str(headers.get(H_INLINE))[:20]!r} (a pack must say \"1\")")
    return pid, int_header(headers, H_PACK_FILES, pid, lo=1, hi=MAX_PACK_FILES)
