"""The receive engine on the in-memory link: what a stream's messages become, what a
hostile sender can make a receiver do, and identity from the broker's stamp. No broker,
no network: each test runs in well under a second (the real broker proves the wiring in
tests/integration/test_queue_liveness.py, tests/integration/test_hostile_scale.py and the others)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import (
    ReceiveOptions,
    StreamFailure,
    TransferResult,
    find_manifest,
    receive_stream,
    receive_streams,
)
from airflow_provider_amqstream.engine.receive import stream as receive_module
from airflow_provider_amqstream.engine.receive.offers import MAX_YIELDS
from airflow_provider_amqstream.engine.receive.stream import StreamReceiver
from airflow_provider_amqstream.exceptions import StreamError, StreamQuarantined, StreamStalled
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.link import open_link
from airflow_provider_amqstream.transport.memory import MemoryBroker
from tests.helpers import Tamper, page_cache_droppable, resident_pages, send_stream

Q = "/queue/landing"
DEST = Destination.parse(Q)
FAST = {"wait_timeout": 0.3, "idle_timeout": 0.3, "gap_grace": 0.2}


def play(broker: MemoryBroker, user: str, spec: p.StreamSpec, data: bytes, seqs: list[int], *, end: bool = True,
         tamper: Tamper | None = None, offer: bool = True) -> None:
    """Offer ``spec`` as ``user`` and send chunks ``seqs`` (in that order, repeats allowed)."""
    with open_link(broker.params(user)) as link:
        send_stream(link.send, Q, spec, data, seqs, end=end, tamper=tamper, offer=offer)


def receive_all(broker: MemoryBroker, out: Path, user: str = "rx", **opts: Any) -> tuple[list[TransferResult],
                                                                                        list[StreamFailure]]:
    failures: list[StreamFailure] = []
    got = receive_streams(broker.params(user), Q, out, on_failure=failures.append,
                          options=ReceiveOptions(**{**FAST, **opts}))
    return got, failures


def test_chunks_out_of_order_and_repeated_arrive_byte_exact(broker: MemoryBroker, tmp_path: Path) -> None:
    data = os.urandom(10_000)
    spec = p.StreamSpec("mixed-1", "mixed.bin", len(data), 1000)
    seqs = list(range(1, 11)) * 2
    random.Random(7).shuffle(seqs)
    play(broker, "alice", spec, data, seqs)
    got = receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST))
    assert got is not None and (tmp_path / "out" / "mixed.bin").read_bytes() == data
    assert got.duplicates == 10 and got.sender == "alice"
    assert broker.messages(DEST.data_queue("mixed-1", "alice")) == []


def test_a_received_stream_gives_its_pages_back_batch_by_batch(broker: MemoryBroker, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each synced batch, then the published file, leaves the page cache; chunks out of order
    are hashed from what is still cached, so the file still checks out."""
    out = tmp_path / "out"
    out.mkdir()
    if not page_cache_droppable(out):
        pytest.skip(f"{out} is on a filesystem whose pages are the file (tmpfs)")
    dropped: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            dropped.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    data = os.urandom(64 * 4096 + 123)
    spec = p.StreamSpec("cold-1", "cold.bin", len(data), 4096)
    seqs = list(range(1, spec.chunks + 1))
    random.Random(3).shuffle(seqs)
    play(broker, "alice", spec, data, seqs)
    got = receive_stream(broker.params("rx"), Q, out, options=ReceiveOptions(**FAST, window=4))
    assert got is not None and got.sha256 == hashlib.sha256(data).hexdigest()
    assert resident_pages(out / "cold.bin") == 0
    # Dropped while the stream was under way, never past what was durable and hashed.
    assert len(dropped) > 2 and all(off == 0 and 0 < n <= len(data) for off, n in dropped)
    assert dropped[-1] == (0, len(data)) and any(n < len(data) for _, n in dropped[:-1])
    assert (out / "cold.bin").read_bytes() == data


def test_a_missing_chunk_quarantines_the_stream_naming_the_range(broker: MemoryBroker, tmp_path: Path) -> None:
    data = os.urandom(5000)
    play(broker, "alice", p.StreamSpec("gap-1", "gap.bin", len(data), 1000), data, [1, 2, 4, 5])
    with pytest.raises(StreamQuarantined, match=r"chunks 3-3 \(bytes 2000-2999\)"):
        receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST))
    [(filed, _)] = broker.messages("/queue/DLQ.landing")
    assert filed[hdr.H_STREAM] == "gap-1" and "chunks 3-3" in filed[hdr.H_QUARANTINE_REASON]
    assert not list((tmp_path / "out" / ".amqstream").glob("gap-1.*"))


def test_a_corrupt_chunk_quarantines_the_stream(broker: MemoryBroker, tmp_path: Path) -> None:
    data = os.urandom(3000)

    def flip(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, (bytes([body[0] ^ 1]) + body[1:]) if seq == 2 else body

    play(broker, "alice", p.StreamSpec("bad-1", "bad.bin", len(data), 1000), data, [1, 2, 3], tamper=flip)
    with pytest.raises(StreamQuarantined, match="CRC-32"):
        receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST))
    assert not (tmp_path / "out" / "bad.bin").exists()


