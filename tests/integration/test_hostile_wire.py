"""Hostile frames from an authorized sender (raw stomp.py) against a real receiver.

Every header, name and size a sender controls, at its worst: the receiver refuses the
stream (quarantined, with the reason), never hangs, crashes or blows its memory, and the
next good stream still arrives byte-exact. The hostile sender is an ordinary user of this
module's broker, allowed only to send to the ``/queue/rt.>`` family, as the attacker of
the issue was; good streams and the receiver use the administrator.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_streams, send_file, send_files
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import crc32
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import RawSender, browse, cli, make_file, play, running_broker, sha256_file
from tests.integration.test_pack import HOSTILE_PACKS, _pack

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """This module's broker (``params`` and ``uri`` are its administrator's), with a user
    who may only send to the ``rt`` family."""
    yield from running_broker(tmp_path_factory.mktemp("hostile") / "broker", {"rt": {"send": ["/queue/rt.>"]}})


@pytest.fixture
def sender(broker: EmbeddedBroker) -> BrokerParams:
    """The hostile sender: authorized, but only to send to ``/queue/rt.>``."""
    return dataclasses.replace(params_from_uri(broker.info(user="rt").uri), connect_timeout=10.0)


@pytest.fixture
def queue_name(request: pytest.FixtureRequest) -> str:
    return f"/queue/rt.{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]}"


def _receive_after(params: BrokerParams, queue: str, tmp_path: Path) -> tuple[list[Any], list[Any], str]:
    """Send a good stream behind whatever is queued; receive one stream; return what
    arrived, what failed, and the good file's SHA-256."""
    good = make_file(tmp_path / "good.bin", 5000)
    sha = send_file(params, good, queue, SendOptions(chunk_size=1000)).sha256
    got: list[Any] = []
    failed: list[Any] = []
    receive_streams(params, queue, tmp_path / "out", count=1, options=ReceiveOptions(wait_timeout=20, idle_timeout=10),
                    on_result=got.append, on_failure=failed.append)
    return got, failed, sha


def _raw_offer(sender: BrokerParams, queue: str, **changes: str) -> None:
    dest = Destination.parse(queue)
    spec = p.StreamSpec("hostile-1", "f.bin", 3000, 1000)
    raw = RawSender(sender)
    raw.send(str(dest), b"", {**p.offer_headers(spec, dest, sender=sender.user), **changes})
    raw.close()


def test_an_offer_with_a_200_kib_header_section_is_refused_not_looped_on(
        params: BrokerParams, sender: BrokerParams, uri: str, tmp_path: Path, queue_name: str) -> None:
    """ActiveMQ accepts it (10 KiB per header); a receiver that drops the connection on it
    reconnects into the same message for ever. Through the CLI, as users run it."""
    big = {f"junk{i}": "x" * 10_000 for i in range(20)}
    _raw_offer(sender, queue_name, **big)
    good = make_file(tmp_path / "good.bin", 5000)
    sent = send_file(params, good, queue_name, SendOptions(chunk_size=1000))
    t0 = time.monotonic()
    proc = cli("receive", "--from", queue_name, "--out-dir", str(tmp_path / "out"), "--conn", uri, "--count", "1",
               "--wait", "20", "--json", "-q")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["status"] for x in lines] == ["quarantined", "complete"]
    assert "header section was too large" in lines[0]["reason"]
    assert lines[1]["sha256"] == sent.sha256 == sha256_file(tmp_path / "out" / "good.bin")
    assert time.monotonic() - t0 < 60
    [filed] = browse(params, "/queue/DLQ." + Destination.parse(queue_name).name)
    assert hdr.H_QUARANTINE_REASON in filed.headers


@pytest.mark.parametrize("changes", [
    {hdr.H_SIZE: "+3000"}, {hdr.H_SIZE: " 3000"}, {hdr.H_SIZE: "3_000"}, {hdr.H_SIZE: "\u0663\u0660\u0660\u0660"},
    {hdr.H_CHUNK_SIZE: "1e3"}, {hdr.H_STREAM: "hostile-1\n"}, {hdr.H_STREAM: "../../etc"}, {hdr.H_NAME: "x" * 300},
    {hdr.H_VERSION: "2"}, {hdr.H_MODE: "stream\n"},
], ids=lambda c: "-".join(f"{k}={v[:12]!r}" for k, v in c.items()))
def test_malformed_offers_are_quarantined_and_the_next_stream_arrives(
        params: BrokerParams, sender: BrokerParams, tmp_path: Path, queue_name: str, changes: dict[str, str]) -> None:
    _raw_offer(sender, queue_name, **changes)
    got, failed, sha = _receive_after(params, queue_name, tmp_path)
    assert [r.sha256 for r in got] == [sha]
    assert [f.status for f in failed] == ["quarantined"] and "invalid offer" in failed[0].reason


