"""The broker command, the hook against a real broker, provider discovery."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import ROOT, free_port

pytestmark = pytest.mark.broker


def test_hook_round_trips_binary_bodies_byte_exact(uri: str, queue_name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    bodies = [b"\x00" * 10, os.urandom(3 * 1024 * 1024) + b"\x00\n\n\x00", b"", b"\r\n:\\"]
    hook = AmqStreamHook()
    with hook.get_conn() as link:
        for body in bodies:
            link.send_confirmed(queue_name, body, {"n": "1"})
        link.subscribe(queue_name, prefetch=2)
        got = []
        for _ in bodies:
            frame = link.get(10)
            assert frame is not None, "message did not come back"
            got.append(frame.body)
            link.ack(frame)
    assert got == bodies


def test_hook_init_does_not_touch_network_or_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", raising=False)

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("network or connection lookup in __init__")

    monkeypatch.setattr(AmqStreamHook, "get_connection", classmethod(boom))
    monkeypatch.setattr(StompLink, "open", boom)
    AmqStreamHook("does_not_exist")


def test_test_connection_live_broker(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQ_OK", uri)
    ok, msg = AmqStreamHook("amq_ok").test_connection()
    assert ok, msg
    assert "receipt" in msg


def test_test_connection_closed_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQ_CLOSED", f"amqstream://u:p@127.0.0.1:{free_port()}")
    ok, msg = AmqStreamHook("amq_closed").test_connection()
    assert not ok
    assert "cannot reach any broker" in msg and "127.0.0.1" in msg


def test_test_connection_bad_credentials_names_user_not_password(broker: EmbeddedBroker,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQ_BAD", f"amqstream://amqstream:wrong-secret@127.0.0.1:{broker.port}")
    ok, msg = AmqStreamHook("amq_bad").test_connection()
    assert not ok
    assert "refused login for user amqstream" in msg
    assert "wrong-secret" not in msg


def test_test_connection_anonymous_refused(broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQ_ANON", f"amqstream://127.0.0.1:{broker.port}")
    ok, msg = AmqStreamHook("amq_anon").test_connection()
    assert not ok and "refused" in msg


def test_failover_skips_dead_first_host(broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    info = broker.info()
    dead = free_port()
    # urlsplit cannot parse two ports in one netloc: failover lists go in the hosts extra.
    monkeypatch.setenv("AIRFLOW_CONN_AMQ_FO",
                       json.dumps({"conn_type": "amqstream", "host": "127.0.0.1", "port": dead,
                                   "login": info.user, "password": info.password,
                                   "extra": {"hosts": f"127.0.0.1:{dead},127.0.0.1:{info.port}"}}))
    ok, msg = AmqStreamHook("amq_fo").test_connection()
    assert ok, msg


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "airflow_provider_amqstream.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, **(env or {})})


def test_broker_command_survives_kill9_with_persistent_message(tmp_path: Path) -> None:
    data, port = str(tmp_path / "b"), str(free_port())
    r = _cli("broker", "start", "--data-dir", data, "--port", port)
    assert r.returncode == 0, r.stderr
    assert "generated credentials" in r.stdout and "AIRFLOW_CONN_AMQSTREAM_DEFAULT" in r.stdout
    try:
        assert _cli("broker", "status", "--data-dir", data).returncode == 0
        broker = EmbeddedBroker(data)
        assert broker.port == int(port)  # remembered from start
        uri = _cli("broker", "uri", "--data-dir", data).stdout.strip()
        from airflow_provider_amqstream.hooks.connection import params_from_uri
        params = params_from_uri(uri)
        with StompLink(params) as link:
            link.send_confirmed("/queue/survivor", b"\x00keep me", {})
        pid = broker.running_pid()
        broker.kill()
        assert broker.running_pid() is None
        assert _cli("broker", "status", "--data-dir", data).returncode == 1
        r = _cli("broker", "start", "--data-dir", data)
        assert r.returncode == 0, r.stderr
        assert "generated credentials" not in r.stdout  # printed once only
        assert broker.running_pid() not in (None, pid)
        with StompLink(params) as link:
            link.subscribe("/queue/survivor")
            frame = link.get(20)
            assert frame is not None and frame.body == b"\x00keep me"
            link.ack(frame)
    finally:
        r = _cli("broker", "stop", "--data-dir", data)
    assert "stopped" in r.stdout
    assert _cli("broker", "status", "--data-dir", data).returncode == 1


def test_broker_start_explains_missing_activemq(tmp_path: Path) -> None:
    r = _cli("broker", "start", "--data-dir", str(tmp_path / "b"), "--port", str(free_port()),
             env={"ACTIVEMQ_HOME": str(tmp_path / "nowhere"), "PATH": "/nonexistent"})
    # With PATH emptied java is missing too; either message must say what to install.
    assert r.returncode == 1
    assert "apt-get install" in r.stderr


def test_shipped_config_bounds_memory(tmp_path: Path) -> None:
    b = EmbeddedBroker(tmp_path / "b", port=free_port())
    conf, _ = b.render_config()
    xml = (conf / "activemq.xml").read_text()
    for needle in ('maxPageSize="16"', "<storeCursor/>", 'limit="128 mb"', "tcpNoDelay=true",
                   'concurrentStoreAndDispatchQueues="false"', "simpleAuthenticationPlugin",
                   'schedulerSupport="false"', "individualDeadLetterStrategy",
                   "transport.ioBufferSize=65536&amp;transport.socketBufferSize=1048576&amp;wireFormat"):
        assert needle in xml
    # The redelivery plugin would need the scheduler, which lets senders repeat messages.
    assert "<redeliveryPlugin" not in xml
    assert oct((conf / "activemq.xml").stat().st_mode & 0o777) == "0o600"  # it holds the password


def test_provider_discovered_through_entry_point() -> None:
    eps = importlib.metadata.entry_points(group="apache_airflow_provider")
    ours = [ep for ep in eps if ep.value.startswith("airflow_provider_amqstream")]
    assert len(ours) == 1
    info = ours[0].load()()
    assert info["package-name"] == "airflow-provider-amqstream"
    ct = info["connection-types"][0]
    assert ct["connection-type"] == "amqstream"
    assert {"hosts", "tls", "ca_file", "heartbeat_ms", "chunk_size", "window"} <= set(ct["conn-fields"])


def test_airflow_cli_lists_provider_hook_and_form() -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = lambda *a: subprocess.run(["airflow", "providers", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=120, env=env)
    assert "airflow-provider-amqstream" in run("list").stdout
    hooks = run("hooks").stdout
    assert "amqstream" in hooks and "AmqStreamHook" in hooks
    assert "amqstream" in run("behaviours").stdout
    widgets = run("widgets").stdout
    assert "extra__amqstream__window" in widgets and "extra__amqstream__tls" in widgets


def test_broker_jvm_runs_c1_only_unless_the_user_says_otherwise(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.broker.process import java_command

    monkeypatch.delenv("AMQSTREAM_BROKER_JAVA_OPTS", raising=False)
    cmd = java_command("java", tmp_path, tmp_path, tmp_path)
    assert "-XX:TieredStopAtLevel=1" in cmd
    # The user's options come later, so the JVM takes theirs (the last of a flag wins).
    monkeypatch.setenv("AMQSTREAM_BROKER_JAVA_OPTS", "-XX:TieredStopAtLevel=4")
    cmd = java_command("java", tmp_path, tmp_path, tmp_path)
    assert cmd.index("-XX:TieredStopAtLevel=4") > cmd.index("-XX:TieredStopAtLevel=1")
