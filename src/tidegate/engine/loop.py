"""The engine loop: schedule -> run -> update, in a thread of its own, apart from asyncio.

The asyncio side submits and aborts through a locked inbox; results go back once per step with
`loop.call_soon_threadsafe`, into one asyncio.Queue per request. Only the engine thread touches the
scheduler and the runner. The CLI runs it in the process's main thread: measured here, torch's
OpenMP matmuls ran up to 3x slower when called from a secondary thread (bench/engine_batching.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol, TextIO

from tidegate.engine.metrics import EngineMetrics
from tidegate.engine.scheduler import ScheduledBatch, Scheduler, StepOutput
from tidegate.engine.sequence import SamplingParams, Sequence

__all__ = ["Runner", "EngineLoop", "Submission"]

log = logging.getLogger(__name__)


class Runner(Protocol):
    def run(self, batch: ScheduledBatch) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Submission:
    seq_id: int
    outputs: asyncio.Queue[StepOutput]  # ends with an output whose finish_reason is set


class EngineLoop:
    def __init__(self, scheduler: Scheduler, runner: Runner, metrics: EngineMetrics | None = None) -> None:
        self._scheduler = scheduler
        self._runner = runner
        self._metrics = metrics
        self._inbox: deque[Sequence | int] = deque()  # a Sequence to add, or a seq_id to abort
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue[StepOutput]] = {}  # asyncio thread only
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Fault injection (`tidegate engine --fault-injection`): each step is followed by a pause of
        # (slowdown - 1) x its own time, so the replica runs `slowdown` times slower at every batch
        # size, as on a slower machine; for measuring how the gateway's limits follow a slow replica.
        self.slowdown = 1.0
        # `tidegate engine --step-log`: one CSV line a step (start, seconds, prefill tokens, decoding
        # sequences, summed context, and from a ModelRunner the decodes' part of that context and what
        # its decode attention read: rows, positions, path, copied positions), what `tidegate sim
        # calibrate --step-log` fits a profile on
        self.step_log: TextIO | None = None
        # the block manager's prefix-cache counters as last published (the metrics take the deltas)
        self._published_prefix_counts = (0, 0, 0)

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        """Runs the loop in a new thread (tests; the CLI calls `run_forever` from its main thread)."""
        self._aio_loop = aio_loop
        self._thread.start()

    def run_forever(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        """Runs the loop in the calling thread until `stop`."""
        self._aio_loop = aio_loop
        self._run()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Safe from any thread; joins the loop's thread when `start` made one."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> Submission:
        """Asyncio thread only."""
        seq = Sequence(seq_id=next(self._ids), prompt_token_ids=prompt_token_ids, params=params, priority=priority)
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[seq.seq_id] = queue
        self._post(seq)
        return Submission(seq.seq_id, queue)

    def abort(self, seq_id: int) -> None:
        """Frees the sequence soon; safe from any thread, and for finished sequences."""
        self._post(seq_id)

    def forget(self, seq_id: int) -> None:
        """Asyncio thread: the caller no longer reads this sequence's queue."""
        if self._queues.pop(seq_id, None) is not None:
            self.abort(seq_id)

    def _post(self, item: Sequence | int) -> None:
        with self._lock:
            self._inbox.append(item)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            outputs = self._drain_inbox()
            if self._scheduler.has_work:
                outputs += self._step()
            self._publish_state()
            if outputs:
                assert self._aio_loop is not None
                self._aio_loop.call_soon_threadsafe(self._deliver, outputs)
            if not self._scheduler.has_work and not self._inbox:
                # a timeout, so that a main thread waiting here still runs signal handlers
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _drain_inbox(self) -> list[StepOutput]:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        aborted: list[StepOutput] = []
        for item in items:
            if isinstance(item, Sequence):
                self._scheduler.add(item)
            else:
                output = self._scheduler.abort(item)
                if output is not None:
                    aborted.append(output)
        return aborted

    def _step(self) -> list[StepOutput]:
        started_s = time.perf_counter()
        outputs = self._run_step()
        if self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - started_s))
        if self._metrics is not None:  # a slowed engine's pause is part of its step
            self._metrics.busy.inc(time.perf_counter() - started_s)
        return outputs

    def _run_step(self) -> list[StepOutput]:
        batch = self._scheduler.schedule()
        started_s = time.perf_counter()
        try:
            outputs = self._scheduler.update(batch, self._runner.run(batch))
        except Exception:  # a failing step must not kill the thread: fail its sequences, keep serving
            log.exception("engine step failed; aborting its %d sequences", len(batch.chunks))
            outputs = [o for c in batch.chunks if (o := self._scheduler.abort(c.seq.seq_id)) is not None]
        if self.step_log is not None:
            decodes = batch.num_decodes
            # a runner without the attribute (a test's fake) logs the five columns of old
            attention = getattr(self._runner, "decode_attention", None)
            shape = ""
            if attention is not None:
                decode_context = sum(c.start + 1 for c in batch.chunks[:decodes])
                shape = (f",{decode_context},{attention.rows},{attention.positions},{attention.path},"
                         f"{attention.copied_positions}")
            self.step_log.write(f"{started_s:.6f},{time.perf_counter() - started_s:.6f},"
                                f"{sum(c.num_tokens for c in batch.chunks[decodes:])},{decodes},"
                                f"{sum(c.start + c.num_tokens for c in batch.chunks)}{shape}\n")
        if self._metrics is not None:
            self._metrics.step_batch_size.observe(len(batch.chunks))
        return outputs

    def _publish_state(self) -> None:
        if self._metrics is not None:
            scheduler = self._scheduler
            blocks = scheduler.blocks
            self._metrics.set_state(len(scheduler.running), len(scheduler.waiting), blocks.usage)
            counts = (blocks.prefix_queried_tokens, blocks.prefix_hit_tokens, blocks.evicted_blocks)
            last = self._published_prefix_counts
            if counts != last:
                self._metrics.add_prefix_cache_counts(*(now - then for now, then in zip(counts, last)))
                self._published_prefix_counts = counts

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.seq_id)
            if queue is None:
                continue
            queue.put_nowait(output)
            if output.finish_reason is not None:
                del self._queues[output.seq_id]