def _bomb(declared: int) -> bytes:
    """A zstd frame header declaring ``declared`` bytes, then one empty raw block."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + declared.to_bytes(8, "little") + b"\x01\x00\x00"


@pytest.mark.parametrize("case", ["bomb-1tib", "bomb-64kib", "far-ahead", "cut-headers", "huge-crc"])
def test_hostile_chunks_are_quarantined_and_the_next_stream_arrives(
        params: BrokerParams, sender: BrokerParams, tmp_path: Path, queue_name: str, case: str) -> None:
    data = make_file(tmp_path / "f.bin", 4 * 1024).read_bytes()
    spec = p.StreamSpec(f"hc-{case}", "f.bin", len(data), 2 if case == "far-ahead" else 1024)

    def tamper(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        if seq != 1:
            return headers, body
        if case.startswith("bomb"):
            wire = _bomb(2**40) if case == "bomb-1tib" else zstandard.ZstdCompressor().compress(b"\0" * 65536)
            return {**headers, hdr.H_ENCODING: "zstd", hdr.H_CRC: str(crc32(wire))}, wire
        if case == "far-ahead":
            far = spec.chunks  # the last of 2048 two-byte chunks, 2047 past the gap
            off, n = spec.chunk_span(far)
            return p.data_message(spec, far, data[off:off + n])[0], data[off:off + n]
        if case == "cut-headers":
            return {**headers, **{f"pad{i}": "y" * 10_000 for i in range(12)}}, body
        return {**headers, hdr.H_CRC: "9" * 20}, body

    play(sender, queue_name, spec, data, [1], end=False, tamper=tamper)
    got, failed, sha = _receive_after(params, queue_name, tmp_path)
    assert [r.sha256 for r in got] == [sha]
    [f] = failed
    assert f.status == "quarantined" and f.stream_id == spec.stream_id
    assert not list((tmp_path / "out" / ".amqstream").glob(f"{spec.stream_id}.*"))


def test_the_broker_schedules_nothing_for_a_sender(params: BrokerParams, sender: BrokerParams,
                                                  queue_name: str) -> None:
    """schedulerSupport is off: repeat and delay headers are ordinary headers."""
    raw = RawSender(sender)
    raw.send(queue_name, b"once", {"AMQ_SCHEDULED_REPEAT": "50", "AMQ_SCHEDULED_PERIOD": "1000"})
    raw.send(queue_name, b"now", {"AMQ_SCHEDULED_DELAY": "600000"})
    raw.close()
    with StompLink(params) as link:
        sub = link.subscribe(queue_name, prefetch=100)
        bodies = []
        while (frame := link.get(3, sub)) is not None:
            bodies.append(bytes(frame.body))
            link.ack(frame)
    assert bodies == [b"once", b"now"]


@pytest.mark.parametrize(("name", "published"), [
    (". .bashrc", "bashrc"), (". ..", None), ("..", None), ("../../etc/passwd", "passwd"), ("a/.hidden", "hidden"),
    ("é" * 120 + ".csv", None),
], ids=["dot-space-bashrc", "dot-space-dotdot", "dotdot", "traversal", "hidden", "long"])
def test_hostile_names_publish_a_visible_file_inside_the_directory(
        params: BrokerParams, sender: BrokerParams, tmp_path: Path, queue_name: str, name: str,
        published: str | None) -> None:
    """A name from the wire never becomes hidden, '.', '..', a path, or too long for one
    directory entry; sent twice, the second copy's collision name fits too."""
    data = make_file(tmp_path / "f.bin", 3000).read_bytes()
    out = tmp_path / "out"
    paths = []
    for sid in ("named-1", "named-2"):
        play(sender, queue_name, p.StreamSpec(sid, name, len(data), 1000), data, [1, 2, 3])
        got: list[Any] = []
        receive_streams(params, queue_name, out, count=1, options=ReceiveOptions(wait_timeout=20, idle_timeout=10),
                        on_result=got.append)
        [res] = got
        path = Path(res.path or "")
        assert path.parent == out and path.read_bytes() == data, path
        assert not path.name.startswith(".") and len(path.name.encode()) <= 255, path.name
        paths.append(path)
    assert paths[0] != paths[1]
    if published is not None:
        assert paths[0].name == published
    elif name.startswith("é"):
        assert paths[0].name.endswith(".csv") and len(paths[0].name.encode()) <= 200
    else:
        assert paths[0].name == "named-1"


