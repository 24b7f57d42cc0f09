"""The engine's events as Airflow metrics (``airflow_provider_amqstream.metrics``).

The mapping is checked event by event, then on a real receive: the events a real receiver
emits (a stream published, one quarantined over ``max_bytes``, one that yields after its
sender went silent) reach Airflow's metrics API with the documented names and a
``destination`` tag.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from airflow_provider_amqstream import metrics
from airflow_provider_amqstream.engine import ReceiveOptions, StreamQuarantined, StreamStalled, receive_stream
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import play

DEST = "/queue/landing"


def test_each_event_maps_to_its_documented_counters() -> None:
    tags = {"destination": DEST}
    assert metrics.metric_calls("stream_close", {"destination": DEST, "bytes": 10, "bytes_transferred": 4}) == [
        (metrics.FILES_RECEIVED, 1, tags), (metrics.BYTES_RECEIVED, 4, tags)]
    # The caller's destination where the event names none.
    assert metrics.metric_calls("stream_close", {"bytes": 7}, destination="/queue/x") == [
        (metrics.FILES_RECEIVED, 1, {"destination": "/queue/x"}),
        (metrics.BYTES_RECEIVED, 7, {"destination": "/queue/x"})]
    assert metrics.metric_calls("stream_sent", {"destination": DEST, "bytes": 9, "bytes_transferred": 9}) == [
        (metrics.FILES_SENT, 1, tags), (metrics.BYTES_SENT, 9, tags)]
    assert metrics.metric_calls("stream_sent", {"destination": DEST, "status": "already_sent", "bytes": 9}) == []
    assert metrics.metric_calls("stream_quarantined", {"destination": DEST}) == [(metrics.STREAMS_QUARANTINED, 1, tags)]
    assert metrics.metric_calls("stream_yielded", {"destination": DEST, "status": "no_room"}) == [
        (metrics.STREAMS_YIELDED, 1, {**tags, "status": "no_room"})]
    assert metrics.metric_calls("duplicate_offer", {}, destination=DEST) == [(metrics.DUPLICATES, 1, tags)]
    assert metrics.metric_calls("bytes", {"destination": DEST, "count": 5, "direction": "sent"}) == [
        (metrics.BYTES_SENT, 5, tags)]
    assert metrics.metric_calls("stream_open", {"destination": DEST}) == []
    assert all(name.startswith("amqstream.") for name in metrics.NAMES)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, dict[str, Any]]]:
    """What reaches Airflow's metrics API (the Task SDK's ``stats.incr``)."""
    from airflow.sdk.observability import stats

    calls: list[tuple[str, int, dict[str, Any]]] = []
    monkeypatch.setattr(stats, "incr", lambda name, count=1, rate=None, *, tags=None: calls.append(
        (name, count, dict(tags or {}))))
    return calls


def test_a_metrics_backend_that_fails_never_fails_the_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.observability import stats

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("statsd is down")

    monkeypatch.setattr(stats, "incr", broken)
    metrics.emit("stream_close", {"destination": DEST, "bytes": 1})


@pytest.mark.broker
def test_a_real_receivers_events_become_metrics(params: BrokerParams, queue_name: str, tmp_path: Any,
                                                counted: list[tuple[str, int, dict[str, Any]]]) -> None:
    def events(kind: str, data: dict[str, Any]) -> None:
        metrics.emit(kind, data, destination=queue_name)

    data = bytes(range(256)) * 10
    good = p.StreamSpec("good-1", "good.bin", len(data), 1000)
    play(params, queue_name, good, data, [1, 2, 3])
    got = receive_stream(params, queue_name, tmp_path / "in", stream_id="good-1",
                         options=ReceiveOptions(wait_timeout=10, events=events))
    assert got is not None and got.sha256 == hashlib.sha256(data).hexdigest()
    play(params, queue_name, p.StreamSpec("big-1", "big.bin", len(data), 1000), data, [1, 2, 3])
    with pytest.raises(StreamQuarantined):
        receive_stream(params, queue_name, tmp_path / "in", stream_id="big-1",
                       options=ReceiveOptions(wait_timeout=10, max_bytes=100, events=events))
    play(params, queue_name, p.StreamSpec("slow-1", "slow.bin", len(data), 1000), data, [1], end=False)
    with pytest.raises(StreamStalled):
        receive_stream(params, queue_name, tmp_path / "in", stream_id="slow-1",
                       options=ReceiveOptions(wait_timeout=10, idle_timeout=0.5, events=events))
    tags = {"destination": queue_name}
    assert counted == [(metrics.FILES_RECEIVED, 1, tags), (metrics.BYTES_RECEIVED, len(data), tags),
                       (metrics.STREAMS_QUARANTINED, 1, tags),
                       (metrics.STREAMS_YIELDED, 1, {**tags, "status": "stalled"})]
