"""Streams through the real broker: shapes of files, duplicates, gaps, corruption,
many producers and consumers, the atomic mode."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.exceptions import ProtocolError, StreamError, StreamQuarantined
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import browse, cli, cli_json, make_file, send_stream, sha256_file

pytestmark = pytest.mark.broker


def roundtrip(params: BrokerParams, src: Path, queue: str, out: Path, **send_kw: object) -> Path:
    sent = send_file(params, src, queue, SendOptions(**send_kw))  # type: ignore[arg-type]
    got = receive_stream(params, queue, out, options=ReceiveOptions(wait_timeout=10, idle_timeout=10))
    assert got is not None, "no stream arrived"
    assert got.sha256 == sent.sha256 == sha256_file(src)
    assert Path(got.path or "").read_bytes() == src.read_bytes()
    return Path(got.path or "")


@pytest.mark.parametrize("size,chunk", [(0, 1024), (4 * 1024, 1024), (777, 1), (3 * 2**20 + 5, 2**20)],
                         ids=["empty", "exact-multiple", "one-byte-chunks", "ragged"])
def test_file_shapes(params: BrokerParams, tmp_path: Path, queue_name: str, size: int, chunk: int) -> None:
    src = make_file(tmp_path / "in" / "f.bin", size)
    roundtrip(params, src, queue_name, tmp_path / "out", chunk_size=chunk)


def test_non_ascii_file_name(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "in" / "Größe données 数据.csv", 5000)
    path = roundtrip(params, src, queue_name, tmp_path / "out", chunk_size=1000)
    assert path.name == "Größe données 数据.csv"


def test_atomic_mode_hides_stream_until_complete(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "f.bin", 50_000)
    spec = p.StreamSpec("atomic-1", "f.bin", src.stat().st_size, 10_000, hdr.Mode.ATOMIC)
    dest = Destination.parse(queue_name)
    # A producer that stored some chunks and died: nothing is offered.
    with StompLink(params) as link:
        data = src.read_bytes()
        for seq in (1, 2):
            off, n = spec.chunk_span(seq)
            link.send(dest.data_queue("atomic-1", params.user), data[off:off + n],
                      p.data_message(spec, seq, data[off:off + n])[0])
        link.round_trip()
    assert receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=2)) is None
    # Its retry finishes and only then offers it; the receiver gets it whole.
    sent = send_file(params, src, queue_name, SendOptions(chunk_size=10_000, mode="atomic"), stream_id="atomic-1")
    got = receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10))
    assert got is not None and got.sha256 == sent.sha256 and got.duplicates == 2


def _inject(params: BrokerParams, queue: str, spec: p.StreamSpec, data: bytes, seqs: list[int], *,
            corrupt: int | None = None, end: bool = True) -> None:
    """Play a sender by hand with raw stomp: chosen chunks, in a chosen order."""

    def flip_first_byte(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, (bytes([body[0] ^ 0xFF]) + body[1:] if seq == corrupt else body)

    with StompLink(params) as link:
        send_stream(link.send, queue, spec, data, seqs, end=end, tamper=flip_first_byte)
        link.round_trip()


def test_reordered_and_duplicated_chunks(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    data = make_file(tmp_path / "f", 10_000).read_bytes()
    spec = p.StreamSpec("dup-1", "f.bin", len(data), 1000)
    _inject(params, queue_name, spec, data, [2, 1, 3, 3, 5, 4, 6, 7, 8, 1, 10, 9, 2])
    got = receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10, window=4))
    assert got is not None and Path(got.path or "").read_bytes() == data
    assert got.duplicates == 3


def test_missing_range_is_reported_with_stream_and_range(params: BrokerParams, tmp_path: Path,
                                                         queue_name: str) -> None:
    data = make_file(tmp_path / "f", 10_000).read_bytes()
    spec = p.StreamSpec("gap-1", "f.bin", len(data), 1000)
    _inject(params, queue_name, spec, data, [1, 2, 5, 6, 7, 8, 9, 10])
    with pytest.raises(StreamError, match=r"gap-1.*chunks 3-4 \(bytes 2000-3999\)"):
        receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10, gap_grace=1))
    assert not (tmp_path / "out" / "f.bin").exists()


def test_corrupted_chunk_detected_never_published(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    data = make_file(tmp_path / "f", 10_000).read_bytes()
    spec = p.StreamSpec("crc-1", "f.bin", len(data), 1000)
    _inject(params, queue_name, spec, data, list(range(1, 11)), corrupt=6)
    good = make_file(tmp_path / "g.bin", 3000)
    sent = send_file(params, good, queue_name, SendOptions(chunk_size=1000))
    with pytest.raises(StreamQuarantined, match=r"crc-1.*chunk 6 at offset 5000 failed its CRC-32"):
        receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10))
    assert not (tmp_path / "out" / "f.bin").exists()
    # Quarantined: no partial data left, the offer filed with its reason, the queue moves on.
    assert not list((tmp_path / "out" / ".amqstream").glob("crc-1.*"))
    [filed] = browse(params, "/queue/DLQ." + queue_name.split("/")[-1])
    assert filed.headers[hdr.H_STREAM] == "crc-1" and "CRC-32" in filed.headers[hdr.H_QUARANTINE_REASON]
    got = receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10))
    assert got is not None and got.sha256 == sent.sha256


def test_send_rejects_bad_input_clearly(params: BrokerParams, tmp_path: Path) -> None:
    with pytest.raises(StreamError, match="cannot read .*missing.bin"):
        send_file(params, tmp_path / "missing.bin", "/queue/x")
    with pytest.raises(ProtocolError, match="destination"):
        send_file(params, make_file(tmp_path / "f", 10), "/queue/bad name")
    for bad in (0, -1, hdr.MAX_CHUNK_SIZE + 1):
        with pytest.raises(ProtocolError, match=f"chunk size {bad} is outside"):
            send_file(params, make_file(tmp_path / "f", 10), "/queue/x", SendOptions(chunk_size=bad))
    with pytest.raises(StreamError, match="window must be at least 1"):
        send_file(params, make_file(tmp_path / "f", 10), "/queue/x", SendOptions(window=0))


def test_four_producers_two_consumers_one_stream_at_a_time(uri: str, tmp_path: Path, queue_name: str) -> None:
    files = [make_file(tmp_path / "in" / f"f{i}.bin", 200_000 + i * 150_001, seed=i) for i in range(8)]
    out = tmp_path / "out"
    events = tmp_path / "events.jsonl"
    receivers = [cli("receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--follow",
                     "--wait", "20", "--window", "4", "--json", "--events", str(events), "-q") for _ in range(2)]
    senders = [cli("send", *[], str(files[i]), "--to", queue_name, "--conn", uri, "--chunk-size", "65536",
                   "--json", "-q") for i in range(4)]
    for s in senders:
        cli_json(s)
    senders = [cli("send", str(files[i]), "--to", queue_name, "--conn", uri, "--chunk-size", "65536",
                   "--json", "-q") for i in range(4, 8)]
    for s in senders:
        cli_json(s)
    results = [r for proc in receivers for r in cli_json(proc, timeout=120)]
    assert sorted(r["name"] for r in results) == sorted(f.name for f in files)
    for f in files:
        assert sha256_file(out / f.name) == sha256_file(f)
    # No receiver ever had two streams open: its open/close events strictly alternate.
    by_pid: dict[int, list[dict[str, object]]] = {}
    for line in events.read_text().splitlines():
        ev = json.loads(line)
        by_pid.setdefault(ev["pid"], []).append(ev)
    assert len(by_pid) == 2, "both consumers should have taken streams"
    for evs in by_pid.values():
        kinds = [e["event"] for e in evs if e["event"] in ("stream_open", "stream_close")]
        assert kinds == ["stream_open", "stream_close"] * (len(kinds) // 2), kinds


def test_concurrent_send_and_receive_in_process(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "f.bin", 40 * 2**20 + 3)
    box: dict[str, object] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", receive_stream(
        params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=30))))
    t.start()
    sent = send_file(params, src, queue_name, SendOptions(chunk_size=256 * 1024))
    t.join(60)
    got = box["r"]
    assert got is not None and got.sha256 == sent.sha256  # type: ignore[attr-defined]


def test_compressed_csv_round_trip(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    from example_support import write_sample_csv

    src = write_sample_csv(tmp_path / "sales.csv", rows=60_000)
    sent = send_file(params, src, queue_name, SendOptions(compression="zstd", chunk_size=256 * 1024))
    # Compressed on the wire, not silently sent as it is: the chunks say zstd and are smaller.
    chunks = browse(params, Destination.parse(queue_name).data_queue(sent.stream_id, params.user))
    assert chunks and all(c.headers.get(hdr.H_ENCODING) == "zstd"
                          for c in chunks if c.headers.get(hdr.H_KIND) == "data")
    assert sum(len(c.body) for c in chunks) < 0.6 * min(src.stat().st_size, len(chunks) * 256 * 1024)
    got = receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10, idle_timeout=10))
    assert got is not None and got.sha256 == sent.sha256 == sha256_file(src)


def test_repeats_after_publication_are_cleared(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    """A sender killed after the broker confirmed its end marker, but before its checkpoint
    said so, repeats it on the re-run; nothing may be left behind in the broker."""
    from airflow_provider_amqstream.engine import FileCheckpoint, checkpoint_name, default_state_dir

    src = make_file(tmp_path / "f.bin", 5000)
    sent = send_file(params, src, queue_name, SendOptions(chunk_size=1000), stream_id="rep-1")
    got = receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10))
    assert got is not None and got.sha256 == sent.sha256
    ckpt = FileCheckpoint(default_state_dir() / checkpoint_name("rep-1", params))
    # The state as the crash left it: in flight (no sent_at), confirmed up to chunk 3.
    state = {k: v for k, v in (ckpt.load() or {}).items() if k != "sent_at"}
    ckpt.save({**state, "confirmed_seq": 3, "end_sent": False})
    send_file(params, src, queue_name, stream_id="rep-1")  # repeats chunks 4-5 and the end, then re-offers
    events: list[str] = []
    assert receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(
        wait_timeout=3, events=lambda kind, data: events.append(f"{kind}:{data.get('messages', '')}"))) is None
    assert "leftovers_cleared:3" in events
    dest = Destination.parse(queue_name)
    with StompLink(params) as link:
        for q in (queue_name, dest.data_queue("rep-1", params.user)):
            link._live().subscribe(q, id=q, ack="auto", headers={"browser": "true"})
            frame = link.get(10)
            assert frame is not None and frame.headers.get("browser") == "end", f"{q} is not empty"


def test_same_file_to_two_destinations_is_two_streams(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    """Fan-out by re-sending: the second send must not mistake the first's finished
    checkpoint for an interrupted transfer of its own."""
    src = make_file(tmp_path / "f.bin", 3000)
    first = send_file(params, src, queue_name + ".a", SendOptions(chunk_size=1000))
    second = send_file(params, src, queue_name + ".b", SendOptions(chunk_size=1000))
    assert first.stream_id != second.stream_id
    assert second.resumed_from == 0 and second.bytes_transferred == 3000
    for suffix in (".a", ".b"):
        got = receive_stream(params, queue_name + suffix, tmp_path / f"out{suffix}",
                             options=ReceiveOptions(wait_timeout=10))
        assert got is not None and got.sha256 == sha256_file(src)


def test_a_collision_name_never_replaces_another_streams_file(params: BrokerParams, tmp_path: Path,
                                                              queue_name: str) -> None:
    # A sender names its file after the collision name another stream would get: neither
    # file may replace the other, with or without such a sender.
    from airflow_provider_amqstream.engine.receive.partial_file import short_id

    srcs = [make_file(tmp_path / "in" / f"{i}.bin", 1000 + i) for i in range(4)]
    out = tmp_path / "out"
    second, third = short_id("second"), short_id("third")
    for src, name, sid in ((srcs[0], "data.csv", "first"), (srcs[1], f"data.{second}.csv", "squatter"),
                           (srcs[2], "data.csv", "second"), (srcs[3], "data.csv", "third")):
        send_file(params, src, queue_name, SendOptions(mode="atomic"), stream_id=sid, name=name)
        got = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10, idle_timeout=10))
        assert got is not None and got.stream_id == sid
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == {
        "data.csv": srcs[0].read_bytes(), f"data.{second}.csv": srcs[1].read_bytes(),
        f"data.{second}-2.csv": srcs[2].read_bytes(), f"data.{third}.csv": srcs[3].read_bytes()}


def test_collision_names_cannot_be_exhausted(tmp_path: Path) -> None:
    """Every name a sender can predict taken: the stream still gets one, unguessable."""
    import re

    from airflow_provider_amqstream.engine.receive.partial_file import final_name, short_id

    sid = "victim-1"
    short = short_id(sid)
    for name in ("a.txt", f"a.{short}.txt", f"a.{short}-2.txt", f"a.{short}-3.txt"):
        (tmp_path / name).write_text("taken")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = {final_name(fd, p.StreamSpec(sid, "a.txt", 10, 10), overwrite=False) for _ in range(3)}
    finally:
        os.close(fd)
    assert all(re.fullmatch(r"a\.[0-9a-f]{16}\.txt", n) for n in got) and len(got) == 3, got
