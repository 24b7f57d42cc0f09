"""The examples in a real deployment, started the way users start it (``make airflow``
runs scripts/airflow.sh): api-server, scheduler, dag-processor, triggerer and a log server
(LocalExecutor, SQLite) on private loopback ports, the embedded broker, Spark in local mode.
Runs are triggered and read through the public REST API; the connection form, its Test
button, a running sensor's log and a DAG's docs are checked in headless Chromium.

It listens on loopback only, keeps every file with a secret from other users,
documents its DAGs, hands another shell its connections, and a SIGTERM to ``make`` (the
fixture's teardown) stops all of it.

One deployment serves the module (starting it costs ~30-60 s here); each test triggers its
own runs and waits on them, so none depends on another having run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from example_support import write_sample_csv

from airflow_provider_amqstream.engine import SendOptions
from tests.deployment import Deployment, json_line
from tests.helpers import ROOT, make_file, sha256_file, wait_for

pytestmark = [pytest.mark.deployment, pytest.mark.broker, pytest.mark.spark]

EXAMPLES = ROOT / "dags" / "examples"
SCHEDULED = ("amqstream_bulk_landing", "amqstream_site_a_producer", "amqstream_site_b_consumer")
QUEUE = "/queue/amqstream.examples"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    home = tmp_path_factory.mktemp("deployment")
    dags = home / "dags"
    dags.mkdir()
    for dag_file in [*EXAMPLES.glob("*.py"), EXAMPLES / ".airflowignore", ROOT / "tests" / "dags" / "deploy_dags.py"]:
        (dags / dag_file.name).symlink_to(dag_file)
    # One file already waits in the landing zone, so the first scheduled bulk run moves just
    # it (an empty landing zone is seeded with three, which is three Spark jobs).
    write_sample_csv(home / "examples" / "landing" / "arrived-0.csv", rows=2_000, seed=10)
    d = Deployment(home, dags)
    try:
        d.wait_ready()
        print(f"\ndeployment ready in {d.startup_seconds:.1f}s at {d.base}")
        yield d
    finally:
        seconds = d.stop()  # SIGTERM to make, the top process
        print(f"\ndeployment stopped in {seconds:.1f}s")
        # Everything it started is gone: components, LocalExecutor workers, tasks, spark-submit, broker.
        d.wait_all_exited(30, "SIGTERM")
        assert "airflow.sh: stopped" in d.text(), d.text()[-2000:]


def _broker_uri(d: Deployment) -> str:
    env = {**os.environ, "AMQSTREAM_BROKER_DIR": str(d.home / "broker")}
    out = subprocess.run([sys.executable, "-m", "airflow_provider_amqstream.cli", "broker", "uri"], check=True,
                         capture_output=True, text=True, env=env)
    return out.stdout.strip()


def _send(d: Deployment, path: Path, destination: str, *extra: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "airflow_provider_amqstream.cli", "send", str(path), "--to",
                          destination, "--conn", _broker_uri(d), "--json", *extra], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "AMQSTREAM_STATE_DIR": str(d.home / "cli-state")})
    assert out.returncode == 0, out.stderr
    return json_line(out.stdout)


def _scheduled_run(d: Deployment, dag_id: str) -> str:
    runs = wait_for(lambda: [r for r in d.runs(dag_id) if r["run_type"] == "scheduled"], 120,
                    f"a scheduled run of {dag_id}", interval=1)
    return runs[0]["dag_run_id"]


def test_make_airflow_serves_the_examples_unpaused_and_prints_the_login(deployment: Deployment) -> None:
    d = deployment
    assert f"UI          {d.base}   user admin, password " in d.text()
    assert f"in another shell:  source {d.home / 'env.sh'}" in d.text()
    r = __import__("httpx").post(f"{d.base}/auth/token", json={"username": "admin", "password": "wrong"}, timeout=30)
    assert r.status_code == 401
    health = d.api("GET", "/monitor/health")
    assert health["scheduler"]["status"] == "healthy", health
    assert health["triggerer"]["status"] == "healthy", health
    assert health["dag_processor"]["status"] == "healthy", health
    dags = wait_for(lambda: {x["dag_id"]: x for x in d.api("GET", "/dags", params={"limit": 100})["dags"]
                             if x["dag_id"].startswith("amqstream_")} or None, 60, "the example DAGs", interval=1)
    assert set(dags) == {p.stem for p in EXAMPLES.glob("amqstream_*.py")}
    assert not any(x["is_paused"] for x in dags.values())
    assert d.api("GET", "/importErrors")["total_entries"] == 0
    conn = d.api("POST", "/connections/test", json={"connection_id": "probe", "conn_type": "amqstream",
                                                    **_conn_fields(_broker_uri(d))})
    assert conn["status"] is True and conn["message"].startswith("Connected to stomp://127.0.0.1:"), conn


def test_scheduled_examples_succeed_twice_and_the_deferred_sensor_resumes_in_the_triggerer(
        deployment: Deployment) -> None:
    d = deployment
    # First runs: the ones the scheduler made when the DAGs appeared (unpaused at creation).
    first = {dag_id: _scheduled_run(d, dag_id) for dag_id in SCHEDULED}
    for dag_id, run_id in first.items():
        d.wait_run(dag_id, run_id, timeout=300)
    landing = d.home / "examples" / "landing"
    assert not (landing / "arrived-0.csv").exists(), "the bulk example left its sent file in the landing zone"

    # Second bulk run: a new file arrived; the run moves only it, and the file sent before
    # does not hold it up (stream ids no longer repeat).
    write_sample_csv(landing / "arrived-1.csv", rows=2_000, seed=11)
    bulk2 = d.trigger("amqstream_bulk_landing")
    d.wait_run("amqstream_bulk_landing", bulk2)
    sent = d.xcom("amqstream_bulk_landing", bulk2, "send")  # one task for the whole landing directory
    [only] = [f for f in sent["files"] if f["status"] != "already_sent"]
    assert only["name"] == "arrived-1.csv" and not sent["failed"], sent
    # It landed in the run's dated directory; the landing asset is their parent, and its event
    # names the day, the file count and the manifest.
    [landed] = (d.home / "examples" / "received" / "bulk").glob("*/arrived-1.csv")
    assert sha256_file(landed) == only["sha256"]
    [event] = _events_of(d, f"file://{d.home / 'examples' / 'received' / 'bulk'}", "amqstream_bulk_landing", bulk2)
    assert event["extra"]["out_dir"] == str(landed.parent) and event["extra"]["files"] == 1, event
    assert event["extra"]["manifest"] == d.xcom("amqstream_bulk_landing", bulk2, "receive")["manifest"], event

    # Second site run: the consumer first, so its sensor must wait for the producer in the
    # triggerer, then the producer.
    d.trigger("amqstream_site_b_consumer")

    def deferred_site_b_run() -> str | None:
        # Mine, or a newer scheduled one (every 5 min) that came first: max_active_runs is 1.
        for run in d.runs("amqstream_site_b_consumer"):
            mine = run["dag_run_id"] != first["amqstream_site_b_consumer"] and run["state"] == "running"
            if mine and d.ti("amqstream_site_b_consumer", run["dag_run_id"], "receive")["state"] == "deferred":
                return run["dag_run_id"]
        return None

    b2 = wait_for(deferred_site_b_run, 120, "site B's sensor to defer", interval=0.5)
    ti = d.ti("amqstream_site_b_consumer", b2, "receive")
    assert ti["trigger"] and ti["trigger"]["classpath"].endswith("StreamOfferTrigger"), ti
    wait_for(lambda: d.ti("amqstream_site_b_consumer", b2, "receive")["triggerer_job"], 60,
             "a triggerer to take the trigger", interval=0.5)
    a2 = d.trigger("amqstream_site_a_producer")
    d.wait_run("amqstream_site_a_producer", a2)
    d.wait_run("amqstream_site_b_consumer", b2)
    receive = d.ti("amqstream_site_b_consumer", b2, "receive")
    got = d.xcom("amqstream_site_b_consumer", b2, "receive")
    assert got["stream_id"] == d.xcom("amqstream_site_a_producer", a2, "send", map_index=0)["stream_id"]
    log = d.log("amqstream_site_b_consumer", b2, "receive", 1)
    if receive["try_number"] != 1:
        # Airflow 3.3 (apache/airflow#72716, #71580): a stale "success" from the try's exit
        # on defer, read after the resumed try is running, fails that try. The resumed try
        # did receive the stream; the retry must return it (its claim), not wait for another.
        assert "Failed to report terminal task state" in log, f"the sensor was retried instead of resumed: {log}"
        assert "was received by an earlier try of this task" in d.log("amqstream_site_b_consumer", b2, "receive",
                                                                       receive["try_number"])
    assert "Pausing task as DEFERRED" in log
    assert re.search(r"waiting for .* to be offered on /queue/amqstream\.examples\.sites", log), log[-3000:]
    assert f"received stream {got['stream_id']}" in log


def test_one_file_example_succeeds(deployment: Deployment) -> None:
    # Not scheduled (triggered by hand with a path): one run here.
    d = deployment
    conf = {"path": str(d.home / "one-file.csv"), "rows": 3_000}
    run_id = d.trigger("amqstream_one_file", conf)
    d.wait_run("amqstream_one_file", run_id)
    report = d.xcom("amqstream_one_file", run_id, "check")
    assert report["rows"] == 3_000 and report["sha256"] == sha256_file(Path(conf["path"]))
    assert Path(report["parquet"], "_amqstream_summary.json").is_file()


def _asset(d: Deployment, uri: str) -> dict[str, Any]:
    """The asset of ``uri`` once the API lists it (the scheduler activates an asset first
    made by an event through an alias on its next look at the assets, within a minute)."""
    return wait_for(lambda: next((a for a in d.api("GET", "/assets", params={"uri_pattern": uri, "limit": 100})
                                  ["assets"] if a["uri"] == uri), None), 180, f"asset {uri} in /api/v2/assets",
                    interval=2)


def _events_of(d: Deployment, uri: str, dag_id: str, run_id: str) -> list[dict[str, Any]]:
    """The events of asset ``uri`` that a run produced, through /api/v2/assets/events."""
    asset = _asset(d, uri)
    return d.api("GET", "/assets/events", params={"asset_id": asset["id"], "source_dag_id": dag_id,
                                                  "source_run_id": run_id, "limit": 100})["asset_events"]


def _received(d: Deployment, run_id: str) -> None:
    """Wait until example 1's run ``run_id`` has sent and received its file (its Spark task
    may still run: it takes minutes on a loaded machine)."""
    def state() -> str | None:
        s = d.ti("amqstream_one_file", run_id, "receive")["state"]
        assert s not in ("failed", "upstream_failed"), d.describe("amqstream_one_file", run_id)
        return s if s == "success" else None

    wait_for(state, 600, f"example 1's run {run_id} to receive its file", interval=2)


def test_the_examples_assets_and_their_events_through_the_api(deployment: Deployment) -> None:
    """Example 1 as a user browses its assets: the destination the send produced
    (``amqstream://`` + the connection's id), the landing directory the receive produced
    (no host, one asset however many files) and the Parquet directory Spark produced, each
    with one event from this run."""
    d = deployment
    conf = {"path": str(d.home / "assets.csv"), "rows": 1_000}
    run_id = d.trigger("amqstream_one_file", conf)
    _received(d, run_id)
    sent = d.xcom("amqstream_one_file", run_id, "send")
    examples = d.home / "examples"
    want = {f"amqstream://amqstream_default{QUEUE}.one": "send", f"file://{examples / 'received' / 'one'}": "receive",
            f"file://{examples / 'parquet' / 'one'}": "to_parquet"}
    for uri, task in want.items():
        if task == "to_parquet":
            d.wait_run("amqstream_one_file", run_id, timeout=900)
        [event] = _events_of(d, uri, "amqstream_one_file", run_id)
        assert event["source_task_id"] == task, event
        if task != "to_parquet":
            assert event["extra"]["stream_id"] == sent["stream_id"] and event["extra"]["sha256"] == sent["sha256"]
        else:
            assert event["extra"]["rows"] == 1_000 and event["extra"]["output"].endswith(sent["stream_id"]), event
    # No asset of the machine's name, none per received file.
    names = [a["uri"] for a in d.api("GET", "/assets", params={"limit": 1000})["assets"]]
    assert not [u for u in names if u.startswith("file://") and not u.startswith("file:///")], names
    assert not [u for u in names if u.endswith(".csv")], names


def _event_runs_received(d: Deployment, before: set[str]) -> dict[str, list[str]]:
    """stream id -> the new event-driven runs (not in ``before``) whose receive took it, from XCom."""
    got: dict[str, list[str]] = {}
    for run in d.runs("amqstream_event_driven"):
        if run["dag_run_id"] in before:
            continue
        for t in d.task_instances("amqstream_event_driven", run["dag_run_id"]):
            if t["task_id"] == "receive" and t["state"] == "success":
                x = d.xcom("amqstream_event_driven", run["dag_run_id"], "receive", map_index=t["map_index"])
                got.setdefault(x["stream_id"], []).append(run["dag_run_id"])
    return got


def _offer_events(d: Deployment, tmp_path: Path, *numbers: int) -> dict[str, str]:
    """Offer one atomic stream per number, back to back from this process: stream id -> sha256."""
    from airflow_provider_amqstream.engine import send_file
    from airflow_provider_amqstream.hooks.connection import params_from_uri

    params = params_from_uri(_broker_uri(d))
    files = {i: write_sample_csv(tmp_path / f"event-{i}.csv", rows=1_000, seed=20 + i) for i in numbers}
    results = [send_file(params, path, QUEUE + ".events", SendOptions(mode="atomic"),
                         stream_id=f"evt-{tmp_path.name[-16:]}-{i}")
               for i, path in files.items()]
    return {r.stream_id: r.sha256 for r in results}


def test_event_driven_example_runs_once_per_offered_stream(deployment: Deployment, tmp_path: Path) -> None:
    d = deployment
    before = {r["dag_run_id"] for r in d.runs("amqstream_event_driven")}
    offered = {}
    for i in range(2):  # one after the other: see the next test for streams offered together
        [(sid, digest)] = _offer_events(d, tmp_path, i).items()
        offered[sid] = digest
        wait_for(lambda sid=sid: sid in _event_runs_received(d, before), 240,
                 f"an event-driven run to receive {sid}", interval=2)
    got = _event_runs_received(d, before)
    assert {sid: len(got[sid]) for sid in offered} == {sid: 1 for sid in offered}, got
    assert got[list(offered)[0]] != got[list(offered)[1]], "one run for two streams offered apart"
    runs = [r for r in d.runs("amqstream_event_driven") if r["dag_run_id"] not in before]
    assert runs and all(r["run_type"] == "asset_triggered" for r in runs), runs
    for run_id in {r for rs in got.values() for r in rs}:  # each run goes on to Spark and succeeds
        d.wait_run("amqstream_event_driven", run_id)
    for sid, digest in offered.items():
        summary = d.home / "examples" / "parquet" / "events" / sid / "_amqstream_summary.json"
        assert summary.is_file() and digest in summary.read_text()


def test_event_driven_streams_offered_together_are_all_received(deployment: Deployment, tmp_path: Path) -> None:
    d = deployment
    before = {r["dag_run_id"] for r in d.runs("amqstream_event_driven")}
    offered = _offer_events(d, tmp_path, 0, 1)
    offered_ids = sorted(offered)
    wait_for(lambda: set(_event_runs_received(d, before)) & set(offered), 240,
             "an event-driven run to receive one of two streams offered together", interval=2)
    # Its event fires once the first stream is taken (the trigger paces them: Airflow 3.3
    # would fold two events arriving together into one run and leave the second waiting).
    wait_for(lambda: set(_event_runs_received(d, before)) >= set(offered), 120,
             "the second of two streams offered together to be received", interval=2)
    runs = _event_runs_received(d, before)
    assert all(len(runs[sid]) == 1 for sid in offered), runs
    assert runs[offered_ids[0]] != runs[offered_ids[1]], "both streams were received by one run"


def test_killed_send_is_retried_by_the_scheduler_and_resumes(deployment: Deployment, tmp_path: Path) -> None:
    d = deployment
    src = make_file(tmp_path / "big.bin", 48 * 2**20 + 123, seed=3)
    stream_id = f"kill-{tmp_path.name[-16:]}"
    run_id = d.trigger("amqs_deploy_slow_transfer", {"path": str(src), "queue": f"/queue/deploy.kill.{stream_id}",
                                                     "out_dir": str(tmp_path / "in"), "stream_id": stream_id})
    # Mid-send: the broker has confirmed chunks (resume_offset published) and the task runs.
    offset = wait_for(lambda: (x := d.xcom("amqs_deploy_slow_transfer", run_id, "send", key="resume_offset"))
                      and x["offset"] > 0 and x["offset"], 120, "the send to publish a resume offset", interval=0.3)
    ti = d.ti("amqs_deploy_slow_transfer", run_id, "send")
    assert ti["state"] == "running" and ti["try_number"] == 1 and ti["pid"], ti
    assert d.owns(ti["pid"]), f"pid {ti['pid']} is not a process of this deployment"
    os.kill(ti["pid"], signal.SIGKILL)
    d.wait_run("amqs_deploy_slow_transfer", run_id, timeout=300)
    ti = d.ti("amqs_deploy_slow_transfer", run_id, "send")
    assert ti["try_number"] == 2, ti
    tries = d.api("GET", f"/dags/amqs_deploy_slow_transfer/dagRuns/{run_id}/taskInstances/send/tries")
    assert tries["task_instances"][0]["state"] in ("failed", "up_for_retry"), tries
    result = d.xcom("amqs_deploy_slow_transfer", run_id, "send")
    assert result["resumed_from"] >= offset > 0, (result, offset)
    assert result["bytes_transferred"] < src.stat().st_size - offset + 1, result
    got = d.xcom("amqs_deploy_slow_transfer", run_id, "receive")
    assert got["sha256"] == sha256_file(src) == result["sha256"]


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _program(cmd: str) -> str:
    """The program's name in a command line; a process that exited while it was sampled
    leaves an empty one."""
    return cmd.split()[0].rsplit("/", 1)[-1] if cmd.split() else "(exited)"


def test_everything_it_started_listened_on_loopback_only(deployment: Deployment) -> None:
    """Every TCP listener of every process of the deployment, sampled each
    second since it was ready (Spark jobs among them): nothing on 0.0.0.0,
    [::] or an external address."""
    d = deployment
    # Spark's driver must have listened while sampled, whichever tests ran before: the
    # scheduler's first run of the bulk example submits a Spark job.
    d.wait_run("amqstream_bulk_landing", _scheduled_run(d, "amqstream_bulk_landing"), timeout=300)
    seen = d.listeners | set(d.listening())
    wide = sorted(x for x in seen if x[0] not in LOOPBACK)
    assert not wide, "\n".join(f"{a}:{port} pid {pid} {cmd}" for a, port, pid, cmd in wide)
    ports = {port for _, port, _, _ in seen}
    assert d.port in ports and _conn_fields(_broker_uri(d))["port"] in ports, sorted(seen)
    assert any("serve-logs" in cmd for *_, cmd in seen), sorted(seen)  # ours, not Airflow's on every interface
    assert not ports & {8793, 8794}, sorted(seen)
    assert any("SparkSubmit" in cmd or "pyspark" in cmd for *_, cmd in seen), "no Spark driver was seen listening"
    print(f"\nlisteners seen: {len(seen)}, all on loopback: "
          f"{sorted({(a, p, _program(cmd)) for a, p, _, cmd in seen})}")


def test_the_dags_explain_themselves_through_the_api(deployment: Deployment) -> None:
    """Description, docs and parameter descriptions as the UI gets them; the
    provider's documentation URL."""
    d = deployment
    for path in sorted(EXAMPLES.glob("amqstream_*.py")):
        details = d.api("GET", f"/dags/{path.stem}/details")
        assert details["description"], path.stem
        assert "**Run it:**" in (details["doc_md"] or ""), path.stem
        for name, param in (details["params"] or {}).items():
            assert param.get("description"), f"{path.stem}: parameter {name} has no description"
    params = d.api("GET", "/dags/amqstream_one_file/details")["params"]
    assert set(params) == {"path", "rows"} and params["rows"]["schema"]["type"] == "integer", params
    assert d.api("GET", "/dags/amqstream_event_driven/details")["params"]["stream_ids"]["description"]
    from importlib.metadata import distribution

    [ours] = [x for x in d.api("GET", "/providers")["providers"] if x["package_name"] == "airflow-provider-amqstream"]
    installed = dict(u.split(", ", 1) for u in distribution("airflow-provider-amqstream").metadata.get_all(
        "Project-URL") or []).get("Documentation")
    assert ours["documentation_url"] == installed and installed.startswith("https://"), ours


def test_another_shell_gets_the_deployment_from_env_sh(deployment: Deployment) -> None:
    """One line to paste, and the CLI finds the deployment's broker without
    Airflow's metadata database."""
    d = deployment
    env_file = d.home / "env.sh"
    assert env_file.stat().st_mode & 0o777 == 0o600
    # A clean environment, as a new terminal has (PYTHONPATH: this checkout, as the deployment's own).
    shell = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    script = f"source {env_file} && amqstream test-connection && echo AIRFLOW_HOME=$AIRFLOW_HOME"
    t0 = time.monotonic()
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=shell, timeout=120)
    took = time.monotonic() - t0
    assert run.returncode == 0, run.stderr
    assert f"ok: connected to stomp://127.0.0.1:{_conn_fields(_broker_uri(d))['port']}" in run.stdout
    assert f"AIRFLOW_HOME={d.airflow_home}" in run.stdout
    assert "Skipping masking" not in run.stdout + run.stderr
    print(f"\namqstream test-connection from another shell: {took:.2f}s")


