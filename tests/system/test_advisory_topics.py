"""Advisory topics in a network of brokers: only the bridge and the administrator may write
them. A plain message an ordinary user wrote to ``ActiveMQ.Advisory.Consumer.Queue.NAME``
reached the bridge as a consumer advisory with no consumer in it and shut the bridge down
(NullPointerException at the other site), once per message: 34 shutdowns in 40 s.

Two embedded brokers joined by a duplex bridge (tests/system/test_network.py's ``Sites``).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
import stomp

from airflow_provider_amqstream.broker.auth import ADVISORY_TOPICS, auth_plugins
from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import StompFrames, make_file, sha256_file, started, wait_for
from tests.system.test_network import QUEUE, Sites

HOSTILE = "/topic/ActiveMQ.Advisory.Consumer.Queue." + QUEUE.removeprefix("/queue/")
# How many plain messages each user tries: more than the bridge could survive before
# (one shutdown per message that got through).
ATTEMPTS = 20


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    yield from started(Sites(tmp_path / "sites"))


def _try_advisory_writes(params: BrokerParams, count: int) -> list[tuple[str, str]]:
    """Send ``count`` plain messages to the consumer advisory of the forwarded queue, each
    asking for a receipt, with raw stomp.py; return (frame kind, message) per attempt."""
    listener = StompFrames()
    conn = stomp.Connection12([params.hosts[0]], auto_decode=False)
    conn.set_listener("frames", listener)
    conn.connect(params.login, params.password, wait=True)
    answers = []
    try:
        for i in range(count):
            conn.send(HOSTILE, b"not an advisory", headers={"receipt": f"adv-{i}"})
            try:
                kind, headers = listener.frames.get(timeout=15)
            except queue.Empty:
                raise AssertionError(f"no receipt and no error for attempt {i} within 15s") from None
            assert headers.get("receipt-id") == f"adv-{i}", headers
            answers.append((kind, headers.get("message", "")))
    finally:
        if conn.is_connected():
            conn.disconnect()
    return answers


def _bridge_log(broker: EmbeddedBroker) -> dict[str, int]:
    text = broker.log_file.read_text(errors="replace")
    return {"established": text.count("has been established"), "shut down": text.count("shutdown due to"),
            "NullPointerException": text.count("NullPointerException")}


def test_only_the_bridge_and_the_administrator_may_write_advisories() -> None:
    xml = auth_plugins("admin-user", "pw", {"producer": {"send": [QUEUE], "password": "p-pw"},
                                                  "consumer": {"receive": [QUEUE], "password": "c-pw"}},
                       bridge=("amqs-bridge", "bridge-pw"), forwarded=(QUEUE,))
    [line] = [ln for ln in xml.splitlines() if f'topic="{ADVISORY_TOPICS[1]}"' in ln.replace("&gt;", ">")]
    assert 'read="amqs-bridge,amqstream"' in line and 'write="amqs-bridge,amqstream"' in line, line
    # Creating an advisory's topic is all a user needs: the broker does it in the user's name.
    assert 'admin="amqs-bridge,amqs-user-consumer,amqs-user-producer,amqstream"' in line, line


@pytest.mark.broker
@pytest.mark.network
def test_an_ordinary_user_cannot_write_advisories_and_the_bridge_stays_up(sites: Sites, tmp_path: Path) -> None:
    """Each site's ordinary user tries ATTEMPTS plain messages on the consumer advisory of
    the forwarded queue: every one is refused, the bridge is never rebuilt, and a stream sent
    afterwards crosses it byte-exact."""
    # Each end logs the bridge once it is up; site B's line may come a moment after A's.
    wait_for(lambda: _bridge_log(sites.b)["established"], 30, "site B to log the bridge", interval=0.1)
    before = {"a": _bridge_log(sites.a), "b": _bridge_log(sites.b)}
    assert before["a"]["established"] == before["b"]["established"] == 1, before
    for broker, user in ((sites.a, "producer"), (sites.b, "consumer")):
        answers = _try_advisory_writes(sites.params(broker, user), ATTEMPTS)
        refused = [msg for kind, msg in answers if kind == "ERROR" and f"User {user} is not authorized to write" in msg]
        assert len(refused) == ATTEMPTS, f"{user}: {answers[:3]}"
    src = make_file(tmp_path / "after.bin", 3 * 2**20 + 7, seed=3)
    sent = send_file(sites.params(sites.a, "producer"), src, QUEUE, SendOptions(chunk_size=256 * 1024),
                     stream_id="after-advisories")
    got = receive_stream(sites.params(sites.b, "consumer"), QUEUE, tmp_path / "out",
                         options=ReceiveOptions(wait_timeout=60))
    assert got is not None and got.stream_id == "after-advisories"
    assert sha256_file(Path(got.path)) == sha256_file(src) == sent.sha256
    # The bound: not one bridge shutdown or rebuild, at either end, in all those attempts.
    assert {"a": _bridge_log(sites.a), "b": _bridge_log(sites.b)} == before