class _Killed(BaseException):
    """The receiver dies here (nothing in the engine catches it)."""


def test_a_receiver_killed_while_quarantining_leaves_the_stream_filed_once(
        broker: MemoryBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver killed after it moved a poisoned stream's chunks to the DLQ but before it
    acknowledged the offer: the offer comes back without its chunks. The next receiver must
    finish the quarantine (one record, with the first reason), not take the stream for a
    stalled one and park it for ever, as the soak found."""
    data = os.urandom(5000)

    def flip(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, (bytes([body[0] ^ 1]) + body[1:]) if seq == 2 else body

    play(broker, "alice", p.StreamSpec("bad-2", "bad.bin", len(data), 1000), data, [1, 2, 3, 4, 5], tamper=flip)
    abandon = StreamReceiver.abandon

    def abandon_then_die(self: StreamReceiver) -> int:
        abandon(self)
        raise _Killed

    monkeypatch.setattr(StreamReceiver, "abandon", abandon_then_die)
    with pytest.raises(_Killed):
        receive_all(broker, tmp_path / "out")
    monkeypatch.setattr(StreamReceiver, "abandon", abandon)
    assert [h[hdr.H_STREAM] for h, _ in broker.messages(Q)] == ["bad-2"], "the offer came back"
    assert broker.messages(DEST.data_queue("bad-2", "alice")) == [], "its chunks are gone"

    got, failures = receive_all(broker, tmp_path / "out")
    assert got == [] and [(f.stream_id, f.status) for f in failures] == [("bad-2", "quarantined")]
    assert "CRC-32" in failures[0].reason
    [(filed, _)] = broker.messages("/queue/DLQ.landing")
    assert filed[hdr.H_STREAM] == "bad-2" and "CRC-32" in filed[hdr.H_QUARANTINE_REASON]
    assert broker.messages(Q) == [] and broker.messages(DEST.parked_queue()) == []
    assert not list((tmp_path / "out" / ".amqstream").glob("bad-2*"))


@pytest.mark.parametrize("n", [10, 1000])
def test_offers_too_large_and_junk_ahead_do_not_hold_up_a_good_stream(broker: MemoryBroker, tmp_path: Path,
                                                                     n: int) -> None:
    """What tests/integration/test_hostile_scale.py measures on ActiveMQ, here as logic: each bad offer
    is settled once (parked or quarantined), none is taken twice, and no list grows."""
    with open_link(broker.params("mallory")) as link:
        for i in range(n):
            link.send(Q, b"", p.offer_headers(p.StreamSpec(f"tib-{i}", "x.bin", 2**40, 2**20), DEST, sender="mallory"))
            link.send(Q, b"junk", {hdr.H_STREAM: f"junk-{i}"})
    good = os.urandom(2000)
    play(broker, "alice", p.StreamSpec("good-1", "good.bin", len(good), 1000), good, [1, 2])
    t0 = time.monotonic()
    got, failures = receive_all(broker, tmp_path / "out")
    assert [r.stream_id for r in got] == ["good-1"] and (tmp_path / "out" / "good.bin").read_bytes() == good
    assert sorted(f.status for f in failures) == ["no_room"] * n + ["quarantined"] * n
    parked = broker.messages(DEST.parked_queue())
    assert len(parked) == n and all(p.parked_until(h) > time.time() + 200 for h, _ in parked)
    assert {h[hdr.H_FIRST_SENDER] for h, _ in parked} == {"mallory"}
    assert broker.messages(Q) == [] and len(broker.messages("/queue/DLQ.landing")) == n
    # Parked ones are passed, not taken, by the next receiver: nothing fails twice.
    again, failures = receive_all(broker, tmp_path / "out")
    assert again == [] and failures == []
    print(f"\n{n} offers too large and {n} junk messages settled in {time.monotonic() - t0:.2f}s")


def test_a_stalled_stream_is_parked_and_comes_back_whole(broker: MemoryBroker, tmp_path: Path) -> None:
    data = os.urandom(6000)
    spec = p.StreamSpec("late-1", "late.bin", len(data), 1000)
    play(broker, "alice", spec, data, [1, 2], end=False)
    with pytest.raises(StreamStalled, match=r"late-1.*at byte 2000 of 6000"):
        receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST, yield_backoff=600))
    # The space reserved past the data on disk is given back while it waits.
    assert (tmp_path / "out" / ".amqstream" / "late-1.part").stat().st_size == 2000
    [(parked, _)] = broker.messages(DEST.parked_queue())
    assert parked[hdr.H_YIELDS] == "1" and "at byte 2000" in parked[hdr.H_YIELD_REASON]
    play(broker, "alice", spec, data, [3, 4, 5, 6], offer=False)
    assert receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST)) is None
    got = receive_stream(broker.params("rx"), Q, tmp_path / "out", stream_id="late-1", options=ReceiveOptions(**FAST))
    assert got is not None and got.resumed_from == 2000 and (tmp_path / "out" / "late.bin").read_bytes() == data


def test_a_slow_senders_chunks_are_reported_as_they_arrive(broker: MemoryBroker, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that come one at a time are committed when the link goes quiet, one by one,
    never as a full batch: the receive must report them all the same, or a slow transfer
    shows no progress until its end. The sender sends each chunk once the one before it is
    reported."""
    monkeypatch.setattr(receive_module, "PROGRESS_EVERY", 0.0)
    data = os.urandom(4000)
    spec = p.StreamSpec("slow-1", "slow.bin", len(data), 1000)
    seen: list[int] = []
    reported = threading.Condition()

    def progress(done: int, total: int) -> None:
        with reported:
            seen.append(done)
            reported.notify_all()

    def sender() -> None:
        with open_link(broker.params("alice")) as link:
            for seq in range(1, spec.chunks + 1):
                send_stream(link.send, Q, spec, data, [seq], end=seq == spec.chunks, offer=seq == 1)
                with reported:
                    if not reported.wait_for(lambda at=seq * 1000: at in seen, timeout=5):
                        return

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    got = receive_stream(broker.params("rx"), Q, tmp_path / "out",
                         options=ReceiveOptions(**{**FAST, "idle_timeout": 10.0}, progress=progress))
    thread.join(5)
    assert got is not None and (tmp_path / "out" / "slow.bin").read_bytes() == data
    assert {1000, 2000, 3000} <= set(seen), seen


def test_a_stream_another_process_of_the_directory_is_receiving_is_parked_and_left_to_it(
        broker: MemoryBroker, tmp_path: Path) -> None:
    """The broker can hand one stream's offer to two receivers of one directory (the first's
    connection dropped while it still wrote). The second finds the partial file locked: it
    parks the offer, touches nothing of the other's data, and goes on with the next stream
    (it used to exit with a plain error)."""
    data, good = os.urandom(4000), os.urandom(3000)
    spec = p.StreamSpec("held-1", "held.bin", len(data), 1000)
    play(broker, "alice", spec, data, [1, 2, 3, 4])
    play(broker, "alice", p.StreamSpec("next-1", "next.bin", len(good), 1000), good, [1, 2, 3])
    sdir = tmp_path / "out" / ".amqstream"
    sdir.mkdir(parents=True)
    (sdir / "held-1.part").write_bytes(b"the other receiver's chunks")
    with open(sdir / "held-1.part", "rb") as other:
        fcntl.flock(other, fcntl.LOCK_EX)  # what the other receiver's PartialFile holds
        got, failures = receive_all(broker, tmp_path / "out", yield_backoff=600)
        assert [r.stream_id for r in got] == ["next-1"] and (tmp_path / "out" / "next.bin").read_bytes() == good
        assert [(f.stream_id, f.status) for f in failures] == [("held-1", "busy")], failures
        assert "being received by another process" in failures[0].reason
        assert (sdir / "held-1.part").read_bytes() == b"the other receiver's chunks"
        [(parked, _)] = broker.messages(DEST.parked_queue())
        assert parked[hdr.H_STREAM] == "held-1" and parked[hdr.H_YIELDS] == "1"
    # Once the other lets go, the stream is taken by id and completed here.
    (sdir / "held-1.part").unlink()
    got_again = receive_stream(broker.params("rx"), Q, tmp_path / "out", stream_id="held-1",
                               options=ReceiveOptions(**FAST))
    assert got_again is not None and (tmp_path / "out" / "held.bin").read_bytes() == data


def test_a_receiver_that_cannot_park_puts_the_offer_back_and_goes_on(broker: MemoryBroker, tmp_path: Path) -> None:
    """A broker whose memory is full refuses the receiver's send to the parked queue. The
    receiver does not exit: the offer goes back with its connection, and once the broker
    takes sends again the stalled offer is parked and the good stream behind it arrives. A
    broker that keeps refusing ends the receive once the reconnect timeout has passed,
    naming the destination."""
    data = os.urandom(3000)
    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"", p.offer_headers(p.StreamSpec("gone-3", "gone.bin", 10**6, 2**20), DEST, sender="mallory"))
    play(broker, "alice", p.StreamSpec("good-3", "good.bin", len(data), 1000), data, [1, 2, 3])
    broker.refuse(DEST.parked_queue(), 2)
    got, failures = receive_all(broker, tmp_path / "out", wait_timeout=1)
    assert [r.stream_id for r in got] == ["good-3"] and (tmp_path / "out" / "good.bin").read_bytes() == data
    assert [f.stream_id for f in failures] == ["gone-3"] and broker.refusals[DEST.parked_queue()] == 0
    assert [h[hdr.H_STREAM] for h, _ in broker.messages(DEST.parked_queue())] == ["gone-3"]

    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"", p.offer_headers(p.StreamSpec("gone-4", "gone.bin", 10**6, 2**20), DEST, sender="mallory"))
    broker.refuse(DEST.parked_queue(), 10**6)
    with pytest.raises(StreamError, match=r"gave up after 1s.*refused messages to /queue/landing.amqs_parked"):
        receive_all(broker, tmp_path / "out", reconnect_timeout=1)


