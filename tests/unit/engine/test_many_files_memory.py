"""Memory flat in the number of files, both ends, on the in-memory link: the traced peak of
a send (and of a receive) of 5,000 tiny files is within a small bound of that of 1,000.
Before the ends streamed their files and results, each file kept ~2.4 KiB on the sender and
~4.4 KiB on the receiver: 4,000 more files were ~10 MB and ~17 MB more."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import (
    BulkResult,
    ReceiveOptions,
    SendOptions,
    find_manifest,
    iter_files,
    receive_streams,
    send_files,
)
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/many"
# What 4,000 more files may add to a peak. The part of it that is not per file: a batch's
# list travels (and is checked) in parts of up to 2,000 files (protocol/bulk.py,
# BATCH_PART_FILES), and the receiver looks a part's completion records up together, so the
# 1,000-file batch has a part half the size of the 5,000-file one's (~1.5 MB less on the
# receiver); past 2,000 files that stops growing. Per file, the bound is ~750 bytes, against
# the 2.4 KiB (send) and 4.4 KiB (receive) each file used to keep.
BOUND = 3_000_000


ROOT = Path(__file__).resolve().parents[3]


def make_tree(root: Path, count: int) -> Path:
    for i in range(count):
        d = root / f"d{i // 100:03d}"
        if i % 100 == 0:
            d.mkdir(parents=True)
        (d / f"f{i:05d}.txt").write_bytes(b"%08d" % i)
    return root


def traced_peak(fn: Callable[[], object]) -> int:
    """Bytes the traced peak of ``fn`` rose above what was allocated when it started."""
    # What exists already is no concern of the measurement (and not scanned while it runs).
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
        box["res"] = send_files(broker.params("alice"), iter_files([src], recursive=True), Q,
                                SendOptions(manifest=True, restart=True))

    with pytest.MonkeyPatch.context() as mp:
        consume_everything(broker, mp)
        peak = traced_peak(send)
    totals = box["res"].totals()
    assert (totals["files"], totals["files_sent"], totals["files_failed"]) == (count, count, 0)
    return peak


def receive_peak(broker: MemoryBroker, src: Path, out: Path, count: int) -> int:
    # Sent again (measured above, dropped): now the receiver gets every file of it.
    res = send_files(broker.params("alice"), iter_files([src], recursive=True), Q,
                     SendOptions(manifest=True, restart=True))
    got = []

    def receive() -> None:
        receive_streams(broker.params("rx"), Q, out, count=count, on_result=lambda r: got.append(1),
                        options=ReceiveOptions(wait_timeout=2.0))

    peak = traced_peak(receive)
    assert len(got) == count
    manifest = find_manifest(out, res.batch_id)
    assert manifest is not None and sum(1 for _ in manifest.open()) == count
    return peak


def measure(work: Path) -> dict[str, list[int]]:
    """The traced peaks of a send and a receive of 1,000 and of 5,000 files under ``work``."""
    broker = MemoryBroker()
    try:
        small, large = make_tree(work / "small", 1000), make_tree(work / "large", 5000)
        # Once unmeasured, so imports and first-use caches land outside both measurements.
        send_peak(broker, make_tree(work / "warm", 50), 50)
        sends = [send_peak(broker, small, 1000), send_peak(broker, large, 5000)]
        receives = [receive_peak(broker, small, work / "out-small", 1000),
                    receive_peak(broker, large, work / "out-large", 5000)]
    finally:
        broker.close()
    return {"sends": sends, "receives": receives}


def test_send_and_receive_peak_do_not_grow_with_the_number_of_files(tmp_path: Path) -> None:
    # Measured in a process of its own, as the command line runs: pytest's process holds
    # thousands of objects of its own and its peaks wander by megabytes between two runs.
    code = ("import json, sys; from pathlib import Path; "
            "from tests.unit.engine.test_many_files_memory import measure; "
            "print(json.dumps(measure(Path(sys.argv[1]))))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=1200, env={**os.environ, "AMQSTREAM_STATE_DIR": str(tmp_path / "state")})
    assert run.returncode == 0, run.stderr[-3000:]
    peaks = json.loads(run.stdout.splitlines()[-1])
    sends, receives = peaks["sends"], peaks["receives"]
    assert sends[1] - sends[0] < BOUND, f"send peaks {sends} (1,000 then 5,000 files)"
    assert receives[1] - receives[0] < BOUND, f"receive peaks {receives} (1,000 then 5,000 files)"
