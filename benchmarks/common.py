"""What the benchmarks share: sizes, test data, the sshd baseline, running the CLI (under
:mod:`benchmarks.probe`, which measures its memory and CPU) and reading its JSON.

Imported by ``python -m benchmarks`` and by its parts (bulk, network, startup), which are
also run alone; none of them imports ``benchmarks.__main__``, so it loads once.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.probe import merge

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
CHUNK = 1024 * 1024


def parse_size(text: str) -> int:
    """Bytes in ``text``: a count, or one with K, M or G (binary: ``1G`` is 1024 MiB), any case.

    :param text: what the user wrote, e.g. ``64K``, ``100M``, ``1G`` or ``4096``.
    """
    digits, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if not digits.isdigit() or unit not in ("", "K", "M", "G"):
        raise ValueError(f"size {text!r}: use a byte count or a number with K, M or G (e.g. 64K, 100M, 1G)")
    return int(digits) * 1024 ** ("_KMG".index(unit or "_"))


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ data
def make_random(path: Path, size: int) -> None:
    with open(path, "wb") as fh:
        left = size
        while left:
            n = min(left, 8 * MiB)
            fh.write(os.urandom(n))
            left -= n


def make_csv(path: Path, size: int, seed_file: Path) -> None:
    """A CSV of ``size`` bytes: a generated block of typed rows repeated (generating GBs of
    rows in Python would take longer than the benchmark). Per-chunk compression sees only
    1 MiB at a time, so the repetition does not flatter it."""
    if not seed_file.exists():
        sys.path.insert(0, str(ROOT / "dags" / "examples"))  # the examples' sample data helper
        from example_support import write_sample_csv

        write_sample_csv(seed_file, rows=600_000)
    block = seed_file.read_bytes()
    header, _, rows = block.partition(b"\n")
    rows = rows[: rows.rfind(b"\n") + 1]
    with open(path, "wb") as fh:
        fh.write(header + b"\n")
        left = size - len(header) - 1
        while left > 0:
            piece = rows[:left]
            fh.write(piece)
            left -= len(piece)


# ------------------------------------------------------------------------------ runners
def py(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, **(env or {})})


def cli_module(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m airflow_provider_amqstream.cli ARGS`` under the probe."""
    return py("benchmarks.probe", "-m", "airflow_provider_amqstream.cli", *args, env=env)


def installed_command() -> list[str]:
    """The ``amqstream`` console script installed beside this Python, run as users run it
    (no ``-m``, no ``--conn``), under the probe; ``-m`` only where the package is not installed."""
    exe = Path(sys.executable).parent / "amqstream"
    return [sys.executable, "-m", "benchmarks.probe", *([str(exe)] if exe.exists() else
                                                         ["-m", "airflow_provider_amqstream.cli"])]