def test_an_offer_whose_data_queue_the_broker_refuses_is_parked_naming_its_sender(
        broker: MemoryBroker, tmp_path: Path) -> None:
    """The broker refuses to create a stream's data queue (its sender is at its cap): that
    offer gives way, blaming its sender, and the next stream arrives; a repeat of a
    published stream whose data queue is refused is acknowledged (nothing can be there)."""
    play(broker, "mallory", p.StreamSpec("over-1", "o.bin", 10, 10), b"", [], end=False)
    broker.refuse_creating(DEST.data_queue("over-1", "mallory"), 1)
    data = os.urandom(3000)
    play(broker, "alice", p.StreamSpec("good-1", "good.bin", len(data), 1000), data, [1, 2, 3])
    got, failures = receive_all(broker, tmp_path / "out")
    assert [r.stream_id for r in got] == ["good-1"] and (tmp_path / "out" / "good.bin").read_bytes() == data
    assert [(f.stream_id, f.status) for f in failures] == [("over-1", "refused")]
    assert "'mallory'" in failures[0].reason and "rx" not in failures[0].reason
    [(parked, _)] = broker.messages(DEST.parked_queue())
    assert parked[hdr.H_STREAM] == "over-1" and "'mallory'" in parked[hdr.H_YIELD_REASON]
    play(broker, "alice", p.StreamSpec("good-1", "good.bin", len(data), 1000), b"", [], end=False)
    broker.refuse_creating(DEST.data_queue("good-1", "alice"), 1)
    again, failures = receive_all(broker, tmp_path / "out")
    assert [r.status for r in again] == ["duplicate"] and failures == []
    assert broker.uncreatable[DEST.data_queue("good-1", "alice")] == 0, "the repeat did not look at its data queue"


