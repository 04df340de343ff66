"""The event loop: virtual time only moves forward, and ties run in the order they were scheduled."""

from __future__ import annotations

from tidegate.clock import Clock
from tidegate.sim.loop import EventLoop, VirtualClock


def test_events_at_one_instant_run_in_scheduling_order() -> None:
    loop, seen = EventLoop(), []
    for name in "abc":
        loop.call_at(1.0, seen.append, name)
    loop.call_at(0.5, seen.append, "first")
    loop.run()
    assert seen == ["first", "a", "b", "c"] and loop.now_s == 1.0


def test_call_later_counts_from_the_virtual_now() -> None:
    loop, seen = EventLoop(), []
    loop.call_at(2.0, lambda: loop.call_later(0.5, lambda: seen.append(loop.now_s)))
    loop.run()
    assert seen == [2.5]


def test_run_until_stops_at_the_time_and_leaves_later_events() -> None:
    loop, seen = EventLoop(), []
    loop.call_at(1.0, seen.append, 1)
    loop.call_at(3.0, seen.append, 3)
    loop.run_until(2.0)
    assert seen == [1] and loop.now_s == 2.0 and loop.pending == 1


def test_cancelled_event_does_not_run() -> None:
    loop, seen = EventLoop(), []
    handle = loop.call_at(1.0, seen.append, "no")
    handle.cancel()
    loop.run()
    assert seen == []


def test_virtual_clock_is_a_clock_that_reads_the_loop_time() -> None:
    loop = EventLoop()
    clock: Clock = loop.clock
    readings: list[float] = []
    loop.call_at(4.25, lambda: readings.append(clock.now()))
    loop.run()
    assert readings == [4.25] and isinstance(clock, VirtualClock)
