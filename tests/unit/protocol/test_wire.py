"""The chunk protocol's state machines, without a network or a disk."""

from __future__ import annotations

import hashlib
import random

import pytest

from airflow_provider_amqstream.exceptions import ProtocolError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import paths
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import (
    _AUTO_MAX_SKIP,
    _AUTO_SAVING,
    ChunkCodec,
    crc32,
    normalise_compression,
)
from airflow_provider_amqstream.protocol.handshake import HandshakeSender
from airflow_provider_amqstream.protocol.names import Destination, derive_stream_id, owner_element, validate_stream_id
from airflow_provider_amqstream.protocol.state import ReceiverState, SenderState, Verdict


def spec(size: int = 10_000, chunk: int = 1000, sid: str = "s1") -> p.StreamSpec:
    return p.StreamSpec(sid, "data.csv", size, chunk)


def chunks_of(data: bytes, sp: p.StreamSpec) -> list[tuple[dict[str, str], bytes]]:
    out = []
    for seq in range(1, sp.chunks + 1):
        off, n = sp.chunk_span(seq)
        body = data[off:off + n]
        out.append((p.data_message(sp, seq, body)[0], body))
    return out


def reassemble(sp: p.StreamSpec, frames: list[tuple[dict[str, str], bytes]]) -> tuple[bytes, ReceiverState]:
    st = ReceiverState(sp)
    buf = bytearray(sp.size)
    for headers, body in frames:
        d = st.decide(headers, body)
        if d.verdict is Verdict.WRITE:
            buf[d.offset:d.offset + len(body)] = body
            st.mark_durable(d.seq)
    return bytes(buf), st


def test_chunk_geometry() -> None:
    assert spec(0).chunks == 0
    assert spec(1000).chunks == 1
    assert spec(1001).chunks == 2
    assert spec(3000).chunk_span(3) == (2000, 1000)
    assert spec(2500).chunk_span(3) == (2000, 500)
    with pytest.raises(ProtocolError, match="outside 1..3"):
        spec(2500).chunk_span(4)


def test_headers_are_jms_identifiers_and_carry_group() -> None:
    sp = spec()
    h = p.data_message(sp, 2, b"x" * 1000)[0]
    for name in h:
        assert name.isidentifier() and not name.startswith("JMS") or name in (hdr.H_GROUP_ID, hdr.H_GROUP_SEQ)
    assert h[hdr.H_GROUP_ID] == "s1" and h[hdr.H_GROUP_SEQ] == "2" and h[hdr.H_OFFSET] == "1000"
    assert p.end_headers(sp, "0" * 64)[hdr.H_GROUP_SEQ] == "-1"


def test_out_of_order_and_duplicates_reassemble_exactly() -> None:
    data = random.Random(1).randbytes(10_500)
    sp = spec(len(data))
    frames = chunks_of(data, sp)
    shuffled = frames + frames[3:6]
    random.Random(2).shuffle(shuffled)
    out, st = reassemble(sp, shuffled)
    assert out == data
    assert st.next_seq > st.spec.chunks and st.duplicates == 3 and not st.ahead


def test_mark_durable_returns_chunks_in_hash_order() -> None:
    st = ReceiverState(spec(5000))
    assert st.mark_durable(3) == []
    assert st.mark_durable(2) == []
    assert st.mark_durable(1) == [1, 2, 3]
    assert st.mark_durable(5) == []
    assert st.missing_ranges() == [(4, 4)]
    assert st.mark_durable(4) == [4, 5]


def test_missing_ranges_are_named_with_bytes() -> None:
    st = ReceiverState(spec(10_000))
    for seq in (1, 2, 5, 9):
        st.mark_durable(seq)
    assert st.missing_ranges() == [(3, 4), (6, 8), (10, 10)]
    assert "chunks 3-4 (bytes 2000-3999)" in st.describe_missing()


