"""How often a trigger may speak: rare "still waiting" lines."""

from __future__ import annotations

import time


class Every:
    """True at most once per ``interval`` seconds: the 10 minutes the README promises."""

    interval = 600.0

    def __init__(self) -> None:
        self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval:
            return False
        self.last = now
        return True
