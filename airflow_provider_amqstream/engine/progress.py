"""When a progress display should speak, and what rate it may honestly claim.

The engine calls a progress callback with ``(bytes done, total)``; ``done`` counts bytes
from earlier runs of a resumed transfer too, and the end of a stream may be reported more
than once (after the last window and again when the stream is closed). Both the terminal
bar of the CLI and the task-log lines of the operators render what :class:`ProgressMeter`
decides: the final line once, and the rate of the last :data:`RATE_WINDOW` seconds of this
run (:class:`RecentRate`), never an average over an outage or over earlier runs.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

# Seconds of readings a rate is measured over. Long enough to smooth the bursts of a
# windowed sender (a reading per confirmed window), short enough that a rate after a broker
# outage says how fast it goes now, not how long the broker was away.
RATE_WINDOW = 30.0


class RecentRate:
    """Bytes per second over the readings of the last :data:`RATE_WINDOW` seconds.

    A gap between two readings longer than the window (a broker outage, a stalled sender)
    starts the measurement again: the bytes before it say nothing about the speed after.
    """

    def __init__(self) -> None:
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, done: int) -> float | None:
        """Record ``done`` bytes at ``now``; return the rate, or None before two readings span any time."""
        if self.samples and now - self.samples[-1][0] > RATE_WINDOW:
            self.samples.clear()
        self.samples.append((now, done))
        # Keep one reading at or before the window's start, so the rate spans the whole window.
        while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_WINDOW:
            self.samples.popleft()
        t0, d0 = self.samples[0]
        if now <= t0 or done < d0:
            return None
        return (done - d0) / (now - t0)


@dataclass(frozen=True)
class ProgressReport:
    """One line worth showing.

    :param done: bytes of the stream that are done, earlier runs included.
    :param total: the stream's size.
    :param rate: bytes per second moved in this run over the last readings (see
        :class:`RecentRate`), or None before there are two readings to measure between.
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
    """Throttle progress readings and measure this run's recent rate.

    The first reading is the baseline: a resumed transfer starts with the bytes of its
    earlier runs already counted, so the rate is measured from there, never from zero.

    :param interval: least seconds between two reports before the final one.
    :param clock: monotonic seconds (a parameter so tests can drive it).
    """

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.rate = RecentRate()
        self.last: float | None = None
        self.finished = False

    def reading(self, done: int, total: int) -> ProgressReport | None:
        """The report to show for this reading, or None to stay quiet."""
        if self.finished:
            return None
        now = self.clock()
        final = done >= total
        rate = self.rate.add(now, done)
        if not final and self.last is not None and now - self.last < self.interval:
            return None
        self.last = now
        self.finished = final
        return ProgressReport(done, total, rate, final)