@pytest.mark.parametrize("case", sorted(HOSTILE_PACKS))
def test_a_hostile_pack_is_quarantined_whole_and_the_next_stream_arrives(
        params: BrokerParams, sender: BrokerParams, tmp_path: Path, queue_name: str, case: str) -> None:
    headers, body = HOSTILE_PACKS[case](*_pack())
    raw = RawSender(sender)
    raw.send(queue_name, body, headers)
    raw.close()
    # The next good stream comes in a pack too: on the receiver's subscription for packs,
    # after the hostile one.
    good = make_file(tmp_path / "in" / "good.bin", 5000)
    [sent] = send_files(params, [good], queue_name).results
    got: list[Any] = []
    failed: list[Any] = []
    receive_streams(params, queue_name, tmp_path / "out", count=1, options=ReceiveOptions(wait_timeout=20),
                    on_result=got.append, on_failure=failed.append)
    assert [r.sha256 for r in got] == [sent.sha256] == [sha256_file(tmp_path / "out" / "good.bin")]
    assert [f.status for f in failed] == ["quarantined"] and "invalid pack" in failed[0].reason, failed
    assert sorted(f.name for f in (tmp_path / "out").iterdir() if f.is_file()) == ["good.bin"]
    assert browse(params, queue_name) == []


def _member(dest: Destination, sid: str, name: str, data: bytes, user: str) -> tuple[dict[str, str], bytes]:
    spec = p.StreamSpec(sid, name, len(data), 4096, hdr.Mode.ATOMIC)
    return bw.inline_offer(spec, dest, data, hashlib.sha256(data).hexdigest(), sender=user)


@pytest.mark.parametrize("case", ["sha-mismatch", "zstd-bomb", "data-queue-elsewhere", "dotdot-name", "same-id"])
def test_a_bad_member_fails_alone_and_its_pack_mates_arrive(
        params: BrokerParams, sender: BrokerParams, tmp_path: Path, queue_name: str, case: str) -> None:
    """Each member is checked as the inline offer it is: the bad one is quarantined (or,
    for a name, made safe; for a repeated id, reported as the duplicate it is), the others
    of its pack are published byte-exact, the pack is acknowledged, and the next good
    stream arrives."""
    dest = Destination.parse(queue_name)
    data = [make_file(tmp_path / f"m{i}.bin", 2000 + i, seed=i).read_bytes() for i in range(3)]
    members = [_member(dest, f"pm-{case}-{i}", f"m{i}.bin", d, sender.user) for i, d in enumerate(data)]
    h, w = members[1]
    if case == "sha-mismatch":
        members[1] = ({**h, hdr.H_SHA256: "0" * 64}, w)
    elif case == "zstd-bomb":
        members[1] = ({**h, hdr.H_ENCODING: "zstd", hdr.H_CRC: str(crc32(_bomb(2**40)))}, _bomb(2**40))
    elif case == "data-queue-elsewhere":
        members[1] = ({**h, hdr.H_DATA_DEST: "/queue/rt.other.amqs.x"}, w)
    elif case == "dotdot-name":
        members[1] = _member(dest, f"pm-{case}-1", "..", data[1], sender.user)
    else:
        members[1] = members[0]
    raw = RawSender(sender)
    raw.send(queue_name, *reversed(bw.pack_message(members)))
    raw.close()
    good = make_file(tmp_path / "good.bin", 5000)
    sha = send_file(params, good, queue_name, SendOptions(chunk_size=1000)).sha256
    got: list[Any] = []
    failed: list[Any] = []
    out = tmp_path / "out"
    expected = 3 if case in ("same-id", "dotdot-name") else 2
    receive_streams(params, queue_name, out, count=expected + 1,
                    options=ReceiveOptions(wait_timeout=20, idle_timeout=10), on_result=got.append,
                    on_failure=failed.append)
    assert sha == sha256_file(out / "good.bin")
    assert (out / "m0.bin").read_bytes() == data[0] and (out / "m2.bin").read_bytes() == data[2]
    if case == "same-id":
        assert [r.status for r in got].count("duplicate") == 1 and not failed
    elif case == "dotdot-name":
        [named] = [r for r in got if r.stream_id == f"pm-{case}-1"]
        assert Path(named.path or "").parent == out and Path(named.path or "").read_bytes() == data[1]
    else:
        assert [(f.status, f.stream_id) for f in failed] == [("quarantined", f"pm-{case}-1")]
        assert not (out / "m1.bin").exists()
    assert browse(params, queue_name) == [], "the pack was not acknowledged"
