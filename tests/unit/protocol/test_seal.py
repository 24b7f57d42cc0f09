"""The seal alone: keys, recipients, wrapping, and chunks that open only where they were sealed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_provider_amqstream.exceptions import ConfigurationError
from airflow_provider_amqstream.protocol import seal as s

ALICE, BOB, EVE = s.Identity.generate(), s.Identity.generate(), s.Identity.generate()


def _seal(sid: str = "sid-1", *who: s.Identity) -> s.Seal:
    return s.Seal.create(sid, [s.parse_recipient(i.recipient) for i in (who or (ALICE,))],
                         name="secret report.csv", size=10, chunk_size=4)


def test_a_key_file_round_trips_and_names_its_recipient() -> None:
    text = ALICE.to_text()
    again = s.Identity.parse(text, "/k/alice.key")
    assert again.recipient == ALICE.recipient and again.source == "/k/alice.key"
    assert ALICE.recipient in text.splitlines()[0]


@pytest.mark.parametrize("text", ["", "hello", s.KEY_PREFIX + "-aaaa", BOB.to_text().replace("a", "b", 1)[:-3]])
def test_a_malformed_key_file_is_named_and_its_bytes_never_shown(text: str) -> None:
    with pytest.raises(ConfigurationError, match="/k/bad.key") as exc:
        s.Identity.parse(text, "/k/bad.key")
    assert text.strip().splitlines()[-1:] == [] or text.strip().splitlines()[-1] not in str(exc.value)


def test_a_recipient_with_a_typo_fails_its_checksum() -> None:
    good = ALICE.recipient
    assert s.parse_recipient(good) == ALICE.public
    i = len(good) // 2
    typo = good[:i] + ("a" if good[i] != "a" else "b") + good[i + 1:]
    last = good[:-1] + next(c for c in "abcdefghijklmnopqrstuvwxyz234567" if c != good[-1])
    for bad in (typo, last, good[:-1], "amqs1", "age1xyz", good + "a"):
        with pytest.raises(ConfigurationError, match="recipient"):
            s.parse_recipient(bad)


def test_only_a_recipient_opens_the_stream_and_learns_the_name() -> None:
    sealed = _seal("sid-1", ALICE, BOB)
    for who in (ALICE, BOB):
        opened = s.Seal.open(sealed.header, [EVE, who], stream_id="sid-1", size=10, chunk_size=4)
        assert opened is not None and opened[0].key == sealed.key and opened[1] == "secret report.csv"
    assert s.Seal.open(sealed.header, [EVE], stream_id="sid-1", size=10, chunk_size=4) is None
    assert "secret" not in sealed.header


def test_the_directory_travels_in_the_seal_and_a_longest_one_fits_a_quarantine_copy() -> None:
    from airflow_provider_amqstream.protocol import wire as p

    assert s.Seal.open(_seal().header, [ALICE], stream_id="sid-1", size=10, chunk_size=4)[2] == ""  # type: ignore[index]
    # Five recipients, the longest name and directory, each character one JSON escapes.
    name, subdir = '"' * 255, "/".join(['\\' * 127] * 8)[:1024]
    sealed = s.Seal.create("sid-1", [s.parse_recipient(s.Identity.generate().recipient) for _ in range(5)],
                           name=name, size=10, chunk_size=4, subdir=subdir)
    assert len(sealed.header) <= s.MAX_SEAL_HEADER
    copy = p.quarantined_headers({s.H_SEAL: sealed.header}, cause=p.Outcome.NO_KEY, reason="r", source="q", by="h",
                                 at="t", sender="a")
    me = s.Identity.generate()
    kept = s.Seal.create("sid-1", [s.parse_recipient(me.recipient)], name="n", size=10, chunk_size=4, subdir=subdir)
    assert copy[s.H_SEAL] == sealed.header
    assert s.Seal.open(kept.header, [me], stream_id="sid-1", size=10, chunk_size=4)[1:] == ("n", subdir)  # type: ignore[index]


@pytest.mark.parametrize("where", [{"stream_id": "sid-2"}, {"size": 11}, {"chunk_size": 5}])
def test_a_header_moved_to_another_stream_or_spec_does_not_open(where: dict[str, object]) -> None:
    sealed = _seal()
    kw: dict[str, object] = {"stream_id": "sid-1", "size": 10, "chunk_size": 4, **where}
    with pytest.raises(s.SealBroken):
        s.Seal.open(sealed.header, [ALICE], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("header", ["!!!", "AQ", "Ag", "AQE"])
def test_a_malformed_header_is_broken_not_a_crash(header: str) -> None:
    with pytest.raises(s.SealBroken):
        s.Seal.open(header, [ALICE], stream_id="x", size=1, chunk_size=1)


@settings(max_examples=40, deadline=None)
@given(body=st.binary(max_size=300), seq=st.integers(1, 2**40), last=st.booleans(),
       enc=st.sampled_from([None, "zstd"]))
def test_a_chunk_opens_where_it_was_sealed_and_nowhere_else(body: bytes, seq: int, last: bool,
                                                            enc: str | None) -> None:
    sealed, other = _seal("a"), _seal("b")
    wire, h = sealed.chunk(seq, last, body, enc)
    headers = {**h, **({s.H_ENCODING: enc} if enc else {})}
    assert sealed.open_chunk(seq, last, wire, headers) == body
    assert len(body) < 4 or body not in wire
    flipped = bytes([wire[0] ^ 1]) + wire[1:]
    other_salt = {**headers, s.H_NONCE: f"{int(h[s.H_NONCE], 16) ^ 1:08x}"}
    recoded = {**h, s.H_ENCODING: "zstd"} if not enc else h
    for bad in (lambda: sealed.open_chunk(seq + 1, last, wire, headers),  # reordered
                lambda: sealed.open_chunk(seq, not last, wire, headers),  # a middle chunk passed off as the last
                lambda: other.open_chunk(seq, last, wire, headers),  # transplanted
                lambda: sealed.open_chunk(seq, last, wire[:-1], headers),  # truncated
                lambda: sealed.open_chunk(seq, last, flipped, headers),  # tampered
                lambda: sealed.open_chunk(seq, last, wire, other_salt),  # its nonce changed
                lambda: sealed.open_chunk(seq, last, wire, recoded),  # its encoding header changed
                lambda: sealed.open_chunk(seq, last, wire, {})):  # no nonce
        with pytest.raises(s.SealBroken):
            bad()


def test_a_stream_cut_before_its_last_chunk_is_caught() -> None:
    sealed = _seal()
    middle, h = sealed.chunk(2, False, b"abcd", None)
    # The broker drops chunk 3 and relabels chunk 2 as the last: its seal says otherwise.
    with pytest.raises(s.SealBroken):
        sealed.open_chunk(2, True, middle, h)


def test_the_same_chunk_sealed_twice_uses_two_nonces() -> None:
    sealed = _seal()
    (a, ha), (b, hb) = sealed.chunk(1, False, b"same", None), sealed.chunk(1, False, b"same", None)
    assert a != b and ha != hb and sealed.open_chunk(1, False, a, ha) == sealed.open_chunk(1, False, b, hb)


def test_the_digest_needs_the_key() -> None:
    a, b = _seal(), _seal()
    sha = "0" * 64
    assert a.digest(sha) != b.digest(sha) and len(a.digest(sha)) == 64 and a.digest(sha) != a.digest("1" * 64)


def test_recipients_are_bounded() -> None:
    with pytest.raises(ConfigurationError, match="recipients"):
        _seal("x", *[ALICE] * (s.MAX_RECIPIENTS + 1))
    with pytest.raises(ConfigurationError, match="recipients"):
        s.Seal.create("x", [], name="n", size=1, chunk_size=1)


def test_a_recipient_that_is_no_usable_key_is_refused_before_anything_is_sealed() -> None:
    # A low-order point passes the checksum (anyone can spell one) but gives no shared secret.
    point = bytes(32)
    with pytest.raises(ConfigurationError, match="no usable X25519 key") as exc:
        s.Seal.create("x", [s.parse_recipient(ALICE.recipient), point], name="n", size=1, chunk_size=1)
    assert s.RECIPIENT_PREFIX in str(exc.value)


def test_no_key_material_in_a_repr() -> None:
    sealed = _seal()
    assert sealed.key.hex() not in repr(sealed) and str(sealed.key) not in repr(sealed)
    assert ALICE.to_text().splitlines()[1] not in repr(ALICE)
    assert ALICE.private.hex() not in repr(ALICE) and repr(ALICE.private) not in repr(ALICE)


def test_sealing_never_imports_cryptography() -> None:
    """Its wheel brings a second OpenSSL and a Rust extension, about 8 MiB of RSS: sealing and
    opening use the libcrypto hashlib already loaded (protocol/crypto.py). Airflow itself still
    loads `cryptography` for its connections; the command line and the engine do not."""
    code = ("import sys, airflow_provider_amqstream.cli, airflow_provider_amqstream.engine.send.bulk, "
            "airflow_provider_amqstream.engine.receive.session\n"
            "from airflow_provider_amqstream.protocol import seal as s\n"
            "me = s.Identity.generate()\n"
            "sealed = s.Seal.create('sid', [s.parse_recipient(me.recipient)], name='n', size=3, chunk_size=3)\n"
            "wire, h = sealed.chunk(1, True, b'abc', None)\n"
            "opened, name, _ = s.Seal.open(sealed.header, [me], stream_id='sid', size=3, chunk_size=3)\n"
            "assert bytes(opened.open_chunk(1, True, wire, h)) == b'abc' and name == 'n'\n"
            "print('cryptography' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"


# --------------------------------------------------------------------------- sealed packs
def _pack(n: int = 3, *who: s.Identity) -> tuple[list[tuple[dict[str, str], bytes]], dict[str, str], bytes]:
    from airflow_provider_amqstream.protocol import bulk as bw
    from airflow_provider_amqstream.protocol import wire as p
    from airflow_provider_amqstream.protocol.names import Destination

    members = []
    for i in range(n):
        body = f"payroll row {i}\n".encode() * (i + 1)
        spec = p.StreamSpec(f"sid-{i}", f"payroll-{i}.csv", len(body), 1000, p.hdr.Mode.ATOMIC)
        members.append(bw.inline_offer(spec, Destination.parse("/queue/q"), body, "0" * 64, sender="a"))
    headers, wire = bw.pack_message(members, [s.parse_recipient(i.recipient) for i in (who or (ALICE,))])
    return members, headers, bytes(wire)


def test_a_sealed_pack_opens_to_its_members_for_a_recipient_only() -> None:
    from airflow_provider_amqstream.protocol import bulk as bw

    members, headers, wire = _pack(3, ALICE, BOB)
    assert b"payroll" not in wire and "payroll" not in str(headers)
    for who in (ALICE, BOB):
        opened = bw.open_pack(headers, wire, [who])
        assert opened is not None
        assert [(m, bytes(b)) for m, b in opened] == [({k: v for k, v in h.items() if k.startswith("amqs_")}, b)
                                                     for h, b in members]
    assert bw.open_pack(headers, wire, [EVE]) is None
    assert bw.sealed_members(headers) == [(h["amqs_stream"], int(h["amqs_size"])) for h, _ in members]
    with pytest.raises(s.RemoteProtocolError, match="sealed"):
        bw.read_pack(headers, wire)  # no unsealed reading of a sealed pack


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_byte_of_a_sealed_pack_altered_fails_to_open(data: st.DataObject) -> None:
    from airflow_provider_amqstream.protocol import bulk as bw

    _, headers, wire = _pack(2)
    at = data.draw(st.integers(0, len(wire) - 1))
    bad = wire[:at] + bytes([wire[at] ^ data.draw(st.integers(1, 255))]) + wire[at + 1:]
    with pytest.raises(s.SealBroken):
        bw.open_pack(headers, bad, [ALICE])


@pytest.mark.parametrize("change", [
    {"amqs_pack_ids": "|sid-1|sid-0|sid-2|"},   # reordered in the clear
    {"amqs_pack_sizes": "|14|28|43|"},          # a size grown
    {"amqs_pack_files": "2"},                   # a member hidden
    {"amqs_stream": "pk-" + "0" * 32},          # another pack's id
])
def test_what_a_sealed_pack_shows_cannot_be_changed_without_it_failing(change: dict[str, str]) -> None:
    from airflow_provider_amqstream.protocol import bulk as bw

    _, headers, wire = _pack(3)
    with pytest.raises(s.RemoteProtocolError):
        bw.open_pack({**headers, **change}, wire, [ALICE])


@pytest.mark.parametrize("shown", [
    {"amqs_pack_sizes": "|1|2|"}, {"amqs_pack_sizes": "|1|x|3|"}, {"amqs_pack_sizes": "1|2|3"},
    {"amqs_pack_sizes": "|1|2|" + "9" * 40 + "|"}, {"amqs_pack_ids": "|../x|sid-1|sid-2|"}, {"amqs_pack_sizes": None},
])
def test_a_sealed_pack_showing_malformed_ids_or_sizes_is_refused_before_any_key_is_tried(
        shown: dict[str, str | None]) -> None:
    from airflow_provider_amqstream.protocol import bulk as bw

    _, headers, wire = _pack(3)
    bad = {k: v for k, v in {**headers, **shown}.items() if v is not None}
    with pytest.raises(s.RemoteProtocolError):
        bw.sealed_members(bad)
    with pytest.raises(s.RemoteProtocolError):
        bw.open_pack(bad, wire, [ALICE])
