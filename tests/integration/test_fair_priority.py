"""Fair share on the shipped broker: our plugin stamps each offer's priority from how many
offers its sender has pending on the queue (broker/java, FairOfferPlugin), so one user's
backlog of stalled offers no longer costs another user's next stream a step per offer
ahead (docs/decisions/fair-share.md).

``mallory`` may only send and speaks raw stomp.py, writing the highest priority herself;
``alice`` sends a good stream with the engine; a real ``amqstream receive --follow`` at
default settings (``idle_timeout`` 120 s) receives as ``rx``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.broker.process import broker_jar
from airflow_provider_amqstream.engine import SendOptions, send_file
from airflow_provider_amqstream.engine.receive.stream import FIRST_LOOK
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from tests.helpers import RawSender, assert_old_gen_bounded, cli, make_file, params_as, running_broker, sha256_file

pytestmark = pytest.mark.broker

BACKLOGS = (10, 100, 1000)
QUEUES = [f"/queue/fairprio.b{n}" for n in BACKLOGS]
# Beside FIRST_LOOK at mallory's first offer: a subscription, a park, an acknowledgement and
# alice's transfer, on a loaded machine.
SLACK = 10.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    if broker_jar() is None:
        pytest.skip("no broker jar (scripts/broker_jar.sh): offers are not prioritised")
    yield from running_broker(tmp_path_factory.mktemp("fairprio") / "broker",
                              {"mallory": {"send": QUEUES}, "alice": {"send": QUEUES}, "rx": {"receive": QUEUES}})


def _wait_behind(broker: EmbeddedBroker, queue: str, n: int, tmp_path: Path) -> tuple[float, int]:
    """mallory offers ``n`` streams she never sends, alice one good stream; return how long a
    fresh ``receive --follow`` took to complete alice's and how many of mallory's it saw first."""
    raw = RawSender(params_as(broker, "mallory"))
    try:
        dest = Destination.parse(queue)
        for i in range(n):
            spec = p.StreamSpec(f"held-{i:05d}", "held.bin", 5_000_000, 1024 * 1024)
            # The priority she writes is overwritten by the broker's.
            raw.send(queue, b"", {**p.offer_headers(spec, dest, sender="mallory"), "priority": "9"})
    finally:
        raw.close()
    src = make_file(tmp_path / "good.bin", 300_000, seed=n)
    send_file(params_as(broker, "alice"), src, queue, SendOptions(chunk_size=64 * 1024))
    out = tmp_path / "out"
    t0 = time.monotonic()
    # Its warnings go to a file: a pipe nobody drains fills after ~100 of them and blocks the
    # receiver in its logger, which would look like a receiver that stopped taking offers.
    err = tmp_path / "receiver.err"
    with err.open("w") as err_file:
        proc = cli("receive", "--from", queue, "--out-dir", str(out), "--conn", broker.info(user="rx").uri,
                   "--follow", "--json", "-q", stderr=err_file)
    # The watchdog, not a sleep: a receiver that never completes alice's stream is killed.
    watchdog = threading.Timer(600, proc.kill)
    watchdog.start()
    seen: list[dict[str, str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                seen.append(json.loads(line))
                if seen[-1].get("status") == "complete":
                    break
        wait = time.monotonic() - t0
    finally:
        watchdog.cancel()
        proc.kill()
        proc.communicate(timeout=60)
    assert seen and seen[-1].get("status") == "complete", \
        f"alice's stream never completed behind {n}: {seen[-3:]}; receiver stderr: {err.read_text()[-2000:]}"
    assert sha256_file(out / "good.bin") == sha256_file(src)
    return wait, sum(1 for r in seen if r.get("status") == "stalled")


def test_another_users_backlog_of_offers_costs_a_good_stream_a_constant(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    """Behind 10, 100 and 1,000 stalled offers of mallory's, alice's stream waits one look at
    mallory's first offer and about nothing per offer further back: her first pending offer
    outranks mallory's second, and the receiver (prefetch 1) is handed it next."""
    waits, looked = {}, {}
    for n, queue in zip(BACKLOGS, QUEUES, strict=True):
        waits[n], looked[n] = _wait_behind(broker, queue, n, tmp_path / str(n))
    print("\n" + ", ".join(f"behind {n}: {waits[n]:.2f}s ({looked[n]} of mallory's seen first)" for n in BACKLOGS)
          + f"; broker old generation {assert_old_gen_bounded(broker, 'stalled backlogs'):.0f} MiB")
    for n in BACKLOGS:
        # Her first and at most the one the broker handed over before alice's arrived, however many wait.
        assert looked[n] <= 2, f"the receiver took {looked[n]} of mallory's {n} offers before alice's"
        assert waits[n] <= 2 * FIRST_LOOK + SLACK, f"{waits[n]:.1f}s behind {n} stalled offers"
    assert waits[1000] <= waits[10] + SLACK, waits
