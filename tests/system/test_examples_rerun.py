"""Scheduled examples succeed run after run, keep every run's files,
and a sensor asked for a stream it already received returns that result at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, find_received, receive_stream, send_file
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.conftest import ROOT
from tests.helpers import free_port, make_file, sha256_file
from tests.integration.test_airflow import _load

pytestmark = pytest.mark.broker


def test_find_received_reads_the_completion_record(params: BrokerParams, queue_name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert find_received(out, "never-1") is None
    src = make_file(tmp_path / "f.bin", 10_000)
    send_file(params, src, queue_name, SendOptions(mode="atomic"), stream_id="fr-1")
    got = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=30))
    assert got is not None
    record = find_received(out, "fr-1")
    assert record is not None and record["sha256"] == got.sha256 == sha256_file(src)
    assert record["path"] == got.path
    with pytest.raises(ValueError, match="not valid"):
        find_received(out, "../fr-1")


@pytest.mark.parametrize("deferrable", [False, True], ids=["poke", "deferrable"])
def test_sensor_returns_a_stream_it_already_received_at_once(params: BrokerParams, queue_name: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             deferrable: bool) -> None:
    from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

    out = tmp_path / "out"
    src = make_file(tmp_path / "f.bin", 50_000)
    send_file(params, src, queue_name, SendOptions(mode="atomic"), stream_id="again-1")
    assert receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=30)) is not None
    # Nothing listens here: any look at a broker would fail, so the answer comes from out_dir.
    monkeypatch.setenv("AIRFLOW_CONN_AMQS_NOWHERE", f"amqstream://127.0.0.1:{free_port()}")
    sensor = StreamCompleteSensor(task_id="r", source=queue_name, out_dir=str(out), stream_id="again-1",
                                  amqstream_conn_id="amqs_nowhere", deferrable=deferrable, timeout=5)
    if deferrable:
        result: Any = sensor.execute({})
    else:
        ret = sensor.poke({})
        assert ret.is_done
        result = ret.xcom_value
    assert result["stream_id"] == "again-1" and result["sha256"] == sha256_file(src)
    assert Path(result["path"]).read_bytes() == src.read_bytes()


@pytest.fixture
def example_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uri: str) -> Path:
    import json as _json

    import example_support

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", _json.dumps(
        {"conn_type": "spark", "host": "local[2]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}))
    for name in ("LANDING", "RECEIVED", "PARQUET", "BASE"):
        monkeypatch.setattr(example_support, name, tmp_path / name.lower())
    # A queue of this test's own, so offers left by other tests cannot be taken here.
    monkeypatch.setattr(example_support, "QUEUE", f"/queue/rerun.{tmp_path.name}")
    return tmp_path


@pytest.mark.spark
def test_bulk_landing_runs_twice_in_a_row(airflow_db: Path, example_dirs: Path) -> None:
    """Example 2 as shipped, two runs in a row: each moves the whole landing directory in one
    send task and one receive task, and archives what it sent. The first run's Spark
    application converts the batch; the second run's is marked done without running (the
    deployment test runs both of its bulk runs through Spark)."""
    dag = _load(ROOT / "dags" / "examples", "amqstream_bulk_landing")
    received = example_dirs / "received" / "bulk"
    for run in (1, 2):
        before = set(received.glob("*/.amqstream/manifests/*/*.manifest.jsonl"))
        dr = dag.test(mark_success_pattern="^to_parquet$" if run == 2 else None)
        assert dr.state == "success", f"run {run}"
        day = received / dr.run_after.strftime("%Y-%m-%d")  # the run's dated landing directory
        assert not [p for p in (example_dirs / "landing").rglob("*") if p.is_file()], "sent files stayed behind"
        run_id = dr.run_id.replace(":", "_").replace("+", "_")
        sent = example_dirs / "sent" / run_id
        rel = sorted(str(p.relative_to(sent)) for p in sent.rglob("*") if p.is_file())
        assert rel == ["eu/batch-1.csv", "us/batch-0.csv", "us/batch-2.csv"]
        # The run's manifest names where each file landed (a name taken by run 1 gets the stream id).
        [manifest] = set(received.glob("*/.amqstream/manifests/*/*.manifest.jsonl")) - before
        assert manifest.is_relative_to(day), manifest
        rows = [json.loads(line) for line in manifest.read_text().splitlines()]
        assert len(rows) == 3
        for row in rows:
            assert sha256_file(day / row["path"]) == row["sha256"]
        assert sorted(sha256_file(sent / r) for r in rel) == sorted(r["sha256"] for r in rows)
        if run == 1:
            summary = example_dirs / "parquet" / "bulk" / run_id / "_amqstream_batch_summary.json"
            batch = json.loads(summary.read_text())
            assert batch["files"] == 3 and batch["rows"] == 15_000
    kept = [p.name for p in received.rglob("*.csv") if ".amqstream" not in p.parts]
    assert len(kept) == 6 and sum(n.startswith("batch-0") for n in kept) == 2, kept  # none overwritten
    assert len(list(received.glob("*/.amqstream/manifests/*/*.manifest.jsonl"))) == 2


@pytest.mark.spark
def test_two_sites_run_twice_in_a_row_and_keep_every_file(airflow_db: Path, example_dirs: Path) -> None:
    examples = ROOT / "dags" / "examples"
    producer = _load(examples, "amqstream_site_a_producer")
    consumer = _load(examples, "amqstream_site_b_consumer")
    for run in (1, 2):
        assert producer.test().state == "success", f"producer run {run}"
        # The second conversion is marked done without running Spark (the deployment test
        # converts both of its runs): what this test checks is the files and their archive.
        assert consumer.test(mark_success_pattern="^to_parquet$" if run == 2 else None).state == "success", \
            f"consumer run {run}"
    archived = [p for p in (example_dirs / "base" / "site-a" / "outbox" / "sent").rglob("*") if p.is_file()]
    assert len(archived) == 2, archived  # the second run did not overwrite the first's archive
    received = [p for p in (example_dirs / "received" / "site-b").iterdir() if p.is_file()]
    assert len(received) == 2, received
    assert sorted(sha256_file(p) for p in received) == sorted(sha256_file(p) for p in archived)
    assert len(list((example_dirs / "parquet" / "site-b").glob("*/_amqstream_summary.json"))) == 1

