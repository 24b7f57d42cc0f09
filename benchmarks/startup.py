"""How fast the installed command starts, as users run it (``python -m benchmarks.startup``).

Three figures, each the median of several runs of the installed ``amqstream`` console script:
``--version``; the time from starting ``amqstream send`` (connection in
``AIRFLOW_CONN_AMQSTREAM_DEFAULT``, no ``--conn``) until its first message reaches a
consumer already subscribed to the destination; and the send's peak RSS with the connection
from the environment against the same send with ``--conn URI``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import stomp

from airflow_provider_amqstream.hooks.connection import params_from_uri
from benchmarks.common import ROOT, installed_command, json_rows, log, scratch_broker

RUNS = 7


def _command() -> list[str]:
    """The installed command, bare: what users start (for the timings)."""
    exe = Path(sys.executable).parent / "amqstream"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "airflow_provider_amqstream.cli"]


class _FirstMessage(stomp.ConnectionListener):
    def __init__(self) -> None:
        self.at: float | None = None
        self.seen = threading.Event()
        self.subscribed = threading.Event()

    def on_receipt(self, frame: stomp.utils.Frame) -> None:
        self.subscribed.set()

    def on_message(self, frame: stomp.utils.Frame) -> None:
        if self.at is None:
            self.at = time.monotonic()
            self.seen.set()


def _first_byte(uri: str, queue: str, src: Path, env: dict[str, str]) -> float:
    """Seconds from spawning ``amqstream send`` to its first message at a subscribed consumer."""
    bp = params_from_uri(uri)
    conn = stomp.Connection12(list(bp.hosts), auto_decode=False)
    conn.connect(bp.login, bp.password, wait=True)
    first = _FirstMessage()
    conn.set_listener("first", first)
    conn.subscribe(queue, id="1", ack="auto", headers={"receipt": "sub"})
    try:
        if not first.subscribed.wait(30):
            raise RuntimeError(f"the broker did not confirm the subscription to {queue}")
        t0 = time.monotonic()
        proc = subprocess.Popen([*_command(), "send", str(src), "--to", queue, "--json", "-q"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not first.seen.wait(60):
            proc.kill()
            raise RuntimeError(f"no message from amqstream send on {queue} within 60s")
        out, err = proc.communicate(timeout=120)
        if proc.returncode:
            raise RuntimeError(f"amqstream send failed: {err[-1000:]}")
        return (first.at or t0) - t0
    finally:
        conn.disconnect()


def run(work: Path, uri: str) -> dict[str, float]:
    work.mkdir(parents=True, exist_ok=True)
    src = work / "startup.bin"
    src.write_bytes(os.urandom(1000))
    version = []
    for _ in range(RUNS):
        t0 = time.monotonic()
        subprocess.run([*_command(), "--version"], check=True, capture_output=True)
        version.append(time.monotonic() - t0)
    base = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
    env_conn = {**base, "AIRFLOW_CONN_AMQSTREAM_DEFAULT": uri, "AMQSTREAM_STATE_DIR": str(work / "state-env")}
    # Timed bare, as users start it; measured (peak RSS) in runs of their own under the probe.
    first = [_first_byte(uri, f"/queue/bench.startup.{os.getpid()}.{i}", src, env_conn) for i in range(RUNS)]

    def peak_mib(queue: str, conn: list[str], env: dict[str, str]) -> float:
        proc = subprocess.run([*installed_command(), "send", str(src), "--to", queue, *conn, "--json", "-q"],
                              env=env, cwd=ROOT, check=True, capture_output=True, text=True)
        return float(json_rows(proc.stdout)[-1]["peak_rss_kib"]) / 1024

    rss_env = [peak_mib(f"/queue/bench.startup.env.{os.getpid()}.{i}", [], env_conn) for i in range(RUNS)]
    state_uri = {**base, "AMQSTREAM_STATE_DIR": str(work / "state-uri")}
    rss_uri = [peak_mib(f"/queue/bench.startup.uri.{i}", ["--conn", uri], state_uri) for i in range(RUNS)]
    return {"version_s": statistics.median(version), "first_byte_s": statistics.median(first),
            "rss_env_mib": statistics.median(rss_env), "rss_uri_mib": statistics.median(rss_uri), "runs": RUNS}


def table(row: dict[str, float]) -> str:
    return "\n".join([
        "| `amqstream --version` | first message of `send` at a consumer, connection from `$AIRFLOW_CONN` "
        "| send peak RSS, `$AIRFLOW_CONN` | send peak RSS, `--conn URI` |",
        "|---|---|---|---|",
        f"| {row['version_s']:.3f} s | {row['first_byte_s']:.3f} s | {row['rss_env_mib']:.0f} MiB "
        f"| {row['rss_uri_mib']:.0f} MiB |",
        "",
        f"Medians of {row['runs']} runs of the installed console script, process start included."])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.splitlines()[0])
    ap.add_argument("--uri", help="a broker to use (default: start one)")
    args = ap.parse_args(argv)
    if args.uri is None:
        with scratch_broker(None, "amqs-startup-") as (work, uri):
            row = run(work, uri)
    else:
        with tempfile.TemporaryDirectory(prefix="amqs-startup-") as tmp:
            row = run(Path(tmp), args.uri)
    log(json.dumps(row))
    print(table(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