def test_another_shell_lists_every_example_destination_without_naming_one(deployment: Deployment) -> None:
    """The deployment's amqstream_default names the examples' destinations (its extra), so
    `streams ls` without --from shows each of them."""
    d = deployment
    shell = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    script = f"source {d.home / 'env.sh'} && amqstream streams ls --json --rate-window 0"
    run = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=shell, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [json.loads(line)["destination"] for line in run.stdout.splitlines()] == [
        f"{QUEUE}{q}" for q in (".one", ".bulk", ".sites", ".events")]


def _secrets(d: Deployment) -> list[str]:
    broker = json.loads((d.home / "broker" / "credentials.json").read_text())["password"]
    return [broker, d.password]


def test_no_file_with_a_password_is_readable_by_others(deployment: Deployment) -> None:
    """The deployment's directory is its owner's; every file holding the
    broker's or the admin's password, and everything the deployment wrote, is mode 0600."""
    d = deployment
    secrets = [s.encode() for s in _secrets(d)]
    assert d.home.stat().st_mode & 0o077 == 0
    holders, readable = [], []
    for path in d.home.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        mode = path.stat().st_mode & 0o777
        if mode & 0o077 and path.relative_to(d.home).parts[0] in ("logs", "airflow", "broker", "env.sh", "spark-conf"):
            readable.append(f"{oct(mode)} {path}")
        if path.stat().st_size < 64 * 2**20 and any(s in path.read_bytes() for s in secrets):
            holders.append(path.relative_to(d.home))
            if mode & 0o077:
                readable.append(f"{oct(mode)} {path} (holds a password)")
    assert not readable, "\n".join(readable)
    for expected in ("env.sh", "logs/broker-start.log", "broker/credentials.json"):
        assert Path(expected) in holders, (expected, holders)
    print(f"\nfiles holding a password, all 0600: {sorted(map(str, holders))}")


