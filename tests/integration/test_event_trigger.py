"""The ``amqstream`` message queue (event-driven scheduling) and quiet triggers.

Triggers run with asyncio against the real session broker; offers are made with the
real sender (``send_file``) or, for hostile ones, with raw stomp.py.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import stomp

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.engine.receive import browse as offers_mod
from airflow_provider_amqstream.engine.receive.browse import OfferBrowser
from airflow_provider_amqstream.exceptions import StreamStalled
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination, owner_element
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from airflow_provider_amqstream.triggers.offered import StreamOfferedTrigger
from airflow_provider_amqstream.triggers.stream import StreamOfferTrigger
from tests.conftest import ROOT
from tests.helpers import browse, make_file, play

CONN_ID = "amqs_evt"


@pytest.fixture
def conn(uri: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", uri)
    return CONN_ID


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts looks and STOMP sessions opened by watchers."""
    counts = {"looks": 0, "opens": 0}
    real_look, real_open = OfferBrowser.look, StompLink.open

    def look(self: OfferBrowser, *a: Any, **k: Any) -> Any:
        counts["looks"] += 1
        return real_look(self, *a, **k)

    def open_(self: Any) -> Any:
        if (self.client_id or "").startswith("amqs-watch"):  # not the test's own senders and receivers
            counts["opens"] += 1
        return real_open(self)

    monkeypatch.setattr(OfferBrowser, "look", look)
    monkeypatch.setattr(StompLink, "open", open_)
    return counts


async def _collect(gen: AsyncIterator[Any], events: list[Any], until: Callable[[], bool], timeout: float) -> None:
    """Drain ``gen`` into ``events`` until ``until()`` holds (checked after each event and
    every few milliseconds), then close it; fail after ``timeout`` seconds."""

    async def pump() -> None:
        async for ev in gen:
            events.append(ev)

    task = asyncio.ensure_future(pump())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while not until():
            if task.done():
                task.result()  # re-raise what ended it
                return
            if loop.time() > deadline:
                raise AssertionError(f"timed out after {timeout}s; events so far: {events}")
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


def _offer_two(tmp_path: Path, params: BrokerParams, queue: str) -> dict[str, Any]:
    sent = {}
    for i, size in enumerate((70_000, 3 * 2**20 + 5)):
        src = make_file(tmp_path / f"in-{i}.bin", size, seed=i)
        res = send_file(params, src, queue, SendOptions(mode="atomic", chunk_size=2**20), stream_id=f"evt-{i}")
        sent[res.stream_id] = res
    return sent


def test_message_queue_trigger_resolves_to_our_trigger() -> None:
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger

    mq = MessageQueueTrigger(scheme="amqstream", destination="/queue/incoming", amqstream_conn_id="c1",
                             poll_interval=2.0)
    assert isinstance(mq.trigger, StreamOfferedTrigger)
    classpath, kwargs = mq.serialize()
    assert classpath == "airflow_provider_amqstream.triggers.offered.StreamOfferedTrigger"
    assert kwargs["destination"] == "/queue/incoming" and kwargs["amqstream_conn_id"] == "c1"
    again = StreamOfferedTrigger(**kwargs)  # what the triggerer rebuilds
    assert again.serialize() == (classpath, kwargs)


