"""A shared-store master/slave pair on loopback; the master is killed mid-transfer
and the transfer finishes through the slave, byte-exact. Marker: failover."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import SendOptions
from tests.helpers import cli, cli_json, free_port, make_file, read_json, sha256_file, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.failover]


def test_transfer_survives_master_death(tmp_path: Path) -> None:
    store = tmp_path / "shared-kahadb"
    master = EmbeddedBroker(tmp_path / "master", port=free_port(), store_dir=store)
    master.start()
    # The slave shares the credentials so clients log in to either.
    (tmp_path / "slave").mkdir()
    (tmp_path / "slave" / "credentials.json").write_text(master.creds_file.read_text())
    (tmp_path / "slave" / "credentials.json").chmod(0o600)
    slave = EmbeddedBroker(tmp_path / "slave", port=free_port(), store_dir=store)
    slave.start(wait=False)  # blocks on the store lock until the master dies
    try:
        info = master.info()
        conn = json.dumps({"conn_type": "amqstream", "login": info.user, "password": info.password,
                           "host": "127.0.0.1", "extra": {"hosts": f"127.0.0.1:{master.port},127.0.0.1:{slave.port}"}})
        env = {"AIRFLOW_CONN_AMQS_PAIR": conn}
        src = make_file(tmp_path / "big.bin", 192 * 2**20 + 5)
        out = tmp_path / "out"
        receiver = cli("receive", "--from", "/queue/fo", "--out-dir", str(out), "--conn", "amqs_pair", "--json",
                       "-q", "--wait", "60", env=env)
        sender = cli("send", str(src), "--to", "/queue/fo", "--conn", "amqs_pair", "--stream-id", "fo-1",
                     "--chunk-size", str(256 * 1024), "--window", "4", "--json", "-q", env=env)
        wait_for(lambda: (read_json(out / ".amqstream" / "fo-1.json") or {}).get("next_seq", 0) >= 100, 90,
                 "the receiver to store 100 chunks through the master")
        master.kill()
        wait_for(slave.port_open, 60, "the slave to take over")
        [sent] = cli_json(sender)
        [got] = cli_json(receiver)
        assert got["sha256"] == sent["sha256"] == sha256_file(src) == sha256_file(out / "big.bin")
    finally:
        slave.stop()
        master.stop()


def test_a_long_send_that_loses_the_broker_gets_the_whole_reconnect_timeout(
        params: object, tmp_path: Path, queue_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``reconnect_timeout`` bounds a broker that stays away, not the transfer: a send that
    ran longer than it and then lost its connection must still reconnect (it gave up at
    once, the deadline having passed during the transfer)."""
    import types

    from airflow_provider_amqstream.engine import records
    from airflow_provider_amqstream.engine.send import stream as sending
    from airflow_provider_amqstream.exceptions import ConnectionLost

    src = make_file(tmp_path / "long.bin", 3 * 2**20 + 5, seed=3)
    clock = [0.0]
    real_time = records.time
    # Backoff's clock, ten minutes later once the first attempt ends: a long transfer.
    monkeypatch.setattr(records, "time", types.SimpleNamespace(
        monotonic=lambda: real_time.monotonic() + clock[0], sleep=real_time.sleep, time=real_time.time))
    real_over, calls = sending._Attempt.over, []

    def lost_after_the_data(self: sending._Attempt, link: object) -> None:
        calls.append(1)
        real_over(self, link)
        if len(calls) == 1:
            clock[0] += 600
            raise ConnectionLost(f"connection to {params.url} was lost (test)")  # type: ignore[attr-defined]

    monkeypatch.setattr(sending._Attempt, "over", lost_after_the_data)
    res = sending.send_file(params, src, queue_name,
                            options=SendOptions(chunk_size=1024 * 1024, window=1, reconnect_timeout=30))
    assert len(calls) == 2 and res.sha256 == sha256_file(src)