def test_corrupt_chunk_is_never_written() -> None:
    sp = spec(3000)
    headers, body = chunks_of(b"a" * 3000, sp)[1]
    d = ReceiverState(sp).decide(headers, b"b" + body[1:])
    assert d.verdict is Verdict.CORRUPT and "CRC-32" in d.reason and "offset 1000" in d.reason
    short = body[:-1]  # a CRC that matches, over a body of the wrong length
    d = ReceiverState(sp).decide(headers | {hdr.H_CRC: str(crc32(short))}, short)
    assert d.verdict is Verdict.CORRUPT and "999 bytes" in d.reason


@pytest.mark.parametrize("field,value,match", [
    (hdr.H_SEQ, "0", "outside"), (hdr.H_SEQ, "4", "outside"), (hdr.H_SEQ, "x", "not an integer"),
    (hdr.H_OFFSET, "5", "claims offset"), (hdr.H_STREAM, "other", "arrived on its data queue"),
    (hdr.H_KIND, "offer", "unexpected offer"), (hdr.H_KIND, "zzz", "not an amqstream message"),
])
def test_malformed_data_headers_raise_protocol_error(field: str, value: str, match: str) -> None:
    sp = spec(3000)
    headers, body = chunks_of(b"a" * 3000, sp)[1]
    headers[field] = value
    with pytest.raises(ProtocolError, match=match):
        ReceiverState(sp).decide(headers, body)


def test_end_marker_and_verification() -> None:
    data = b"hello world" * 100
    sp = spec(len(data))
    _, st = reassemble(sp, chunks_of(data, sp))
    sha = hashlib.sha256(data).hexdigest()
    assert st.decide(p.end_headers(sp, sha), b"").verdict is Verdict.END
    assert st.complete
    st.verify(sha)
    with pytest.raises(ProtocolError, match="SHA-256 mismatch"):
        st.verify("0" * 64)
    bad = p.end_headers(sp, sha) | {hdr.H_SIZE: "1"}
    with pytest.raises(ProtocolError, match="end marker says"):
        ReceiverState(sp).decide(bad, b"")


def test_handshake_reply_queue_must_be_the_streams_own() -> None:
    sp = p.StreamSpec("abc-1", "f.bin", 10, 5, hdr.Mode.HANDSHAKE)
    topic = Destination.parse("/topic/news")
    h = p.offer_headers(sp, topic, window=4, sender="ann")
    assert p.parse_offer(h, topic, sender="ann") == (sp, "/topic/news.amqs.ann.abc-1")
    assert p.handshake_terms(h, sp, topic) == ("/queue/news.amqs_ctl.abc-1", 4)
    for reply in ("/queue/payroll.amqs_ctl.abc-1", "/topic/news.amqs_ctl.abc-1", ""):
        with pytest.raises(ProtocolError, match="no valid amqs_reply_to"):
            p.handshake_terms(h | {hdr.H_REPLY_TO: reply}, sp, topic)


def test_offer_round_trip_and_validation() -> None:
    sp = p.StreamSpec("abc-1", "naïve.csv", 12345, 1000, hdr.Mode.ATOMIC)
    dest = Destination.parse("/queue/landing")
    got, data_q = p.parse_offer(p.offer_headers(sp, dest, sender="ann"), dest, sender="ann")
    assert got == sp and data_q == "/queue/landing.amqs.ann.abc-1"
    for elsewhere in ("/queue/elsewhere", "/queue/secret.amqs.ann.abc-1", "/queue/landing.amqs.abc-1"):
        h = p.offer_headers(sp, dest, sender="ann")
        h[hdr.H_DATA_DEST] = elsewhere  # a confused deputy: the receiver would read with its own rights
        with pytest.raises(ProtocolError, match="not this stream's queue"):
            p.parse_offer(h, dest, sender="ann")
    with pytest.raises(ProtocolError, match="not this stream's queue"):
        p.parse_offer(p.offer_headers(sp, dest, sender="ann"), Destination.parse("/queue/other"), sender="ann")
    h = p.offer_headers(sp, dest, sender="ann") | {hdr.H_VERSION: "9"}
    with pytest.raises(ProtocolError, match="version 9 is not supported"):
        p.parse_offer(h, dest, sender="ann")


