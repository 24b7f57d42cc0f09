"""How often a trigger may speak: rare "still waiting" lines."""

from __future__ import annotations

import time


class Every:
    """True at most once per ``interval`` seconds: for rare "still waiting" lines.

    :param interval: seconds between two true answers.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval:
            return False
        self.last = now
        return True
