"""A discrete-event loop on a virtual clock: the simulator's body, with no asyncio and no wall clock.

Events are (time_s, seq, callback) in a heap. `seq` rises with every scheduling call, so events
due at the same instant run in the order they were scheduled: a run is a function of its inputs
alone, whatever the platform or the hash seed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["VirtualClock", "EventHandle", "EventLoop"]


class VirtualClock:
    """Satisfies `tidegate.clock.Clock`: the time the loop has reached, moved only by the loop."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now(self) -> float:
        return self._now_s

    def advance_to(self, time_s: float) -> None:
        if time_s < self._now_s:
            raise ValueError(f"virtual time cannot go back from {self._now_s} to {time_s}")
        self._now_s = time_s


@dataclass(eq=False, slots=True)
class EventHandle:
    """A scheduled callback; `cancel()` keeps it from running (it stays in the heap, skipped)."""

    time_s: float
    callback: Callable[..., None]
    args: tuple = field(default=())
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self, start_s: float = 0.0) -> None:
        self.clock = VirtualClock(start_s)
        self._heap: list[tuple[float, int, EventHandle]] = []
        self._seq = itertools.count()
        self.events_run = 0

    @property
    def now_s(self) -> float:
        return self.clock.now()

    @property
    def pending(self) -> int:
        """Events scheduled and not yet run, cancelled ones included."""
        return len(self._heap)

    def call_at(self, time_s: float, callback: Callable[..., None], *args: object) -> EventHandle:
        # an event in the past would reorder history: it runs now, after those already due now
        handle = EventHandle(max(time_s, self.now_s), callback, args)
        heapq.heappush(self._heap, (handle.time_s, next(self._seq), handle))
        return handle

    def call_later(self, delay_s: float, callback: Callable[..., None], *args: object) -> EventHandle:
        if delay_s < 0:
            raise ValueError(f"delay must be >= 0, got {delay_s}")
        return self.call_at(self.now_s + delay_s, callback, *args)

    def run_until(self, time_s: float) -> None:
        """Runs every event due at or before `time_s`, then leaves the clock at `time_s`."""
        while self._heap and self._heap[0][0] <= time_s:
            self._run_next()
        if time_s > self.now_s:
            self.clock.advance_to(time_s)

    def run(self) -> None:
        """Runs until no event is left; the clock stays at the last event's time."""
        while self._heap:
            self._run_next()

    def _run_next(self) -> None:
        time_s, _seq, handle = heapq.heappop(self._heap)
        if handle.cancelled:
            return
        self.clock.advance_to(time_s)
        self.events_run += 1
        handle.callback(*handle.args)
