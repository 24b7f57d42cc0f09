"""The broker drops a data queue once it is empty and nobody consumes it: every stream has
a data queue of its own, so without that its heap grows with every stream it ever carried.
And it keeps at most so many a user fills and nobody empties, which it never drops.

Not one of the `quiet` tests, which run with nothing else beside them: it asserts the heap of
a broker of its own, and waits most of its time for the broker's purge schedule.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.auth import MAX_WAITING
from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.exceptions import DestinationFull
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import make_file, old_gen_mib, params_as, running_broker, sha256_file, wait_for

pytestmark = pytest.mark.broker

QUEUE = "/queue/purge.a"


@pytest.fixture
def broker_of_its_own(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    yield from running_broker(tmp_path / "broker", {"mallory": {"send": [QUEUE], "max_waiting": 2000},
                                                     "eve": {"send": [QUEUE]}, "rx": {"receive": [QUEUE]}})


def test_data_queues_a_user_leaves_behind_are_capped(broker_of_its_own: EmbeddedBroker, tmp_path: Path) -> None:
    """A send-only user, with raw STOMP, leaves one message on each of as many data queues of
    its own as it can: the broker keeps the default cap's worth (1,000), refuses each one more
    saying why, its heap grows by no more than those cost, and another user's stream still
    arrives."""
    broker = broker_of_its_own
    eve, mallory, rx = (params_as(broker, name) for name in ("eve", "mallory", "rx"))
    dest = Destination.parse(QUEUE)
    heap_before = old_gen_mib(broker.running_pid() or 0)
    with StompLink(eve) as link:
        for i in range(MAX_WAITING):
            link.send(dest.data_queue(f"left-{i:05d}", "eve"), b"x" * 1000, {})
        link.round_trip()  # the broker handles a connection's frames in order: all stored
    for i in range(MAX_WAITING, MAX_WAITING + 10):
        with StompLink(eve) as link, pytest.raises(DestinationFull, match="1000 of its streams already wait"):
            link.send_confirmed(dest.data_queue(f"left-{i:05d}", "eve"), b"x", {})
    heap_after = old_gen_mib(broker.running_pid() or 0)
    src = make_file(tmp_path / "good.bin", 200_000)
    sent = send_file(mallory, src, QUEUE, SendOptions(chunk_size=64 * 1024))
    got = receive_stream(rx, QUEUE, tmp_path / "out", options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sent.sha256 == sha256_file(src)
    # ~14 KiB per destination (measured with 2,000): the cap bounds it near 14 MiB.
    assert heap_after <= heap_before + 32, (heap_before, heap_after)
    print(f"\n{MAX_WAITING} data queues left behind by one user, 10 more refused: old generation "
          f"{heap_before:.0f} -> {heap_after:.0f} MiB")


def test_emptied_data_queues_leave_the_broker_heap(broker_of_its_own: EmbeddedBroker) -> None:
    """Every stream has a data queue of its own. Once a queue is empty and nobody consumes
    it, the broker must drop it: ActiveMQ keeps each destination in its heap until it is
    purged, and it purges only when told how often (schedulePeriodForDestinationPurge). The
    soak's broker, without that, grew by ~50 KiB per stream it ever carried."""
    broker = broker_of_its_own
    u = {name: params_as(broker, name) for name in ("mallory", "rx")}
    n = 1500
    dest = Destination.parse(QUEUE)
    queues = [dest.data_queue(f"done-{i:05d}", "mallory") for i in range(n)]
    heap_before = old_gen_mib(broker.running_pid() or 0)
    with StompLink(u["mallory"]) as link:
        for q in queues:
            link.send(q, b"x" * 1000, {"n": q})
        link.send_confirmed(queues[-1], b"x", {"n": "end"})
    with StompLink(u["rx"]) as link:
        for q in queues:
            sub = link.subscribe(q, prefetch=1)
            for _ in range(2 if q == queues[-1] else 1):
                frame = link.get(10, sub)
                assert frame is not None, f"nothing on {q}"
                link.ack(frame)
            link.unsubscribe(sub)
    heap_full = old_gen_mib(broker.running_pid() or 0)
    log = broker.data_dir / "data" / "broker.log"

    def purged() -> int:
        # ActiveMQ logs each destination it drops ("<name> Inactive for longer than ...").
        return sum(".amqs.mallory.done-" in line and "Inactive for longer than" in line
                   for line in log.read_text(errors="replace").splitlines())

    wait_for(lambda: purged() >= n, 180, f"the broker to drop {n} emptied data queues", interval=2)
    heap_after = old_gen_mib(broker.running_pid() or 0)
    assert heap_after <= heap_before + 8, (heap_before, heap_full, heap_after)
    print(f"\n{n} emptied data queues: old generation {heap_before:.0f} -> {heap_full:.0f} -> {heap_after:.0f} MiB")
