"""A real Airflow deployment for the tests: ``make airflow`` (which runs ``scripts/airflow.sh``)
started on private loopback ports with a private AIRFLOW_HOME, and a small client for the
Airflow 3 public REST API (``/api/v2``, JWT from the simple auth manager's ``/auth/token``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import ROOT, free_port, wait_for

FINISHED = {"success", "failed"}


class Deployment:
    """``make airflow`` as a child process (in a session of its own) and its API.

    Started as users start it: ``make`` is the top process, and what a service manager or CI
    would send goes to it. ``make`` is told its setup stamp is current (``-o``): the tests run
    in the venv ``make test`` prepared and must never reinstall it.

    :param home: the deployment's directory (``AMQSTREAM_AIRFLOW_DIR``).
    :param dags: the DAGs folder it serves.
    :param env: extra environment for every process of the deployment.
    """

    def __init__(self, home: Path, dags: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.dags = dags
        self.airflow_home = home / "airflow"
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.output: list[str] = []
        self.started = time.monotonic()
        # The script sets these itself (the Fernet key: its Airflow makes one); the test
        # session's own must not leak in.
        leak = {"AIRFLOW_HOME", "AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW_CONN_AMQSTREAM_DEFAULT", "AMQSTREAM_BROKER_DIR",
                "AMQSTREAM_STATE_DIR", "AMQSTREAM_EXAMPLE_DIR", "AIRFLOW__CORE__FERNET_KEY"}
        full_env = {k: v for k, v in os.environ.items() if k not in leak}
        full_env.update({"VENV": sys.prefix, "PYTHONPATH": str(ROOT), "AMQSTREAM_AIRFLOW_DIR": str(home),
                         "AMQSTREAM_AIRFLOW_PORT": str(self.port), "AMQSTREAM_DAGS_FOLDER": str(dags),
                         # Every DAG file is in place before the start, and none changes: the
                         # dag-processor's re-parse every 30 s (12.8 CPU-s in 2 minutes, 1.7 with
                         # this) only takes CPU from the tests beside it. Users keep Airflow's 30 s.
                         "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
                         **(env or {})})
        self.proc = subprocess.Popen(["make", "-s", "--no-print-directory", "-o", f"{sys.prefix}/.installed", "airflow",
                                      f"VENV={sys.prefix}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env, cwd=ROOT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.password = ""
        self._token = ""
        self.sessions: set[int] = set()
        # Every TCP listener any process of the deployment had, sampled while it runs:
        # (address, port, pid, command line).
        self.listeners: set[tuple[str, int, int, str]] = set()
        self._sampling = threading.Event()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line.rstrip("\n"))

    def text(self) -> str:
        return "\n".join(self.output)

    def wait_ready(self, timeout: float = 240) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"airflow.sh exited {self.proc.returncode}:\n{self.text()}\n"
                                     f"{self.component_logs()}")
            return any(line.startswith("airflow.sh: ready") for line in self.output)

        wait_for(ready, timeout, "the deployment to say it is ready", interval=0.5)
        m = wait_for(lambda: re.search(r"UI\s+(\S+)\s+user admin, password (\S+)", self.text()), 10,
                     "the UI address and admin login in the output")
        assert m.group(1) == self.base, self.text()
        self.password = m.group(2)
        # Each component leads a session; its workers and tasks stay in it (their environment
        # cannot be read: setproctitle overwrites it).
        self.sessions = {int(line.split()[1]) for line in (self.home / "pids").read_text().splitlines()}
        self.startup_seconds = time.monotonic() - self.started
        self._sampling.set()
        threading.Thread(target=self._sample_listeners, daemon=True).start()

    def component_logs(self, tail: int = 30) -> str:
        out = []
        for log in sorted((self.home / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(out)

    # ---- REST API ----
    def token(self) -> str:
        if not self._token:
            r = httpx.post(f"{self.base}/auth/token", json={"username": "admin", "password": self.password},
                           timeout=30)
            assert r.status_code in (200, 201), r.text
            self._token = r.json()["access_token"]
        return self._token

    def api(self, method: str, path: str, *, headers: dict[str, str] | None = None, **kw: Any) -> Any:
        headers = {"Authorization": f"Bearer {self.token()}", **(headers or {})}
        r = httpx.request(method, f"{self.base}/api/v2{path}", headers=headers, timeout=60, **kw)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text[:2000]}"
        return r.json() if r.content else None

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        run = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns", params={"order_by": "run_after", "limit": 100})["dag_runs"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")["state"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100})[
            "task_instances"]

    def ti(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any]:
        suffix = f"/{map_index}" if map_index >= 0 else ""
        return self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}{suffix}")

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
        r = httpx.get(f"{self.base}/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
                      params={"map_index": map_index}, headers={"Authorization": f"Bearer {self.token()}"},
                      timeout=60)
        return r.json()["value"] if r.status_code == 200 else None

    def log(self, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int = -1) -> str:
        body = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                        params={"map_index": map_index, "full_content": True}, headers={"Accept": "application/json"})
        content = body.get("content", [])
        if isinstance(content, str):
            return content
        return "\n".join(str(e.get("event", "")) if isinstance(e, dict) else str(e) for e in content)

    def describe(self, dag_id: str, run_id: str) -> str:
        return "; ".join(f"{t['task_id']}[{t['map_index']}]={t['state']} (try {t['try_number']})"
                         for t in self.task_instances(dag_id, run_id))

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 240) -> str:
        """Wait for a run to finish; fail naming every task's state if it fails or hangs."""
        try:
            state = wait_for(lambda: (s := self.run_state(dag_id, run_id)) in FINISHED and s, timeout,
                             f"{dag_id} run {run_id} to finish", interval=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.describe(dag_id, run_id)}") from None
        assert state == "success", f"{dag_id} run {run_id} {state}: {self.describe(dag_id, run_id)}"
        return state

    # ---- processes ----
    @staticmethod
    def _session(pid: int) -> int | None:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[3])
        except (OSError, ValueError, IndexError):
            return None

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` runs in a session of this deployment's components."""
        return self._session(pid) in self.sessions

    def broker_pid(self) -> int | None:
        try:
            return int((self.home / "broker" / "broker.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def listening(self) -> list[tuple[str, int, int, str]]:
        """The TCP listeners of this deployment's processes now: (address, port, pid, command)."""
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
        broker = self.broker_pid()
        found = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) < 6:
                continue
            address, _, port = fields[3].rpartition(":")
            # The process column may hold spaces ("airflow api-server" is a process name).
            for pid in map(int, re.findall(r"pid=(\d+)", " ".join(fields[5:]))):
                if pid == broker or self.owns(pid):
                    try:
                        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                    except OSError:
                        command = "?"
                    found.append((address.strip("[]"), int(port), pid, command))
        return found

    def _sample_listeners(self) -> None:
        while self._sampling.is_set():
            self.listeners.update(self.listening())
            time.sleep(1)  # a sampling period, not a synchronisation: the test reads what was seen

    def own_processes(self) -> list[str]:
        """Every process on this machine started for this deployment (its AIRFLOW_HOME or broker dir)."""
        marks = (f"AIRFLOW_HOME={self.airflow_home}".encode(), f"AMQSTREAM_BROKER_DIR={self.home / 'broker'}".encode())
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                environ = (proc / "environ").read_bytes()
                cmdline = (proc / "cmdline").read_bytes()
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[-1].split()[0] == "Z":
                continue
            mine = any(m + b"\0" in environ + b"\0" for m in marks) or self.owns(int(proc.name))
            if mine or str(self.home / "broker").encode() in cmdline:
                command = cmdline.replace(b"\0", b" ").decode(errors="replace")[:160]
                found.append(f"{proc.name} {command}")
        return found

    def wait_all_exited(self, timeout: float, after: str) -> None:
        """Wait until no process of this deployment is left (:meth:`own_processes`); fail
        naming those left running ``after`` (what stopped it) and the script's last words."""
        try:
            wait_for(lambda: not self.own_processes(), timeout, "every process of the deployment to exit",
                     interval=0.5)
        except AssertionError:
            raise AssertionError(f"left running {timeout:.0f}s after {after}: {self.own_processes()}\n"
                                 f"{self.text()[-2000:]}") from None

    def wait_stopped(self, timeout: float, after: str) -> None:
        """Wait until no process of this deployment is left and the script has said it stopped
        (its last line, written once everything it started is gone)."""
        self.wait_all_exited(timeout, after)
        wait_for(lambda: "airflow.sh: stopped" in self.text(), 10, "the script to say it stopped")

    def stop(self, timeout: float = 90) -> float:
        """SIGTERM to the top process (``make``), as a service manager or CI stops what it
        started; return the seconds it took to stop."""
        self._sampling.clear()
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                raise AssertionError(f"airflow.sh did not stop in {timeout}s:\n{self.text()[-3000:]}") from None
        self._reader.join(10)
        # The output has the admin password: kept as the deployment keeps its files, 0600.
        fd = os.open(self.home / "airflow.sh.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.text() + "\n")
        return time.monotonic() - t0


def json_line(text: str) -> dict[str, Any]:
    """The last JSON object printed by ``amqstream ... --json``."""
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
