"""Small files inside their offers: one message per file, received in groups made
durable together. What comes off the wire is checked as strictly as a chunk: hostile inline
offers, sent with raw stomp.py as an authorized sender, are quarantined and the next good
file still arrives; a receiver killed in the middle of groups leaves every file exactly once."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, TransferResult, receive_streams, send_files
from airflow_provider_amqstream.exceptions import ProtocolError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec, crc32
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import HeldProxy, RawSender, browse, cli, cli_json, make_file, records_in, sha256_file, wait_for

DEST = Destination.parse("/queue/inline.unit")
BODY = hashlib.sha256(b"inline").digest() * 100  # 3200 bytes, compressible
SHA = hashlib.sha256(BODY).hexdigest()


def _spec(size: int = len(BODY), chunk: int = 4096, mode: hdr.Mode = hdr.Mode.ATOMIC) -> p.StreamSpec:
    return p.StreamSpec("in-1", "f.bin", size, chunk, mode)


@pytest.mark.parametrize("codec", [None, ChunkCodec("zstd")])
def test_an_inline_offer_carries_the_file_and_is_read_back_exactly(codec: ChunkCodec | None) -> None:
    headers, wire = bw.inline_offer(_spec(), DEST, BODY, SHA, sender="ann", codec=codec)
    assert bw.is_inline(headers) and (len(wire) < len(BODY)) == (codec is not None)
    spec, _ = p.parse_offer(headers, DEST, sender="ann")
    assert bw.read_inline(headers, wire, spec) == BODY
    empty = p.StreamSpec("in-0", "empty", 0, 4096)
    h0, w0 = bw.inline_offer(empty, DEST, b"", hashlib.sha256(b"").hexdigest(), sender="ann")
    assert bw.read_inline(h0, w0, empty) == b""


def test_only_one_chunk_outside_handshake_mode_travels_inline() -> None:
    with pytest.raises(ProtocolError, match="one chunk"):
        bw.inline_offer(_spec(chunk=1000), DEST, BODY, SHA, sender="ann")
    with pytest.raises(ProtocolError, match="one chunk"):
        bw.inline_offer(_spec(mode=hdr.Mode.HANDSHAKE), DEST, BODY, SHA, sender="ann")
    with pytest.raises(ProtocolError, match="did the file change"):
        bw.inline_offer(_spec(), DEST, BODY[:-1], SHA, sender="ann")


def _bomb() -> bytes:
    import zstandard

    # A tiny frame that declares far more than the offer's size.
    return zstandard.ZstdCompressor().compress(b"\0" * 2**20)


HOSTILE: dict[str, Any] = {
    "bad-crc": lambda h, w: ({**h, hdr.H_CRC: str((int(h[hdr.H_CRC]) + 1) % 2**32)}, w),
    "sha-mismatch": lambda h, w: ({**h, hdr.H_SHA256: "0" * 64}, w),
    "no-sha": lambda h, w: ({k: v for k, v in h.items() if k != hdr.H_SHA256}, w),
    "short-body": lambda h, w: ({**h, hdr.H_CRC: str(crc32(w[:-1]))}, w[:-1]),
    "zstd-bomb": lambda h, w: ({**h, hdr.H_ENCODING: "zstd", hdr.H_CRC: str(crc32(_bomb()))}, _bomb()),
    "unknown-encoding": lambda h, w: ({**h, hdr.H_ENCODING: "lz4"}, w),
    "inline-value": lambda h, w: ({**h, bw.H_INLINE: "yes"}, w),
    "two-chunks": lambda h, w: ({**h, hdr.H_CHUNK_SIZE: "1000", hdr.H_CHUNKS: "4"}, w),
    "handshake": lambda h, w: ({**h, hdr.H_MODE: "handshake", hdr.H_REPLY_TO: DEST.control_queue("in-1"),
                                hdr.H_WINDOW: "4"}, w),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_inline_offers_are_refused(case: str) -> None:
    headers, wire = HOSTILE[case](*bw.inline_offer(_spec(), DEST, BODY, SHA, sender="ann"))
    with pytest.raises(ProtocolError):
        spec, _ = p.parse_offer(headers, DEST, sender="ann")
        bw.read_inline(headers, wire, spec)


@pytest.mark.broker
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_inline_offer_is_quarantined_and_the_next_files_arrive(
        params: BrokerParams, tmp_path: Path, queue_name: str, case: str) -> None:
    dest = Destination.parse(queue_name)
    sid = f"hx-{case}"
    spec = p.StreamSpec(sid, "bad.bin", len(BODY), 4096, hdr.Mode.ATOMIC)
    headers, wire = HOSTILE[case](*bw.inline_offer(spec, dest, BODY, SHA, sender=params.user))
    if case == "handshake":
        headers[hdr.H_REPLY_TO] = dest.control_queue(sid)
    raw = RawSender(params)
    raw.send(queue_name, wire, headers)
    raw.close()
    good = [make_file(tmp_path / "in" / f"good{i}.bin", 5000 + i, seed=i) for i in range(3)]
    send_files(params, good, queue_name, SendOptions(chunk_size=64 * 1024))
    got: list[TransferResult] = []
    failures: list[Any] = []
    out = tmp_path / "out"
    receive_streams(params, queue_name, out, count=3, options=ReceiveOptions(wait_timeout=15),
                    on_result=got.append, on_failure=failures.append)
    assert sorted(Path(r.path).name for r in got) == [f.name for f in good]
    for r in got:
        assert sha256_file(Path(r.path)) == sha256_file(tmp_path / "in" / Path(r.path).name)
    [f] = failures
    assert f.status == "quarantined" and f.stream_id == sid, f
    [filed] = browse(params, "/queue/DLQ." + dest.name)
    assert filed.headers[hdr.H_STREAM] == sid and filed.headers[hdr.H_QUARANTINE_REASON]
    assert not (out / "bad.bin").exists()
    assert not list((out / ".amqstream").glob("*.inline")), "a temporary file was left behind"


@pytest.mark.broker
def test_hundreds_of_small_files_arrive_in_groups_byte_exact(params: BrokerParams, tmp_path: Path,
                                                             queue_name: str) -> None:
    files = [make_file(tmp_path / "in" / f"s{i:03d}.bin", 1 + i * 97, seed=i) for i in range(300)]
    sent = send_files(params, files, queue_name, SendOptions(chunk_size=64 * 1024, compression="zstd"))
    assert sent.totals()["files_sent"] == 300
    got = receive_streams(params, queue_name, tmp_path / "out", count=300, options=ReceiveOptions(wait_timeout=15))
    assert len(got) == 300 and len({r.stream_id for r in got}) == 300
    for src in files:
        assert sha256_file(tmp_path / "out" / src.name) == sha256_file(src)
    sdir = tmp_path / "out" / ".amqstream"
    assert records_in(tmp_path / "out") == 300 and not list(sdir.glob("*.inline"))


@pytest.mark.broker
def test_a_file_published_before_its_record_is_not_received_twice(params: BrokerParams, tmp_path: Path,
                                                                  queue_name: str) -> None:
    """A receiver that died after renaming a group's files but before flushing their records
    gets the offers again: the same bytes under the same name are taken over, not copied
    beside; another stream's file under that name, even with the same bytes, keeps it."""
    from airflow_provider_amqstream.engine.receive.inline import MARK

    same = make_file(tmp_path / "in" / "same.csv", 7000, seed=1)
    other = make_file(tmp_path / "in" / "other.csv", 7000, seed=2)
    sent = {Path(r.path).name: r.stream_id for r in send_files(params, [same, other], queue_name,
                                                               SendOptions(chunk_size=64 * 1024)).results}
    out = tmp_path / "out"
    out.mkdir()
    (out / "same.csv").write_bytes(same.read_bytes())  # published by a receiver that died, record lost
    try:
        os.setxattr(out / "same.csv", MARK, sent["same.csv"].encode())
    except OSError:
        pytest.skip("this filesystem keeps no user extended attributes")
    (out / "other.csv").write_bytes(other.read_bytes())  # the same bytes, but another stream's file
    got = receive_streams(params, queue_name, out, count=2, options=ReceiveOptions(wait_timeout=15))
    paths = {Path(r.path).name for r in got}
    assert "same.csv" in paths and sha256_file(out / "same.csv") == sha256_file(same)
    [moved] = [n for n in paths if n.startswith("other.")]
    assert moved != "other.csv" and sha256_file(out / moved) == sha256_file(other)
    assert "other.csv" not in paths
    assert sorted(f.name for f in out.iterdir() if not f.name.startswith(".")) == sorted(["same.csv", "other.csv",
                                                                                          moved])


