"""What the benchmarks share: sizes, test data, the sshd baseline, running the CLI (under
:mod:`benchmarks.probe`, which measures its memory and CPU) and reading its JSON.

Imported by ``python -m benchmarks`` and by its parts (bulk, network, startup), which are
also run alone; none of them imports ``benchmarks.__main__``, so it loads once.
"""

from __future__ import annotations

import contextlib
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
SIZES = {"100M": 100 * MiB, "1G": 1024 * MiB, "4G": 4096 * MiB}


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
def scratch_broker(workdir: str | None, prefix: str) -> Iterator[tuple[Path, str]]:
    """A scratch directory and a fresh embedded broker in it, for one benchmark run: yields
    (the directory, the broker's URI); stops the broker after, and removes the directory
    unless it was ``workdir`` (given to keep it).

    :param workdir: the directory to use and keep, or None for a temporary one.
    :param prefix: the temporary directory's name prefix.
    """
    from airflow_provider_amqstream.broker.embedded import EmbeddedBroker

    work = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    broker = EmbeddedBroker(work / "broker", port=free_port())
    info, _ = broker.start()
    try:
        yield work, info.uri
    finally:
        broker.stop()
        if not workdir:
            shutil.rmtree(work, ignore_errors=True)
