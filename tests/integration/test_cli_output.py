"""The command line as users run it: start-up without Airflow, connections from the
environment or the metadata database, and machine output that is only machine output."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.cli import MODES, _print_result
from airflow_provider_amqstream.engine import SendOptions, TransferResult, send_file
from airflow_provider_amqstream.protocol.headers import Mode
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import HeldProxy, cli, make_file, read_json, sha256_file, wait_for

NO_ENV_CONN = {"AIRFLOW_CONN_AMQSTREAM_DEFAULT": ""}


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 300,
         python_opts: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    for k, v in (env or {}).items():
        if v == "":
            full_env.pop(k, None)  # "" means: not set at all
    return subprocess.run([sys.executable, *python_opts, "-m", "airflow_provider_amqstream.cli", *args],
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def _json_lines(stdout: str) -> list[dict[str, object]]:
    """Every line of stdout must be a JSON object: nothing else may share it."""
    lines = stdout.splitlines()
    assert lines, "no output on stdout"
    return [json.loads(line) for line in lines]


def _imported(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def test_modes_match_the_protocol() -> None:
    assert tuple(m.value for m in Mode) == MODES and MODES[0] == Mode.STREAM.value


def test_version_imports_nothing_heavy() -> None:
    done = _run("--version", python_opts=("-X", "importtime"))
    assert done.returncode == 0 and done.stdout.startswith("amqstream ")
    mods = _imported(done.stderr)
    assert "airflow_provider_amqstream" in mods  # run as __main__, the package is still imported
    assert not {m for m in mods if m == "airflow" or m.startswith(("airflow.", "stomp"))}, mods


@pytest.mark.broker
def test_env_connection_transfer_never_imports_airflow(broker: EmbeddedBroker, tmp_path: Path,
                                                       queue_name: str) -> None:
    """The path users take: AIRFLOW_CONN_AMQSTREAM_DEFAULT set, no --conn, the installed
    module run as a process. Airflow must not be imported; stdout is JSON only."""
    info = broker.info()
    src = make_file(tmp_path / "env.bin", 3 * 2**20 + 5)
    out = tmp_path / "out"
    # The JSON form with the extra as a string, to exercise the rarer spelling for real.
    env = {"AIRFLOW_CONN_AMQSTREAM_DEFAULT": json.dumps(
        {"conn_type": "amqstream", "host": info.host, "port": info.port, "login": info.user,
         "password": info.password, "extra": json.dumps({"receipt_timeout": 30})})}
    sent = _run("send", str(src), "--to", queue_name, "--json", env=env, python_opts=("-X", "importtime"))
    assert sent.returncode == 0, sent.stderr[-2000:]
    got = _run("receive", "--from", queue_name, "--out-dir", str(out), "--json", "--wait", "60", env=env,
               python_opts=("-X", "importtime"))
    assert got.returncode == 0, got.stderr[-2000:]
    [s], [r] = _json_lines(sent.stdout), _json_lines(got.stdout)
    assert s["sha256"] == r["sha256"] == sha256_file(src) == sha256_file(Path(str(r["path"])))
    for proc in (sent, got):
        mods = _imported(proc.stderr)
        assert "airflow_provider_amqstream.hooks.connection" in mods
        airflow_mods = sorted(m for m in mods if m == "airflow" or m.startswith("airflow."))
        assert not airflow_mods, airflow_mods[:10]


@pytest.mark.broker
def test_json_output_is_only_json_with_the_embedded_fallback(broker: EmbeddedBroker, tmp_path: Path,
                                                            queue_name: str) -> None:
    """No connection anywhere: the CLI says on stderr that it uses the embedded broker."""
    src = make_file(tmp_path / "fallback.bin", 2**20)
    env = {**NO_ENV_CONN, "AMQSTREAM_BROKER_DIR": str(broker.data_dir)}
    sent = _run("send", str(src), "--to", queue_name, "--json", env=env)
    assert sent.returncode == 0, sent.stderr[-2000:]
    [s] = _json_lines(sent.stdout)
    assert s["bytes"] == 2**20
    assert "using the embedded broker" in sent.stderr
    got = _run("receive", "--from", queue_name, "--out-dir", str(tmp_path / "o"), "--json", "-q", env=env)
    assert got.returncode == 0, got.stderr[-2000:]
    assert _json_lines(got.stdout)[0]["sha256"] == s["sha256"]


@pytest.mark.broker
def test_progress_prints_its_last_line_once(uri: str, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "p.bin", 5 * 2**20)
    sent = _run("send", str(src), "--to", queue_name, "--conn", uri, "--window", "2", "--chunk-size", str(2**20))
    assert sent.returncode == 0, sent.stderr
    rx = cli("receive", "--from", queue_name, "--out-dir", str(tmp_path / "o"), "--conn", uri)
    _out, rx_err = rx.communicate(timeout=300)
    assert rx.returncode == 0, rx_err
    for err in (sent.stderr, rx_err):
        finals = [line for line in err.splitlines() if "100.0%" in line]
        assert len(finals) == 1, err
    # A human reads the summary on stdout; its rate is this run's.
    assert "MiB/s" in sent.stdout and "sha256" in sent.stdout


@pytest.mark.broker
@pytest.mark.kill
def test_resumed_receive_prints_this_runs_rate(params: BrokerParams, uri: str, tmp_path: Path, queue_name: str,
                                              held_proxy: Callable[..., HeldProxy]) -> None:
    size, chunk = 96 * 2**20, 2**20
    src = make_file(tmp_path / "resume.bin", size)
    send_file(params, src, queue_name, SendOptions(chunk_size=chunk), stream_id="rate-1")
    out = tmp_path / "out"
    # The first receiver gets no more than 64 of the 96 chunks until it is killed: it is part way then.
    proxy = held_proxy(params.hosts[0][1], 64 * chunk, to_broker=False)
    args = ["receive", "--from", queue_name, "--out-dir", str(out), "--conn", proxy.uri(uri), "--window", "4", "-q"]
    first = cli(*args)

    def stored() -> int:
        state = read_json(out / ".amqstream" / "rate-1.json")
        return int(state["next_seq"]) if state else 0

    wait_for(lambda: stored() >= 48, 120, "the receiver to store 48 chunks")
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    args[args.index("--conn") + 1] = uri
    again = _run(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    m = re.search(r"in ([\d.]+)s \(([\d,.]+) MiB/s, resumed at byte (\d+)\)", again.stdout)
    assert m, again.stdout
    secs, rate, resumed = float(m[1]), float(m[2].replace(",", "")), int(m[3])
    assert 0 < resumed < size
    this_run = (size - resumed) / 2**20 / secs
    whole_file = size / 2**20 / secs
    # At most the unsynced window (4 chunks) is written again on top of what was left.
    assert this_run * 0.9 <= rate <= (size - resumed + 4 * chunk) / 2**20 / secs * 1.1, (rate, this_run)
    assert rate < 0.75 * whole_file


def test_rate_of_a_resumed_transfer_counts_only_this_run(capsys: pytest.CaptureFixture[str]) -> None:
    res = TransferResult("s1", "/queue/q", "f", bytes=1000 * 2**20, chunks=1000, sha256="ab", seconds=2.0,
                         mode="stream", resumed_from=900 * 2**20, bytes_transferred=100 * 2**20)
    _print_result(res, False, "sent")
    line = capsys.readouterr().out
    assert "(50.0 MiB/s, resumed at byte 943718400)" in line, line


@pytest.mark.broker
def test_connection_made_in_the_metadata_db(airflow_db: Path, uri: str, tmp_path: Path, queue_name: str) -> None:
    """Connections added with `airflow connections add` (as in the UI) are found."""
    add = subprocess.run([sys.executable, "-m", "airflow", "connections", "add", "amqs_in_db", "--conn-uri", uri],
                         capture_output=True, text=True, timeout=300)
    assert add.returncode == 0, add.stderr[-2000:]
    env = {**NO_ENV_CONN, "AIRFLOW_CONN_AMQS_IN_DB": ""}
    ok = _run("test-connection", "--conn", "amqs_in_db", env=env)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.startswith("ok: connected to ")
    src = make_file(tmp_path / "db.bin", 2**20 + 3)
    sent = _run("send", str(src), "--to", queue_name, "--conn", "amqs_in_db", "--json", env=env)
    assert sent.returncode == 0, sent.stderr[-2000:]
    assert _json_lines(sent.stdout)[0]["bytes"] == 2**20 + 3


@pytest.mark.parametrize("command", [("test-connection",), ("send", "/etc/hostname", "--to", "/queue/x"),
                                     ("receive", "--from", "/queue/x", "--out-dir", "/tmp")])
def test_missing_connection_is_a_clear_error(airflow_db: Path, command: tuple[str, ...]) -> None:
    done = _run(*command, "--conn", "amqs_nowhere", env={"AIRFLOW_CONN_AMQS_NOWHERE": ""})
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert "AIRFLOW_CONN_AMQS_NOWHERE=" in done.stderr and "airflow connections add amqs_nowhere" in done.stderr
