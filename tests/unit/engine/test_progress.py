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


def test_rate_after_an_outage_is_the_rate_now_not_an_average_over_the_downtime() -> None:
    # 20 s at 10 MiB/s, the broker away for 120 s, then 10 MiB/s again.
    # The old meter averaged over everything since the first reading (~1.4 MiB/s here).
    clock = Clock()
    meter = ProgressMeter(0.0, clock)
    mib, done = 2**20, 0
    for _ in range(20):
        meter.reading(done, 1000 * mib)
        clock.t += 1.0
        done += 10 * mib
    clock.t += 120.0  # the outage: no readings
    after = meter.reading(done, 1000 * mib)
    assert after is not None and after.rate is None  # one reading since the outage: no rate yet
    for _ in range(5):
        clock.t += 1.0
        done += 10 * mib
        rep = meter.reading(done, 1000 * mib)
    assert rep is not None and rep.rate == pytest.approx(10 * mib)


def test_rate_is_over_the_last_window_of_readings() -> None:
    clock = Clock()
    meter = ProgressMeter(0.0, clock)
    done = 0
    for step in range(120):  # 60 s at 100 B/s, then 60 s at 1000 B/s
        clock.t += 1.0
        done += 100 if step < 60 else 1000
        rep = meter.reading(done, 10**9)
    assert rep is not None and rep.rate == pytest.approx(1000.0)


def test_batch_log_progress_shows_the_recent_rate(caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.engine import BatchStatus
    from airflow_provider_amqstream.operators import progress as op_progress
    from airflow_provider_amqstream.operators.progress import BatchLogProgress

    clock = Clock()
    monkeypatch.setattr(op_progress.time, "monotonic", clock)
    log = logging.getLogger("amqs.test.batch")
    show = BatchLogProgress(log, "batch b -> /queue/q", interval=10.0)
    st = BatchStatus(files_total=20, bytes_total=20 * 2**20)
    with caplog.at_level(logging.INFO, logger=log.name):
        for i in range(10):
            st.files_done, st.bytes_done = i, i * 2**20
            show(st)
            clock.t += 1.0
        clock.t += 300.0  # an outage
        for i in range(10, 21):  # the last reading is the batch's end: always logged
            st.files_done, st.bytes_done = i, i * 2**20
            show(st)
            clock.t += 0.5
    last = caplog.records[-1].getMessage()
    assert last == "batch b -> /queue/q: 20 of 20 files, 20.0 of 20.0 MiB, 2.0 MiB/s", last