def test_only_what_the_receivers_own_user_parked_is_believed(broker: MemoryBroker, tmp_path: Path) -> None:
    """Another receiving user's parked copies naming alice (one due, one not yet: it must not
    be passed along, which would stamp it as ours) are quarantined, naming who parked them;
    the copy rx itself parked is received as alice's."""
    def parked(sid: str, name: str, due: float) -> tuple[dict[str, str], bytes]:
        body = sid.encode()
        spec = p.StreamSpec(sid, name, len(body), 1024, hdr.Mode.ATOMIC)
        headers, wire = bw.inline_offer(spec, DEST, body, hashlib.sha256(body).hexdigest(), sender="alice")
        return p.parked_headers(headers, sender="alice", not_before=due, reason="x"), wire

    with open_link(broker.params("forger")) as link:
        for sid, due in (("forged-1", time.time() - 1), ("forged-2", time.time() + 3600)):
            link.send(DEST.parked_queue(), parked(sid, f"{sid}.csv", due)[1], parked(sid, f"{sid}.csv", due)[0])
    with open_link(broker.params("rx")) as link:
        link.send(DEST.parked_queue(), parked("mine-1", "mine.csv", 0)[1], parked("mine-1", "mine.csv", 0)[0])
    got, failures = receive_all(broker, tmp_path / "out", wait_timeout=2.5)
    assert [(r.name, r.sender) for r in got] == [("mine.csv", "alice")]
    assert sorted(f.stream_id for f in failures) == ["forged-1", "forged-2"]
    assert all(f.status == "quarantined" and "user 'forger' put it" in f.reason for f in failures)
    assert not list((tmp_path / "out").glob("forged-*")) and broker.messages(DEST.parked_queue()) == []


def test_a_users_stalled_backlog_costs_another_user_one_look_per_round(broker: MemoryBroker, tmp_path: Path) -> None:
    """Fair share: mallory's first silent stream is looked at, her other offers in the
    round are parked unseen, and alice's stream behind them all arrives. A round ends when
    the queue of offers runs dry: then mallory gets a look again."""
    with open_link(broker.params("mallory")) as link:
        for i in range(50):
            link.send(Q, b"", p.offer_headers(p.StreamSpec(f"held-{i}", "h.bin", 5000, 1000), DEST, sender="mallory"))
    data = os.urandom(3000)
    play(broker, "alice", p.StreamSpec("good-1", "good.bin", len(data), 1000), data, [1, 2, 3])
    t0 = time.monotonic()
    got, failures = receive_all(broker, tmp_path / "out", idle_timeout=1.0)
    assert [r.stream_id for r in got] == ["good-1"]
    assert len(failures) == 50 and {f.status for f in failures} == {"stalled"}
    assert [f.stream_id for f in failures if "without a look" not in f.reason] == ["held-0"]
    assert time.monotonic() - t0 < 20, "each of mallory's offers was looked at"
    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"", p.offer_headers(p.StreamSpec("held-new", "h.bin", 5000, 1000), DEST, sender="mallory"))
    _, failures = receive_all(broker, tmp_path / "out", idle_timeout=1.0)
    assert [(f.stream_id, "without a look" in f.reason) for f in failures] == [("held-new", False)]


