"""The CeleryExecutor deployment (``make airflow-celery``: scripts/airflow.sh with
AMQSTREAM_EXECUTOR=celery): Redis and two Celery workers beside the scheduler, the API
server, the triggerer and the embedded broker, all on loopback.

Example 1 runs end to end on the workers. Then a receiving task's worker is killed with
SIGKILL (its whole process tree, as a lost machine) mid-stream: the scheduler fails the try
once its heartbeats stop, the retry lands on the other worker and resumes from the durable
offset in the shared output directory, and the file arrives byte-exact.

One deployment serves the module; each test triggers its own runs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deployment import Deployment
from tests.helpers import ROOT, make_file, sha256_file, wait_for

pytestmark = [pytest.mark.deployment, pytest.mark.broker, pytest.mark.spark]

EXAMPLES = ROOT / "dags" / "examples"
DAG = "amqs_celery_receive"
# Seconds without a task's heartbeat before the scheduler fails it (Airflow's default is 300).
HEARTBEAT_TIMEOUT = 30


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    home = tmp_path_factory.mktemp("celery")
    dags = home / "dags"
    dags.mkdir()
    # Example 1 and the test's DAG only: the scheduled examples would add Spark jobs to a
    # 2-core machine without adding anything the LocalExecutor tests do not check.
    for dag_file in (EXAMPLES / "amqstream_one_file.py", EXAMPLES / "example_support.py",
                     ROOT / "tests" / "dags" / "celery_dags.py"):
        (dags / dag_file.name).symlink_to(dag_file)
    d = Deployment(home, dags, env={"AMQSTREAM_EXECUTOR": "celery",
                                    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT)})
    try:
        d.wait_ready(timeout=480)
        print(f"\ncelery deployment ready in {d.startup_seconds:.1f}s at {d.base}")
        yield d
    finally:
        seconds = d.stop()
        print(f"\ncelery deployment stopped in {seconds:.1f}s")
        try:
            wait_for(lambda: not d.own_processes(), 30, "every process of the deployment to exit", interval=0.5)
        except AssertionError:
            pytest.fail(f"left running after SIGTERM: {d.own_processes()}\n{d.text()[-2000:]}")
        assert "airflow.sh: stopped" in d.text(), d.text()[-2000:]


def _sessions(d: Deployment) -> dict[int, str]:
    """Session id -> component name (each component leads a session of its own)."""
    return {int(pid): name for name, pid in (line.split() for line in (d.home / "pids").read_text().splitlines())}


def _worker_of(d: Deployment, pid: int) -> str | None:
    name = _sessions(d).get(d._session(pid) or -1)
    return name if name and name.startswith("worker") else None


def _workloads_done(d: Deployment) -> int:
    return sum(log.read_text(errors="replace").count("] succeeded in ")
               for log in (d.home / "logs").glob("worker*.log"))


def test_the_banner_names_redis_and_both_workers(deployment: Deployment) -> None:
    d = deployment
    text = d.text()
    assert "executor    CeleryExecutor: Redis on 127.0.0.1:" in text and "workers worker1 worker2" in text, text
    conf = d.home / "redis" / "redis.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    settings = dict(line.split(" ", 1) for line in conf.read_text().splitlines() if line and line[0] != "#")
    assert settings["bind"] == "127.0.0.1" and settings["protected-mode"] == "yes" and len(settings["requirepass"]) > 20
    # Its password is on no command line (only in the 0600 file and the processes' environment).
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and d.owns(int(proc.name)):
            try:
                assert settings["requirepass"].encode() not in (proc / "cmdline").read_bytes(), proc.name
            except OSError:
                continue
    assert set(_sessions(d).values()) >= {"redis", "worker1", "worker2", "scheduler", "api-server"}


def test_one_file_example_runs_on_the_celery_workers(deployment: Deployment) -> None:
    d = deployment
    before = _workloads_done(d)
    conf = {"path": str(d.home / "one-file.csv"), "rows": 3_000}
    run_id = d.trigger("amqstream_one_file", conf)
    d.wait_run("amqstream_one_file", run_id, timeout=600)
    report = d.xcom("amqstream_one_file", run_id, "check")
    assert report["rows"] == 3_000 and report["sha256"] == sha256_file(Path(conf["path"]))
    tasks = d.task_instances("amqstream_one_file", run_id)
    assert all(t["queue"] == "default" for t in tasks), tasks
    # Every task of the run was a Celery workload on one of the two workers.
    assert _workloads_done(d) - before >= len(tasks), (before, _workloads_done(d), tasks)


def _durable(out_dir: Path, sid: str) -> int:
    """Chunks of ``sid`` durable in ``out_dir`` (its receive state), 0 if none yet."""
    try:
        state = json.loads((out_dir / ".amqstream" / f"{sid}.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(state["next_seq"]) - 1


def test_a_receiver_killed_with_its_worker_resumes_on_the_other_worker(deployment: Deployment,
                                                                        tmp_path: Path) -> None:
    from airflow_provider_amqstream.engine import send_file
    from airflow_provider_amqstream.engine.records import FileCheckpoint
    from airflow_provider_amqstream.hooks.connection import params_from_uri

    d = deployment
    t0 = time.monotonic()
    src = make_file(tmp_path / "big.bin", 24 * 2**20 + 123, seed=5)
    sid = f"celery-kill-{tmp_path.name[-12:]}"
    queue = f"/queue/celery.kill.{sid}"
    shared = d.home / "shared-in"  # both workers see it: one machine's disk (NFS in real life)
    run_id = d.trigger(DAG, {"queue": queue, "out_dir": str(shared), "stream_id": sid})

    # The sender stops at half the file until the retry runs: the kill is mid-stream whatever
    # the machine's speed, and nothing waits on a clock.
    half, release = threading.Event(), threading.Event()
    sent: dict[str, object] = {}

    def progress(done: int, total: int) -> None:
        if done >= total // 2 and not release.is_set():
            half.set()
            release.wait(600)

    def send() -> None:
        try:
            uri = (d.home / "env.sh").read_text().split("AIRFLOW_CONN_AMQSTREAM_DEFAULT='", 1)[1].split("'", 1)[0]
            sent["result"] = send_file(params_from_uri(uri), src, queue, stream_id=sid, chunk_size=256 * 1024,
                                       window=4, progress=progress, checkpoint=FileCheckpoint(tmp_path / "send.json"))
        except BaseException as exc:  # reported by the assertion below
            sent["error"] = exc

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        wait_for(half.is_set, 300, "the sender to reach half the file")
        wait_for(lambda: _durable(shared, sid) >= 8, 300, "the receiving task to make chunks durable", interval=0.5)
        ti = d.ti(DAG, run_id, "receive")
        assert ti["state"] == "running" and ti["try_number"] == 1 and ti["pid"], ti
        first = _worker_of(d, ti["pid"])
        assert first, f"pid {ti['pid']} of the receiving task is in no worker's session: {_sessions(d)}"
        durable_at_kill = _durable(shared, sid)
        # The worker's whole process tree, as a lost machine: no task can report anything.
        [session] = [s for s, name in _sessions(d).items() if name == first]
        victims = [int(p.name) for p in Path("/proc").iterdir()
                   if p.name.isdigit() and d._session(int(p.name)) == session]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed_at = time.monotonic()

        def retry_running() -> dict[str, object] | None:
            t = d.ti(DAG, run_id, "receive")
            return t if t["try_number"] == 2 and t["state"] == "running" and t["pid"] else None

        retry = wait_for(retry_running, 300, "the retry of the receiving task to run", interval=1)
        second = _worker_of(d, int(retry["pid"]))  # type: ignore[arg-type]
        print(f"\nreceiver killed on {first} at chunk {durable_at_kill}; retry running on {second} "
              f"{time.monotonic() - killed_at:.0f}s later")
        assert second and second != first, (first, second)
    finally:
        release.set()
        sender.join(300)
    assert "error" not in sent, sent.get("error")
    d.wait_run(DAG, run_id, timeout=300)
    got = d.xcom(DAG, run_id, "receive")
    assert got["sha256"] == sha256_file(src) == sent["result"].sha256  # type: ignore[attr-defined]
    assert got["resumed_from"] >= durable_at_kill * 256 * 1024 > 0, got
    assert got["bytes_transferred"] <= src.stat().st_size - got["resumed_from"], got
    assert sha256_file(Path(got["path"])) == got["sha256"] and Path(got["path"]).parent == shared
    tries = d.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/receive/tries")["task_instances"]
    assert tries[0]["state"] in ("failed", "up_for_retry"), tries
    assert f"airflow.sh: {first} exited" in d.text() and "Celery worker(s) left" in d.text(), d.text()[-2000:]
    print(f"kill-and-resume test: {time.monotonic() - t0:.0f}s")
