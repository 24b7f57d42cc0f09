"""The event-driven example DAG (asset watcher -> one receive per offered stream)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import SendOptions, send_file
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.conftest import ROOT
from tests.helpers import sha256_file
from tests.integration.test_airflow import _load

EXAMPLES = ROOT / "dags" / "examples"


def test_event_driven_dag_parses_and_its_watcher_serializes() -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    bag = DagBag(dag_folder=EXAMPLES / "amqstream_event_driven.py")
    assert bag.import_errors == {}
    dag = bag.dags["amqstream_event_driven"]
    text = json.dumps(DagSerialization.to_dict(dag))
    assert "airflow_provider_amqstream.triggers.offered.StreamOfferedTrigger" in text
    assert "amqstream_offers" in text and "/queue/amqstream.examples.events" in text


@pytest.mark.spark
@pytest.mark.broker
def test_event_driven_run_receives_exactly_its_streams(airflow_db: Path, params: BrokerParams, uri: str,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import example_support

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
        {"conn_type": "spark", "host": "local[2]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}))
    queue = f"/queue/evt.{tmp_path.name}"
    for name in ("RECEIVED", "PARQUET"):
        monkeypatch.setattr(example_support, name, tmp_path / name.lower())
    monkeypatch.setattr(example_support, "QUEUE", queue)
    files = {}
    for i in range(3):
        src = tmp_path / f"orders-{i}.csv"
        example_support.write_sample_csv(src, rows=200, seed=i)
        files[f"evt-{i}"] = send_file(params, src, queue + ".events", SendOptions(mode="atomic"), stream_id=f"evt-{i}")
    dag = _load(EXAMPLES, "amqstream_event_driven")
    # The run is for two of the three offered streams; the third must stay on the queue.
    dr = dag.test(run_conf={"stream_ids": ["evt-0", "evt-2"]})
    assert dr.state == "success"
    got = sorted(p.name for p in (tmp_path / "received" / "events").iterdir() if p.is_file())
    assert got == ["orders-0.csv", "orders-2.csv"]
    for name in got:
        assert sha256_file(tmp_path / "received" / "events" / name) == sha256_file(tmp_path / name)
    summaries = sorted(p.parent.name for p in (tmp_path / "parquet" / "events").glob("*/_amqstream_summary.json"))
    assert summaries == ["evt-0", "evt-2"]
    from airflow_provider_amqstream.engine.receive.browse import OfferBrowser

    browser = OfferBrowser(params, queue + ".events")
    try:
        assert [o.stream_id for o in browser.look()] == ["evt-1"]
    finally:
        browser.close()


def test_run_takes_the_stream_ids_of_its_triggering_events() -> None:
    """Events the scheduler folded into one run each give a stream id (what the trigger put
    in the payload), in order, once; the hand-triggered parameter adds to them."""
    from types import SimpleNamespace

    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=EXAMPLES / "amqstream_event_driven.py").dags["amqstream_event_driven"]
    pick = dag.get_task("offered_streams").python_callable

    def event(payload: object) -> SimpleNamespace:
        return SimpleNamespace(extra={"from_trigger": True, "payload": payload})

    events = {"amqstream_incoming_streams": [event({"stream_id": "a-1", "size": 3}), event({"stream_id": "b-2"}),
                                             event({"stream_id": "a-1"}), event("not a dict"), event({})]}
    assert pick(triggering_asset_events=events, params={"stream_ids": []}) == ["a-1", "b-2"]
    assert pick(triggering_asset_events={}, params={"stream_ids": ["c-3"]}) == ["c-3"]


def test_a_run_that_names_no_stream_fails_saying_what_to_give() -> None:
    """Triggered by hand with 'Stream ids' left empty, the run used to skip every task and go
    green having received nothing: it fails, naming the parameter and the queue."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.sdk.exceptions import AirflowFailException

    dag = DagBag(dag_folder=EXAMPLES / "amqstream_event_driven.py").dags["amqstream_event_driven"]
    pick = dag.get_task("offered_streams").python_callable
    with pytest.raises(AirflowFailException, match=r"'Stream ids'.*/queue/amqstream\.examples\.events"):
        pick(triggering_asset_events={}, params={"stream_ids": []})


@pytest.mark.spark
@pytest.mark.broker
def test_a_malformed_csv_fails_its_spark_task_once_naming_the_cause(airflow_db: Path, params: BrokerParams, uri: str,
                                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """A CSV cut mid-line: Spark cannot read it, and no retry would read other bytes. Its
    Spark task fails on its first try (the DAG allows two retries), and the task's last log
    line names the file and Spark's cause; Spark's own lines come one to an event, no stack
    traces."""
    import example_support

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
        {"conn_type": "spark", "host": "local[1]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}))
    queue = f"/queue/evt.{tmp_path.name}"
    for name in ("RECEIVED", "PARQUET"):
        monkeypatch.setattr(example_support, name, tmp_path / name.lower())
    monkeypatch.setattr(example_support, "QUEUE", queue)
    whole = example_support.write_sample_csv(tmp_path / "whole.csv", rows=300).read_bytes()
    cut = whole.index(b"\n", len(whole) // 2) + 12  # the next row cut after its first fields
    src = tmp_path / "cut.csv"
    src.write_bytes(whole[:cut])
    send_file(params, src, queue + ".events", SendOptions(mode="atomic"), stream_id="cut-1")
    capfd.readouterr()
    dr = _load(EXAMPLES, "amqstream_event_driven").test(run_conf={"stream_ids": ["cut-1"]})
    out = capfd.readouterr()
    log = (out.out + out.err).splitlines()
    assert dr.state == "failed"
    ti = dr.get_task_instance("to_parquet", map_index=0)
    assert (ti.state, ti.try_number) == ("failed", 1), (ti.state, ti.try_number)
    received = tmp_path / "received" / "events" / "cut.csv"
    lines = [line for line in log if "MALFORMED_CSV_RECORD" in line]
    assert lines and str(received) in lines[-1], "\n".join(log[-40:])
    # The failure is the task's last word: nothing of the task's after the line naming it
    # but Airflow's own closing (its exception's record and state change).
    tail = log[log.index(lines[-1]):]
    print("\n".join(tail))
    assert not [line for line in log if line.lstrip().startswith("at org.apache.spark")], "a Java stack trace"
