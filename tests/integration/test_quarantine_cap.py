"""Quarantined streams cannot grow the broker's destinations without bound: the chunks of a
quarantined stream go to ``DLQ.<its data queue>``, one destination each, never purged while
they hold chunks (1,350 one-bad-chunk streams left 1,350). They are capped per user like
data queues (``max_waiting``); past the cap the broker drops the refused chunks (the
quarantine record, with its reason, stays), the receiver goes on, and ``streams`` still
lists and discards every quarantined stream.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, StreamFailure, receive_streams, send_file
from airflow_provider_amqstream.engine.discard import discard
from airflow_provider_amqstream.engine.inventory import take_inventory
from airflow_provider_amqstream.engine.queue_tools import QueueSession
from airflow_provider_amqstream.engine.redrive import redrive
from airflow_provider_amqstream.exceptions import DestinationFull
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination, dead_letter_queue
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import (
    RawSender,
    assert_old_gen_bounded,
    make_file,
    params_as,
    running_broker,
    sha256_file,
    wait_for,
)

pytestmark = pytest.mark.broker

QUEUE = "/queue/qcap.a"
DEST = Destination.parse(QUEUE)
CAP = 3


@pytest.fixture
def capped(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    yield from running_broker(tmp_path / "broker", {"mallory": {"send": [QUEUE], "max_waiting": CAP},
                                                     "alice": {"send": [QUEUE]}, "rx": {"receive": [QUEUE]}})


def _bad_streams(mallory: BrokerParams, ids: Iterable[int]) -> None:
    """Streams of two chunks whose first fails its CRC-32, as mallory with raw STOMP."""
    raw = RawSender(mallory)
    try:
        for i in ids:
            spec = p.StreamSpec(f"bad-{i:03d}", "bad.bin", 2000, 1000)
            raw.send(QUEUE, b"", p.offer_headers(spec, DEST, sender="mallory"))
            body = b"z" * 1000
            raw.send(DEST.data_queue(spec.stream_id, "mallory"), b"y" * 1000, p.data_message(spec, 1, body)[0])
            raw.send(DEST.data_queue(spec.stream_id, "mallory"), body, p.data_message(spec, 2, body)[0])
    finally:
        raw.close()


def test_quarantine_destinations_are_capped_per_user(capped: EmbeddedBroker, tmp_path: Path) -> None:
    broker = capped
    u = {n: params_as(broker, n) for n in ("mallory", "alice", "rx")}
    admin = params_as(broker, None)
    log = broker.data_dir / "data" / "broker.log"

    def purged() -> int:  # mallory's emptied data queues the broker dropped (not their DLQs)
        return sum(".amqs.mallory.bad-" in line and "Inactive for longer than" in line and "DLQ." not in line
                   for line in log.read_text(errors="replace").splitlines())

    failures: list[StreamFailure] = []
    for wave in range(2):
        # Each wave as many as mallory's data-queue cap lets her have at once.
        _bad_streams(u["mallory"], range(wave * CAP, (wave + 1) * CAP))
        receive_streams(u["rx"], QUEUE, tmp_path / "out", on_failure=failures.append,
                        options=ReceiveOptions(wait_timeout=3))
        if wave == 0:
            wait_for(lambda: purged() >= CAP, 180, "the broker to drop the first wave's data queues", interval=2)
    assert [(f.stream_id, f.status) for f in failures] == [(f"bad-{i:03d}", "quarantined") for i in range(2 * CAP)]
    # The first wave's chunks wait in their DLQs for an operator; the second's were dropped at
    # the cap (a browse of a queue the cap forbids making shows nothing).
    def dlq_of(i: int) -> int:
        with QueueSession(admin) as qs:
            return len(qs.browse(dead_letter_queue(DEST.data_queue(f"bad-{i:03d}", "mallory"))).frames)

    held = [dlq_of(i) for i in range(2 * CAP)]
    assert held == [2] * CAP + [0] * CAP, held
    assert "The maxmimum number of destinations allowed (3) for the policy queue://DLQ.qcap.a.amqs.mallory.>" in (
        log.read_text(errors="replace"))
    # The next good stream arrives; every quarantined stream is listed and can be discarded.
    src = make_file(tmp_path / "good.bin", 100_000, seed=2)
    send_file(u["alice"], src, QUEUE, SendOptions(chunk_size=16 * 1024))
    got = receive_streams(u["rx"], QUEUE, tmp_path / "out", count=1, options=ReceiveOptions(wait_timeout=60))
    assert [Path(r.path).name for r in got] == ["good.bin"]
    assert sha256_file(tmp_path / "out" / "good.bin") == sha256_file(src)
    seen = take_inventory(admin, QUEUE, out_dirs=[tmp_path / "out"])
    assert sorted(q.stream_id for q in seen.quarantined) == [f"bad-{i:03d}" for i in range(2 * CAP)]
    for sid in ("bad-000", f"bad-{2 * CAP - 1:03d}"):
        discard(admin, QUEUE, sid, out_dirs=[tmp_path / "out"], quiet=0.2)
    assert dlq_of(0) == 0
    left = take_inventory(admin, QUEUE, out_dirs=[tmp_path / "out"])
    assert len(left.quarantined) == 2 * CAP - 2


def test_a_redrive_past_the_senders_quarantine_cap_says_so(capped: EmbeddedBroker, tmp_path: Path) -> None:
    """mallory's CAP corrupt streams hold her CAP quarantine destinations; her next stream is
    quarantined over max_bytes, and the administrator's redrive of it needs one more: refused,
    in words that name the quarantine destinations and mallory (not a "data queue" of the
    administrator's) and say what to do."""
    u = {n: params_as(capped, n) for n in ("mallory", "rx")}
    admin = params_as(capped, None)
    log = capped.data_dir / "data" / "broker.log"
    _bad_streams(u["mallory"], range(CAP))
    failures: list[StreamFailure] = []
    receive_streams(u["rx"], QUEUE, tmp_path / "out", on_failure=failures.append,
                    options=ReceiveOptions(wait_timeout=3))
    assert [f.status for f in failures] == ["quarantined"] * CAP
    # Her data queues are dropped a minute after they emptied; then she may send again.
    wait_for(lambda: sum(".amqs.mallory.bad-" in line and "Inactive for longer than" in line and "DLQ." not in line
                         for line in log.read_text(errors="replace").splitlines()) >= CAP, 180,
             "the broker to drop mallory's emptied data queues", interval=2)
    raw = RawSender(u["mallory"])
    spec = p.StreamSpec("big-1", "big.bin", 2000, 1000)
    raw.send(QUEUE, b"", p.offer_headers(spec, DEST, sender="mallory"))
    for seq in (1, 2):
        raw.send(DEST.data_queue("big-1", "mallory"), b"b" * 1000, p.data_message(spec, seq, b"b" * 1000)[0])
    raw.close()
    failures.clear()
    receive_streams(u["rx"], QUEUE, tmp_path / "out", on_failure=failures.append,
                    options=ReceiveOptions(wait_timeout=3, max_bytes=10))
    assert [(f.stream_id, f.status) for f in failures] == [("big-1", "quarantined")]
    with pytest.raises(DestinationFull) as full:
        redrive(admin, QUEUE, "big-1", quiet=0.5, receivers=["rx"])
    text = str(full.value)
    assert "data queue" not in text and f"quarantine destination for {QUEUE}" in text, text
    assert f"{CAP} quarantined streams of sender mallory" in text and "streams discard ID --from" in text, text
    assert "users add mallory" in text and "--max-waiting" in text, text
    print(f"\nredrive past mallory's quarantine cap of {CAP}: {text}\nbroker old generation "
          f"{assert_old_gen_bounded(capped, 'filling a quarantine cap'):.0f} MiB")
