"""The broker's memory limit is shared: what one sender leaves waiting must not stop
everyone else.

ActiveMQ's memory limit is broker-wide (each queue's limit is a child of it, and a child
counts as full when its parent is). Left at its default, every queue pages its waiting
messages into memory every 30 s to look for expired ones, up to 400 of them and
whether or not anyone consumes it. Then two backlogs with no consumer fill the broker's
whole limit, and from then on every send to every queue (a good sender's chunks, a
receiver parking an offer) waits 30 s and fails. The shipped configuration turns that
scan off (the protocol sets no expiry).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, StreamFailure, receive_streams, send_file
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import RawSender, make_file, old_gen_mib, running_broker, sha256_file

pytestmark = pytest.mark.broker

QUEUE = "/queue/mem.a"
# ActiveMQ's default expireMessagesPeriod, with a margin: the window in which the scan,
# if it ran, would have paged the backlogs in.
EXPIRY_PERIOD = 30.0
BACKLOG_MIB = 96  # per queue: over its 64 MB limit; two of them are over the broker's 128 MB
ROUND_EVERY = 2.0


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    yield from running_broker(tmp_path_factory.mktemp("mem") / "broker",
                              {"mallory": {"send": [QUEUE]}, "alice": {"send": [QUEUE]}, "rx": {"receive": [QUEUE]}})


@pytest.fixture(scope="module")
def users(three: EmbeddedBroker) -> tuple[EmbeddedBroker, dict[str, BrokerParams]]:
    return three, {u: dataclasses.replace(params_from_uri(three.info(user=u).uri), receipt_timeout=60.0)
                   for u in ("mallory", "alice", "rx")}


def _backlog(params: BrokerParams, queue: str, mib: int) -> None:
    """``mib`` MiB in 256 KiB messages nobody will consume, the last one confirmed (so all
    are stored when this returns)."""
    body = os.urandom(256 * 1024)
    with StompLink(params) as link:
        for i in range(mib * 4 - 1):
            link.send(queue, body, {"n": str(i)})
        link.send_confirmed(queue, body, {"n": "last"})


def test_backlogs_nobody_consumes_do_not_stop_other_queues(
        users: tuple[EmbeddedBroker, dict[str, BrokerParams]], tmp_path: Path) -> None:
    """A send-only user leaves 96 MiB waiting on each of two data queues of her own and
    offers a stream she never sends. For longer than the broker's expiry period, alice's
    streams keep arriving, each within seconds, and the receiver parks the stalled offer
    again and again (a send to the parked queue each time)."""
    broker, u = users
    heap_before = old_gen_mib(broker.running_pid() or 0)
    dest = Destination.parse(QUEUE)
    for sid in ("junk-1", "junk-2"):
        _backlog(u["mallory"], dest.data_queue(sid, "mallory"), BACKLOG_MIB)
    raw = RawSender(u["mallory"])
    raw.send(QUEUE, b"", p.offer_headers(p.StreamSpec("stalled", "s.bin", 10**6, 2**20), dest, sender="mallory"))
    raw.close()

    until = time.monotonic() + EXPIRY_PERIOD + 15
    rounds: list[float] = []
    failures: list[StreamFailure] = []
    while time.monotonic() < until or len(rounds) < 2:
        src = make_file(tmp_path / f"good-{len(rounds)}.bin", 300_000, seed=len(rounds))
        t0 = time.monotonic()
        send_file(u["alice"], src, QUEUE, SendOptions(chunk_size=64 * 1024))
        got = receive_streams(u["rx"], QUEUE, tmp_path / "out", count=1, on_failure=failures.append,
                              options=ReceiveOptions(wait_timeout=60, idle_timeout=0.5))
        rounds.append(time.monotonic() - t0)
        assert [Path(r.path).name for r in got] == [src.name]
        assert sha256_file(Path(got[0].path)) == sha256_file(src)
        # A send waiting for memory fails after 30 s (sendFailIfNoSpaceAfterTimeout); a
        # round that took 10 s already waited for something it should not have.
        assert rounds[-1] < 10, f"round {len(rounds)} took {rounds[-1]:.1f}s: {rounds}"
        # Pacing, not synchronisation: a round every 2 s keeps the count of data queues
        # (each costs the broker some heap until it is collected) from depending on speed.
        time.sleep(max(0.0, t0 + ROUND_EVERY - time.monotonic()))
    assert {f.stream_id for f in failures} == {"stalled"}, failures
    heap_after = old_gen_mib(broker.running_pid() or 0)
    # Nothing paged the backlogs in: the heap holds what it held, not 2 x 96 MiB.
    assert heap_after <= heap_before + 48, (heap_before, heap_after)
    print(f"\n{len(rounds)} good streams beside 2 x {BACKLOG_MIB} MiB waiting, slowest {max(rounds):.2f}s;"
          f" old generation {heap_before:.0f} -> {heap_after:.0f} MiB")