def test_an_offer_names_its_senders_own_data_queue() -> None:
    sp = p.StreamSpec("abc-1", "f.bin", 10, 5)
    dest = Destination.parse("/queue/landing")
    # Another user's queue: the receiver would drain that user's stream for this offer.
    forged = p.offer_headers(sp, dest, sender="bob")
    with pytest.raises(ProtocolError, match="for its sender 'mallory'.*landing.amqs.mallory.abc-1"):
        p.parse_offer(forged, dest, sender="mallory")
    # A broker that stamps nobody: any well-formed sender element, and nothing else.
    assert p.parse_offer(forged, dest, sender="")[1] == "/queue/landing.amqs.bob.abc-1"
    for bad in ("/queue/landing.amqs..abc-1", "/queue/landing.amqs.a.b.abc-1", "/queue/landing.amqs._zz.abc-1"):
        with pytest.raises(ProtocolError, match="not this stream's queue"):
            p.parse_offer(forged | {hdr.H_DATA_DEST: bad}, dest, sender="")


@pytest.mark.parametrize(("user", "element"), [
    ("alice", "alice"), ("a.b", "a_2eb"), ("a_2eb", "a_5f2eb"), ("", "_"), ("j\u00f6rg", "j_c3_b6rg"),
    ("CN=x,O=y", "CN_3dx_2cO_3dy"), ("x" * 65, "_h" + hashlib.sha256(b"x" * 65).hexdigest()[:40]),
])
def test_each_user_has_its_own_data_queue_prefix(user: str, element: str) -> None:
    assert owner_element(user) == element
    # No dot, so one user's prefix (NAME.amqs.<element>.>) cannot cover another's queues.
    assert "." not in element and len(element) <= 64
    assert Destination.parse("/queue/q").data_queue("s-1", user) == f"/queue/q.amqs.{element}.s-1"


def test_receiver_state_survives_json_round_trip() -> None:
    st = ReceiverState(spec(10_000))
    for seq in (1, 2, 4, 7):
        st.mark_durable(seq)
    back = ReceiverState.from_json(st.to_json())
    assert back.next_seq == 3 and back.ahead == {4, 7} and back.spec == st.spec
    bad = st.to_json() | {"ahead": [1]}
    with pytest.raises(ProtocolError, match="inconsistent"):
        ReceiverState.from_json(bad)


def test_sender_state_confirms_forward_only() -> None:
    st = SenderState(spec(10_000), "/queue/x", "id")
    st.confirm(4)
    assert st.confirmed_offset == 4000
    with pytest.raises(ProtocolError, match="out of order"):
        st.confirm(3)
    assert SenderState.from_json(st.to_json()).confirmed_seq == 4


@pytest.mark.parametrize("bad", ["", "..", "a/b", "-x", "a" * 129, "a..b", "ä"])
def test_invalid_stream_ids(bad: str) -> None:
    with pytest.raises(ProtocolError):
        validate_stream_id(bad)


def test_derived_stream_id_is_stable_and_valid() -> None:
    a = derive_stream_id("dätä file.csv", "/x|1|2")
    assert a == derive_stream_id("dätä file.csv", "/x|1|2") != derive_stream_id("dätä file.csv", "/x|1|3")
    validate_stream_id(a)


@pytest.mark.parametrize("name,expected", [
    ("../../etc/passwd", "passwd"), ("/abs/path.csv", "path.csv"), ("..", "sid"),
    ("a\x00b\nc.csv", "abc.csv"), ("C:\\x\\y.txt", "y.txt"), ("CON.txt", "_CON.txt"),
    (".hidden", "hidden"), ("dätä.csv", "dätä.csv"),
])
def test_safe_file_name(name: str, expected: str) -> None:
    assert paths.safe_file_name(name, "sid") == expected


def test_safe_file_name_caps_length_keeping_extension() -> None:
    out = paths.safe_file_name("é" * 300 + ".parquet", "sid")
    assert len(out.encode()) <= 200 and out.endswith(".parquet")