# ---------------------------------------------------------------- the UI, in headless Chromium


def _chromium() -> str | None:
    for path in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if path and os.access(path, os.X_OK):
            return path
    return None


def _conn_fields(uri: str) -> dict[str, Any]:
    from urllib.parse import urlsplit

    u = urlsplit(uri)
    return {"host": u.hostname, "port": u.port, "login": u.username, "password": u.password}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium: apt-get install chromium (scripts/setup.sh does)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Any, deployment: Deployment, tmp_path: Path) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    pg.goto(deployment.base + "/")
    pg.get_by_label("Username").fill("admin")
    pg.get_by_label("Password").fill(deployment.password)
    pg.get_by_role("button", name="Sign in").click()
    pg.wait_for_url(deployment.base + "/")
    try:
        yield pg
    finally:
        pg.screenshot(path=str(tmp_path / "last.png"))
        context.close()


FIELDS = {  # label: what the form must show in the field (defaults), or None
    "Failover brokers": "", "TLS": None, "CA file": "", "Client certificate": "", "Client key": "",
    "Check hostname": None, "Heart-beat (ms)": "10000", "Chunk size (bytes)": "1048576", "Compression": None,
    "Window (chunks)": "16", "Connect timeout (s)": "15", "Receipt timeout (s)": "60",
    "Network of brokers": None, "Virtual host": None, "Destinations": None, "Receivers' directories": None,
    "Quarantine queue": None,
}
# Screenshots are test artifacts: kept after the run in build/ui-screenshots (or the directory
# this variable names; docs/ to refresh the ones the README shows).
KEEP = os.environ.get("AMQSTREAM_UI_SCREENSHOTS") or str(ROOT / "build" / "ui-screenshots")


