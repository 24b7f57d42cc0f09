"""OpenLineage from executed tasks, and a quiet Spark hand-off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.operators.spark import quiet_spark_conf, stream_to_parquet_job
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import make_file, sha256_file

CONN_ID = "amqs_lineage"


def _as_json(dataset: Any) -> dict[str, Any]:
    from openlineage.client.serde import Serde

    return json.loads(Serde.to_json(dataset))


@pytest.mark.broker
def test_send_and_receive_report_file_and_destination_lineage(params: BrokerParams, uri: str, queue_name: str,
                                                              tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.operators.stream import SendStreamOperator
    from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", uri)
    src = make_file(tmp_path / "in" / "data.bin", 300_000)
    send = SendStreamOperator(task_id="send", path=str(src), destination=queue_name, stream_id="lin-1",
                              amqstream_conn_id=CONN_ID, mode="atomic")
    send.execute({})
    recv = StreamCompleteSensor(task_id="recv", source=queue_name, out_dir=str(tmp_path / "out"),
                                stream_id="lin-1", amqstream_conn_id=CONN_ID)
    assert recv.poke({}).is_done
    host, port = params.hosts[0]
    file_ns, dest_ns = "file", f"amqstream://{host}:{port}"  # as the assets name them
    sha, size = sha256_file(src), src.stat().st_size

    sent = send.get_openlineage_facets_on_complete(None)
    (inp,), (out,) = sent.inputs, sent.outputs
    assert (inp.namespace, inp.name) == (file_ns, str(src.resolve()))
    assert (out.namespace, out.name) == (dest_ns, queue_name)
    got = _as_json(out)
    assert got["facets"]["version"]["datasetVersion"] == sha
    assert got["outputFacets"]["outputStatistics"]["size"] == size

    received = recv.get_openlineage_facets_on_complete(None)
    (inp,), (out,) = received.inputs, received.outputs
    assert (inp.namespace, inp.name) == (dest_ns, queue_name)
    assert (out.namespace, out.name) == (file_ns, str((tmp_path / "out" / "data.bin").resolve()))
    assert _as_json(inp)["inputFacets"]["inputStatistics"]["size"] == size
    assert _as_json(out)["facets"]["version"]["datasetVersion"] == sha


@pytest.mark.broker
def test_airflow_emits_the_lineage_of_a_send_and_a_receive(airflow_db: Path, params: BrokerParams, uri: str,
                                                           queue_name: str, tmp_path: Path) -> None:
    """Not the facet methods called by hand: the events Airflow's OpenLineage listener emits
    for real task runs, read back from a file transport."""
    from tests.helpers import ROOT, wait_for

    events_file = tmp_path / "openlineage.jsonl"
    src = make_file(tmp_path / "in" / "orders.bin", 200_001)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AIRFLOW_CONN_AMQSTREAM_DEFAULT": uri,
           "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps({"type": "file", "log_file_path": str(events_file),
                                                          "append": True}),
           "AIRFLOW__OPENLINEAGE__NAMESPACE": "amqs-test"}
    env.pop("AIRFLOW__OPENLINEAGE__DISABLED", None)
    # A process of its own: the provider reads its configuration once per process.
    script = ("import json, sys; from tests.integration.test_airflow import _load; from tests.helpers import ROOT; "
              "dr = _load(ROOT / 'tests' / 'dags', 'amqs_test_lineage').test(run_conf=json.loads(sys.argv[1])); "
              "sys.exit(0 if dr.state == 'success' else 1)")
    for i in range(3):
        make_file(tmp_path / "landing" / f"part-{i}.csv", 1000 + i)
    conf = {"path": str(src), "queue": queue_name, "out_dir": str(out), "stream_id": "ol-1",
            "glob": str(tmp_path / "landing" / "part-*.csv"), "many_queue": queue_name + ".many"}
    run = subprocess.run([sys.executable, "-c", script, json.dumps(conf)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]

    tasks = {"send", "receive", "send_many", "receive_many"}

    def events_of(kind: str) -> dict[str, dict[str, Any]] | None:
        if not events_file.exists():
            return None
        events = [json.loads(line) for line in events_file.read_text().splitlines() if line.strip()]
        found = {e["job"]["name"].rsplit(".", 1)[-1]: e for e in events
                 if e.get("eventType") == kind and e["job"]["name"].startswith("amqs_test_lineage.")}
        return found if tasks <= set(found) else None

    # The listener emits from a process of its own after each task; wait for every event.
    done = wait_for(lambda: events_of("COMPLETE"), 60, "COMPLETE events for every task in the OpenLineage file")
    started = wait_for(lambda: events_of("START"), 10, "START events for every task")
    host, port = params.hosts[0]
    file_ns, dest_ns = "file", f"amqstream://{host}:{port}"  # as the assets name them
    sha, size = sha256_file(src), src.stat().st_size
    send, receive = done["send"], done["receive"]
    assert [(d["namespace"], d["name"]) for d in send["inputs"]] == [(file_ns, str(src.resolve()))]
    assert [(d["namespace"], d["name"]) for d in send["outputs"]] == [(dest_ns, queue_name)]
    assert send["outputs"][0]["outputFacets"]["outputStatistics"]["size"] == size
    assert send["outputs"][0]["facets"]["version"]["datasetVersion"] == sha
    assert [(d["namespace"], d["name"]) for d in receive["inputs"]] == [(dest_ns, queue_name)]
    assert [(d["namespace"], d["name"]) for d in receive["outputs"]] == [(file_ns, str((out / "orders.bin").resolve()))]
    assert receive["outputs"][0]["facets"]["version"]["datasetVersion"] == sha
    assert send["job"]["namespace"] == receive["job"]["namespace"] == "amqs-test"
    # Known at start: the destination, and the file a one-file send reads.
    assert [(d["namespace"], d["name"]) for d in started["send"]["inputs"]] == [(file_ns, str(src.resolve()))]
    assert [(d["namespace"], d["name"]) for d in started["send"]["outputs"]] == [(dest_ns, queue_name)]
    assert [(d["namespace"], d["name"]) for d in started["receive"]["inputs"]] == [(dest_ns, queue_name)]
    # A glob: each file it matched, and the destination with their count and bytes.
    many = done["send_many"]
    assert sorted(d["name"] for d in many["inputs"]) == [
        str((tmp_path / "landing" / f"part-{i}.csv").resolve()) for i in range(3)]
    (dest,) = many["outputs"]
    assert (dest["namespace"], dest["name"]) == (dest_ns, queue_name + ".many")
    assert dest["outputFacets"]["outputStatistics"] == {**dest["outputFacets"]["outputStatistics"],
                                                        "size": 3003, "fileCount": 3}
    # Received in one task: the destination became each of the files.
    many_in = done["receive_many"]
    assert [(d["namespace"], d["name"]) for d in many_in["inputs"]] == [(dest_ns, queue_name + ".many")]
    assert sorted(d["name"] for d in many_in["outputs"]) == [
        str((out / "many" / f"part-{i}.csv").resolve()) for i in range(3)]
    assert all(d["namespace"] == file_ns for d in many_in["outputs"])
    assert [(d["namespace"], d["name"]) for d in started["receive_many"]["inputs"]] == [(dest_ns, queue_name + ".many")]
    assert params.password and all(params.password not in json.dumps(e) for e in (send, receive))


def test_a_send_of_thousands_of_files_reports_their_directory_not_each_file(tmp_path: Path) -> None:
    from airflow_provider_amqstream.operators.lineage import MAX_FILE_DATASETS, batch_lineage

    params = BrokerParams(hosts=(("broker.example", 61613),))
    files = [{"path": str(tmp_path / "landing" / f"d{i % 3}" / f"f{i}.csv"), "bytes": 10, "sha256": "ab",
              "destination": "/queue/landing"} for i in range(MAX_FILE_DATASETS + 1)]
    (inp,), (out,) = (lin := batch_lineage({"files": files}, params)).inputs, lin.outputs
    assert inp.name == str((tmp_path / "landing").resolve())
    stats = _as_json(inp)["inputFacets"]["inputStatistics"]
    assert (stats["size"], stats["fileCount"]) == (10 * len(files), len(files))
    assert (out.namespace, out.name) == ("amqstream://broker.example:61613", "/queue/landing")
    few = batch_lineage({"files": files[:3]}, params)
    assert [d.name for d in few.inputs] == [str(Path(f["path"]).resolve()) for f in files[:3]]
    assert not batch_lineage({"files": []}, params).inputs


def test_lineage_is_empty_before_a_result_exists(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.operators.stream import SendStreamOperator

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", uri)
    op = SendStreamOperator(task_id="s", path="/nope", destination="/queue/x", amqstream_conn_id=CONN_ID)
    lineage = op.get_openlineage_facets_on_complete(None)
    assert lineage.inputs == [] and lineage.outputs == []


class _XComOnly:
    """Stands in for a task instance: the method reads the sensor's XCom, nothing else."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def xcom_pull(self, task_ids: str, **_: Any) -> dict[str, Any] | None:
        return self.value if task_ids == "receive" else None