@pytest.mark.parametrize("text,expected", [
    ("landing", "/queue/landing"), ("/queue/a.b", "/queue/a.b"), ("topic://t", "/topic/t"),
])
def test_destination_parse(text: str, expected: str) -> None:
    assert str(Destination.parse(text)) == expected


@pytest.mark.parametrize("bad", ["", "/queue/", "/queue/a b", "/queue/a;b", "/queue/" + "x" * 201])
def test_destination_rejects(bad: str) -> None:
    with pytest.raises(ProtocolError, match="destination"):
        Destination.parse(bad)


def _ctl(sp: p.StreamSpec, kind: hdr.Kind, who: str, pos: int) -> dict[str, str]:
    return p.control_headers(sp, kind, who, pos, hashlib.sha256(who.encode()).hexdigest()[:32])


def test_handshake_sender_window_rewind_and_end() -> None:
    sp = spec(10_000)  # 10 chunks
    hs = HandshakeSender(sp, window=3, point_to_point=False)
    assert hs.next_chunk() is None  # nobody answered yet
    hs.on_control(_ctl(sp, hdr.Kind.HELLO, "a", 1), now=0.0)
    assert [hs.next_chunk() for _ in range(4)] == [1, 2, 3, None]  # window of 3
    hs.on_control(_ctl(sp, hdr.Kind.ACK, "a", 3), now=0.0)
    assert [hs.next_chunk() for _ in range(3)] == [4, 5, None]
    hs.on_control(_ctl(sp, hdr.Kind.REREQ, "a", 4), now=0.0)  # chunk 4 was lost
    assert hs.rewinds == 1 and hs.next_chunk() == 4
    hs.on_control(_ctl(sp, hdr.Kind.HELLO, "b", 1), now=0.0)  # a late subscriber on a topic
    assert hs.slowest == 1 and hs.next_chunk() == 1
    for who in ("a", "b"):
        hs.on_control(_ctl(sp, hdr.Kind.ACK, who, 11), now=0.0)
    assert [s for s in iter(hs.next_chunk, None)] == list(range(2, 11))
    assert hs.take_end() and not hs.take_end()
    hs.on_control(_ctl(sp, hdr.Kind.DONE, "a", 11), now=0.0)
    assert not hs.all_done
    hs.on_control(_ctl(sp, hdr.Kind.DONE, "b", 11), now=0.0)
    assert hs.all_done


def test_handshake_point_to_point_new_receiver_replaces_dead_one() -> None:
    sp = spec(10_000)
    hs = HandshakeSender(sp, window=2)
    hs.on_control(_ctl(sp, hdr.Kind.HELLO, "dead", 1), now=0.0)
    assert [hs.next_chunk(), hs.next_chunk(), hs.next_chunk()] == [1, 2, None]
    hs.on_control(_ctl(sp, hdr.Kind.HELLO, "new", 2), now=11.0)  # took over the offer with chunk 1 on disk
    assert hs.positions == {"new": 2} and hs.next_chunk() == 2  # resend what it lacks


def test_handshake_ignores_impostors_and_bounds_rewinds() -> None:
    sp = spec(10_000)
    hs = HandshakeSender(sp, window=2)
    assert hs.on_control(_ctl(sp, hdr.Kind.HELLO, "real", 1), now=0.0) is hdr.Kind.HELLO
    # Another receiver's hello while the real one is alive, and a done with a forged token.
    assert hs.on_control(_ctl(sp, hdr.Kind.HELLO, "thief", 1), now=1.0) is None
    forged = _ctl(sp, hdr.Kind.DONE, "real", 11) | {hdr.H_TOKEN: "f" * 32}
    assert hs.on_control(forged, now=1.0) is None
    assert hs.on_control(_ctl(sp, hdr.Kind.ACK, "stranger", 5), now=1.0) is None
    assert hs.positions == {"real": 1} and not hs.all_done and hs.ignored == 3
    with pytest.raises(ProtocolError, match="without a valid amqs_token"):
        hs.on_control(_ctl(sp, hdr.Kind.ACK, "real", 1) | {hdr.H_TOKEN: ""}, now=1.0)
    # The real receiver rewinding for ever is stopped after a bounded number of resends.
    with pytest.raises(ProtocolError, match="asked for .* chunks again"):
        for _ in range(1000):
            while hs.next_chunk() is not None:
                pass
            hs.on_control(_ctl(sp, hdr.Kind.HELLO, "real", 1), now=2.0)
    assert hs.resent == hs.max_resend + 1


