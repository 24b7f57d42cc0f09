"""LogProgress: transfer progress as task-log lines."""

from __future__ import annotations

import logging

from airflow_provider_amqstream.progress import ProgressMeter


class LogProgress:
    """A line every ``interval`` seconds with bytes, % and this try's MiB/s; the last line once.

    :param log: the task's logger.
    :param label: what moves, e.g. ``stream ID -> /queue/x``.
    :param interval: seconds between lines before the last.
    """

    def __init__(self, log: logging.Logger, label: str, interval: float = 10.0) -> None:
        self.log, self.label = log, label
        self.meter = ProgressMeter(interval)

    def __call__(self, done: int, total: int) -> None:
        rep = self.meter.reading(done, total)
        if rep is None:
            return
        rate = f", {rep.rate / 2**20:.1f} MiB/s" if rep.rate is not None else ""
        self.log.info("%s: %d of %d bytes (%.1f%%)%s", self.label, rep.done, rep.total, rep.percent, rate)