def amqstream_command(*args: str, env: dict[str, str] | None = None,
                      stderr: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    """The installed console script on this tree's package: an editable install may point at
    another checkout (a git worktree's benchmark would measure the main tree's code), so this
    tree goes first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([*installed_command(), *args], stdout=subprocess.PIPE, stderr=stderr, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **(env or {})})


def json_rows(out: str) -> list[dict[str, Any]]:
    """The JSON lines a probed command printed, each with the probe's figures
    (``peak_rss_kib``, ``cpu_seconds``)."""
    return merge([json.loads(line) for line in out.splitlines() if line.startswith("{")])


def result(proc: subprocess.Popen[str], timeout: float = 3600) -> dict[str, Any]:
    """The last JSON line of a probed command that must succeed."""
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args} failed ({proc.returncode}): {err[-1500:]}")
    return json_rows(out)[-1]


class Sshd:
    """OpenSSH server on a private loopback port with throwaway keys; stopped on exit."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "ssh"
        self.dir.mkdir(exist_ok=True)
        self.port = free_port()
        self.key = self.dir / "client_key"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Sshd:
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not Path(sshd).exists():
            raise RuntimeError("OpenSSH server is not installed: sudo apt-get install openssh-server")
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / name)], check=True)
        (self.dir / "authorized_keys").write_text((self.dir / "client_key.pub").read_text())
        Path("/run/sshd").mkdir(exist_ok=True)
        conf = self.dir / "sshd_config"
        conf.write_text(f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.dir / 'host_key'}\n"
                        f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\nPasswordAuthentication no\n"
                        f"UsePAM no\nStrictModes no\nPidFile {self.dir / 'sshd.pid'}\n"
                        "Subsystem sftp internal-sftp\nPermitRootLogin yes\n")
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(conf)], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("sshd did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(10)

    @property
    def user(self) -> str:
        import getpass

        return getpass.getuser()

    def _opts(self) -> list[str]:
        return ["-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "LogLevel=ERROR", "-o", "BatchMode=yes"]

    @contextlib.contextmanager
    def paramiko_sftp(self) -> Iterator[Any]:
        """An SFTP session of paramiko (SFTP from Python) to this server, closed after."""
        import paramiko

        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        client.connect("127.0.0.1", port=self.port, username=self.user, key_filename=str(self.key),
                       look_for_keys=False, allow_agent=False)
        sftp = client.open_sftp()
        try:
            yield sftp
        finally:
            sftp.close()
            client.close()

    def paramiko_put(self, src: Path, dest: Path) -> float:
        t0 = time.monotonic()  # the connection is part of what a transfer costs
        with self.paramiko_sftp() as sftp:
            sftp.put(str(src), str(dest))
        return time.monotonic() - t0

    def sftp_put(self, src: Path, dest: Path) -> float:
        t0 = time.monotonic()
        subprocess.run(["sftp", "-q", *self._opts(), "-P", str(self.port), "-b", "-", f"{self.user}@127.0.0.1"],
                       input=f"put {src} {dest}\n".encode(), check=True, capture_output=True)
        return time.monotonic() - t0

    def scp_put(self, src: Path, dest: Path) -> float:
        t0 = time.monotonic()
        subprocess.run(["scp", "-q", *self._opts(), "-P", str(self.port), str(src), f"{self.user}@127.0.0.1:{dest}"],
                       check=True, capture_output=True)
        return time.monotonic() - t0


# Alternating rounds of the installed command and raw stomp.py, for the goal between them.
PAIRED_ROUNDS = 3


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median duration (an odd count keeps it one real run, CPU figures and all)."""
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


@contextlib.contextmanager
def scratch_dir(workdir: str | None, prefix: str) -> Iterator[Path]:
    """``workdir`` (created, and kept after) or a new temporary directory (removed after).

    :param workdir: the directory to use and keep, or None for a temporary one.
    :param prefix: the temporary directory's name prefix.
    """
    work = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    finally:
        if not workdir:
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def scratch_broker(workdir: str | None, prefix: str, store: str | None = None) -> Iterator[tuple[Path, str]]:
    """A scratch directory and a fresh embedded broker in it, for one benchmark run: yields
    (the directory, the broker's URI); stops the broker after, and removes the directory
    unless it was ``workdir`` (given to keep it).

    :param workdir: the directory to use and keep, or None for a temporary one.
    :param prefix: the temporary directory's name prefix.
    :param store: a directory on another filesystem to keep the broker's data in (removed after).
    """
    from airflow_provider_amqstream.broker.embedded import EmbeddedBroker

    with scratch_dir(workdir, prefix) as work:
        home = Path(tempfile.mkdtemp(prefix=prefix, dir=store)) if store else work
        broker = EmbeddedBroker(home / "broker", port=free_port())
        info, _ = broker.start()
        try:
            yield work, info.uri
        finally:
            broker.stop()
            if store:
                shutil.rmtree(home, ignore_errors=True)


_QUEUES = itertools.count(1)


def machine_busy() -> float:
    """CPU-seconds the whole machine has been busy since boot (``/proc/stat``: user, nice,
    system, irq and softirq time of every CPU), every process and kernel thread included."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    user, nice, system, _idle, _iowait, irq, softirq = fields
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int | None) -> float:
    """User plus system CPU seconds of a running process (all its threads)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, work: Path, uri: str, broker_pid: int | None = None) -> None:
        self.work, self.uri, self.broker_pid = work, uri, broker_pid

    def queue(self) -> str:
        return f"/queue/bench.{os.getpid()}.{next(_QUEUES)}"

    def ours(self, src: Path, *, compress: bool = False, installed: bool = False,
             env: dict[str, str] | None = None) -> dict[str, Any]:
        """End to end through the CLI. ``installed``: the ``amqstream`` command with the
        connection in ``AIRFLOW_CONN_AMQSTREAM_DEFAULT``; else ``python -m`` with ``--conn URI``.
        ``env``: more environment for both commands (replacing ``PYTHONPATH`` replaces this tree's)."""
        q, out = self.queue(), self.work / "out"
        state = {"AMQSTREAM_STATE_DIR": str(self.work / "state")}
        extra = ["--compress", "zstd"] if compress else []
        if installed:
            run, conn, env = amqstream_command, [], {"AIRFLOW_CONN_AMQSTREAM_DEFAULT": self.uri, **(env or {})}
        else:
            run, conn, env = cli_module, ["--conn", self.uri], dict(env or {})
        t0, b0 = time.monotonic(), process_cpu(self.broker_pid)
        rx = run("receive", "--from", q, "--out-dir", str(out), *conn, "--json", "-q", "--overwrite", "--wait", "120",
                 env=env)
        tx = run("send", str(src), "--to", q, *conn, "--json", "-q", "--stream-id", q.rsplit("/", 1)[1], *extra,
                 env={**env, **state})
        s, r = result(tx), result(rx)
        secs = time.monotonic() - t0
        if r["sha256"] != s["sha256"]:
            raise RuntimeError("amqstream delivered a different file")
        (out / src.name).unlink()
        return {"seconds": secs, "send_rss": s["peak_rss_kib"], "recv_rss": r["peak_rss_kib"],
                "cpu": [s["cpu_seconds"], r["cpu_seconds"], process_cpu(self.broker_pid) - b0]}

    def ours_split(self, src: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        q, out = self.queue(), self.work / "out"
        s = result(cli_module("send", str(src), "--to", q, "--conn", self.uri, "--json", "-q", "--stream-id",
                              q.rsplit("/", 1)[1], env={"AMQSTREAM_STATE_DIR": str(self.work / "state")}))
        r = result(cli_module("receive", "--from", q, "--out-dir", str(out), "--conn", self.uri, "--json", "-q",
                              "--overwrite"))
        (out / src.name).unlink()
        return {"seconds": s["seconds"], "rss": s["peak_rss_kib"]}, {"seconds": r["seconds"], "rss": r["peak_rss_kib"]}

    def raw_stomp(self, src: Path) -> dict[str, Any]:
        q, out = self.queue(), self.work / "raw.out"
        count = -(-src.stat().st_size // CHUNK)
        t0, b0 = time.monotonic(), process_cpu(self.broker_pid)
        rx = py("benchmarks.raw_stomp", "recv", str(out), q, self.uri, str(count))
        tx = py("benchmarks.raw_stomp", "send", str(src), q, self.uri, str(CHUNK))
        s, r = result(tx), result(rx)
        secs = time.monotonic() - t0
        size = out.stat().st_size
        out.unlink()
        if size != src.stat().st_size:
            raise RuntimeError("raw stomp.py lost bytes")
        return {"seconds": secs, "send_rss": s["peak_rss_kib"], "recv_rss": r["peak_rss_kib"],
                "cpu": [s["cpu_seconds"], r["cpu_seconds"], process_cpu(self.broker_pid) - b0]}

    def dd(self, src: Path) -> float:
        out = self.work / "dd.out"
        t0 = time.monotonic()
        subprocess.run(["dd", f"if={src}", f"of={out}", "bs=4M", "conv=fsync"], check=True, capture_output=True)
        secs = time.monotonic() - t0
        out.unlink()
        return secs


def per_gib(cpu: list[float], size: int) -> list[float]:
    return [round(c * 1024 * MiB / size, 2) for c in cpu]
