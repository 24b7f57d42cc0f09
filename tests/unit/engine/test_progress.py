"""Progress displays: the last line once, rates over this run only."""

from __future__ import annotations

import logging

import pytest

from airflow_provider_amqstream.engine.progress import ProgressMeter
from airflow_provider_amqstream.operators.progress import LogProgress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_final_reading_reported_once() -> None:
    clock = Clock()
    meter = ProgressMeter(10.0, clock)
    assert meter.reading(10, 100) is not None
    clock.t += 1
    assert meter.reading(20, 100) is None  # within the interval
    clock.t += 1
    final = meter.reading(100, 100)
    assert final is not None and final.final and final.percent == 100.0
    clock.t += 1
    assert meter.reading(100, 100) is None  # the engine reports the end twice


def test_rate_of_a_resumed_transfer_starts_from_its_first_reading() -> None:
    clock = Clock()
    meter = ProgressMeter(0.0, clock)
    first = meter.reading(900, 1000)  # 900 bytes came from an earlier run
    assert first is not None and first.rate is None
    clock.t += 2.0
    last = meter.reading(1000, 1000)
    assert last is not None and last.rate == pytest.approx(50.0)


def test_log_progress_logs_the_end_once(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("amqs.test.progress")
    progress = LogProgress(log, "stream s -> /queue/q", interval=3600)
    with caplog.at_level(logging.INFO, logger=log.name):
        for done in (2**20, 2 * 2**20, 3 * 2**20, 3 * 2**20):
            progress(done, 3 * 2**20)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines  # the first reading, then the end, once
    assert lines[-1].startswith("stream s -> /queue/q: 3145728 of 3145728 bytes (100.0%), ")
    assert lines[-1].endswith(" MiB/s")
