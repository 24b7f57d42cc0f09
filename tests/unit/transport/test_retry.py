"""The one reconnect policy (transport/retry.py): which failures are worth another connection,
how long a loop tries, and what a receiver and a sender do about a broker not up at start (on
the in-memory link; tests/integration/test_late_broker.py has the real broker)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.exceptions import (
    AccessDenied,
    BrokerUnreachable,
    ConnectionLost,
    DestinationFull,
    StreamError,
    TransportError,
)
from airflow_provider_amqstream.transport import retry
from airflow_provider_amqstream.transport.memory import MemoryBroker
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.retry import Reconnect, transient


class Clock:
    """time.monotonic and time.sleep for the policy: sleeping moves the clock, at once."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(retry, "time", c)
    return c


def test_one_definition_of_transient() -> None:
    lost, down, full = ConnectionLost("lost"), BrokerUnreachable("down"), DestinationFull("full")
    refused, denied = TransportError("refused login"), AccessDenied("denied")
    assert [transient(e, reached=False) for e in (lost, down, full, refused, denied)] == [
        True, True, True, False, False]
    assert [transient(e, reached=True) for e in (lost, down, full, refused, denied)] == [True, True, True, True, False]
    # A receiver or a watcher: a broker never reached is said at once; once reached, it is waited for.
    assert not transient(down, reached=False, wait_at_start=False)
    assert transient(down, reached=True, wait_at_start=False)
    assert not transient(OSError("disk"), reached=True)


def _fail_until_given_up(r: Reconnect, exc: Exception, *, connect: bool = False) -> int:
    for n in range(1, 1000):
        try:
            r.failed(exc)
        except StreamError:
            return n
        if connect:
            r.connected()
    raise AssertionError("never gave up")


def test_the_timeout_runs_from_the_first_failure_since_the_work_moved(clock: Clock) -> None:
    r = Reconnect("receiving streams from /queue/q", "stomp://b:61613", 10.0, wait_at_start=False)
    r.connected()
    clock.now += 3600  # an hour idle, then the connection drops: the whole timeout, not none
    start = clock.now
    with pytest.raises(StreamError, match=r"gave up after 10s of trying to reach stomp://b:61613 .*lost") as err:
        for _ in range(100):
            r.failed(ConnectionLost("lost"))
    assert clock.now - start == pytest.approx(10.0) and isinstance(err.value.__cause__, ConnectionLost)
    # A connection that opened ends the outage: the next one gets the whole timeout again.
    r.connected()
    start = clock.now
    _fail_until_given_up(r, ConnectionLost("lost"))
    assert clock.now - start == pytest.approx(10.0)


def test_a_full_destination_is_waited_for_until_progress_not_until_a_connect(clock: Clock) -> None:
    r = Reconnect("sending 3 files to /queue/q", "stomp://b:61613", 10.0)
    r.connected()
    start = clock.now
    # A full broker lets us connect each time: that does not restart the clock.
    _fail_until_given_up(r, DestinationFull("full"), connect=True)
    assert clock.now - start == pytest.approx(10.0)
    r.progressed()
    r.failed(DestinationFull("full"))
    r.connected()
    before = clock.now
    r.progressed()  # a file confirmed: the wait is over
    _fail_until_given_up(r, ConnectionLost("lost"))
    assert clock.now - before == pytest.approx(10.0)


def test_what_no_retry_can_help_is_raised_as_it_is(clock: Clock) -> None:
    sender = Reconnect("sending", "stomp://b:61613", 10.0)
    with pytest.raises(TransportError, match="refused login"):
        sender.failed(TransportError("refused login"))  # answered and refused before we ever got in
    sender.failed(BrokerUnreachable("not up yet"))  # a sender waits for a broker not up yet
    with pytest.raises(AccessDenied):
        sender.failed(AccessDenied("denied"))
    receiver = Reconnect("receiving", "stomp://b:61613", 10.0, wait_at_start=False)
    with pytest.raises(BrokerUnreachable):
        receiver.failed(BrokerUnreachable("not up yet"))
    assert clock.now == 1000.5  # only the sender's one wait


def test_a_receiver_says_at_once_that_its_broker_is_unreachable_and_a_sender_waits_for_it(tmp_path: Path) -> None:
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 5000)
    name = f"late-{uuid.uuid4().hex}"  # no broker of that name until the timer starts one
    params = BrokerParams(hosts=((name, 0),), login="site-a", backend="memory")
    t0 = time.monotonic()
    with pytest.raises(BrokerUnreachable, match=f"cannot reach any broker at memory://{name}.*is it running"):
        receive_stream(params, "/queue/q", tmp_path / "out", options=ReceiveOptions(reconnect_timeout=30))
    assert time.monotonic() - t0 < 5, "a receiver fails at once, it does not wait out reconnect_timeout"

    started: list[Any] = []
    threading.Timer(1.0, lambda: started.append(MemoryBroker(name))).start()
    try:
        res = send_file(params, src, "/queue/q", SendOptions(reconnect_timeout=30))
        assert res.status == "complete" and res.retries >= 1 and started
        got = receive_stream(params, "/queue/q", tmp_path / "out", options=ReceiveOptions(wait_timeout=2))
        assert got is not None and (tmp_path / "out" / "f.bin").read_bytes() == src.read_bytes()
    finally:
        for b in started:
            b.close()
