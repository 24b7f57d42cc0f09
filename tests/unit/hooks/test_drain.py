"""A drain for a batch ends when that batch's manifest is written, on the in-memory broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, send_file, send_files
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/drain"


@pytest.fixture
def hook(broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AmqStreamHook:
    monkeypatch.setattr(AmqStreamHook, "broker_params", lambda self: broker.params("alice"))
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "state"))
    return AmqStreamHook()


def _files(root: Path, n: int) -> list[Path]:
    root.mkdir()
    for i in range(n):
        (root / f"f{i}.csv").write_text(f"row {i}\n" * 100)
    return sorted(root.iterdir())


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-stream-each"])
def test_a_batch_drain_stops_at_its_manifest_and_leaves_the_next_stream(hook: AmqStreamHook, broker: MemoryBroker,
                                                                       tmp_path: Path, pack: bool) -> None:
    sent = send_files(broker.params("alice"), _files(tmp_path / "a", 3), Q, SendOptions(pack=pack, manifest=True))
    after = tmp_path / "after.bin"
    after.write_bytes(b"x" * 5000)
    send_file(broker.params("alice"), after, Q, stream_id="after-1")
    out = tmp_path / "out"
    # A quiet time far longer than the test: only the manifest can end this drain.
    got = hook.drain(Q, out, options=ReceiveOptions(wait_timeout=600), batch_id=sent.batch_id, deadline=600)
    assert got.manifest is not None and len(got.manifest.read_text().splitlines()) == 3
    assert got.count == 3, [f["stream_id"] for f in got.files]
    assert not (out / "after.bin").exists()
    # The stream behind the batch is still offered, to the next receive.
    [later] = hook.receive_streams(Q, out, count=1, options=ReceiveOptions(wait_timeout=30))
    assert later.stream_id == "after-1"


def test_a_drain_tells_the_callers_event_sink_every_event(hook: AmqStreamHook, broker: MemoryBroker,
                                                         tmp_path: Path) -> None:
    sent = send_files(broker.params("alice"), _files(tmp_path / "a", 2), Q, SendOptions(manifest=True))
    seen: list[str] = []
    got = hook.drain(Q, tmp_path / "out", options=ReceiveOptions(wait_timeout=600, events=lambda k, d: seen.append(k)),
                     batch_id=sent.batch_id, deadline=600)
    assert got.manifest is not None
    assert "batch_complete" in seen and "batch_listed" in seen, seen