def test_handshake_control_validation() -> None:
    sp = spec(10_000)
    hs = HandshakeSender(sp, window=2)
    bad = _ctl(sp, hdr.Kind.ACK, "a", 1) | {hdr.H_NEXT_SEQ: "12"}
    with pytest.raises(ProtocolError, match="outside 1..11"):
        hs.on_control(bad, now=0.0)
    with pytest.raises(ProtocolError, match="not a control message"):
        p.control_headers(sp, hdr.Kind.DATA, "a", 1, "0" * 32)


def test_zstd_chunks_round_trip_and_skip_incompressible() -> None:
    text = b"order_id,region,qty\n" + b"".join(b"%d,north,%d\n" % (i, i % 7) for i in range(20_000))
    sp = spec(len(text), 64 * 1024)
    codec = ChunkCodec("zstd")
    st = ReceiverState(sp)
    out = bytearray(len(text))
    wire_total = 0
    for seq in range(1, sp.chunks + 1):
        off, n = sp.chunk_span(seq)
        headers, wire = p.data_message(sp, seq, text[off:off + n], codec)
        wire_total += len(wire)
        d = st.decide(headers, wire)
        assert d.verdict is Verdict.WRITE and d.data is not None
        out[off:off + n] = d.data
    assert bytes(out) == text and wire_total < len(text) / 3
    rnd = random.Random(3).randbytes(4096)
    headers, wire = p.data_message(spec(4096, 4096), 1, rnd, codec)
    assert wire == rnd and hdr.H_ENCODING not in headers  # incompressible: sent raw


def test_auto_compresses_what_shrinks_and_stops_trying_on_what_does_not() -> None:
    text = b"order_id,region,qty\n" + b"".join(b"%d,north,%d\n" % (i, i % 7) for i in range(40_000))
    rnd = random.Random(5).randbytes(64 * 4096)
    data = text[: 64 * 4096] + rnd + text[: 64 * 4096]
    sp = spec(len(data), 4096)
    codec = ChunkCodec("auto")
    st = ReceiverState(sp)
    out = bytearray(len(data))
    encoded = []
    for seq in range(1, sp.chunks + 1):
        off, n = sp.chunk_span(seq)
        headers, wire = p.data_message(sp, seq, data[off:off + n], codec)
        encoded.append(hdr.H_ENCODING in headers)
        d = st.decide(headers, wire)
        assert d.verdict is Verdict.WRITE and d.data is not None
        out[off:off + n] = d.data
    assert bytes(out) == data
    # The CSV is compressed from its first chunk; of the 64 random chunks, tries back off
    # (1, 2, 4 ... skipped), so few are even attempted; the CSV after them is found again.
    assert all(encoded[:64])
    assert not any(encoded[64:128])
    assert sum(encoded[128:]) >= 64 - _AUTO_MAX_SKIP // 2 and encoded[-1]


def test_crc32_is_zlibs_whichever_library_computes_it() -> None:
    import zlib

    body = random.Random(9).randbytes(100_003)
    assert crc32(body) == zlib.crc32(body) == crc32(memoryview(body))
    assert crc32(b"") == 0


