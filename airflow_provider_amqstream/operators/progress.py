"""Transfer progress as task-log lines: of one stream (LogProgress), of a many-file send
(BatchLogProgress)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from airflow_provider_amqstream.hooks.amqstream import BatchStatus, ProgressMeter, RecentRate


class TaskLog(Protocol):
    """What the operators write to: a task's logger, Airflow's structlog one in a task (its
    ``log`` property) or a ``logging.Logger``."""

    def info(self, msg: Any, /, *args: Any) -> object: ...

    def warning(self, msg: Any, /, *args: Any) -> object: ...


class LogProgress:
    """A line every ``interval`` seconds with bytes, % and this try's recent MiB/s; the last line once."""

    def __init__(self, log: TaskLog, label: str, interval: float = 10.0) -> None:
        self.log, self.label = log, label
        self.meter = ProgressMeter(interval)

    def __call__(self, done: int, total: int) -> None:
        rep = self.meter.reading(done, total)
        if rep is None:
            return
        rate = f", {rep.rate / 2**20:.1f} MiB/s" if rep.rate is not None else ""
        self.log.info("%s: %d of %d bytes (%.1f%%)%s", self.label, rep.done, rep.total, rep.percent, rate)


class BatchLogProgress:
    """A line every ``interval`` seconds with files and MiB done of a many-file send and its
    recent MiB/s, and the line of its last file."""

    def __init__(self, log: TaskLog, label: str, interval: float = 10.0) -> None:
        self.log, self.label, self.interval = log, label, interval
        self.last = 0.0
        self.rate = RecentRate()

    def __call__(self, st: BatchStatus) -> None:
        now = time.monotonic()
        rate = self.rate.add(now, st.bytes_done)
        if st.files_done + st.failed < st.files_total and now - self.last < self.interval:
            return
        self.last = now
        shown = f", {rate / 2**20:.1f} MiB/s" if rate is not None else ""
        self.log.info("%s: %d of %d files, %.1f of %.1f MiB%s", self.label,
                      st.files_done, st.files_total, st.bytes_done / 2**20, st.bytes_total / 2**20, shown)