def test_a_fresh_offer_goes_before_a_backlog_of_parked_ones(broker: MemoryBroker, tmp_path: Path) -> None:
    """With the queue of offers dry, a receiver takes due parked offers back to back; an
    offer that arrives meanwhile is taken after the look in progress, not after them all."""
    with open_link(broker.params("rx")) as link:
        for i in range(30):
            spec = p.StreamSpec(f"due-{i}", "d.bin", 5000, 1000)
            link.send(DEST.parked_queue(), b"", p.parked_headers(p.offer_headers(spec, DEST, sender="mallory"),
                                                                sender="mallory", not_before=time.time() - 1))
    looked, yields = threading.Event(), []

    def event(kind: str, _: Any) -> None:
        if kind == "stream_yielded":
            yields.append(kind)
            if len(yields) == 5:  # well into the back to back sweeps
                looked.set()

    got: list[TransferResult] = []
    opts = ReceiveOptions(**{**FAST, "wait_timeout": 30, "idle_timeout": 0.5}, events=event)
    rx = threading.Thread(target=lambda: got.extend(receive_streams(broker.params("rx"), Q, tmp_path / "out",
                                                                    count=1, options=opts)), daemon=True)
    rx.start()
    assert looked.wait(30), "no parked offer was looked at"
    data = os.urandom(3000)
    t0 = time.monotonic()
    play(broker, "alice", p.StreamSpec("good-1", "good.bin", len(data), 1000), data, [1, 2, 3])
    rx.join(60)
    waited = time.monotonic() - t0
    assert [r.stream_id for r in got] == ["good-1"]
    assert waited < 5, f"{waited:.1f}s: the fresh offer waited for the parked backlog (30 looks of 0.5 s)"
    assert len(yields) <= 8, f"{len(yields)} parked offers were looked at first"


def test_a_half_sent_stream_gives_way_after_its_first_look_not_the_idle_timeout(
        broker: MemoryBroker, tmp_path: Path) -> None:
    """Five streams of two one-byte chunks, each with its first chunk only, ahead of a good
    one: each is parked once its first look is spent (it brought 1 byte, far below
    ``min_rate``), not after ``idle_timeout`` (was 605 s at the default 120 s)."""
    for i in range(5):
        play(broker, "mallory", p.StreamSpec(f"half-{i}", "half.bin", 2, 1), b"xy", [1], end=False)
    good = os.urandom(3000)
    play(broker, "alice", p.StreamSpec("good-h", "good.bin", len(good), 1000), good, [1, 2, 3])
    t0 = time.monotonic()
    got, failures = receive_all(broker, tmp_path / "out", idle_timeout=120, wait_timeout=1)
    took = time.monotonic() - t0
    assert [r.stream_id for r in got] == ["good-h"] and (tmp_path / "out" / "good.bin").read_bytes() == good
    assert [(f.stream_id, f.status) for f in failures] == [(f"half-{i}", "stalled") for i in range(5)]
    assert "at least 16384 bytes a second" in failures[0].reason and "at byte 1 of 2" in failures[0].reason
    assert took < 5 * receive_module.FIRST_LOOK + 5, f"{took:.1f}s behind 5 half-sent streams"
    assert len(broker.messages(DEST.parked_queue())) == 5


def test_a_trickling_stream_gives_way_even_after_a_burst(broker: MemoryBroker, tmp_path: Path) -> None:
    """A burst buys at most the larger of the first look and a chunk's worth of time: a
    sender that sends 5,000 bytes at once, then a new 10-byte chunk every 0.3 s (33 B/s,
    below a ``min_rate`` of 1,000), is parked within seconds, not held while bytes come."""
    spec = p.StreamSpec("drip-1", "drip.bin", 100_000, 10)
    data = os.urandom(spec.size)
    play(broker, "mallory", spec, data, list(range(1, 501)), end=False)
    stop = threading.Event()

    def drip() -> None:
        with open_link(broker.params("mallory")) as link:
            seq = 501
            while not stop.wait(0.3):
                send_stream(link.send, Q, spec, data, [seq], end=False, offer=False)
                seq += 1

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(StreamStalled, match=r"drip-1.*at byte \d+ of 100000"):
            receive_stream(broker.params("rx"), Q, tmp_path / "out",
                           options=ReceiveOptions(wait_timeout=1, idle_timeout=120, min_rate=1000))
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join(5)
    # 5,000 bytes at 1,000 B/s would buy 5 s; banked, they buy the first look at most.
    assert took < 2 * receive_module.FIRST_LOOK + 2, f"held {took:.1f}s"


