"""Memory flat in the number of files, both ends, on the in-memory link: the traced peak of
a send (and of a receive) of 5,000 tiny files is within a small bound of that of 1,000.
Before the ends streamed their files and results, each file kept ~2.4 KiB on the sender and
~4.4 KiB on the receiver: 4,000 more files were ~10 MB and ~17 MB more."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import (
    BulkResult,
    ReceiveOptions,
    find_manifest,
    iter_files,
    receive_streams,
    send_files,
)
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/many"
# What 4,000 more files may add to a peak: well under one file's former cost each (~1 KiB
# would be 4 MB), with room for how many messages happen to wait in the broker meanwhile.
BOUND = 1_500_000


@pytest.fixture
def broker() -> Iterator[MemoryBroker]:
    b = MemoryBroker()
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "state"))


def make_tree(root: Path, count: int) -> Path:
    for i in range(count):
        d = root / f"d{i // 100:03d}"
        if i % 100 == 0:
            d.mkdir(parents=True)
        (d / f"f{i:05d}.txt").write_bytes(b"%08d" % i)
    return root


def traced_peak(fn: Callable[[], object]) -> int:
    """Bytes the traced peak of ``fn`` rose above what was allocated when it started."""
    # pytest's heap is large and long-lived, so the collector's oldest generation runs only
    # when it grows by a quarter: cyclic garbage (frames, tracebacks) then piles up for a
    # while, by the number of files, where the command line (a small heap) collects it at
    # once. Freezing what exists now measures the code as the command line runs it.
    gc.collect()
    gc.freeze()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.unfreeze()


def consume_everything(broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``broker`` drop each message as it arrives, as a consumer keeping up would: the
    in-memory broker is in this process, traced too, and must not hold the whole send while
    the sender is measured."""
    monkeypatch.setattr(broker, "_dispatch", lambda name: broker.queues[name].clear())


def send_peak(broker: MemoryBroker, src: Path, count: int) -> int:
    box: dict[str, BulkResult] = {}

    def send() -> None:
        box["res"] = send_files(broker.params("alice"), iter_files([src], recursive=True), Q, manifest=True,
                                restart=True)

    with pytest.MonkeyPatch.context() as mp:
        consume_everything(broker, mp)
        peak = traced_peak(send)
    totals = box["res"].totals()
    assert (totals["files"], totals["files_sent"], totals["files_failed"]) == (count, count, 0)
    return peak


def receive_peak(broker: MemoryBroker, src: Path, out: Path, count: int) -> int:
    # Sent again (measured above, dropped): now the receiver gets every file of it.
    res = send_files(broker.params("alice"), iter_files([src], recursive=True), Q, manifest=True, restart=True)
    got = []

    def receive() -> None:
        receive_streams(broker.params("rx"), Q, out, count=count, keep=0, on_result=lambda r: got.append(1),
                        options=ReceiveOptions(wait_timeout=2.0))

    peak = traced_peak(receive)
    assert len(got) == count
    manifest = find_manifest(out, res.batch_id)
    assert manifest is not None and sum(1 for _ in manifest.open()) == count
    return peak


def test_send_and_receive_peak_do_not_grow_with_the_number_of_files(broker: MemoryBroker, tmp_path: Path) -> None:
    small, large = make_tree(tmp_path / "small", 1000), make_tree(tmp_path / "large", 5000)
    # Once unmeasured, so imports and first-use caches land outside both measurements.
    send_peak(broker, make_tree(tmp_path / "warm", 50), 50)
    sends = [send_peak(broker, small, 1000), send_peak(broker, large, 5000)]
    receives = [receive_peak(broker, small, tmp_path / "out-small", 1000),
                receive_peak(broker, large, tmp_path / "out-large", 5000)]
    assert sends[1] - sends[0] < BOUND, f"send peaks {sends} (1,000 then 5,000 files)"
    assert receives[1] - receives[0] < BOUND, f"receive peaks {receives} (1,000 then 5,000 files)"