def _shot(pg: Any, tmp_path: Path, name: str, *, full_page: bool = False) -> None:
    pg.screenshot(path=str(tmp_path / name), full_page=full_page)
    Path(KEEP).mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(Path(KEEP) / name), full_page=full_page)


def test_connection_form_shows_our_fields_and_test_answers(page: Any, deployment: Deployment, tmp_path: Path) -> None:
    d, pg = deployment, page
    pg.goto(d.base + "/connections")
    pg.get_by_role("button", name="Add Connection").click()
    dlg = pg.get_by_role("dialog")
    dlg.get_by_role("combobox").fill("amqstream")
    pg.keyboard.press("Enter")
    assert dlg.get_by_text("ActiveMQ Stream (STOMP)", exact=True).is_visible()

    # Standard fields: relabelled, with placeholders; schema hidden.
    for name, label, placeholder in (("host", "Broker host(s)", "127.0.0.1 or mq1.example.com,mq2.example.com"),
                                     ("port", "STOMP port", "61613"), ("login", "User", "amqstream")):
        field = dlg.locator(f"input[name={name}]")
        assert field.get_attribute("placeholder") == placeholder
        assert dlg.locator(f"label[for='{field.get_attribute('id')}']").inner_text().strip() == label
    assert dlg.locator("input[name=schema]").count() == 0
    dlg.locator("input[name=connection_id]").fill("amq_ui_good")
    uri = _broker_uri(d)
    for name, value in _conn_fields(uri).items():
        dlg.locator(f"input[name={name}]").fill(str(value))
    _shot(pg, tmp_path, "ui-connection-standard.png")

    # Extra fields: every one with its label, help text and default.
    dlg.get_by_role("button", name="Extra Fields", exact=True).click()
    text = dlg.inner_text()
    for label, default in FIELDS.items():
        assert re.search(rf"^{re.escape(label)}$", text, re.M), f"no field labelled {label!r} in the form"
        key = {"Failover brokers": "hosts", "Heart-beat (ms)": "heartbeat_ms", "Chunk size (bytes)": "chunk_size",
               "Window (chunks)": "window", "Connect timeout (s)": "connect_timeout",
               "Receipt timeout (s)": "receipt_timeout", "CA file": "ca_file", "Client certificate": "cert_file",
               "Client key": "key_file"}.get(label)
        if key:
            assert dlg.locator(f"[name=element_{key}]").input_value() == default, label
    assert "Brokers tried in order, as comma-separated host:port" in text
    # Free-text extras carry a hint and suggest an example (the form's placeholder for them).
    hosts = dlg.locator("[name=element_hosts]")
    assert hosts.get_attribute("placeholder"), "no hint on the failover field"
    assert dlg.locator(f"datalist#{hosts.get_attribute('list')} option").first.get_attribute("value") == \
        "mq1.example.com:61613,mq2.example.com:61613"
    # Compression shows its default (auto, as for a connection without the key), never "null".
    assert "auto (compress chunks that shrink: CSV, JSON, logs)" in text and "null" not in text.lower().split()
    for name in ("ca_file", "cert_file", "key_file"):  # a path to type, no options to "start typing" for
        assert dlg.locator(f"[name=element_{name}]").get_attribute("placeholder") is None, name
    pg.set_viewport_size({"width": 1400, "height": 2100})  # the whole dialog in one picture
    _shot(pg, tmp_path, "ui-connection-form.png")
    pg.set_viewport_size({"width": 1400, "height": 1000})
    dlg.get_by_role("button", name="Save").click()
    wait_for(lambda: any(c["connection_id"] == "amq_ui_good" for c in d.api("GET", "/connections")["connections"]),
             30, "the saved connection")
    saved = d.api("GET", "/connections/amq_ui_good")
    assert saved["conn_type"] == "amqstream" and saved["port"] == _conn_fields(uri)["port"]
    # The form's default is saved as it reads (its "none" is saved as null: tests/unit/airflow).
    assert json.loads(saved["extra"])["compression"] == "auto", saved["extra"]

    # A connection with a wrong password, made through the API.
    d.api("POST", "/connections", json={"connection_id": "amq_ui_bad_password", "conn_type": "amqstream",
                                         **{**_conn_fields(uri), "password": "not-the-password"}})

    def test_button(conn_id: str) -> str:
        pg.goto(d.base + "/connections")
        row = pg.get_by_role("row").filter(has_text=conn_id)
        row.get_by_role("button", name="Test Connection").click()
        toast = pg.locator("[data-scope=toast][data-part=root]").filter(has_text=re.compile("Connect|connect"))
        toast.first.wait_for()
        return toast.first.inner_text()

    good = test_button("amq_ui_good")
    assert f"Connected to stomp://127.0.0.1:{_conn_fields(uri)['port']} and received a receipt" in good, good
    _shot(pg, tmp_path, "ui-connection-test-good.png")
    bad = test_button("amq_ui_bad_password")
    assert "Connected to" not in bad and re.search(r"password|credential|authenticat|login", bad, re.I), bad
    _shot(pg, tmp_path, "ui-connection-test-bad.png")


