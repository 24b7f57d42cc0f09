"""Fixtures: real ActiveMQ brokers started for the tests and stopped after them."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import pytest

from airflow_provider_amqstream.broker import EmbeddedBroker
from airflow_provider_amqstream.transport import BrokerParams
from tests.helpers import free_port

logging.getLogger("stomp.py").setLevel(logging.CRITICAL)


def _params(broker: EmbeddedBroker) -> BrokerParams:
    info = broker.info()
    return BrokerParams(hosts=((info.host, info.port),), login=info.user, password=info.password,
                        connect_timeout=10.0, receipt_timeout=30.0)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One authenticated broker for the session (tests use their own queue names)."""
    b = EmbeddedBroker(tmp_path_factory.mktemp("broker"), port=free_port())
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A broker this test may kill and restart."""
    b = EmbeddedBroker(tmp_path / "broker", port=free_port())
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def params(broker: EmbeddedBroker) -> BrokerParams:
    return _params(broker)


@pytest.fixture
def uri(broker: EmbeddedBroker) -> str:
    return broker.info().uri


@pytest.fixture
def queue_name(request: pytest.FixtureRequest) -> str:
    """A destination no other test uses."""
    safe = "".join(c if c.isalnum() else "_" for c in request.node.name)[:60]
    return f"/queue/t.{safe}.{os.getpid()}"


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "send-state"))
