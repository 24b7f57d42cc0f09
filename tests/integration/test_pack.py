"""Packs: several small files in one broker message.

The pure part: a pack carries its members exactly, and every malformed pack is refused
before any member is trusted. Against the real broker: a stream asked for by id comes
with its pack, a watcher sees each packed stream as an offer of its own, and a packed
stream that cannot fit yields its pack once, not in a loop. Hostile packs from a
restricted sender are in test_hostile_wire.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, receive_stream, receive_streams, send_files
from airflow_provider_amqstream.exceptions import ProtocolError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import paths
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec, crc32
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import browse, make_file, sha256_file

DEST = Destination.parse("/queue/pack.unit")


def _members(n: int = 3, codec: ChunkCodec | None = None) -> list[tuple[dict[str, str], bytes, bytes]]:
    out = []
    for i in range(n):
        data = hashlib.sha256(str(i).encode()).digest() * (10 * i)  # the first one is empty
        spec = p.StreamSpec(f"m_{i}", f"f{i}.csv", len(data), 4096, hdr.Mode.ATOMIC)
        headers, wire = bw.inline_offer(spec, DEST, data, hashlib.sha256(data).hexdigest(), sender="ann", codec=codec,
                                       subdir="a/b" if i == 1 else "")
        out.append((headers, wire, data))
    return out


def _pack(n: int = 3) -> tuple[dict[str, str], bytes]:
    return bw.pack_message([(h, w) for h, w, _ in _members(n)])


@pytest.mark.parametrize("codec", [None, ChunkCodec("zstd")])
def test_a_pack_carries_each_member_exactly(codec: ChunkCodec | None) -> None:
    members = _members(codec=codec)
    headers, body = bw.pack_message([(h, w) for h, w, _ in members])
    assert headers[hdr.H_PACK_IDS] == "|m_0|m_1|m_2|" and bw.is_pack(headers) and bw.is_inline(headers)
    got = bw.read_pack(headers, body)
    assert [h[hdr.H_STREAM] for h, _ in got] == ["m_0", "m_1", "m_2"]
    for (mh, mw), (_, _, data) in zip(got, members, strict=True):
        assert hdr.H_GROUP_ID not in mh, "a JMS property inside a pack means nothing"
        spec, _ = p.parse_offer(mh, DEST, sender="ann")
        assert bw.read_inline(mh, mw, spec) == data
    assert paths.safe_subdir(got[1][0].get(hdr.H_DIR), "m_1") == ("a", "b")


def _recrc(h: dict[str, str], b: bytes) -> tuple[dict[str, str], bytes]:
    return {**h, hdr.H_CRC: str(crc32(b))}, b


def _reindex(h: dict[str, str], b: bytes, change: Callable[[list[Any]], Any]) -> tuple[dict[str, str], bytes]:
    n = int(h[bw.H_PACK_INDEX])
    index = json.dumps(change(json.loads(b[:n]))).encode()
    return _recrc({**h, bw.H_PACK_INDEX: str(len(index))}, index + b[n:])


def _many(h: dict[str, str], b: bytes) -> tuple[dict[str, str], bytes]:
    members = [(mh, mw) for mh, mw, _ in _members(1)] * (bw.MAX_PACK_FILES + 1)
    index = json.dumps([{**mh, bw.H_PACK_LEN: str(len(mw))} for mh, mw in members]).encode()
    return _recrc({**h, bw.H_PACK_FILES: str(len(members)), bw.H_PACK_INDEX: str(len(index)),
                   hdr.H_PACK_IDS: "|" + "|".join(mh[hdr.H_STREAM] for mh, _ in members) + "|"},
                  index + b"".join(mw for _, mw in members))


# Each breaks one rule of the pack itself; the CRC is made right again where the change
# is in the body, so the check that must catch it is reached.
HOSTILE_PACKS: dict[str, Callable[[dict[str, str], bytes], tuple[dict[str, str], bytes]]] = {
    "bad-crc": lambda h, b: ({**h, hdr.H_CRC: str((int(h[hdr.H_CRC]) + 1) % 2**32)}, b),
    "index-past-body": lambda h, b: ({**h, bw.H_PACK_INDEX: str(len(b) + 1)}, b),
    "index-not-json": lambda h, b: _recrc(h, b"\xff" * int(h[bw.H_PACK_INDEX]) + b[int(h[bw.H_PACK_INDEX]):]),
    "index-deep-nesting": lambda h, b: _recrc({**h, bw.H_PACK_INDEX: "200000"}, b"[" * 200_000 + b),
    "index-an-object": lambda h, b: _reindex(h, b, lambda ix: {"a": ix}),
    "count-mismatch": lambda h, b: ({**h, bw.H_PACK_FILES: "2"}, b),
    "count-zero": lambda h, b: ({**h, bw.H_PACK_FILES: "0"}, b),
    "too-many-files": _many,
    "trailing-bytes": lambda h, b: _recrc(h, b + b"x"),
    "member-len-past-body": lambda h, b: _reindex(h, b, lambda ix: [*ix[:2], {**ix[2], bw.H_PACK_LEN: "99999"}]),
    "member-len-signed": lambda h, b: _reindex(h, b, lambda ix: [*ix[:2], {**ix[2], bw.H_PACK_LEN: "+1"}]),
    "member-not-offer": lambda h, b: _reindex(h, b, lambda ix: [*ix[:2], {**ix[2], hdr.H_KIND: "data"}]),
    "member-not-inline": lambda h, b: _reindex(h, b, lambda ix: [*ix[:2], {**ix[2], bw.H_INLINE: "0"}]),
    "member-non-string": lambda h, b: _reindex(h, b, lambda ix: [*ix[:2], {**ix[2], hdr.H_SIZE: 3}]),
    "member-jms-header": lambda h, b: _reindex(h, b, lambda ix: [*ix[:2], {**ix[2], "JMSXUserID": "admin"}]),
    "member-many-headers": lambda h, b: _reindex(
        h, b, lambda ix: [*ix[:2], {**ix[2], **{f"amqs_x{i}": "" for i in range(40)}}]),
    "member-a-list": lambda h, b: _reindex(h, b, lambda ix: [*ix[:2], [ix[2]]]),
    "ids-list-another": lambda h, b: ({**h, hdr.H_PACK_IDS: "|m_0|m_1|victim|"}, b),
    "ids-missing": lambda h, b: ({k: v for k, v in h.items() if k != hdr.H_PACK_IDS}, b),
    "version-2": lambda h, b: ({**h, hdr.H_VERSION: "2"}, b),
    "no-inline": lambda h, b: ({k: v for k, v in h.items() if k != bw.H_INLINE}, b),
    "bad-pack-id": lambda h, b: ({**h, hdr.H_STREAM: "../pk"}, b),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PACKS))
def test_a_malformed_pack_is_refused_whole(case: str) -> None:
    headers, body = HOSTILE_PACKS[case](*_pack())
    with pytest.raises(ProtocolError, match="pack"):
        bw.read_pack(headers, body)


def test_a_pack_member_selector_matches_only_that_id() -> None:
    sel = p.offer_selector("a_b")
    # '_' is LIKE's any-character: escaped, "a-b" no longer matches "a_b".
    assert "'%|a!_b|%' ESCAPE '!'" in sel and "amqs_kind = 'pack'" in sel
    with pytest.raises(ProtocolError):
        p.offer_selector("x' OR '1'='1")


def _small_files(tmp_path: Path, n: int = 5) -> list[Path]:
    return [make_file(tmp_path / "in" / f"p{i}.bin", 3000 + i, seed=i) for i in range(n)]


@pytest.mark.broker
def test_a_stream_asked_for_by_id_comes_with_its_pack(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    files = _small_files(tmp_path)
    sent = send_files(params, files, queue_name)
    [pack] = browse(params, queue_name)
    assert pack.headers[hdr.H_KIND] == "pack" and pack.headers[bw.H_PACK_FILES] == "5"
    wanted = sent.results[2]
    got = receive_stream(params, queue_name, tmp_path / "out", stream_id=wanted.stream_id,
                         options=ReceiveOptions(wait_timeout=15))
    assert got is not None and got.stream_id == wanted.stream_id
    for f in files:  # the whole pack landed, each file byte-exact
        assert sha256_file(tmp_path / "out" / f.name) == sha256_file(f)
    assert browse(params, queue_name) == [], "the pack was not acknowledged"


@pytest.mark.broker
def test_a_watcher_sees_each_packed_stream_as_an_offer(params: BrokerParams, tmp_path: Path,
                                                      queue_name: str) -> None:
    from airflow_provider_amqstream.engine.receive.browse import OfferBrowser

    sent = send_files(params, _small_files(tmp_path), queue_name)
    ids = [r.stream_id for r in sent.results]
    browser = OfferBrowser(params, queue_name)
    try:
        seen = browser.look()
        assert sorted(o.stream_id for o in seen) == sorted(ids)
        assert {o.name for o in seen} == {f"p{i}.bin" for i in range(5)}
        assert [o.stream_id for o in browser.look(stream_id=ids[3])] == [ids[3]]
        assert sorted(o.stream_id for o in browser.look(skip=(ids[0],))) == sorted(ids[1:])
    finally:
        browser.close()


@pytest.mark.broker
def test_a_packed_stream_without_room_yields_its_pack_once(params: BrokerParams, tmp_path: Path,
                                                          queue_name: str) -> None:
    """The pack is parked whole (in the parked queue), so no receiver is handed the same
    pack again at once (a loop of yields); a receiver with room takes it after its time."""
    files = _small_files(tmp_path, 3)
    send_files(params, files, queue_name)
    [pack] = browse(params, queue_name)
    failures: list[Any] = []
    full = tmp_path / "full"
    got = receive_streams(params, queue_name, full, options=ReceiveOptions(wait_timeout=1, min_free_bytes=2**62,
                                                                         yield_backoff=8), on_failure=failures.append)
    assert got == [] and [f.status for f in failures] == ["no_room"]
    assert browse(params, queue_name) == []
    [parked] = browse(params, Destination.parse(queue_name).parked_queue())
    assert parked.headers[hdr.H_STREAM] == pack.headers[hdr.H_STREAM] and parked.body == pack.body
    due = p.parked_until(parked.headers)
    assert due > time.time() + 4, "the pack must be parked, not handed out again"
    # Parked for everyone: a receiver with room passes it until its time, then takes it.
    got = receive_streams(params, queue_name, tmp_path / "roomy", count=3, options=ReceiveOptions(wait_timeout=30))
    assert time.time() >= due
    assert sorted(Path(r.path).name for r in got) == [f.name for f in files]


@pytest.mark.broker
def test_the_hook_sees_a_packed_stream_waiting(uri: str, params: BrokerParams, tmp_path: Path, queue_name: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

    monkeypatch.setenv("AIRFLOW_CONN_AMQS_PACKED", uri)
    browser = AmqStreamHook("amqs_packed").offer_browser(queue_name)
    try:
        assert browser.look() == []
        sent = send_files(params, _small_files(tmp_path, 2), queue_name).results
        assert sorted(o.stream_id for o in browser.look()) == sorted(r.stream_id for r in sent)
        assert [o.stream_id for o in browser.look(stream_id=sent[1].stream_id)] == [sent[1].stream_id]
        assert browser.look(stream_id="not-there") == []
    finally:
        browser.close()


@pytest.mark.broker
@pytest.mark.kill
@pytest.mark.quiet  # flow control under a memory limit: needs the machine quiet
def test_a_stopped_receiver_does_not_stall_the_senders(private_broker: Any, tmp_path: Path) -> None:
    """A receiver that stops (SIGSTOP: a paused VM, a debugger) keeps what the broker handed
    it, unacknowledged, counted against the queue's memory limit with what the broker pages
    in for it. That must stay under the limit, or every sender to the queue is held by the
    broker's flow control (it was, with 64 packs handed at once, and now and then with 16 and
    a 32 MB limit). Resumed, the receiver takes every file."""
    import os
    import signal
    import subprocess

    from tests.helpers import cli, records_in, wait_for

    uri, queue = private_broker.info().uri, "/queue/stopped.receiver"
    src = tmp_path / "landing"
    files = [make_file(src / f"s{i:04d}.bin", 64 * 1024, seed=i) for i in range(2000)]
    out = tmp_path / "out"
    with open(tmp_path / "rx.jsonl", "w") as sink:
        rx = cli("receive", "--from", queue, "--out-dir", str(out), "--conn", uri, "--follow", "--wait", "10",
                 "--json", "-q", stdout=sink)
    tx = cli("send", str(src), "--recursive", "--to", queue, "--conn", uri, "--json", "-q",
             env={"AMQSTREAM_STATE_DIR": str(tmp_path / "state")})
    try:
        wait_for(lambda: records_in(out) >= 100, 60, "100 files received")
        os.kill(rx.pid, signal.SIGSTOP)
        try:
            sent, err = tx.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            tx.kill()
            raise AssertionError("the sender is stalled behind the stopped receiver") from None
        assert tx.returncode == 0, err[-2000:]
        assert json.loads(sent.splitlines()[-1])["files"] == 2000
    finally:
        os.kill(rx.pid, signal.SIGCONT)
    assert rx.wait(180) == 0
    published = sorted(f.name for f in out.iterdir() if f.suffix == ".bin")
    assert published == sorted(f.name for f in files)
    assert list(out.glob(".amqstream/manifests/*/*.manifest.jsonl")), "the batch announcement did not get through"
    for f in files[::97]:
        assert sha256_file(out / f.name) == sha256_file(f)
