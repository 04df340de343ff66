"""Fault injection: a slowed engine loop pauses after each step for (factor - 1) x the step's time."""

from __future__ import annotations

import asyncio
import time

from tests.engine.fake_runner import FakeRunner
from tests.engine.test_scheduler import make_scheduler
from tidegate.engine.loop import EngineLoop
from tidegate.engine.scheduler import ScheduledBatch
from tidegate.engine.sequence import SamplingParams


class TimedRunner(FakeRunner):
    """Takes a few milliseconds a step and records the time it spent, so the loop's pauses can be compared."""

    def __init__(self) -> None:
        super().__init__()
        self.busy_s = 0.0

    def run(self, batch: ScheduledBatch) -> list[int]:
        started_s = time.perf_counter()
        time.sleep(0.004)
        tokens = super().run(batch)
        self.busy_s += time.perf_counter() - started_s
        return tokens


async def _generate(slowdown: float, tokens: int = 20) -> tuple[float, float]:
    """Seconds the loop took for one sequence of `tokens` steps, and the runner's own time in them."""
    runner = TimedRunner()
    loop = EngineLoop(make_scheduler(), runner)
    loop.slowdown = slowdown
    loop.start(asyncio.get_running_loop())
    try:
        started_s = time.perf_counter()
        submission = loop.submit([7, 7, 7], SamplingParams(max_tokens=tokens, ignore_eos=True))
        while (await asyncio.wait_for(submission.outputs.get(), 30.0)).finish_reason is None:
            pass
        return time.perf_counter() - started_s, runner.busy_s
    finally:
        loop.stop()


def test_a_slowed_loop_takes_at_least_factor_times_its_steps() -> None:
    elapsed_s, busy_s = asyncio.run(_generate(slowdown=3.0))
    # sleeps never end early: each step's pause is at least twice the step's own time
    assert elapsed_s >= 3.0 * busy_s * 0.95


def test_an_unslowed_loop_adds_no_pause() -> None:
    elapsed_s, busy_s = asyncio.run(_generate(slowdown=1.0))
    slowed_s, slowed_busy_s = asyncio.run(_generate(slowdown=3.0))
    # the same work in the same run: the unslowed loop's time beyond its steps is mere overhead
    assert elapsed_s - busy_s < 0.5 * (slowed_s - slowed_busy_s)