def test_a_sender_above_the_minimum_rate_keeps_its_receiver(broker: MemoryBroker, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1,000 bytes every 0.5 s (2,000 B/s) against a minimum of 1,000 B/s and a
    first look of 0.2 s: each chunk buys a second, so the gaps longer than the look do not
    part the receiver from the stream, which arrives whole in one go."""
    monkeypatch.setattr(receive_module, "FIRST_LOOK", 0.2)
    spec = p.StreamSpec("steady-1", "steady.bin", 5000, 1000)
    data = os.urandom(spec.size)
    stop = threading.Event()

    def steady() -> None:
        with open_link(broker.params("alice")) as link:
            for seq in range(1, spec.chunks + 1):
                send_stream(link.send, Q, spec, data, [seq], end=seq == spec.chunks, offer=seq == 1)
                if stop.wait(0.5):  # the sender's own pace
                    return

    t = threading.Thread(target=steady, daemon=True)
    t.start()
    try:
        got = receive_stream(broker.params("rx"), Q, tmp_path / "out",
                             options=ReceiveOptions(wait_timeout=5, idle_timeout=10, min_rate=1000))
    finally:
        stop.set()
        t.join(10)
    assert got is not None and got.resumed_from == 0 and (tmp_path / "out" / "steady.bin").read_bytes() == data


def test_a_stream_that_never_sent_a_chunk_keeps_nothing(broker: MemoryBroker, tmp_path: Path) -> None:
    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"", p.offer_headers(p.StreamSpec("gone-1", "gone.bin", 10**9, 2**20), DEST, sender="mallory"))
    got, failures = receive_all(broker, tmp_path / "out", idle_timeout=5)
    assert got == [] and [f.status for f in failures] == ["stalled"]
    # Said as it was: a short look, not five seconds of waiting.
    assert "no chunk arrived in a first look of 2.0s at byte 0" in failures[0].reason, failures[0].reason
    assert not list((tmp_path / "out" / ".amqstream").glob("gone-1*")), "nothing reserved for a silent sender"


def test_a_silent_stream_an_earlier_receiver_reserved_for_gets_only_the_first_look(
        broker: MemoryBroker, tmp_path: Path) -> None:
    """A receiver killed while it looked at a stream that never sent a chunk leaves its
    reservation behind (a fresh part file, no state). Receivers restarted after it must give
    the stream its first look, not the whole idle timeout counted from the reservation: with
    receivers killed every few seconds, a silent stream ahead of good ones was never given up."""
    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"", p.offer_headers(p.StreamSpec("gone-2", "gone.bin", 10**6, 2**20), DEST, sender="mallory"))
    sdir = tmp_path / "out" / ".amqstream"
    sdir.mkdir(parents=True)
    (sdir / "gone-2.part").write_bytes(b"\0" * 10**6)  # just now, as each restarted receiver does
    t0 = time.monotonic()
    got, failures = receive_all(broker, tmp_path / "out", idle_timeout=60)
    assert got == [] and [f.status for f in failures] == ["stalled"]
    assert time.monotonic() - t0 < 30, "the silent stream was waited on for the idle timeout"
    assert not list(sdir.glob("gone-2*")), "nothing kept for a silent sender"


def test_a_stream_that_gave_way_too_often_is_quarantined(broker: MemoryBroker, tmp_path: Path) -> None:
    headers = p.parked_headers(p.offer_headers(p.StreamSpec("tired-1", "t.bin", 10, 10), DEST, sender="alice"),
                               not_before=time.time() - 1, reason="stalled", sender="alice")
    headers[hdr.H_YIELDS] = str(MAX_YIELDS)
    with open_link(broker.params("rx")) as link:
        link.send(DEST.parked_queue(), b"", headers)
    got, failures = receive_all(broker, tmp_path / "out")
    assert got == [] and [f.status for f in failures] == ["quarantined"]
    assert f"gave way {MAX_YIELDS} times" in failures[0].reason
    assert broker.messages(DEST.parked_queue()) == []


def test_handshake_chunks_that_never_help_end_within_the_idle_timeout(broker: MemoryBroker, tmp_path: Path) -> None:
    """A sender trickling corrupt chunks in handshake mode, each asked again, for ever."""
    import threading

    spec = p.StreamSpec("trickle-1", "t.bin", 10_000, 1000, hdr.Mode.HANDSHAKE)
    stop = threading.Event()
    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"", p.offer_headers(spec, DEST, window=8, sender="mallory"))

    def trickle() -> None:
        with open_link(broker.params("mallory")) as link:
            while not stop.wait(0.05):
                headers = p.data_message(spec, 1, b"x" * 1000)[0]
                link.send(DEST.data_queue(spec.stream_id, "mallory"), b"y" * 1000, headers)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(StreamStalled, match="no new data"):
            receive_stream(broker.params("rx"), Q, tmp_path / "out",
                           options=ReceiveOptions(wait_timeout=1, idle_timeout=1, rerequest_after=0.2))
        assert time.monotonic() - t0 < 3
    finally:
        stop.set()
        t.join(5)


def test_another_users_chunks_are_refused_and_the_stream_arrives(broker: MemoryBroker, tmp_path: Path) -> None:
    data = os.urandom(3000)
    spec = p.StreamSpec("own-1", "own.bin", len(data), 1000)

    def forge(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        fake = b"\0" * len(body)
        return p.data_message(spec, seq, fake)[0], fake

    with open_link(broker.params("alice")) as link:
        link.send(Q, b"", p.offer_headers(spec, DEST, sender="alice"))
    # Into alice's own data queue, as a broker whose ACL leaves every data queue open would let it.
    with open_link(broker.params("mallory")) as link:
        for seq in (1, 2):
            link.send(DEST.data_queue("own-1", "alice"), *forge(seq, {}, b"\0" * 1000)[::-1])
    play(broker, "alice", spec, data, [1, 2, 3], offer=False)
    got = receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST))
    assert got is not None and got.sender == "alice" and (tmp_path / "out" / "own.bin").read_bytes() == data
    assert {h["JMSXUserID"] for h, _ in broker.messages(f"/queue/DLQ.{DEST.name}.amqs.alice.own-1")} == {"mallory"}


def test_a_stream_id_of_one_user_is_refused_to_another(broker: MemoryBroker, tmp_path: Path) -> None:
    data = os.urandom(2000)
    spec = p.StreamSpec("mine-1", "mine.bin", len(data), 1000)
    play(broker, "alice", spec, data, [1, 2])
    assert receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST)) is not None
    play(broker, "mallory", spec, data, [1, 2])
    with pytest.raises(StreamQuarantined, match="belongs to a stream user 'alice' sent"):
        receive_stream(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST))
    assert (tmp_path / "out" / "mine.bin").read_bytes() == data


def _batch(broker: MemoryBroker, user: str, batch_id: str, results: list[tuple[str, int, str]]) -> None:
    entries = [{"stream_id": sid, "dir": "", "name": f"{sid}.bin", "bytes": size, "sha256": sha}
               for sid, size, sha in results]
    with open_link(broker.params(user)) as link:
        for headers, body in list(bw.iter_batch_messages(batch_id, entries, len(entries))):
            link.send(Q, body, headers)


def _part(batch_id: str, part: int, parts: int, files: int, tag: str = "f") -> tuple[dict[str, str], bytes]:
    """Part ``part`` of ``parts`` of a batch listing ``files`` files nobody sent."""
    entries = [{"stream_id": f"{tag}-{batch_id}-{part}-{i}", "dir": "", "name": "x.bin", "bytes": 1,
                "sha256": "0" * 64} for i in range(files)]
    [(headers, body)] = list(bw.iter_batch_messages(batch_id, entries, len(entries)))
    return {**headers, bw.H_PART: str(part), bw.H_PARTS: str(parts)}, body


def _held(out: Path) -> tuple[set[str], int]:
    """The batch ids with a part kept in ``out``, and the bytes they take on disk."""
    files = [f for f in (out / ".amqstream" / "batches").rglob("*.json")]
    return {f.name.rsplit(".", 2)[0] for f in files}, sum(f.stat().st_blocks * 512 for f in files)


def test_batch_parts_without_their_first_part_are_counted_and_pruned(broker: MemoryBroker, tmp_path: Path) -> None:
    """A sender leaves part 2 of 100 batches whose first part never comes: they count against
    ``MAX_PENDING`` like any batch (they were never counted, nor pruned); a part older than
    ``MAX_AGE`` is forgotten as a receiver starts; forgetting batch ``x`` leaves ``x.1``'s parts."""
    from airflow_provider_amqstream.engine.receive import manifest

    out = tmp_path / "out"
    with open_link(broker.params("mallory")) as link:
        for n in range(100):
            link.send(Q, *_part(f"orphan-{n:03d}", 2, 3, 2)[::-1])
    got, failures = receive_all(broker, out)
    assert got == [] and failures == []
    held, _ = _held(out)
    assert len(held) == manifest.MAX_PENDING and "orphan-099" in held and "orphan-000" not in held
    old = time.time() - manifest.MAX_AGE - 60
    for f in (out / ".amqstream" / "batches" / "mallory").glob("orphan-099.*"):
        os.utime(f, (old, old))
    with open_link(broker.params("mallory")) as link:
        link.send(Q, *_part("x", 2, 2, 1)[::-1])
        link.send(Q, *_part("x.1", 2, 2, 1)[::-1])
        for n in range(manifest.MAX_PENDING - 1):
            link.send(Q, *_part(f"later-{n:03d}", 2, 3, 1)[::-1])
    receive_all(broker, out)
    held, _ = _held(out)
    assert "orphan-099" not in held, "a part past MAX_AGE is forgotten"
    assert "x.1" in held and "x" not in held and len(held) == manifest.MAX_PENDING


def test_batch_parts_take_at_most_half_the_room_above_the_reserve(broker: MemoryBroker, tmp_path: Path) -> None:
    """Ten parts of one batch, each listing 1,999 files, into a 4 MiB filesystem: they stop
    at half of the room above the reserve (the rest give way, parked, as files without room
    do), the good stream behind them arrives, and a receiver started again with less room
    than they hold forgets them and runs."""
    import shutil
    import subprocess

    mnt = tmp_path / "fs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True,
                         timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); run as root")
    try:
        out = mnt / "out"
        good = os.urandom(3000)
        with open_link(broker.params("mallory")) as link:
            for k in range(2, 12):
                link.send(Q, *_part("wide-1", k, 40, 1999)[::-1])
        play(broker, "alice", p.StreamSpec("good-w", "good.bin", len(good), 1000), good, [1, 2, 3])
        got, failures = receive_all(broker, out, yield_backoff=600)
        assert [r.stream_id for r in got] == ["good-w"] and (out / "good.bin").read_bytes() == good
        assert failures and {(f.stream_id, f.status) for f in failures} == {("wide-1", "no_room")}
        assert "no room for part" in failures[0].reason and "mallory" in failures[0].reason
        kept = list((out / ".amqstream" / "batches").rglob("*.json"))
        _, size = _held(out)
        assert kept and len(kept) + len(failures) == 10
        assert size <= (4 * 2**20 - 4 * 2**20 // 50) // 2, size
        assert len(broker.messages(DEST.parked_queue())) == len(failures)
        # Started again with less room than the parts hold: they are forgotten, it runs.
        again, failures = receive_all(broker, out, min_free_bytes=shutil.disk_usage(out).free, yield_backoff=600)
        assert again == [] and failures == [] and _held(out) == (set(), 0)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)


