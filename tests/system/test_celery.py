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
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import SendOptions
from tests.deployment import Deployment, json_line
from tests.helpers import ROOT, make_file, sha256_file, wait_for

pytestmark = [pytest.mark.deployment, pytest.mark.broker, pytest.mark.spark]

EXAMPLES = ROOT / "dags" / "examples"
DAG = "amqs_celery_receive"
# Seconds without a task's heartbeat before the scheduler fails it (Airflow's default is 300).
HEARTBEAT_TIMEOUT = 30
CHUNK = 256 * 1024


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
    # Three workers: each kill test loses one and still has two to retry on, in any order.
    d = Deployment(home, dags, env={"AMQSTREAM_EXECUTOR": "celery", "AMQSTREAM_CELERY_WORKERS": "3",
                                    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT)})
    try:
        d.wait_ready(timeout=480)
        print(f"\ncelery deployment ready in {d.startup_seconds:.1f}s at {d.base}")
        yield d
    finally:
        # Stopped as a user in a terminal stops it (Ctrl-C: SIGINT to make's process group,
        # make and the script): Redis and every worker go with the rest. SIGTERM has its
        # own test with the LocalExecutor (test_deployment_stop.py); one start is enough here.
        if d.proc.poll() is None:
            os.killpg(d.proc.pid, signal.SIGINT)
            try:
                d.proc.wait(120)
            except subprocess.TimeoutExpired:
                pass  # d.stop() says so, and kills what is left
        seconds = d.stop()
        print(f"\ncelery deployment stopped in {seconds:.1f}s")
        d.wait_stopped(90, "Ctrl-C")
        assert "stopping redis" in d.text(), d.text()[-2000:]


def _sessions(d: Deployment) -> dict[int, str]:
    """Session id -> component name (each component leads a session of its own)."""
    return {int(pid): name for name, pid in (line.split() for line in (d.home / "pids").read_text().splitlines())}


def _worker_of(d: Deployment, pid: int) -> str | None:
    name = _sessions(d).get(d._session(pid) or -1)
    return name if name and name.startswith("worker") else None


def _workloads_done(d: Deployment) -> int:
    return sum(log.read_text(errors="replace").count("] succeeded in ")
               for log in (d.home / "logs").glob("worker*.log"))


def test_the_banner_names_redis_and_the_workers(deployment: Deployment) -> None:
    d = deployment
    text = d.text()
    assert "executor    CeleryExecutor: Redis on 127.0.0.1:" in text and "workers worker1 worker2 worker3" in text, text
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
    assert set(_sessions(d).values()) >= {"redis", "worker1", "worker2", "worker3", "scheduler", "api-server"}
    # Every TCP listener of the deployment (Redis's, the workers' if any) is on loopback.
    seen = d.listening()
    assert int(settings["port"]) in {port for _, port, _, _ in seen}, seen
    assert all(address in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for address, *_ in seen), seen


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
    # Every task of the run was a Celery workload on one of the workers (a worker logs the
    # workload's end just after the task reported its state to the API).
    wait_for(lambda: _workloads_done(d) - before >= len(tasks), 60,
             f"the workers to log {len(tasks)} finished workloads", interval=0.5)
    # Each task instance records the worker that ran it (the UI's Hostname column), not the
    # 127.0.0.1 every one recorded before; its log still reads through the API.
    assert {t["hostname"] for t in tasks} <= {"worker1", "worker2", "worker3"}, [t["hostname"] for t in tasks]
    log = d.log("amqstream_one_file", run_id, "send", 1)
    assert "Could not read" not in log and "amqstream" in log, log[-2000:]


def _durable(out_dir: Path, sid: str) -> int:
    """Chunks of ``sid`` durable in ``out_dir`` (its receive state), 0 if none yet."""
    try:
        state = json.loads((out_dir / ".amqstream" / f"{sid}.json").read_text())
    except (OSError, ValueError):
        return 0
    return int(state["next_seq"]) - 1


class PausedSender:
    """Sends a stream from the test process and stops at half the file until released, so a
    kill is mid-stream whatever the machine's speed (nothing waits on a clock)."""

    def __init__(self, d: Deployment, src: Path, queue: str, sid: str, state: Path) -> None:
        self.half, self.release = threading.Event(), threading.Event()
        self.result: object = None
        self.error: BaseException | None = None
        uri = (d.home / "env.sh").read_text().split("AIRFLOW_CONN_AMQSTREAM_DEFAULT='", 1)[1].split("'", 1)[0]
        self.uri = uri
        self.thread = threading.Thread(target=self._send, args=(src, queue, sid, state), daemon=True)
        self.thread.start()

    def _progress(self, done: int, total: int) -> None:
        if done >= total // 2 and not self.release.is_set():
            self.half.set()
            self.release.wait(600)

    def _send(self, src: Path, queue: str, sid: str, state: Path) -> None:
        from airflow_provider_amqstream.engine import send_file
        from airflow_provider_amqstream.engine.records import FileCheckpoint
        from airflow_provider_amqstream.hooks.connection import params_from_uri

        try:
            self.result = send_file(params_from_uri(self.uri), src, queue,
                                    SendOptions(chunk_size=CHUNK, window=4, progress=self._progress,
                                                checkpoint_for=lambda _: FileCheckpoint(state)),
                                    stream_id=sid)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> Any:
        self.release.set()
        self.thread.join(300)
        assert self.error is None and self.result is not None, self.error
        return self.result