def test_provider_works_without_common_messaging() -> None:
    """With common.messaging missing, our queue module says what to install; the rest imports."""
    code = textwrap.dedent("""
        import sys
        # As if the package were not installed: None in sys.modules makes an import fail.
        for name in ("airflow.providers.common.messaging.providers",
                     "airflow.providers.common.messaging.providers.base_provider"):
            sys.modules[name] = None
        from airflow.exceptions import AirflowOptionalProviderFeatureException
        try:
            import airflow_provider_amqstream.queues.amqstream
        except AirflowOptionalProviderFeatureException as exc:
            print("OPTIONAL:", exc)
        import airflow_provider_amqstream.sensors.stream, airflow_provider_amqstream.triggers.offered
        from airflow_provider_amqstream.provider_info import get_provider_info
        print("OK", len(get_provider_info()["queues"]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OPTIONAL:" in out.stdout and "airflow-provider-amqstream[messaging]" in out.stdout
    assert "OK 1" in out.stdout


@pytest.mark.broker
def test_event_trigger_fires_once_per_offered_stream(conn: str, params: BrokerParams, queue_name: str,
                                                     tmp_path: Path, counted: dict[str, int]) -> None:
    sent = _offer_two(tmp_path, params, queue_name)
    # Unpaced: every waiting stream fires at once (pacing has its own test).
    trig = StreamOfferedTrigger(destination=queue_name, amqstream_conn_id=conn, poll_interval=0.05, pace=0)
    events: list[Any] = []
    marks: dict[str, int] = {}

    def two_then_more_looks() -> bool:
        if len(events) < 2:
            return False
        marks.setdefault("looks", counted["looks"])
        return counted["looks"] >= marks["looks"] + 5  # five more looks see both offers again

    asyncio.run(_collect(trig.run(), events, two_then_more_looks, 120))
    assert len(events) == 2, [e.payload for e in events]
    by_id = {e.payload["stream_id"]: e.payload for e in events}
    assert set(by_id) == set(sent)
    for sid, res in sent.items():
        got = by_id[sid]
        assert (got["name"], got["size"], got["destination"], got["mode"]) == (res.name, res.bytes, queue_name,
                                                                              "atomic")
        assert "sender" in got and isinstance(got["offered_at"], int)
    assert counted["opens"] == 1, "the trigger opened more than one connection"

    # It only looked: both streams are still there for their receivers.
    for sid, res in sent.items():
        got = receive_stream(params, queue_name, tmp_path / "out", stream_id=sid,
                             options=ReceiveOptions(wait_timeout=30))
        assert got is not None and got.sha256 == res.sha256


@pytest.mark.broker
def test_events_are_paced_until_the_last_fired_stream_is_taken(conn: str, params: BrokerParams, queue_name: str,
                                                               tmp_path: Path, counted: dict[str, int]) -> None:
    """Airflow 3.3 folds events that arrive while a run is being created into that run: the
    next event waits until the run started for the last one has taken its stream."""
    sent = _offer_two(tmp_path, params, queue_name)
    trig = StreamOfferedTrigger(destination=queue_name, amqstream_conn_id=conn, poll_interval=0.05)
    events: list[Any] = []
    seen: dict[str, Any] = {}

    def take_first() -> None:
        sid = events[0].payload["stream_id"]
        seen["taking"] = time.monotonic()
        seen["first"] = receive_stream(params, queue_name, tmp_path / "out", stream_id=sid,
                                       options=ReceiveOptions(wait_timeout=30))

    def paced() -> bool:
        if len(events) == 1 and "looks" not in seen:
            seen["looks"] = counted["looks"]
        if "taker" not in seen and "looks" in seen and counted["looks"] >= seen["looks"] + 10:
            # Ten looks saw both offers and fired only one: now its run takes it.
            seen["held"] = len(events)
            seen["taker"] = threading.Thread(target=take_first)
            seen["taker"].start()
        if len(events) == 2 and "second" not in seen:
            seen["second"] = time.monotonic()
        return len(events) == 2

    asyncio.run(_collect(trig.run(), events, paced, 120))
    seen["taker"].join(60)
    assert seen["held"] == 1, "the second stream fired before the first was taken"
    assert seen["second"] >= seen["taking"]
    assert seen["first"] is not None and {e.payload["stream_id"] for e in events} == set(sent)

    # A run that never takes its stream holds the next one back for ``pace`` seconds only.
    again = StreamOfferedTrigger(destination=queue_name, amqstream_conn_id=conn, poll_interval=0.05, pace=0.5)
    more = make_file(tmp_path / "more.bin", 1000)
    send_file(params, more, queue_name, SendOptions(mode="atomic"), stream_id="evt-more")
    later: list[Any] = []
    asyncio.run(_collect(again.run(), later, lambda: len(later) == 2, 60))
    assert {e.payload["stream_id"] for e in later} == {events[1].payload["stream_id"], "evt-more"}
    with pytest.raises(ValueError, match="pace must be >= 0"):
        StreamOfferedTrigger(destination=queue_name, pace=-1)


@pytest.mark.broker
def test_event_trigger_forgets_received_streams_and_fires_new_ones(conn: str, params: BrokerParams,
                                                                   queue_name: str, tmp_path: Path,
                                                                   counted: dict[str, int]) -> None:
    browser = OfferBrowser(params, queue_name)
    try:
        assert browser.look() == []
        src = make_file(tmp_path / "a.bin", 1000)
        send_file(params, src, queue_name, SendOptions(mode="atomic"), stream_id="again-1")
        assert [o.stream_id for o in browser.look()] == ["again-1"]
        assert receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=30))
        assert browser.look() == []
        assert browser.opened == 1
    finally:
        browser.close()


def _raw_send(info: Any, queue: str, headers: dict[str, str], body: bytes = b"") -> None:
    conn = stomp.Connection12([(info.host, info.port)], auto_decode=False)
    conn.connect(info.user, info.password, wait=True)
    try:
        conn.send(queue, body, headers={**headers, "persistent": "true", "receipt": "r1"})
    finally:
        conn.disconnect()


@pytest.mark.broker
def test_hostile_offers_are_skipped_and_reported_once(broker: EmbeddedBroker, conn: str, params: BrokerParams,
                                                      queue_name: str, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """An authorized sender offers the worst values with raw stomp.py; only the good offer fires."""
    info = broker.info()
    dest = Destination.parse(queue_name)
    good = p.offer_headers(p.StreamSpec("good-1", "ok.csv", 10, 10), dest, sender=params.user)

    def bad(**changes: str) -> dict[str, str]:
        h = dict(good, **changes)
        if hdr.H_DATA_DEST not in changes:  # keep the data queue consistent, so only the change is wrong
            h[hdr.H_DATA_DEST] = f"{queue_name}.amqs.{owner_element(params.user)}.{h[hdr.H_STREAM]}"
        return h

    hostile = [
        bad(**{hdr.H_STREAM: "../../etc"}),
        bad(**{hdr.H_STREAM: "x" * 5000}),
        bad(**{hdr.H_STREAM: "big-name", hdr.H_NAME: "n" * 9000}),
        bad(**{hdr.H_STREAM: "neg", hdr.H_SIZE: "-1"}),
        bad(**{hdr.H_STREAM: "huge", hdr.H_SIZE: "9" * 400}),
        bad(**{hdr.H_STREAM: "forged", hdr.H_DATA_DEST: "/queue/elsewhere"}),
        bad(**{hdr.H_STREAM: "v9", hdr.H_VERSION: "9"}),
        bad(**{hdr.H_STREAM: "re-1", hdr.H_REOFFER: "1"}),  # valid, but nobody starts from a re-offer
    ]
    for h in hostile:
        _raw_send(info, queue_name, h)
    # The sender field comes off the wire too: a long, unprintable one is cut and cleaned.
    _raw_send(info, queue_name, dict(good, JMSXUserID="evil\x07" + "u" * 10_000))
    trig = StreamOfferedTrigger(destination=queue_name, amqstream_conn_id=conn, poll_interval=0.05)
    events: list[Any] = []
    looks = {"n": 0}
    real_look = OfferBrowser.look

    def look(self: OfferBrowser, *a: Any, **k: Any) -> Any:
        looks["n"] += 1
        return real_look(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.WARNING, logger=offers_mod.__name__):
        mp.setattr(OfferBrowser, "look", look)
        asyncio.run(_collect(trig.run(), events, lambda: looks["n"] >= 6, 120))
    assert [e.payload["stream_id"] for e in events] == ["good-1"]
    sender = events[0].payload["sender"]
    assert sender is None or (len(sender) <= hdr.MAX_USER_ID and sender.isprintable())
    # Each filed away once, with its reason, where a receiver files what it cannot take.
    warnings = [r for r in caplog.records if "quarantined to" in r.getMessage()]
    assert len(warnings) == 7, [r.getMessage()[:120] for r in warnings]
    filed = browse(params, f"/queue/DLQ.{dest.name}")
    assert len(filed) == 7 and all(f.headers[hdr.H_QUARANTINED_FROM] == queue_name for f in filed)
    assert sorted(f.headers[hdr.H_STREAM] for f in browse(params, queue_name)) == ["good-1", "re-1"]


@pytest.mark.broker
def test_waiting_trigger_keeps_one_connection_and_logs_little(conn: str, params: BrokerParams, queue_name: str,
                                                              tmp_path: Path, counted: dict[str, int],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    trig = StreamOfferTrigger(source=queue_name, stream_id="late-1", amqstream_conn_id=conn, poll_interval=0.02,
                              timeout=600)
    events: list[Any] = []
    marks: dict[str, int] = {}

    def offer_after_many_looks() -> bool:
        if counted["looks"] >= 40 and "sent" not in marks:
            marks["sent"] = 1
            send_file(params, make_file(tmp_path / "late.bin", 500), queue_name, SendOptions(mode="atomic"),
                      stream_id="late-1")
        return bool(events)

    asyncio.run(_collect(trig.run(), events, offer_after_many_looks, 180))
    assert events[0].payload["status"] == "success"
    assert counted["looks"] >= 40 and counted["opens"] == 1
    # Triggers log through Airflow's structlog set-up, to stdout here as in a task log.
    ours = [line for line in capsys.readouterr().out.splitlines() if "StreamOfferTrigger" in line]
    assert len(ours) <= 3, ours
    assert any("waiting for stream late-1" in line and "until" in line for line in ours), ours


@pytest.mark.broker
def test_stomp_connect_line_stays_out_of_logs(params: BrokerParams) -> None:
    """A process that logs at INFO (as a task does) does not get stomp.py's per-connect line."""
    h, port = params.hosts[0]
    code = textwrap.dedent(f"""
        import logging
        logging.basicConfig(level=logging.INFO)
        from airflow_provider_amqstream.transport.params import BrokerParams
        from airflow_provider_amqstream.transport.session import StompLink
        params = BrokerParams(hosts=(({h!r}, {port}),), login={params.login!r}, password={params.password!r})
        for _ in range(3):
            with StompLink(params) as link:
                link.round_trip()
        print("DONE")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "DONE" in out.stdout, out.stderr[-2000:]
    assert "established connection" not in out.stderr.lower(), out.stderr[-2000:]


@pytest.mark.broker
def test_a_deferred_sensor_is_not_woken_for_a_stream_that_yielded_its_place(
        conn: str, params: BrokerParams, queue_name: str, tmp_path: Path) -> None:
    """A stalled stream's offer is parked (in the parked queue) until its back-off ends.
    The sensor's trigger must pass it too, or it fires at once, the sensor finds nothing
    to take, defers again, and loops until its timeout."""
    data = make_file(tmp_path / "late.bin", 6000).read_bytes()
    play(params, queue_name, p.StreamSpec("stall-1", "late.bin", len(data), 1000), data, [1, 2], end=False)
    out = tmp_path / "out"
    with pytest.raises(StreamStalled):
        receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=5, idle_timeout=1,
                                                                       yield_backoff=600))
    assert browse(params, queue_name) == []
    [parked] = browse(params, Destination.parse(queue_name).parked_queue())
    assert p.parked_until(parked.headers) > time.time() + 500 and parked.headers[hdr.H_YIELDS] == "1"
    trig = StreamOfferTrigger(source=queue_name, amqstream_conn_id=conn, poll_interval=0.2, timeout=3)
    events: list[Any] = []
    asyncio.run(_collect(trig.run(), events, lambda: bool(events), 60))
    assert events[0].payload["status"] == "timeout", events[0].payload
    # A sensor asking for that very stream is woken: a receiver asked for it takes it at once.
    woken: list[Any] = []
    again = StreamOfferTrigger(source=queue_name, stream_id="stall-1", amqstream_conn_id=conn, poll_interval=0.2,
                               timeout=30)
    asyncio.run(_collect(again.run(), woken, lambda: bool(woken), 60))
    assert woken[0].payload["status"] == "success"
