"""Hostile input: random and malformed frames never crash the receiver's state machine,
never get written unverified, and names from the wire never leave the output directory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from airflow_provider_amqstream.exceptions import ProtocolError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import paths
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec, crc32
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.state import ReceiverState, Verdict

FILE = hashlib.sha256(b"seed").digest() * 40  # 1280 bytes
SPEC = p.StreamSpec("hx-1", "f.bin", len(FILE), 100)
CODEC = ChunkCodec("zstd")

header_values = st.one_of(
    st.text(max_size=30), st.integers(-2**70, 2**70).map(str), st.sampled_from(["", "-1", "0", "13", "1e3", " 5"]),
)
header_names = st.sampled_from([hdr.H_KIND, hdr.H_STREAM, hdr.H_SEQ, hdr.H_OFFSET, hdr.H_CRC, hdr.H_SIZE, hdr.H_CHUNKS,
                                hdr.H_SHA256, hdr.H_ENCODING, hdr.H_VERSION, "JMSXGroupSeq", "other"])


def good_frame(seq: int) -> tuple[dict[str, str], bytes]:
    off, n = SPEC.chunk_span(seq)
    return p.data_message(SPEC, seq, FILE[off:off + n], CODEC if seq % 2 else None)


@st.composite
def frames(draw: st.DrawFn) -> tuple[dict[str, str], bytes]:
    seq = draw(st.integers(1, SPEC.chunks))
    headers, body = good_frame(seq)
    choice = draw(st.integers(0, 5))
    if choice == 1:  # tamper with headers
        for name, value in draw(st.dictionaries(header_names, header_values, max_size=4)).items():
            headers[name] = value
    elif choice == 2:  # drop headers
        for name in draw(st.lists(header_names, max_size=3)):
            headers.pop(name, None)
    elif choice == 3:  # body longer, shorter or different
        body = draw(st.binary(max_size=300))
    elif choice == 4:  # an end marker, right or wrong
        headers = p.end_headers(SPEC, draw(st.sampled_from([hashlib.sha256(FILE).hexdigest(), "0" * 64, "zz"])))
        body = b""
    return headers, body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames(), max_size=40))
def test_random_frames_never_crash_and_never_write_wrong_bytes(stream: list[tuple[dict[str, str], bytes]]) -> None:
    state = ReceiverState(SPEC)
    disk = bytearray(len(FILE))
    for headers, body in stream:
        try:
            d = state.decide(headers, body)
        except ProtocolError as exc:
            assert SPEC.stream_id in str(exc) or "amqstream message" in str(exc)  # names what failed
            continue
        if d.verdict is Verdict.WRITE:
            data = body if d.data is None else d.data
            # Whatever passed CRC, length and decoding is exactly the file's bytes there.
            assert bytes(data) == FILE[d.offset:d.offset + len(data)]
            disk[d.offset:d.offset + len(data)] = data
            state.mark_durable(d.seq)
    if state.complete:
        # Publication requires the SHA-256 to match: a wrong end marker can never publish.
        actual = hashlib.sha256(disk).hexdigest()
        if state.expected_sha256 != actual:
            try:
                state.verify(actual)
            except ProtocolError:
                return
            raise AssertionError("an unverified file would have been published")


@settings(max_examples=500, deadline=None)
@given(st.text(min_size=0, max_size=400))
def test_names_from_the_wire_stay_inside_the_output_directory(name: str) -> None:
    out = Path("/srv/out")
    safe = paths.safe_file_name(name, "sid-1")
    assert safe and "/" not in safe and "\x00" not in safe and not safe.startswith(".")
    assert safe not in (".", "..") and not safe.lstrip().startswith(".")
    assert len(safe.encode("utf-8", "surrogatepass")) <= 220
    assert os.path.normpath(out / safe).startswith(str(out) + "/")
    assert all(ch.isprintable() for ch in safe)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(header_names | st.sampled_from([hdr.H_NAME, hdr.H_MODE, hdr.H_CHUNK_SIZE, hdr.H_DATA_DEST]),
                       header_values, max_size=10))
def test_malformed_offers_are_refused_with_protocol_errors(headers: dict[str, str]) -> None:
    headers.setdefault(hdr.H_KIND, "offer")
    dest = Destination.parse("/queue/landing")
    try:
        spec, data_dest = p.parse_offer(headers, dest, sender="ann")
    except ProtocolError:
        return
    # Accepted only if it is a whole, consistent offer: what it says is what the spec holds.
    assert data_dest == dest.data_queue(spec.stream_id, "ann") == headers[hdr.H_DATA_DEST]
    assert (spec.size, spec.chunk_size, spec.chunks) == (int(headers[hdr.H_SIZE]), int(headers[hdr.H_CHUNK_SIZE]),
                                                        int(headers[hdr.H_CHUNKS]))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", fullmatch=True))
def test_collision_names_always_fit_one_directory_entry(name: str, sid: str) -> None:
    from airflow_provider_amqstream.engine.receive.partial_file import collision_name

    base = paths.safe_file_name(name, sid)
    other = collision_name(base, sid)
    assert len(other.encode("utf-8", "surrogatepass")) <= 255 and sid in other
    assert "/" not in other and not other.startswith(".") and other != base


@settings(max_examples=200, deadline=None)
@given(st.integers(1, SPEC.chunks), st.binary(min_size=1, max_size=200))
def test_forged_compressed_chunks_are_rejected(seq: int, junk: bytes) -> None:
    headers, _ = good_frame(seq)
    headers[hdr.H_ENCODING] = "zstd"
    headers[hdr.H_CRC] = str(crc32(junk))
    d = ReceiverState(SPEC).decide(headers, junk)
    assert d.verdict is Verdict.CORRUPT