def test_auto_trades_some_of_zstds_shrinking_for_speed() -> None:
    # "auto" runs at a faster level than "zstd": a CSV chunk comes out larger, still under half.
    text = b"order_id,region,qty,price\n" + b"".join(
        b"%d,%s,%d,%d.%02d\n" % (i, (b"north", b"south", b"east")[i % 3], i % 7, i % 997, i % 100)
        for i in range(60_000))
    body = text[: 2**20]
    fast, enc = ChunkCodec("auto").encode(body)
    small, _ = ChunkCodec("zstd").encode(body)
    assert enc == "zstd" and len(small) < len(fast) < len(body) * _AUTO_SAVING
    assert ChunkCodec.decode("zstd", fast, len(body)) == body
    # A small body (a pack member) shrinks too little at the fast level: both use level 1.
    assert ChunkCodec("auto").encode(body[:4096]) == ChunkCodec("zstd").encode(body[:4096])


def test_auto_sends_raw_what_shrinks_too_little_to_pay() -> None:
    # ~1.6x: worth it to "zstd" (5 % saved), not to "auto" (half saved).
    body = random.Random(11).randbytes(6000) + bytes(4000)
    wire, enc = ChunkCodec("zstd").encode(body)
    assert enc == "zstd" and len(body) * 0.5 < len(wire) < len(body) * 0.95
    assert ChunkCodec("auto").encode(body) == (body, None)


def test_compression_settings_are_checked() -> None:
    assert ChunkCodec("none").encode(b"a" * 4096) == (b"a" * 4096, None)
    assert ChunkCodec(None).encode(b"a" * 4096) == (b"a" * 4096, None)
    assert ChunkCodec("AUTO").encoding == "auto"
    # What a bulk send passes on to each large file's send_file: None there means the connection's.
    assert ChunkCodec("none").encoding == ChunkCodec(None).encoding == "none"
    with pytest.raises(ProtocolError, match="lz9.*auto, zstd, none"):
        ChunkCodec("lz9")


def test_corrupt_or_unknown_encoding_is_never_written() -> None:
    sp = spec(8192, 8192)
    body = b"a" * 8192
    headers, wire = p.data_message(sp, 1, body, ChunkCodec("zstd"))
    assert headers[hdr.H_ENCODING] == "zstd"
    evil = wire[:-4] + b"\x00\x00\x00\x00"  # a consistent CRC over a broken frame
    d = ReceiverState(sp).decide(headers | {hdr.H_CRC: str(crc32(evil))}, evil)
    assert d.verdict is Verdict.CORRUPT and "decompress" in d.reason
    d = ReceiverState(sp).decide(headers | {hdr.H_ENCODING: "lzma"}, wire)
    assert d.verdict is Verdict.CORRUPT and "unknown chunk encoding" in d.reason
    with pytest.raises(ProtocolError, match="not supported"):
        ChunkCodec("brotli")


@pytest.mark.parametrize("raw", ["+2", " 4", "4 ", "0_0", "\u0664", "٣", "1e3", "-0", "", "9" * 21])
def test_integer_headers_are_ascii_digits_only(raw: str) -> None:
    sp = spec(10_000)
    headers = p.data_message(sp, 1, b"x" * 1000)[0] | {hdr.H_SEQ: raw}
    with pytest.raises(ProtocolError, match="amqs_seq"):
        ReceiverState(sp).decide(headers, b"x" * 1000)


@pytest.mark.parametrize("sid", ["abc\n", "abc\r", "a b", "abc\n\n"])
def test_stream_ids_and_destinations_match_whole(sid: str) -> None:
    with pytest.raises(ProtocolError):
        validate_stream_id(sid)
    with pytest.raises(ProtocolError):
        Destination.parse("/queue/" + sid + "x")