def test_a_batch_is_checked_a_part_at_a_time(tmp_path: Path) -> None:
    """A batch of 12 parts of 2,000 files, none received: what the receiver keeps while it
    waits is the first part's missing files, not the batch's 24,000 (the whole batch's ids
    were 143.7 MiB of RSS at 250 parts, 467 MiB at 1,000); the traced peak stays that of a
    part or two."""
    import gc
    import tracemalloc

    from airflow_provider_amqstream.engine.receive.manifest import Batches
    from airflow_provider_amqstream.engine.state_dir import StateDir

    out = tmp_path / "out"
    batches = Batches(out, StateDir.create(out))
    batches.load()
    parts = 12
    sent = [_part("huge-1", k, parts, bw.BATCH_PART_FILES) for k in range(1, parts + 1)]
    gc.collect()
    tracemalloc.start()
    try:
        while sent:
            batch_id, part, nparts, entries = bw.parse_batch(*sent.pop(0))
            assert batches.record(batch_id, part, nparts, entries, "mallory") is None
            del entries
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    [(at, missing)] = batches.missing.values()
    assert at == 1 and len(missing) == bw.BATCH_PART_FILES
    print(f"\nrecording a batch of {parts} parts x {bw.BATCH_PART_FILES} files: traced peak {peak / 2**20:.1f} MiB")
    assert peak < 5 * 2**20, f"{peak / 2**20:.1f} MiB"


