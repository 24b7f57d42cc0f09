"""Operators, sensor, trigger and example DAGs under real Airflow (SQLite),
a real broker and real spark-submit."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import (
    ReceiveOptions,
    SendOptions,
    checkpoint_name,
    find_manifest,
    receive_stream,
)
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from tests.conftest import ROOT, _params
from tests.helpers import HeldProxy, cli, cli_json, free_port, make_file, read_json, sha256_file, wait_for

pytestmark = pytest.mark.broker
SIZE = 128 * 2**20 + 999
CHUNK = 256 * 1024
PART = 40 * 2**20  # what a first try may send before it is cut off: 160 chunks of 512


def _load(folder: Path, dag_id: str) -> Any:
    """Parse ``folder`` and serialize its DAGs to the DB (dag.test() needs them there)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import BundleDagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    bag = BundleDagBag(dag_folder=folder, bundle_path=folder, bundle_name="dags-folder")
    assert not bag.import_errors, bag.import_errors
    sync_bag_to_db(bag, "dags-folder", None)
    return bag.dags[dag_id]


@pytest.fixture
def spark_and_broker(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections for the example DAGs: the session broker and Spark in local mode."""
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
        {"conn_type": "spark", "host": "local[2]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}))


def _try_number(db: Path, dag_id: str, task_id: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as con:
        row = con.execute("select max(try_number) from task_instance where dag_id=? and task_id=?",
                          (dag_id, task_id)).fetchone()
    return int(row[0] or 0)


def _in_thread(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` beside dag.test(); the returned join re-raises its failure."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test thread
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> None:
        t.join(120)
        if "exc" in box:
            raise box["exc"]

    return join


def test_example_dags_parse_without_connections_or_network(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.dag_processing.dagbag import DagBag

    def no_network(*a: object, **k: object) -> None:
        raise AssertionError("DAG parsing touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(AmqStreamHook, "get_connection", classmethod(no_network))
    bag = DagBag(dag_folder=ROOT / "dags" / "examples")
    assert bag.import_errors == {}
    assert {"amqstream_one_file", "amqstream_bulk_landing", "amqstream_site_a_producer",
            "amqstream_site_b_consumer"} <= set(bag.dags)


def test_operator_and_sensor_build_no_hook_in_init(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.operators.stream import SendStreamOperator
    from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("hook built in __init__")

    monkeypatch.setattr(AmqStreamHook, "__init__", boom)
    SendStreamOperator(task_id="s", path="/x", destination="/queue/x", amqstream_conn_id="missing")
    StreamCompleteSensor(task_id="r", source="/queue/x", out_dir="/tmp/x", amqstream_conn_id="missing")


def test_operator_rejects_bad_arguments_clearly() -> None:
    from airflow_provider_amqstream.operators.stream import SendStreamOperator

    with pytest.raises(ValueError, match="s: mode must be one of"):
        SendStreamOperator(task_id="s", path="/x", destination="/queue/x", mode="fast")
    with pytest.raises(ValueError, match="window must be at least 1"):
        SendStreamOperator(task_id="s", path="/x", destination="/queue/x", window=0)


@pytest.fixture
def spark_cluster(tmp_path: Path) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """A real Spark standalone cluster on loopback, one master and one worker, started
    from the pyspark distribution; yields the master URL and a reader of its status."""
    import urllib.request

    spark_class = str(Path(sys.executable).parent / "spark-class")
    port, ui = free_port(), free_port()
    logs = tmp_path / "spark-logs"
    logs.mkdir()
    procs = [subprocess.Popen(
        [spark_class, *args], stdout=open(logs / f"{name}.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True) for name, args in [
        ("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                    "--webui-port", str(ui)]),
        ("worker", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--webui-port", str(free_port()),
                    "--cores", "2", "--memory", "2g", "--work-dir", str(tmp_path / "spark-work"),
                    f"spark://127.0.0.1:{port}"])]]

    def status() -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as resp:
                return dict(json.load(resp))
        except (OSError, ValueError):
            # Not up yet; or up but still serving its HTML page at /json/ (seen once in CI).
            return {}

    try:
        wait_for(lambda: status().get("aliveworkers"), 120, "a Spark worker registered with the standalone master")
        yield f"spark://127.0.0.1:{port}", status
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(30)


@pytest.mark.spark
@pytest.mark.parametrize("cluster", [False, True], ids=["local", "standalone-cluster"])
def test_example_one_file_end_to_end_with_spark(airflow_db: Path, spark_and_broker: None, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
                                                cluster: bool) -> None:
    if cluster:
        # Only the Spark connection changes: the same DAG, operator and job run on a cluster.
        master, status = request.getfixturevalue("spark_cluster")
        host, port = master.rsplit(":", 1)
        monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
            {"conn_type": "spark", "host": host, "port": int(port),
             "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}))
        monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)  # the executors' Python, as the driver's
    report = tmp_path / "report.json"
    monkeypatch.setenv("AMQSTREAM_REPORT_FILE", str(report))
    import example_support

    monkeypatch.setattr(example_support, "RECEIVED", tmp_path / "received")
    monkeypatch.setattr(example_support, "PARQUET", tmp_path / "parquet")
    dag = _load(ROOT / "dags" / "examples", "amqstream_one_file")
    src = tmp_path / "in" / "sales.csv"
    dr = dag.test(run_conf={"path": str(src), "rows": 20_000})
    assert dr.state == "success"
    rep = json.loads(report.read_text())
    with open(src, "rb") as fh:
        csv_rows = sum(1 for _ in fh) - 1
    assert rep["rows"] == csv_rows == 20_000
    assert rep["sha256"] == sha256_file(src)
    assert list(Path(rep["parquet"]).glob("region=*/*.parquet")), "no partitioned parquet written"
    if cluster:
        apps = status().get("completedapps", [])
        assert [app["name"] for app in apps] == ["amqstream:sales.csv"], apps  # the job names itself after its file


def test_sender_retry_resumes_from_task_state(airflow_db: Path, private_broker: EmbeddedBroker, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              held_proxy: Callable[..., HeldProxy]) -> None:
    # The first try can get no further than PART bytes: it is part way when its broker goes.
    proxy = held_proxy(private_broker.port, PART)
    uri = proxy.uri(private_broker.info().uri)
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    src = make_file(tmp_path / "big.bin", SIZE)
    record = tmp_path / "send.json"
    from airflow_provider_amqstream.hooks.connection import params_from_uri

    name = checkpoint_name("sr-1", params_from_uri(uri)).removesuffix(".json")
    ckpt = tmp_path / "send-state" / f"amqstream_send_{name}.json"

    def chaos() -> None:
        wait_for(lambda: (read_json(ckpt) or {}).get("confirmed_seq", 0) >= 100, 120,
                 "the sender to confirm 100 chunks")
        private_broker.kill()  # the first try loses its broker and gives up after reconnect_timeout
        proxy.release()
        wait_for(lambda: _try_number(airflow_db, "amqs_test_send_retry", "send") >= 2, 60, "a second try")
        private_broker.start()

    join = _in_thread(chaos)
    dag = _load(ROOT / "tests" / "dags", "amqs_test_send_retry")
    dr = dag.test(run_conf={"path": str(src), "queue": "/queue/retry.send", "stream_id": "sr-1",
                            "record": str(record)})
    join()
    assert dr.state == "success"
    res = json.loads(record.read_text())
    assert res["resumed_from"] > 0
    assert res["bytes_transferred"] < SIZE  # the retry did not start from zero
    got = receive_stream(_params(private_broker), "/queue/retry.send", tmp_path / "out",
                         options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sha256_file(src) == res["sha256"]


def test_sensor_retry_resumes(airflow_db: Path, private_broker: EmbeddedBroker, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch, held_proxy: Callable[..., HeldProxy]) -> None:
    uri = private_broker.info().uri
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    src = make_file(tmp_path / "big.bin", SIZE)
    out = tmp_path / "out"
    record = tmp_path / "recv.json"
    send_args = ["send", str(src), "--to", "/queue/retry.recv", "--stream-id", "rr-1",
                 "--chunk-size", str(CHUNK), "--window", "4", "--json", "-q"]
    state = out / ".amqstream" / "rr-1.json"
    # The first sender can get no further than PART bytes: it is part way when it is killed.
    proxy = held_proxy(private_broker.port, PART)

    def chaos() -> None:
        sender = cli(*send_args, "--conn", proxy.uri(uri))
        wait_for(lambda: (read_json(state) or {}).get("next_seq", 0) >= 100, 120, "the sensor to store 100 chunks")
        os.kill(sender.pid, signal.SIGKILL)  # the sensor's first try stalls and fails
        sender.communicate(timeout=30)
        proxy.close()
        wait_for(lambda: _try_number(airflow_db, "amqs_test_recv_retry", "receive") >= 2, 60, "a second try")
        cli_json(cli(*send_args, "--conn", uri))  # the producer's re-run resumes too

    join = _in_thread(chaos)
    dag = _load(ROOT / "tests" / "dags", "amqs_test_recv_retry")
    dr = dag.test(run_conf={"queue": "/queue/retry.recv", "out_dir": str(out), "stream_id": "rr-1",
                            "record": str(record)})
    join()
    assert dr.state == "success"
    res = json.loads(record.read_text())
    assert res["resumed_from"] > 0 and res["bytes_transferred"] < SIZE
    assert sha256_file(Path(res["path"])) == sha256_file(src) == res["sha256"]


def test_a_retry_returns_the_streams_an_earlier_try_received(airflow_db: Path, uri: str, params: Any,
                                                              queue_name: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A try that publishes streams and then dies must not strand them: its offers are
    acknowledged, so without the claim the retry would wait for new streams (seen in a
    real deployment: the file was received, the run waited for the next one)."""
    from airflow_provider_amqstream.engine import send_file

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    sent = {}
    for i in range(4):
        src = make_file(tmp_path / f"f{i}.bin", 300_000 + i)
        sent[send_file(params, src, queue_name, SendOptions(mode="atomic"),
                       stream_id=f"lost-{i}").stream_id] = sha256_file(src)
    record = tmp_path / "record.json"
    dag = _load(ROOT / "tests" / "dags", "amqs_test_lost_success")
    dr = dag.test(run_conf={"queue": queue_name, "out_dir": str(tmp_path / "out"), "record": str(record)})
    assert dr.state == "success"
    for task_id in ("receive", "drain"):
        assert _try_number(airflow_db, "amqs_test_lost_success", task_id) == 2, task_id
    got = json.loads(record.read_text())
    one, many = got["receive"], got["drain"]["files"]
    assert one["stream_id"] == "lost-0" and Path(one["path"]).is_file()
    # The drain's retry reports the two its first try took, then takes the last one.
    assert [f["stream_id"] for f in many] == ["lost-1", "lost-2", "lost-3"]
    for r in [one, *many]:
        assert sha256_file(Path(r["path"])) == sent[r["stream_id"]] == r["sha256"]


def test_a_claim_is_one_task_instance_across_its_tries(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from airflow_provider_amqstream.engine import find_claimed
    from airflow_provider_amqstream.engine import store as st
    from airflow_provider_amqstream.engine.receive.claims import claim_key
    from airflow_provider_amqstream.engine.state_dir import StateDir
    from airflow_provider_amqstream.operators.checkpoint import task_claim

    def ti(try_number: int, map_index: int = -1) -> dict[str, Any]:
        return {"ti": SimpleNamespace(dag_id="d", run_id="r", task_id="t", map_index=map_index,
                                      try_number=try_number)}

    assert task_claim(ti(1)) == task_claim(ti(2)) != task_claim(ti(1, map_index=0))
    assert task_claim({}) is None
    out = tmp_path / "out"
    sdir = StateDir.create(out)
    for sid, at in (("s1", 2), ("s0", 1)):  # completion records, as a receiver packs them (claims.pack_done)
        st.open_store(sdir).put_many([(st.DONE, sid, ["", "", 1, 1, 0, "", "", at, "landing", "s", f"{sid}.bin"])])
    for sid in ("s1", "s0", "gone"):  # "gone": its record was cleaned away since
        st.open_store(sdir).put_many([(st.CLAIM, claim_key("airflow:d/r/t/-1"), [sid, 1.0])])
    assert [d["stream_id"] for d in find_claimed(out, "airflow:d/r/t/-1")] == ["s0", "s1"]
    assert find_claimed(out, "airflow:d/r/t/0") == []
    for bad in ("", "x\n", "x" * 2000):
        with pytest.raises(ValueError, match="a claim must be"):
            ReceiveOptions(claim=bad)


def test_deferrable_sensor_completes(airflow_db: Path, broker: EmbeddedBroker, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", broker.info().uri)
    src = make_file(tmp_path / "f.bin", 3 * 2**20 + 1)
    record = tmp_path / "recv.json"
    # dag.test() runs the trigger in this process: watch it poll, then send.
    polled = threading.Event()
    from airflow_provider_amqstream.engine.receive.browse import OfferBrowser

    real = OfferBrowser.look

    def watched(self: OfferBrowser, *a: Any, **k: Any) -> Any:
        polled.set()
        return real(self, *a, **k)

    monkeypatch.setattr(OfferBrowser, "look", watched)

    def send_when_deferred() -> None:
        assert polled.wait(60), "the sensor never deferred to its trigger"
        cli_json(cli("send", str(src), "--to", "/queue/deferred", "--conn", broker.info().uri, "--json", "-q"))

    join = _in_thread(send_when_deferred)
    dag = _load(ROOT / "tests" / "dags", "amqs_test_deferrable")
    dr = dag.test(run_conf={"queue": "/queue/deferred", "out_dir": str(tmp_path / "out"), "record": str(record)})
    join()
    assert dr.state == "success"
    res = json.loads(record.read_text())
    assert sha256_file(Path(res["path"])) == sha256_file(src)


@pytest.mark.spark
def test_examples_two_sites_run_as_shipped(airflow_db: Path, spark_and_broker: None, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Example 3 runs without edits: producer and consumer sites."""
    import example_support

    for name in ("LANDING", "RECEIVED", "PARQUET", "BASE"):
        monkeypatch.setattr(example_support, name, tmp_path / name.lower())
    examples = ROOT / "dags" / "examples"
    for dag_id in ("amqstream_site_a_producer", "amqstream_site_b_consumer"):
        assert _load(examples, dag_id).test().state == "success", dag_id
    assert (tmp_path / "received" / "site-b" / "site-a-orders.csv").exists()
    assert list((tmp_path / "parquet" / "site-b").glob("*/_amqstream_summary.json"))


def test_operator_sends_a_glob_in_one_task(airflow_db: Path, uri: str, params: Any, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch, queue_name: str) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    files = [make_file(tmp_path / "in" / f"part-{i}.bin", 10_000 + i, seed=i) for i in range(25)]
    make_file(tmp_path / "in" / "skip.txt", 10)
    record = tmp_path / "many.json"
    dag = _load(ROOT / "tests" / "dags", "amqs_test_send_many")
    dr = dag.test(run_conf={"path": str(tmp_path / "in" / "part-*.bin"), "queue": queue_name,
                            "record": str(record)})
    assert dr.state == "success"
    res = json.loads(record.read_text())
    assert sorted(Path(f["path"]).name for f in res["files"]) == sorted(f.name for f in files)
    assert res["totals"]["files_sent"] == 25 and res["failed"] == []
    from airflow_provider_amqstream.engine import receive_streams

    got = receive_streams(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=3))
    assert len(got) == 25
    assert find_manifest(tmp_path / "out", res['totals']['batch_id']) is not None
