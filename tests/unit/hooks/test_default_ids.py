"""Default stream and batch ids are keyed by the connection's secret: stable for every
worker and retry that uses the connection, and not computable by another user who knows
the file, the destination or the Airflow run."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_provider_amqstream.engine import default_stream_id, id_key
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.operators.stream import task_batch_id
from airflow_provider_amqstream.transport.params import BrokerParams

QUEUE = "/queue/ids"


def _params(login: str | None, password: str | None) -> BrokerParams:
    return BrokerParams(hosts=(("127.0.0.1", 61613),), login=login, password=password)


def test_the_key_is_stable_per_connection_and_differs_between_users() -> None:
    alice = id_key(_params("alice", "alice-pw"))
    assert alice == id_key(_params("alice", "alice-pw")) and len(alice) == 32
    assert len({alice, id_key(_params("bob", "alice-pw")), id_key(_params("alice", "other-pw"))}) == 3
    assert id_key(_params("alice", None)) == b"" == id_key(_params(None, ""))


def test_a_default_stream_id_without_the_key_is_not_the_senders(tmp_path: Path) -> None:
    src = tmp_path / "report.csv"
    src.write_bytes(b"a,b\n1,2\n")
    guess = default_stream_id(src, QUEUE)
    alice = default_stream_id(src, QUEUE, key=id_key(_params("alice", "alice-pw")))
    bob = default_stream_id(src, QUEUE, key=id_key(_params("bob", "bob-pw")))
    assert len({guess, alice, bob}) == 3
    assert all(sid.startswith("report.csv-") for sid in (guess, alice, bob))
    assert alice == default_stream_id(src, QUEUE, key=id_key(_params("alice", "alice-pw")))
    # A changed file is another stream under the same key.
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert default_stream_id(src, QUEUE, key=id_key(_params("alice", "alice-pw"))) != alice


def test_the_hook_and_the_operator_key_ids_with_the_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "x.bin"
    src.write_bytes(b"x")
    ti = SimpleNamespace(dag_id="d", run_id="manual__1", map_index=-1)
    ids = {}
    for user in ("alice", "bob"):
        monkeypatch.setenv(f"AIRFLOW_CONN_IDS_{user.upper()}", f"amqstream://{user}:{user}-pw@127.0.0.1:61613")
        hook = AmqStreamHook(f"ids_{user}")
        ids[user] = (hook.default_stream_id(src, QUEUE), task_batch_id(hook, ti, "send"))
        assert ids[user] == (hook.default_stream_id(src, QUEUE), task_batch_id(hook, ti, "send"))
        assert ids[user][1].startswith("af-") and len(ids[user][1]) == 27
    assert ids["alice"][0] != ids["bob"][0] and ids["alice"][1] != ids["bob"][1]
    assert ids["alice"][0] == default_stream_id(src, QUEUE, key=id_key(_params("alice", "alice-pw")))
