"""Time is an argument: policies receive `now_s`; only bodies (runtime, simulator) own a clock."""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "WallClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...


class WallClock:
    """The live runtime's clock: monotonic, immune to wall-clock steps."""

    def now(self) -> float:
        return time.monotonic()