@pytest.mark.broker
@pytest.mark.kill
def test_a_receiver_killed_between_groups_leaves_every_file_exactly_once(
        uri: str, params: BrokerParams, tmp_path: Path, queue_name: str, held_proxy: Callable[..., HeldProxy]) -> None:
    # 100 KB each: enough disk work that the kill lands while groups are in flight.
    files = [make_file(tmp_path / "in" / f"k{i:04d}.bin", 100_000 + i, seed=i) for i in range(1000)]
    cli_json(cli("send", str(tmp_path / "in"), "--recursive", "--to", queue_name, "--conn", uri, "--json", "-q",
                 "--no-manifest"))
    out = tmp_path / "out"
    # The first receiver gets no more than 40 MiB of them until it is killed: it is part way then.
    proxy = held_proxy(params.hosts[0][1], 40 * 2**20, to_broker=False)
    args = ["receive", "--from", queue_name, "--out-dir", str(out), "--conn", proxy.uri(uri), "--count", "1000",
            "--json", "-q", "--wait", "20"]
    # Its stdout goes to a file: nobody reads a pipe while we wait, and a full pipe would stop it.
    with open(tmp_path / "first.jsonl", "w") as sink:
        first = cli(*args, stdout=sink)

    def received_150() -> bool:
        assert first.poll() is None, f"the receiver exited early: {first.communicate()[1][-2000:]}"
        return records_in(out) >= 150

    wait_for(received_150, 120, "150 files received", interval=0.005)
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    args[args.index("--conn") + 1] = uri
    before = records_in(out)
    assert before < 1000, "the receiver finished before it could be killed"
    # The re-run drains the queue: offers whose records were written but not yet
    # acknowledged come back as duplicates, so it cannot know how many streams are left.
    args[args.index("--wait") + 1] = "5"
    rest = cli_json(cli(*args))
    complete = [r for r in rest if r["status"] == "complete"]
    assert len(complete) == 1000 - before and {r["status"] for r in rest} <= {"complete", "duplicate"}
    published = sorted(f.name for f in out.iterdir() if not f.name.startswith("."))
    assert published == sorted(f.name for f in files), "a file is missing or was published twice"
    for src in files:
        assert sha256_file(out / src.name) == sha256_file(src)
    assert not list((out / ".amqstream").glob("*.inline")), "the dead receiver's temporary files were left"
