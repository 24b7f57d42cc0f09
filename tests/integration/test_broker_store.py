"""Our store plugin (broker/java/, SizedStorePlugin): KahaDB marshals a message of 64 KiB or
more into one buffer of its size, writing the same journal bytes. A broker started with it says
so in its log; one started without the jar (an external ActiveMQ, or setup not run) says that
instead and moves files as before; a journal written with the plugin reads back without it."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker import process
from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import SendOptions, send_file
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import Receiver, free_port, make_file, params_as, running_broker, sha256_file

pytestmark = pytest.mark.broker

PLUGIN_LINE = "KahaDB marshals messages of 65536 bytes or more into one buffer of their size"


@pytest.fixture(autouse=True)
def _built() -> None:
    if process.broker_jar() is None:
        pytest.fail(f"{process.BROKER_JAR} is missing: `make setup` builds it (scripts/broker_jar.sh)")


def _without_jar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process, "BROKER_JAR", tmp_path / "absent.jar")


@pytest.fixture
def plain_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 caplog: pytest.LogCaptureFixture) -> Iterator[EmbeddedBroker]:
    """A broker started without our jar, as an external ActiveMQ would be."""
    _without_jar(tmp_path, monkeypatch)
    caplog.set_level(logging.INFO, logger=process.__name__)
    yield from running_broker(tmp_path / "broker")


def test_without_the_jar_the_broker_says_so_and_moves_files_as_before(
        plain_broker: EmbeddedBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The broker was started while the fixture was set up.
    said = [r.getMessage() for r in caplog.get_records("setup") if r.name == process.__name__]
    assert len(said) == 1 and "absent.jar is missing" in said[0] and "as ActiveMQ ships" in said[0]
    config = (plain_broker.data_dir / "conf" / "activemq.xml").read_text()
    assert "org.amqstream.broker.SizedStorePlugin" not in config
    assert PLUGIN_LINE not in plain_broker.log_file.read_text()
    params = params_as(plain_broker, None)
    # Chunks above and below the plugin's threshold, and a body of one chunk.
    for size, chunk in ((3 * 2**20 + 5, 256 * 1024), (200_003, 16 * 1024), (70_000, 2**20)):
        src = make_file(tmp_path / f"f{size}.bin", size, seed=size)
        rx = Receiver(params, "/queue/store.plain", tmp_path / f"out{size}")
        sent = send_file(params, src, "/queue/store.plain", SendOptions(chunk_size=chunk, compression="none"))
        got = rx.finish()
        assert got.sha256 == sent.sha256 == sha256_file(src) == sha256_file(Path(got.path or ""))


def test_a_file_through_the_plugin_arrives_whole(tmp_path: Path) -> None:
    for broker in running_broker(tmp_path / "broker"):
        assert PLUGIN_LINE in broker.log_file.read_text()
        params = params_as(broker, None)
        src = make_file(tmp_path / "f.bin", 5 * 2**20 + 11)
        rx = Receiver(params, "/queue/store.sized", tmp_path / "out")
        sent = send_file(params, src, "/queue/store.sized", SendOptions(chunk_size=2**20, compression="none"))
        got = rx.finish()
        assert got.sha256 == sent.sha256 == sha256_file(src) == sha256_file(Path(got.path or ""))


def test_what_the_plugin_stored_reads_back_without_the_jar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broker = EmbeddedBroker(tmp_path / "broker", port=free_port())
    # Above, at and below the threshold; a 1 MiB body with every byte value.
    bodies = [os.urandom(2**20), bytes(range(256)) * 4096, os.urandom(64 * 1024), os.urandom(64 * 1024 - 1),
              os.urandom(100)]
    try:
        broker.start()
        assert PLUGIN_LINE in broker.log_file.read_text()
        with StompLink(params_as(broker, None)) as link:
            for body in bodies:
                link.send_confirmed("/queue/store.kept", body, {"amqstream-n": str(len(body))})
        broker.stop()
        # The journal's format is ActiveMQ's own: a broker without our jar reads it.
        _without_jar(tmp_path, monkeypatch)
        broker.start()
        assert "org.amqstream.broker.SizedStorePlugin" not in (broker.data_dir / "conf" / "activemq.xml").read_text()
        with StompLink(params_as(broker, None)) as link:
            sub = link.subscribe("/queue/store.kept", prefetch=8)
            got = []
            for _ in bodies:
                frame = link.get(30, sub)
                assert frame is not None, "a message the plugin stored did not come back without it"
                link.ack(frame)
                assert frame.headers["amqstream-n"] == str(len(frame.body))
                got.append(bytes(frame.body))
        assert sorted(got) == sorted(bodies)
    finally:
        broker.stop()
