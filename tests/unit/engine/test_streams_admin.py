"""The streams' views and actions without a broker: quarantine causes, the chunk
check a redrive makes, and ``redrive``/``discard`` on the in-memory link. The real broker
proves the wiring in tests/integration/test_streams_admin.py."""

from __future__ import annotations

import fcntl
import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, receive_stream
from airflow_provider_amqstream.engine import inventory as inv
from airflow_provider_amqstream.engine.discard import discard
from airflow_provider_amqstream.engine.redrive import ChunkCheck, RedriveRefused, redrive
from airflow_provider_amqstream.exceptions import DiscardRefused, StreamError, StreamQuarantined, StreamStalled
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import quarantine as qr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import crc32
from airflow_provider_amqstream.protocol.names import Destination, dead_letter_queue
from airflow_provider_amqstream.protocol.outcomes import H_QUARANTINE_CAUSE, Outcome
from airflow_provider_amqstream.transport.link import open_link
from airflow_provider_amqstream.transport.memory import MemoryBroker
from airflow_provider_amqstream.transport.params import extra_list

Q = "/queue/landing"
DEST = Destination.parse(Q)
FAST = {"wait_timeout": 0.3, "idle_timeout": 0.3, "gap_grace": 0.2}


class Frame:
    def __init__(self, headers: dict[str, Any], body: bytes = b"") -> None:
        self.headers, self.body = headers, body