def test_spark_hand_off_reports_the_received_file_as_input(tmp_path: Path) -> None:
    from airflow_provider_amqstream.operators.spark import stream_to_parquet_operator

    op = stream_to_parquet_operator(task_id="to_parquet", sensor_task_id="receive", output_dir=str(tmp_path / "pq"))
    received = {"path": str(tmp_path / "got.csv"), "stream_id": "s-1", "sha256": "ab" * 32, "bytes": 1234}
    op.application_args = [a.replace("{{ ti.xcom_pull(task_ids='receive')['path'] }}", received["path"])
                           .replace("{{ ti.xcom_pull(task_ids='receive')['stream_id'] }}", "s-1")
                           for a in op.application_args]  # as rendered at run time
    lineage = op.get_openlineage_facets_on_complete(_XComOnly(received))
    (inp,), (out,) = lineage.inputs, lineage.outputs
    assert inp.name == received["path"] and inp.namespace == "file"
    assert _as_json(inp)["facets"]["version"]["datasetVersion"] == received["sha256"]
    assert out.name == str(tmp_path / "pq" / "s-1")
    assert "log4j2.configurationFile=file:" in op.conf["spark.driver.extraJavaOptions"]


def _spark_submit(tmp_path: Path, conf: dict[str, Any], tag: str) -> subprocess.CompletedProcess[str]:
    csv = tmp_path / "tiny.csv"
    csv.write_text("id,region,amount\n1,north,2.5\n2,south,3.0\n3,north,1.0\n")
    cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]"]
    for k, v in conf.items():
        cmd += ["--conf", f"{k}={v}"]
    cmd += [stream_to_parquet_job(), "--input", str(csv), "--output", str(tmp_path / f"pq-{tag}")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.spark
def test_spark_job_logs_warnings_and_one_summary_line(tmp_path: Path) -> None:
    quiet = _spark_submit(tmp_path, quiet_spark_conf(), "quiet")
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    lines = (quiet.stdout + quiet.stderr).splitlines()
    info = [line for line in lines if " INFO " in line]
    assert len(info) <= 5, info
    summary = [line for line in lines if line.startswith("stream_to_parquet: ")]
    assert len(summary) == 1 and "3 rows" in summary[0], lines[-20:]
    # The same job without our driver configuration, for comparison (and to show the
    # assertion above could fail).
    loud = _spark_submit(tmp_path, {}, "loud")
    assert loud.returncode == 0, loud.stderr[-3000:]
    loud_info = [line for line in (loud.stdout + loud.stderr).splitlines() if " INFO " in line]
    print(f"spark INFO lines: {len(loud_info)} by default, {len(info)} with quiet_spark_conf")
    assert len(loud_info) > 10 * max(len(info), 1)


@pytest.mark.spark
def test_spark_job_converts_every_file_of_a_directory_of_manifests(tmp_path: Path) -> None:
    """--manifest DIR: every batch manifest in a receiver's output directory, one application."""
    received = tmp_path / "received"
    batches = {"b1": {"a.csv": "id,v\n1,x\n2,y\n", "sub/b.csv": "id,v\n3,z\n"}, "b2": {"c.csv": "id,v\n4,w\n"}}
    for batch, files in batches.items():
        rows = []
        for rel, text in files.items():
            (received / rel).parent.mkdir(parents=True, exist_ok=True)
            (received / rel).write_text(text)
            rows.append(json.dumps({"path": rel, "bytes": len(text.encode()), "sha256": sha256_file(received / rel)}))
        (received / f"{batch}.manifest.jsonl").write_text("\n".join(rows) + "\n")
    out = tmp_path / "pq"
    cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[1]"]
    for k, v in quiet_spark_conf().items():
        cmd += ["--conf", f"{k}={v}"]
    run = subprocess.run([*cmd, stream_to_parquet_job(), "--manifest", str(received), "--output", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "_amqstream_batch_summary.json").read_text())
    assert (summary["files"], summary["rows"]) == (3, 4), summary
    for rel in ("a", "sub/b", "c"):
        assert list((out / rel).glob("*.parquet")), rel


@pytest.mark.spark
def test_spark_job_converts_without_caching_its_input(tmp_path: Path) -> None:
    """A file larger than the memory Spark may cache in converts without a
    "Not enough space to cache" line per partition (the job cached its whole input to count
    it). The driver's storage memory is made tiny here so that 20 MB is "larger"; the 2.6 GiB
    CSV of the report hit the same with the defaults."""
    job = Path(stream_to_parquet_job()).read_text()
    code = "\n".join(line.split("#")[0] for line in job.splitlines())
    assert ".cache(" not in code and ".persist(" not in code
    import random

    csv = tmp_path / "wide.csv"
    rnd = random.Random(3)
    with csv.open("w") as fh:
        fh.write("id,region,amount,note\n")
        for i in range(300_000):
            fh.write(f"{i},{rnd.choice(['north', 'south', 'east'])},{rnd.uniform(0, 999):.2f},"
                     f"note-{rnd.randrange(10**9):09d}-{rnd.randrange(10**9):09d}\n")
    cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", "local[2]", "--driver-memory", "512m",
           "--conf", "spark.memory.fraction=0.02"]
    for k, v in quiet_spark_conf().items():
        cmd += ["--conf", f"{k}={v}"]
    run = subprocess.run([*cmd, stream_to_parquet_job(), "--input", str(csv), "--output", str(tmp_path / "pq")],
                         capture_output=True, text=True, timeout=600)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "Not enough space to cache" not in log and "RejectedExecutionException" not in log, log[-3000:]
    summary = json.loads((tmp_path / "pq" / "_amqstream_summary.json").read_text())
    assert summary["rows"] == 300_000
    print(f"\nspark output of a {csv.stat().st_size / 2**20:.0f} MiB conversion: {len(log.splitlines())} lines")