def test_running_sensor_log_shows_progress_in_the_ui(page: Any, deployment: Deployment, tmp_path: Path) -> None:
    from airflow_provider_amqstream.engine import send_file
    from airflow_provider_amqstream.hooks.connection import params_from_uri

    d, pg = deployment, page
    src = make_file(tmp_path / "held.bin", 8 * 2**20, seed=4)
    size = src.stat().st_size
    stream_id = f"ui-{tmp_path.name[-16:]}"
    queue = f"/queue/deploy.ui.{stream_id}"
    run_id = d.trigger("amqs_deploy_receive", {"path": "", "queue": queue, "out_dir": str(tmp_path / "in"),
                                               "stream_id": stream_id})
    wait_for(lambda: d.ti("amqs_deploy_receive", run_id, "receive")["state"] == "running", 120,
             "the sensor to run", interval=0.5)
    # Until the UI has shown a line, the sender moves a chunk a second (so the sensor logs
    # lines with bytes moved, one per 10 s) and stops two chunks short of the end, so the
    # sensor is still running when its log is read, however slow the machine.
    shown_event, sent, errors = threading.Event(), [], []
    chunk = 256 * 1024

    def hold(done: int, total: int) -> None:
        if not shown_event.is_set():
            shown_event.wait(300 if done >= total - 2 * chunk else 1.0)

    def send() -> None:
        try:
            sent.append(send_file(params_from_uri(_broker_uri(d)), src, queue,
                                  SendOptions(chunk_size=chunk, window=1, progress=hold), stream_id=stream_id))
        except Exception as exc:  # the test thread reports it below
            errors.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    progress = re.compile(rf"receive from {re.escape(queue)}: [1-9]\d* of {size} bytes \((?!100\.0%)")

    def shown() -> bool:
        pg.goto(f"{d.base}/dags/amqs_deploy_receive/runs/{run_id}/tasks/receive")
        try:
            pg.get_by_text(progress).first.wait_for(timeout=5_000)
        except Exception:  # not logged yet: look again
            return False
        return True

    try:
        wait_for(shown, 180, "a line of bytes received, short of the end, in the sensor's log in the UI", interval=1)
        assert d.ti("amqs_deploy_receive", run_id, "receive")["state"] == "running"
        _shot(pg, tmp_path, "ui-sensor-progress-log.png")
    finally:
        shown_event.set()
    sender.join(300)
    assert not errors and sent, errors or "the send did not end in 300 s"
    d.wait_run("amqs_deploy_receive", run_id, timeout=300)
    assert d.xcom("amqs_deploy_receive", run_id, "receive")["sha256"] == sha256_file(src) == sent[0].sha256
    print(f"deployment test so far: {time.monotonic() - d.started:.0f}s since start-up")