def test_a_batch_announced_before_its_files_completes_part_by_part(broker: MemoryBroker, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of two files each, sent before the files: the receiver waits on one part at a
    time and writes the manifest once the last file arrives."""
    monkeypatch.setattr(bw, "BATCH_PART_FILES", 2)
    files = {f"p-{i}": os.urandom(100 + i) for i in range(5)}
    _batch(broker, "alice", "parts-1", [(sid, len(d), hashlib.sha256(d).hexdigest()) for sid, d in files.items()])
    for sid, data in files.items():
        play(broker, "alice", p.StreamSpec(sid, f"{sid}.bin", len(data), 1000), data, [1])
    out = tmp_path / "out"
    got, failures = receive_all(broker, out)
    assert len(got) == 5 and failures == []
    manifest = find_manifest(out, "parts-1", "alice")
    assert manifest is not None and len(manifest.read_text().splitlines()) == 5
    assert _held(out) == (set(), 0)


def test_batches_belong_to_their_sender(broker: MemoryBroker, tmp_path: Path) -> None:
    """A second user announcing the same batch id gets a batch of its own; a batch listing
    another user's stream is dropped; a manifest never lands where a sender names files."""
    out = tmp_path / "out"
    a, m = os.urandom(1500), os.urandom(1600)
    play(broker, "alice", p.StreamSpec("a-1", "a.bin", len(a), 1000), a, [1, 2])
    play(broker, "mallory", p.StreamSpec("m-1", "m.bin", len(m), 1000), m, [1, 2])
    receive_all(broker, out)
    _batch(broker, "alice", "b-1", [("a-1", len(a), hashlib.sha256(a).hexdigest())])
    _batch(broker, "mallory", "b-1", [("m-1", len(m), hashlib.sha256(m).hexdigest())])
    _batch(broker, "mallory", "b-2", [("a-1", len(a), hashlib.sha256(a).hexdigest())])
    receive_all(broker, out)
    alice = find_manifest(out, "b-1", "alice")
    assert alice is not None and '"a.bin"' in alice.read_text() and "m.bin" not in alice.read_text()
    with pytest.raises(StreamError, match="completed by 2 senders"):
        find_manifest(out, "b-1")
    assert find_manifest(out, "b-2") is None, "a batch lists only its own sender's streams"
    assert not list(out.glob("*.manifest.jsonl"))
