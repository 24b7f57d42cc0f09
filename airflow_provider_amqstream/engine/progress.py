"""When a progress display should speak, and what rate it may honestly claim.

The engine calls a progress callback with ``(bytes done, total)``; ``done`` counts bytes
from earlier runs of a resumed transfer too, and the end of a stream may be reported more
than once (after the last window and again when the stream is closed). Both the terminal
bar of the CLI and the task-log lines of the operators render what :class:`ProgressMeter`
decides: the final line once, and a rate over bytes moved in this run only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ProgressReport:
    """One line worth showing.

    :param done: bytes of the stream that are done, earlier runs included.
    :param total: the stream's size.
    :param rate: bytes per second moved in this run, or None before there are two
        readings to measure between.
    :param final: the stream is complete; nothing more will be reported.
    """

    done: int
    total: int
    rate: float | None
    final: bool

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0


class ProgressMeter:
    """Throttle progress readings and measure this run's rate.

    The first reading is the baseline: a resumed transfer starts with the bytes of its
    earlier runs already counted, so the rate is measured from there, never from zero.

    :param interval: least seconds between two reports before the final one.
    :param clock: monotonic seconds (a parameter so tests can drive it).
    """

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.base: tuple[int, float] | None = None
        self.last: float | None = None
        self.finished = False

    def reading(self, done: int, total: int) -> ProgressReport | None:
        """The report to show for this reading, or None to stay quiet."""
        if self.finished:
            return None
        now = self.clock()
        final = done >= total
        if self.base is None:
            self.base = (done, now)
        elif not final and self.last is not None and now - self.last < self.interval:
            return None
        self.last = now
        base_done, base_t = self.base
        rate = (done - base_done) / (now - base_t) if now > base_t and done > base_done else None
        self.finished = final
        return ProgressReport(done, total, rate, final)