def _kill_worker_running(d: Deployment, dag_id: str, run_id: str) -> str:
    """SIGKILL the whole process tree of the worker running the receiving task (a lost
    machine: nothing of it can report anything); return its name."""
    ti = d.ti(dag_id, run_id, "receive")
    assert ti["state"] == "running" and ti["try_number"] == 1 and ti["pid"], ti
    name = _worker_of(d, ti["pid"])
    assert name, f"pid {ti['pid']} of the receiving task is in no worker's session: {_sessions(d)}"
    [session] = [s for s, n in _sessions(d).items() if n == name]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and d._session(int(proc.name)) == session:
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    return name


def _running_worker(d: Deployment, dag_id: str, run_id: str) -> str | None:
    ti = d.ti(dag_id, run_id, "receive")
    return _worker_of(d, ti["pid"]) if ti["state"] == "running" and ti["pid"] else None


def test_a_receiver_killed_with_its_worker_resumes_on_the_other_worker(deployment: Deployment,
                                                                        tmp_path: Path) -> None:
    d = deployment
    t0 = time.monotonic()
    src = make_file(tmp_path / "big.bin", 24 * 2**20 + 123, seed=5)
    sid = f"celery-kill-{tmp_path.name[-12:]}"
    queue = f"/queue/celery.kill.{sid}"
    shared = d.home / "shared-in"  # both workers see it: one machine's disk (NFS in real life)
    run_id = d.trigger(DAG, {"queue": queue, "out_dir": str(shared), "stream_id": sid})
    sender = PausedSender(d, src, queue, sid, tmp_path / "send.json")
    try:
        wait_for(sender.half.is_set, 300, "the sender to reach half the file")
        wait_for(lambda: _durable(shared, sid) >= 8, 300, "the receiving task to make chunks durable", interval=0.5)
        durable_at_kill = _durable(shared, sid)
        first = _kill_worker_running(d, DAG, run_id)
        killed_at = time.monotonic()

        def retry_running() -> dict[str, Any] | None:
            t = d.ti(DAG, run_id, "receive")
            return t if t["try_number"] == 2 and t["state"] == "running" and t["pid"] else None

        retry = wait_for(retry_running, 300, "the retry of the receiving task to run", interval=1)
        second = _worker_of(d, int(retry["pid"]))
        print(f"\nreceiver killed on {first} at chunk {durable_at_kill}; retry running on {second} "
              f"{time.monotonic() - killed_at:.0f}s later")
        assert second and second != first, (first, second)
    finally:
        sent = sender.finish()
    d.wait_run(DAG, run_id, timeout=300)
    got = d.xcom(DAG, run_id, "receive")
    assert got["sha256"] == sha256_file(src) == sent.sha256
    assert got["resumed_from"] >= durable_at_kill * CHUNK > 0, got
    assert got["bytes_transferred"] <= src.stat().st_size - got["resumed_from"], got
    assert sha256_file(Path(got["path"])) == got["sha256"] and Path(got["path"]).parent == shared
    tries = d.api("GET", f"/dags/{DAG}/dagRuns/{run_id}/taskInstances/receive/tries")["task_instances"]
    assert tries[0]["state"] in ("failed", "up_for_retry"), tries
    assert f"airflow.sh: {first} exited" in d.text() and "Celery worker(s) left" in d.text(), d.text()[-2000:]
    print(f"kill-and-resume test: {time.monotonic() - t0:.0f}s")


def test_a_retry_on_the_other_workers_disk_says_where_the_data_is_and_loses_nothing(deployment: Deployment,
                                                                                   tmp_path: Path) -> None:
    """Each worker's own disk and no shared directory: the retry cannot continue the stream.
    It takes none of its chunks, fails saying where the first bytes are, and the command it
    prints finishes the stream there, byte-exact."""
    d = deployment
    t0 = time.monotonic()
    src = make_file(tmp_path / "big.bin", 24 * 2**20 + 321, seed=6)
    sid = f"celery-local-{tmp_path.name[-12:]}"
    queue = f"/queue/celery.local.{sid}"
    dag_id = "amqs_celery_receive_local"
    run_id = d.trigger(dag_id, {"queue": queue, "stream_id": sid})
    sender = PausedSender(d, src, queue, sid, tmp_path / "send.json")
    try:
        wait_for(sender.half.is_set, 300, "the sender to reach half the file")
        first = wait_for(lambda: _running_worker(d, dag_id, run_id), 300, "the receiving task to run", interval=0.5)
        own = d.home / "workers" / first / "in"
        wait_for(lambda: _durable(own, sid) >= 8, 300, "the receiving task to make chunks durable", interval=0.5)
        assert _kill_worker_running(d, dag_id, run_id) == first
    finally:
        sent = sender.finish()
    state = wait_for(lambda: (s := d.run_state(dag_id, run_id)) in ("success", "failed") and s, 300,
                     f"{dag_id} run {run_id} to finish", interval=1)
    assert state == "failed", d.describe(dag_id, run_id)
    # The whole log, the exception's text included (not only each line's event).
    log = json.dumps(d.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/receive/logs/2",
                           params={"full_content": True}, headers={"Accept": "application/json"}))
    assert "another receiver took its first chunks and holds them" in log, log[-3000:]
    assert f"directory {own.resolve()} (partial file {own.resolve() / '.amqstream' / (sid + '.part')}" in log
    assert "Nothing was dead-lettered" in log
    # What it printed, run where the data is (this machine holds both workers' disks).
    command = f"amqstream receive --from {queue} --out-dir {own.resolve()} --stream-id {sid}"
    assert command in log, log[-3000:]
    out = subprocess.run([sys.executable, "-m", "airflow_provider_amqstream.cli", *command.split()[1:], "--conn",
                          sender.uri, "--json", "--wait", "30"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json_line(out.stdout)
    assert got["sha256"] == sent.sha256 == sha256_file(src) and got["resumed_from"] >= 8 * CHUNK, got
    print(f"\nworker-local retry test: {time.monotonic() - t0:.0f}s")
