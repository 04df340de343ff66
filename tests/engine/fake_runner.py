"""A runner with no model: the sampled token is a pure function of the sequence, so runs replay."""

from __future__ import annotations

from tidegate.engine.scheduler import ScheduledBatch, Scheduler, StepOutput

EOS = 0


class FakeRunner:
    def __init__(self) -> None:
        self.batches: list[ScheduledBatch] = []

    def run(self, batch: ScheduledBatch) -> list[int]:
        self.batches.append(batch)
        # token = 1 + position, never EOS: sequences end by max_tokens unless a test says otherwise
        return [1 + chunk.start + chunk.num_tokens for chunk in batch.chunks if chunk.samples]


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[ScheduledBatch, list[StepOutput]]:
    """One engine iteration: schedule -> run -> update."""
    batch = scheduler.schedule()
    return batch, scheduler.update(batch, runner.run(batch))
