"""The operators pass sealing through: seal_to is checked when the DAG is parsed, and a sealed
file sent by SendStreamOperator arrives whole through ReceiveStreamsOperator's keys; on the
in-memory broker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine.keys import new_key_file
from airflow_provider_amqstream.exceptions import ConfigurationError
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.protocol import seal
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/sealed-ops"


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[MemoryBroker]:
    b = MemoryBroker()
    monkeypatch.setattr(AmqStreamHook, "broker_params", lambda self: b.params("alice"))
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "state"))
    yield b
    b.close()


def test_a_bad_recipient_fails_the_dag_at_parse_time() -> None:
    with pytest.raises(ConfigurationError, match="recipient"):
        SendStreamOperator(task_id="send", path="/x", destination=Q, seal_to=["amqs1nope"])


def test_a_sealed_file_goes_from_operator_to_operator(broker: MemoryBroker, tmp_path: Path) -> None:
    key = tmp_path / "rx.key"
    recipient = new_key_file(key).recipient
    src = tmp_path / "ledger 2026.csv"
    src.write_bytes(b"id,amount\n" * 500)
    sent = SendStreamOperator(task_id="send", path=str(src), destination=Q, seal_to=[recipient]).execute({})
    assert sent["stream_id"].startswith("sealed-")
    [(offer, _)] = broker.messages(Q)
    assert seal.H_SEAL in offer and "ledger" not in str(offer)
    got = ReceiveStreamsOperator(task_id="receive", source=Q, out_dir=str(tmp_path / "out"), count=1,
                                 wait_timeout=5, keys=[str(key)]).execute({})
    assert got["count"] == 1 and (tmp_path / "out" / "ledger 2026.csv").read_bytes() == src.read_bytes()
