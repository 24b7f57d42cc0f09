"""Durability batched over groups of small files, on the in-memory link: a receiver that dies
after a group's records are durable but before its acknowledgements, or a sender that dies
before its ledger records a group of confirmations, loses no file and publishes none twice;
files whose records were durable come back as duplicates. The crash is an exception raised at
that point (the link closes, so the in-memory broker hands the unacknowledged packs out
again)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_streams, send_files
from airflow_provider_amqstream.engine.receive import inline
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/small"
FILES = 40  # three packs at 16 KiB a file: one group of them, more than one pack


class Crash(BaseException):
    """The receiver dying: nothing in the engine catches it (as nothing runs after a kill)."""


def _sources(tmp_path: Path) -> dict[str, bytes]:
    src = tmp_path / "in"
    src.mkdir()
    data = {f"f{i:03d}.bin": os.urandom(16 * 1024 + i) for i in range(FILES)}
    for name, body in data.items():
        (src / name).write_bytes(body)
    return data


def _send(broker: MemoryBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, bytes]:
    data = _sources(tmp_path)
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "state"))
    sent = send_files(broker.params("tx"), [tmp_path / "in" / n for n in sorted(data)], Q, SendOptions(manifest=False))
    assert sent.totals()["files_sent"] == FILES
    return data


def _receive(broker: MemoryBroker, out: Path) -> list[Any]:
    return receive_streams(broker.params("rx"), Q, out, count=FILES,
                           options=ReceiveOptions(wait_timeout=0.5, idle_timeout=0.5))


def _published(out: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in out.iterdir() if not f.name.startswith(".")}


def test_a_crash_after_the_records_before_the_acks_gives_duplicates_not_losses(
        broker: MemoryBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _send(broker, tmp_path, monkeypatch)
    out = tmp_path / "out"

    def die(link: Any, offer: Any) -> None:
        raise Crash

    with monkeypatch.context() as m:
        m.setattr(inline, "settle", die)
        with pytest.raises(Crash):
            _receive(broker, out)
    assert _published(out) == data  # the group was durable before anything was acknowledged
    again = _receive(broker, out)
    assert sorted(r.status for r in again) == ["duplicate"] * FILES
    assert _published(out) == data, "a file was lost or published twice"


def test_a_sender_that_dies_before_its_ledger_is_flushed_sends_again_as_duplicates(
        broker: MemoryBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger is written once per group of confirmations: files the broker confirmed but
    the ledger had not recorded when the sender died are sent again by the re-run, and the
    receiver reports them as duplicates (nothing lost, nothing published twice)."""
    from airflow_provider_amqstream.engine.send import batch

    assert batch.LEDGER_GROUP > FILES  # so the whole send is one unflushed group
    data = _sources(tmp_path)
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "state"))
    files = [tmp_path / "in" / n for n in sorted(data)]

    def die(self: Any) -> None:
        if self.buffer:
            raise Crash

    with monkeypatch.context() as m:
        m.setattr(batch.BatchLedger, "flush", die)
        with pytest.raises(Crash):
            send_files(broker.params("tx"), files, Q, SendOptions(manifest=False), batch_id="b1")
    out = tmp_path / "out"
    first = _receive(broker, out)
    assert sorted(r.status for r in first) == ["complete"] * FILES  # the broker had them all
    again = send_files(broker.params("tx"), files, Q, SendOptions(manifest=False), batch_id="b1")
    assert again.totals()["files_sent"] == FILES, "the re-run skipped files its ledger never recorded"
    second = _receive(broker, out)
    assert sorted(r.status for r in second) == ["duplicate"] * FILES
    assert _published(out) == data
    # Now flushed: a third run sends nothing.
    third = send_files(broker.params("tx"), files, Q, SendOptions(manifest=False), batch_id="b1")
    assert third.totals()["files_sent"] == 0