@pytest.mark.spark
def test_the_task_log_of_a_conversion_holds_the_job_not_spark_start_up_noise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's own task log lines (what the hook logs of spark-submit's
    output), for the noise Spark prints at start-up: the incubator module, the loopback host
    name and SPARK_LOCAL_IP, pandas' version, the native Hadoop library."""
    from airflow_provider_amqstream.operators.spark import APP_NAME, stream_to_parquet_operator

    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
        {"conn_type": "spark", "host": "local[1]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}))
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)  # as on a machine set up by nobody
    csv = tmp_path / "tiny.csv"
    csv.write_text("id,region,amount\n1,north,2.5\n2,south,3.0\n")
    op = stream_to_parquet_operator(task_id="to_parquet", sensor_task_id="receive", output_dir=str(tmp_path / "pq"))
    assert op.name == APP_NAME
    op.name = "amqstream:amqs_test.to_parquet"  # as rendered in a run
    op.application_args = ["--input", str(csv), "--output", str(tmp_path / "pq" / "s-1"), "--format", "auto"]
    from structlog.testing import capture_logs

    # The hook logs each line spark-submit prints through structlog, as in a task.
    with capture_logs() as logs:
        op.execute({})
    records = [str(e.get("event")) for e in logs]
    text = "\n".join(records)
    assert "stream_to_parquet: " in text and "2 rows" in text, text
    assert "--name amqstream:amqs_test.to_parquet" in text, text
    for noise in ("incubator modules", "SPARK_LOCAL_IP", "resolves to a loopback address", "pandas",
                  "NativeCodeLoader", " INFO "):
        assert noise not in text, f"{noise!r} in the task log:\n{text}"
    print(f"\ntask log of a conversion: {len(records)} lines")


