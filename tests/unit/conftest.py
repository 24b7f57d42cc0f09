"""Unit tests run the engine on the in-memory broker: ``broker`` is one per test (the
real ActiveMQ of tests/conftest.py is for the integration and system tests)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from airflow_provider_amqstream.transport.memory import MemoryBroker


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    b = MemoryBroker()
    yield b
    b.close()