def _data(n: int) -> bytes:
    return (hashlib.sha256(b"x").digest() * (n // 32 + 1))[:n]


def _chunks(spec: p.StreamSpec, data: bytes, user: str = "site-a") -> list[Frame]:
    out = []
    for seq in range(1, spec.chunks + 1):
        off, n = spec.chunk_span(seq)
        out.append(Frame({**p.data_message(spec, seq, data[off:off + n])[0], hdr.H_USER_ID: user}, data[off:off + n]))
    out.append(Frame({**p.end_headers(spec, hashlib.sha256(data).hexdigest()), hdr.H_USER_ID: user}))
    return out


@pytest.mark.parametrize(("written", "cause", "redrivable"), [
    (Outcome.MAX_BYTES, "max_bytes", True),
    (Outcome.REUSED_ID, "reused_id", True),
    (Outcome.PARTIAL_OF_OTHER, "reused_id", True),
    (Outcome.GAVE_WAY, "no_room", True),
    (Outcome.CORRUPT, "corrupt", False),
    (Outcome.INCOMPLETE, "corrupt", False),
    (Outcome.INVALID, "corrupt", False),
])
def test_a_quarantine_cause_says_whether_redrive_can_help(written: Outcome, cause: str, redrivable: bool) -> None:
    # The cause a receiver wrote decides, never the reason's prose.
    c = qr.quarantine_cause({H_QUARANTINE_CAUSE: written.value, hdr.H_QUARANTINE_REASON: "over this receiver's limit"})
    assert (c.label, c.redrivable) == (cause, redrivable) and c.advice


def test_inline_packed_and_handshake_streams_and_batch_list_parts_cannot_be_redriven() -> None:
    over = {H_QUARANTINE_CAUSE: Outcome.MAX_BYTES.value}
    assert qr.quarantine_cause({H_QUARANTINE_CAUSE: Outcome.NO_KEY.value, hdr.H_KIND: "batch"}) is Outcome.BATCH_LIST
    assert qr.quarantine_cause({**over, "amqs_inline": "1"}).label == "inline"
    assert qr.quarantine_cause({**over, hdr.H_KIND: "pack"}).label == "inline"
    assert qr.quarantine_cause({**over, hdr.H_MODE: "handshake"}).label == "handshake"


def test_a_complete_stream_passes_the_check_in_any_order_with_its_sha256() -> None:
    spec, data = p.StreamSpec("s", "s.bin", 4500, 1000), _data(4500)
    check = ChunkCheck(spec, "site-a")
    frames = _chunks(spec, data)
    for f in [frames[2], frames[0], frames[4], frames[1], frames[3], frames[5], frames[1]]:  # one repeat
        assert check.take(f, trust_redrive_header=False) == {qr.H_REDRIVE_SENDER: "site-a"}
    assert check.verdict() == [] and check.sha256_checked and check.duplicates == 1 and check.sender == "site-a"
    # The final move forwards each chunk once.
    assert [check.forward(f) for f in [frames[1], frames[1]]] == [True, False]


def test_the_check_names_what_cannot_arrive() -> None:
    spec, data = p.StreamSpec("s", "s.bin", 5000, 1000), _data(5000)
    frames = _chunks(spec, data)
    check = ChunkCheck(spec)
    for f in frames[:3]:
        check.take(f, trust_redrive_header=False)
    assert check.verdict() == ["chunks 4-5 of 5 are missing (consumed by a receiver before the quarantine, or never "
                               "sent)", "its end marker is missing (the sender never finished)"]
    # Another user's chunk, a corrupt one, and a second chunk 2 that differs.
    check = ChunkCheck(spec)
    forged = Frame({**frames[0].headers, hdr.H_USER_ID: "mallory"}, frames[0].body)
    bad = Frame(dict(frames[1].headers), b"X" + frames[1].body[1:])
    other = Frame({**frames[2].headers, hdr.H_CRC: str(crc32(b"Y" * 1000))}, b"Y" * 1000)
    for f in [*frames, forged, bad, other]:
        check.take(f, trust_redrive_header=False)
    problems = " | ".join(check.verdict())
    assert "sent by 2 users (mallory, site-a)" in problems and "chunk 2 fails its CRC-32" in problems
    assert "two different chunks 3" in problems
    # Chunks that add up to another file than the end marker says.
    check = ChunkCheck(spec)
    lie = Frame({**frames[-1].headers, hdr.H_SHA256: "0" * 64})
    for f in [*frames[:-1], lie]:
        check.take(f, trust_redrive_header=False)
    assert check.verdict() == ["its chunks do not add up to the SHA-256 of its end marker (corrupt)"]


def test_an_earlier_redrives_record_of_the_sender_is_believed_on_dlq_queues_only() -> None:
    spec, data = p.StreamSpec("s", "s.bin", 1000, 1000), _data(1000)
    frames = [Frame({**f.headers, hdr.H_USER_ID: "admin", qr.H_REDRIVE_SENDER: "site-a"}, f.body)
              for f in _chunks(spec, data)]
    trusted = ChunkCheck(spec, "site-a")
    for f in frames:
        trusted.take(f, trust_redrive_header=True)
    assert trusted.verdict() == [] and trusted.sender == "site-a"
    untrusted = ChunkCheck(spec, "site-a")
    for f in frames:
        untrusted.take(f, trust_redrive_header=False)
    assert untrusted.sender == "admin" and untrusted.verdict()


def test_extra_lists_take_a_list_or_commas() -> None:
    assert extra_list({"destinations": "/queue/a, /queue/b,"}, "destinations") == ["/queue/a", "/queue/b"]
    assert extra_list({"destinations": ["/queue/a"]}, "destinations") == ["/queue/a"]
    assert extra_list({}, "destinations") == []


def _play(broker: MemoryBroker, user: str, spec: p.StreamSpec, data: bytes, seqs: list[int], end: bool = True) -> None:
    with open_link(broker.params(user)) as link:
        link.send(Q, b"", p.offer_headers(spec, DEST, sender=user))
        for f in _chunks(spec, data, user)[:-1]:
            if int(f.headers[hdr.H_SEQ]) in seqs:
                link.send(DEST.data_queue(spec.stream_id, user), f.body, {k: v for k, v in f.headers.items()
                                                                          if k != hdr.H_USER_ID})
        if end:
            link.send(DEST.data_queue(spec.stream_id, user), b"", p.end_headers(spec, hashlib.sha256(data).hexdigest()))


def test_redrive_and_discard_on_the_memory_link(broker: MemoryBroker, tmp_path: Path) -> None:
    spec, data = p.StreamSpec("big", "big.bin", 3500, 1000), _data(3500)
    _play(broker, "site-a", spec, data, [1, 2, 3, 4])
    with pytest.raises(StreamQuarantined):
        receive_stream(broker.params("spark"), Q, tmp_path / "in", options=ReceiveOptions(**FAST, max_bytes=10))
    seen = inv.take_inventory(broker.params("admin"), Q, out_dirs=[tmp_path / "in"])
    assert [(q.stream_id, q.cause, q.by_user) for q in seen.quarantined] == [("big", "max_bytes", "spark")]
    with pytest.raises(RedriveRefused, match="filed by spark"):
        redrive(broker.params("admin"), Q, "big", quiet=0.05)
    res = redrive(broker.params("admin"), Q, "big", quiet=0.05, receivers=["spark"])
    assert (res.chunks, res.bytes, res.sender_before, res.redriven_by) == (4, 3500, "site-a", "admin")
    got = receive_stream(broker.params("spark"), Q, tmp_path / "in", options=ReceiveOptions(**FAST))
    assert got is not None and Path(got.path).read_bytes() == data and got.sender == "admin"
    # A stream whose sender went silent: discard takes its parked offer, its chunks and its partial data.
    spec, data = p.StreamSpec("gone", "gone.bin", 3000, 1000), _data(3000)
    _play(broker, "site-a", spec, data, [1], end=False)
    with pytest.raises(StreamStalled, match="nothing arrived"):
        receive_stream(broker.params("spark"), Q, tmp_path / "in", options=ReceiveOptions(**FAST))
    assert (tmp_path / "in" / ".amqstream" / "gone.part").exists()
    out = discard(broker.params("admin"), Q, "gone", out_dirs=[tmp_path / "in"], quiet=0.05)
    assert out.removed == {DEST.parked_queue(): 1} and len(out.local) == 2 and out.bytes_freed > 0
    assert not list((tmp_path / "in" / ".amqstream").glob("gone.*"))
    for queue in (Q, DEST.parked_queue(), f"/queue/DLQ.{DEST.name}", DEST.data_queue("gone", "site-a")):
        assert not [h for h, _ in broker.messages(queue) if h.get(hdr.H_STREAM) == "gone"], queue
    with pytest.raises(StreamError, match="no quarantine copy"):
        redrive(broker.params("admin"), Q, "gone", quiet=0.05)
    # One the check refuses: its chunks are filed under the DLQ of its data queue.
    spec, data = p.StreamSpec("cut", "cut.bin", 3000, 1000), _data(3000)
    _play(broker, "site-a", spec, data, [1, 2], end=False)
    with pytest.raises(StreamQuarantined):
        receive_stream(broker.params("spark"), Q, tmp_path / "in", options=ReceiveOptions(**FAST, max_bytes=10))
    with pytest.raises(RedriveRefused, match="chunks 3 of 3 are missing"):
        redrive(broker.params("admin"), Q, "cut", quiet=0.05, receivers=["spark"])
    filed = broker.messages(dead_letter_queue(DEST.data_queue("cut", "site-a")))
    assert sorted(h[hdr.H_SEQ] for h, _ in filed) == ["1", "2"]


def test_discard_refuses_a_stream_a_receiver_holds_and_removes_nothing(broker: MemoryBroker, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    sdir = tmp_path / "in" / ".amqstream"
    sdir.mkdir(parents=True)
    part = sdir / "held.part"
    part.write_bytes(b"x" * 10)
    # Another receiver's partial state beside it, unreadable: not the discard's business.
    (sdir / "other.part").write_bytes(b"")
    (sdir / "other.json").write_text("{not json")
    with open(part, "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a receiver holds its .part
        with pytest.raises(DiscardRefused, match=r"held on /queue/landing is being received into .*held\.part"):
            discard(broker.params("admin"), Q, "held", out_dirs=[tmp_path / "in"], quiet=0.05)
        assert part.read_bytes() == b"x" * 10
    out = discard(broker.params("admin"), Q, "held", out_dirs=[tmp_path / "in"], quiet=0.05)
    assert not part.exists() and out.bytes_freed >= 10
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "other" in r.getMessage()]