@pytest.mark.spark
@pytest.mark.broker
def test_a_sealed_file_goes_through_the_key_holder_to_spark(uri: str, queue_name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark hand-off of a sealed stream: the offer names no file, the sensor's keys give it
    back its real name (and so its format), and the job converts what was sent."""
    import jinja2

    from airflow_provider_amqstream.engine.keys import new_key_file
    from airflow_provider_amqstream.operators.spark import stream_to_parquet_operator
    from airflow_provider_amqstream.operators.stream import SendStreamOperator
    from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", uri)
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_DEFAULT", json.dumps(
        {"conn_type": "spark", "host": "local[1]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}))
    key = tmp_path / "landing.key"
    recipient = new_key_file(key).recipient
    src = tmp_path / "in" / "sales.csv"
    src.parent.mkdir()
    src.write_text("id,region,amount\n1,north,2.5\n2,south,3.0\n3,north,1.0\n")
    sent = SendStreamOperator(task_id="send", path=str(src), destination=queue_name, amqstream_conn_id=CONN_ID,
                              seal_to=[recipient]).execute({})
    assert "sales" not in sent["stream_id"]
    got = StreamCompleteSensor(task_id="receive", source=queue_name, out_dir=str(tmp_path / "out"),
                               stream_id=sent["stream_id"], amqstream_conn_id=CONN_ID, keys=[str(key)]).poke({})
    assert got.is_done and Path(got.xcom_value["path"]).name == "sales.csv"
    op = stream_to_parquet_operator(task_id="to_parquet", sensor_task_id="receive", output_dir=str(tmp_path / "pq"))
    op.application_args = [jinja2.Template(a).render(ti=_XComOnly(got.xcom_value)) for a in op.application_args]
    op.execute({})
    summary = json.loads((tmp_path / "pq" / sent["stream_id"] / "_amqstream_summary.json").read_text())
    assert summary["rows"] == 3 and summary["source_sha256"] == sha256_file(src) == got.xcom_value["sha256"]