def _settled(pg: Any) -> None:
    """Wait until the animations that end have ended (a dialog fading in), so a screenshot
    shows the page; endless ones (a spinner, a running task's pulse) never do."""
    pg.wait_for_function("() => document.getAnimations().every(a => a.playState !== 'running'"
                         " || a.effect.getComputedTiming().iterations === Infinity)")


def test_dag_docs_and_parameter_help_in_the_ui(page: Any, deployment: Deployment, tmp_path: Path) -> None:
    """The docs of a DAG (its "Dag Docs" button) and the help of its trigger
    parameters, as a user sees them."""
    d, pg = deployment, page
    pg.goto(f"{d.base}/dags/amqstream_one_file")
    pg.get_by_role("button", name="Dag Docs").click()
    dlg = pg.get_by_role("dialog")
    dlg.get_by_text("One file end to end").wait_for()
    _settled(pg)
    assert "SendStreamOperator" in dlg.inner_text() and "**" not in dlg.inner_text()  # rendered, not raw
    # The dialog opens 500x400 with a resize handle: drag it, as a reader would, to see it all.
    box = dlg.bounding_box()
    pg.mouse.move(box["x"] + box["width"] - 3, box["y"] + box["height"] - 3)
    pg.mouse.down()
    pg.mouse.move(box["x"] + box["width"] + 350, box["y"] + 560, steps=10)
    pg.mouse.up()
    _shot(pg, tmp_path, "ui-dag-docs.png")
    pg.keyboard.press("Escape")
    dlg.wait_for(state="hidden")
    pg.get_by_role("button", name="Trigger").first.click()
    dlg = pg.get_by_role("dialog")
    dlg.get_by_text("Rows of the sample CSV written when").wait_for()
    _settled(pg)
    text = dlg.inner_text()
    assert "Path of the CSV to send (on the worker)" in text and "Rows of the sample CSV written when" in text, text
    _shot(pg, tmp_path, "ui-trigger-params.png")