def test_zstd_frames_must_declare_exactly_the_chunk_length() -> None:
    import zstandard

    # 17 bytes that declare 1 TiB: python-zstandard would try to allocate it.
    bomb = b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + (2**40).to_bytes(8, "little") + b"\x01\x00\x00" + b"\x00"
    with pytest.raises(ProtocolError, match="declares 1099511627776 bytes, expected 4"):
        ChunkCodec.decode("zstd", bomb, 4)
    # 64 KiB of zeros in a small frame, for a 4-byte span.
    inflated = zstandard.ZstdCompressor().compress(b"\0" * 65536)
    with pytest.raises(ProtocolError, match="declares 65536 bytes, expected 4"):
        ChunkCodec.decode("zstd", inflated, 4)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(b"abcd" * 300)
    with pytest.raises(ProtocolError, match="declares no content size"):
        ChunkCodec.decode("zstd", unsized, 1200)
    good = zstandard.ZstdCompressor().compress(b"abcd" * 300)
    assert ChunkCodec.decode("zstd", good, 1200) == b"abcd" * 300
    # Through the state machine, a bomb is a corrupt chunk, never a crash.
    sp = p.StreamSpec("z-1", "f", 4, 4)
    headers = p.data_message(sp, 1, b"abcd")[0] | {hdr.H_ENCODING: "zstd", hdr.H_CRC: str(crc32(bomb))}
    assert ReceiverState(sp).decide(headers, bomb).verdict is Verdict.CORRUPT


def test_chunks_far_ahead_of_the_gap_are_refused() -> None:
    sp = p.StreamSpec("sparse-1", "f", 5000 * 2, 2)  # 5000 chunks of 2 bytes
    st = ReceiverState(sp)
    ok = p.data_message(sp, hdr.MAX_AHEAD, b"ab")[0]
    assert st.decide(ok, b"ab").verdict is Verdict.WRITE
    far = p.data_message(sp, hdr.MAX_AHEAD + 1, b"ab")[0]
    with pytest.raises(ProtocolError, match=r"chunk 1025 is 1024 chunks past the first missing chunk 1"):
        st.decide(far, b"ab")


def test_truncated_header_sections_are_protocol_errors() -> None:
    sp = spec(10_000)
    dest = Destination.parse("/queue/landing")
    with pytest.raises(ProtocolError, match="header section was too large"):
        p.parse_offer(p.offer_headers(sp, dest, sender="ann") | {hdr.H_TRUNCATED: "5 bytes"}, dest, sender="ann")
    with pytest.raises(ProtocolError, match="header section was too large"):
        ReceiverState(sp).decide(p.data_message(sp, 1, b"x" * 1000)[0] | {hdr.H_TRUNCATED: "1"}, b"x" * 1000)


@pytest.mark.parametrize("name", [". .bashrc", ". .", ". ..", "..", " .. ", ".\t.hidden", "./.x"])
def test_published_names_are_never_hidden_or_dot_entries(name: str) -> None:
    safe = paths.safe_file_name(name, "sid-1")
    assert safe not in (".", "..") and not safe.startswith(".") and safe.strip() == safe


def test_what_a_peer_sent_wrong_is_a_remote_error_and_our_own_misuse_a_local_one() -> None:
    from airflow_provider_amqstream.exceptions import LocalProtocolError, RemoteProtocolError
    from airflow_provider_amqstream.protocol import bulk as bw

    dest = Destination.parse("/queue/q")
    sp = spec()
    offer = p.offer_headers(sp, dest, sender="a")
    # Off the wire, whichever check finds it: the parser's own, or one shared with our arguments.
    for bad in ({**offer, hdr.H_SIZE: "x"}, {**offer, hdr.H_STREAM: "../x"}, {**offer, hdr.H_KIND: "nonsense"}):
        with pytest.raises(RemoteProtocolError):
            p.parse_offer(bad, dest, sender="a")
    with pytest.raises(RemoteProtocolError):
        ReceiverState(sp).decide({**p.data_message(sp, 1, b"x" * 1000)[0], hdr.H_STREAM: "other"}, b"x" * 1000)
    with pytest.raises(RemoteProtocolError):
        paths.safe_subdir("/etc", "s1")
    with pytest.raises(RemoteProtocolError):
        bw.read_pack({hdr.H_KIND: "pack"}, b"junk")
    # Our own misuse.
    with pytest.raises(LocalProtocolError):
        normalise_compression("lzma")
    with pytest.raises(LocalProtocolError):
        p.data_message(sp, 1, b"too short")