def test_the_assets_page_shows_the_examples_assets(page: Any, deployment: Deployment, tmp_path: Path) -> None:
    """The Assets page, as a user browses it after example 1 ran: the destination, the
    landing directory and the Parquet directory, with their last events; and the landing
    directory's page, whose graph links the send, the destination, the receive, the directory
    and the Spark task."""
    d, pg = deployment, page
    run_id = d.trigger("amqstream_one_file", {"path": str(d.home / "assets-ui.csv"), "rows": 500})
    _received(d, run_id)  # the Parquet asset is declared in the DAG: listed before Spark runs
    examples = d.home / "examples"
    uris = [f"amqstream://amqstream_default{QUEUE}.one", f"file://{examples / 'received' / 'one'}",
            f"file://{examples / 'parquet' / 'one'}"]
    assets = [_asset(d, uri) for uri in uris]
    pg.goto(d.base + "/assets")
    for uri in uris:
        pg.get_by_text(uri, exact=True).first.wait_for()
    _settled(pg)
    _shot(pg, tmp_path, "ui-assets.png")
    # The landing directory's page: one producing task (receive), one consuming (to_parquet);
    # its graph links the DAG to the destination, the directory and the Parquet.
    pg.goto(f"{d.base}/assets/{assets[1]['id']}")
    pg.get_by_text("Producing Tasks").wait_for()
    assert pg.get_by_text("1 Task", exact=True).count() == 2
    for label in (uris[0], uris[2], "amqstream_one_file"):  # the DAG and the assets it links
        pg.get_by_text(label, exact=True).first.wait_for()
    _settled(pg)
    _shot(pg, tmp_path, "ui-asset-graph.png")
    pg.get_by_role("button", name="Task Dependencies").click()
    pg.wait_for_load_state("networkidle")
    _settled(pg)
    _shot(pg, tmp_path, "ui-asset-graph-tasks.png")
