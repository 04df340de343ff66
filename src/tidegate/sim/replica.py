"""A modelled replica: the embedded engine's own scheduler, with a cost model in place of the model.

Batching, the token budget, chunked prefill, KV blocks, preemption and priority classes are the
engine's (`tidegate.engine.scheduler`), so the simulator cannot drift from them. Only a step's
duration is modelled. One step is one event: schedule it, hold the virtual clock for its cost,
then apply its outputs (one generated token per sampling sequence) and report first tokens,
finishes and failures to the listener.

Except where nothing can change but the clock: while every running sequence decodes (or one of
them prefills, after all the decodes in the engine's order, with chunks that fill the step's
budget), nothing waiting can be admitted and the KV cache holds them all, the steps ahead are
known: the same sequences, one token longer and one chunk further each time, until a sequence
finishes or the prompt reaches its last chunk. Those steps are one event (a *stretch*), their
times summed ahead; the step that finishes a sequence or a prompt runs through the scheduler
again. A request submitted, a slow-down or a death during a stretch cuts it at the step in
progress, where the engine would have seen it. Records match stepping one step at a time to
floating-point rounding (`test_stretches_of_decode_steps_give_the_records_of_one_step_at_a_time`).
Mid-stretch, `load` reports the KV use of the stretch's start.

The engine's prefix caching is modelled too, by the scheduler itself: a request's prompt computes
only what the replica's KV cache does not already hold. A request submitted without its token ids
gets a prompt of its own (its first token is its request id, and it is marked unique, so that its
blocks are not hashed), so that requests share no prefix unless a caller says they do
(`submit(..., prompt_token_ids=...)`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.mirror_rows import MirrorRows
from tidegate.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence
from tidegate.sim.loop import EventHandle, EventLoop
from tidegate.sim.step_noise import SharedDrift, StepNoise, StepNoiseStream
from tidegate.types import ReplicaLoad

__all__ = ["StepCostModel", "ReplicaSpec", "ReplicaListener", "ModelledReplica", "FAILURE_KILLED",
           "FAILURE_TOO_LONG"]

FAILURE_KILLED = "replica_killed"  # the replica died with the request in flight, or was dead
FAILURE_TOO_LONG = "too_long"  # prompt + output cannot fit the replica's whole KV cache

# Any token but an end-of-sequence one: a sequence ends by its output length alone.
_SAMPLED_TOKEN = 1
_PROMPT_TOKEN = 7  # fills the prompts the simulator makes up


@dataclass(frozen=True, slots=True)
class StepCostModel:
    """step_s = base + prefill tokens + decode batch + context, each linear (DistServe's form),
    except that a measured profile may give the decode batch's cost point by point
    (`decode_s_by_batch`), where the engine's is not linear in the batch, or the forward pass's
    cost by its rows (`forward_s_by_rows`: prefill tokens + decoding sequences), in place of the
    prefill and decode terms.

    Defaults fitted to tiny-random-llama (fp32, 1 torch thread, the engine's ModelRunner) from one
    short measurement on a shared 2-core machine, so within perhaps 20 %:
      decode batch 1 / 8 / 32 at ~10 tokens of context: 15 / 26 / 56 ms per step;
      decode batch 8 at ~1,000 tokens of context: 73 ms;
      one prefill of 32 / 96 / 256 tokens: 60 / 143 / 313 ms.
    Refit for another model or machine (`tidegate sim calibrate`); the form matters more than
    the figures here.
    """

    base_s: float = 0.014  # a step's fixed cost: weights read once per step, Python, sampling
    prefill_s_per_token: float = 0.0012  # each prompt token computed in the step
    decode_s_per_seq: float = 0.0013  # each sequence decoding one token in the step
    context_s_per_token: float = 6e-6  # attention: each scheduled sequence's context length, summed
    # (batch, cost of its decoding sequences) measured, by batch: interpolated between points; past
    # the last, its slope goes on (at least `decode_s_per_seq`); below the first, pro rata. Empty:
    # `decode_s_per_seq` x batch. On tiny-random-llama, 1 thread, a decode of 2 or 4 sequences cost
    # more than one of 8 (18, 25 and 16 ms a step: torch's small-matrix kernels), which no line fits.
    decode_s_by_batch: tuple[tuple[int, float], ...] = ()
    # (rows, cost of the step's forward pass) by its rows, the prefill tokens and decoding sequences
    # it computes, interpolated as `decode_s_by_batch` is; past the last point, `forward_s_per_row`
    # a row. Given, it replaces the prefill and decode terms: the engine computes a step's prefill
    # chunks and decodes as one batch of rows, and the small-matrix cost of a decode of 2-7
    # sequences is not paid when a prefill chunk rides along (tiny-random-llama, 1 thread: base +
    # chunk + decode table predicted steps with 3-7 decodes and a chunk 6-16 % slow, with 8-15
    # decodes and a chunk 7-14 % fast; by rows, held-out shapes within 7 %).
    forward_s_by_rows: tuple[tuple[int, float], ...] = ()
    forward_s_per_row: float = 0.0
    # the batched decode attention, a row x position it reads: the embedded engine runs it over its
    # decode mirror (`engine.decode_mirror`), every row up to the highest one decoding read to the
    # step's longest decode context (a mask hides the rest), so it costs rows x the longest context,
    # not the summed contexts (bench/decode_attention_grid.py); rows as `engine.mirror_rows` hands
    # them out (at least the decodes). Fitted on step logs that carry the attention's shape, on request
    # (`tidegate sim calibrate --step-log ... --decode-attention`)
    decode_attention_s_per_position: float = 0.0
    # a prefill chunk's context (its start + its tokens), summed over the step's chunks: its
    # attention over the cached positions before it, and their copy out of the paged cache
    prefill_context_s_per_token: float = 0.0

    def decode_s(self, batch: int) -> float:
        """What `batch` decoding sequences add to a step (without a forward table)."""
        if not self.decode_s_by_batch or batch <= 0:
            return self.decode_s_per_seq * batch
        return _interpolated(self.decode_s_by_batch, batch, self.decode_s_per_seq)

    def forward_s(self, rows: int) -> float:
        """What a forward pass over `rows` (prefill tokens + decoding sequences) adds to a step."""
        return _interpolated(self.forward_s_by_rows, rows, self.forward_s_per_row) if rows > 0 else 0.0

    def describe(self) -> str:
        """The model as one line, for people."""
        if self.forward_s_by_rows:
            points = ", ".join(f"{rows}: {s * 1000:.1f}" for rows, s in self.forward_s_by_rows)
            return (f"step_s = {self.base_s * 1000:.2f} ms + forward pass by rows (ms: {points}; then "
                    f"{self.forward_s_per_row * 1e6:.0f} us a row) + {self.context_s_per_token * 1e9:.1f} ns x "
                    f"context tokens{self._describe_attention()}")
        return (f"step_s = {self.base_s * 1000:.2f} ms + {self.prefill_s_per_token * 1e6:.1f} us x prefill tokens "
                f"+ {'decode table' if self.decode_s_by_batch else f'{self.decode_s_per_seq * 1e6:.1f} us x decoding sequences'}"
                f" + {self.context_s_per_token * 1e9:.1f} ns x context tokens{self._describe_attention()}")

    def _describe_attention(self) -> str:
        text = ""
        if self.prefill_context_s_per_token:
            text += f" + {self.prefill_context_s_per_token * 1e9:.1f} ns x prefill chunks' context"
        if self.decode_attention_s_per_position:
            text += f" + {self.decode_attention_s_per_position * 1e9:.1f} ns x attention rows x longest decode context"
        return text

    def step_s(self, prefill_tokens: int, decode_batch: int, sum_context_tokens: int,
               longest_decode_context: int = 0, *, attention_rows: int | None = None,
               decode_context_tokens: int | None = None) -> float:
        """`longest_decode_context`: the longest context of the step's decoding sequences (the
        position of its new token + 1), which the decode attention reads in each of its
        `attention_rows` (None: one a decode). `decode_context_tokens`: the decodes' part of
        `sum_context_tokens`, the rest the prefill chunks' (None: all of it where the step
        decodes, else none)."""
        rows = decode_batch if attention_rows is None else attention_rows
        attention_s = self.decode_attention_s_per_position * rows * longest_decode_context
        if decode_context_tokens is None:
            decode_context_tokens = sum_context_tokens if decode_batch else 0
        attention_s += self.prefill_context_s_per_token * (sum_context_tokens - decode_context_tokens)
        if self.forward_s_by_rows:
            return (self.base_s + self.forward_s(prefill_tokens + decode_batch)
                    + self.context_s_per_token * sum_context_tokens + attention_s)
        return (self.base_s + self.prefill_s_per_token * prefill_tokens + self.decode_s(decode_batch)
                + self.context_s_per_token * sum_context_tokens + attention_s)

    @property
    def has_attention_terms(self) -> bool:
        """Whether a step's cost depends on its decode attention's shape (else the simulator need
        not track the mirror's rows: a step is costed as fast as before the terms existed)."""
        return bool(self.decode_attention_s_per_position or self.prefill_context_s_per_token)

    def batch_step_s(self, batch: ScheduledBatch, attention_rows: int | None = None) -> float:
        decodes = batch.num_decodes
        prefill_tokens = sum(chunk.num_tokens for chunk in batch.chunks[decodes:])
        # a chunk's last position attends to everything before it
        sum_context_tokens = sum(chunk.start + chunk.num_tokens for chunk in batch.chunks)
        if not self.has_attention_terms:
            return self.step_s(prefill_tokens, decodes, sum_context_tokens)
        decode_context_tokens = sum(chunk.start + 1 for chunk in batch.chunks[:decodes])
        longest = max((chunk.start + 1 for chunk in batch.chunks[:decodes]), default=0)
        return self.step_s(prefill_tokens, decodes, sum_context_tokens, longest, attention_rows=attention_rows,
                           decode_context_tokens=decode_context_tokens)


def _interpolated(table: tuple[tuple[int, float], ...], at: int, slope_past_last: float) -> float:
    """A measured table's value at `at`: linear between its points, pro rata below the first, the
    slope given past the last."""
    first_at, first_s = table[0]
    if at <= first_at:
        return first_s * at / first_at
    for (low_at, low_s), (high_at, high_s) in zip(table, table[1:]):
        if at <= high_at:
            return low_s + (high_s - low_s) * (at - low_at) / (high_at - low_at)
    last_at, last_s = table[-1]
    return last_s + slope_past_last * (at - last_at)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    replica_id: str
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_tokens: int = 32768  # the embedded engine server's default
    cost: StepCostModel = field(default_factory=StepCostModel)
    stretches: bool = True  # False: every step an event (the reference stretches are tested against)
    cold_start_s: float = 0.0  # from "replica requested" to "ready" (`StartReplica`)
    # each step's time is the cost model's mean times a seeded draw of this (None: the mean exactly)
    noise: StepNoise | None = None
    noise_seed: int = 0


@dataclass(slots=True)
class _Stretch:
    """Steps taken as one event: step j ends `ends_s[j]` after `start_s`; each decodes every
    running sequence but `prefilling`, which gets `chunks[j]` prompt tokens."""

    start_s: float
    ends_s: list[float]
    prefilling: Sequence | None
    chunks: list[int]
    # the step noise's state after each step (`StepNoiseStream.committed`), if the replica has noise
    noise_states: list[tuple[int, float, float]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.ends_s)

    def steps_done(self, now_s: float) -> int:
        """Steps finished by `now_s` (the next one is in progress)."""
        return bisect.bisect_right(self.ends_s, now_s - self.start_s)

    def cut(self, steps: int) -> None:
        del self.ends_s[steps:]
        del self.chunks[steps:]
        del self.noise_states[steps:]


class ReplicaListener(Protocol):
    def on_first_token(self, now_s: float, replica_id: str, request_id: int) -> None: ...
    def on_finish(self, now_s: float, replica_id: str, request_id: int) -> None: ...
    def on_failure(self, now_s: float, replica_id: str, request_id: int, reason: str) -> None: ...


class ModelledReplica:
    def __init__(self, spec: ReplicaSpec, loop: EventLoop, listener: ReplicaListener,
                 shared_drift: SharedDrift | None = None) -> None:
        """`shared_drift`: the step noise's drift this replica shares with the others of its run
        (`StepNoise.shared_share`); None: one of its own."""
        self.spec = spec
        self.replica_id = spec.replica_id
        self._loop = loop
        self._listener = listener
        self.scheduler = Scheduler(spec.scheduler, BlockManager(spec.kv_cache_tokens))
        self.alive = True
        self.slowdown = 1.0  # step durations are multiplied by this
        # and by this: the share of its cores other work on the machine takes (`share_cores`)
        self.contention = 1.0
        # the rows of the engine's decode mirror the decoding sequences hold: the decode attention
        # reads every row up to the highest one in use (`StepCostModel.decode_attention_s_per_position`)
        self._mirror_rows = MirrorRows()
        self._noise = (StepNoiseStream(spec.noise, spec.noise_seed, spec.replica_id, shared_drift)
                       if spec.noise is not None else None)
        self._next_step: EventHandle | None = None  # a step started or about to start
        self._stretch: _Stretch | None = None  # the decode stretch `_next_step` ends, if it is one
        self._load: ReplicaLoad | None = None  # `load`, until the scheduler's state changes
        self._busy_since_s: float | None = None
        # counters for the report
        self.busy_s = 0.0  # time with at least one sequence running or waiting
        self.steps = 0
        self.generated_tokens = 0
        self.preemptions = 0
        # called as (replica_id, start_s, step_s, batch) when a single step starts (not for the
        # decode stretches taken as one event: set `ReplicaSpec.stretches` False to see every step);
        # for analyses of what a request waited for, such as bench/protection_anatomy.py
        self.step_observer: Callable[[str, float, float, ScheduledBatch], None] | None = None

    @property
    def load(self) -> ReplicaLoad:
        """What a live engine's /metrics would say now (built again only after the scheduler's
        state changed: the harness reads every replica's at every event)."""
        if self._load is None:
            self._load = ReplicaLoad(running_sequences=len(self.scheduler.running),
                                     waiting_sequences=len(self.scheduler.waiting),
                                     kv_cache_usage=self.scheduler.blocks.usage,
                                     kv_cache_tokens=self.scheduler.blocks.capacity_tokens)
        return self._load

    def submit(self, request_id: int, prompt_tokens: int, output_tokens: int, priority: int = 0,
               prompt_token_ids: list[int] | None = None) -> None:
        """Hands a request to the engine; it joins the next step (same-instant arrivals batch).
        `prompt_token_ids` (`prompt_tokens` of them) say which requests share a prompt prefix, for
        the KV cache; without them the prompt shares nothing with any other request's."""
        unique_prompt = prompt_token_ids is None
        if unique_prompt:
            prompt_token_ids = _distinct_prompt(request_id, prompt_tokens)
        elif len(prompt_token_ids) != prompt_tokens:
            raise ValueError(f"request {request_id}: {len(prompt_token_ids)} prompt token ids for "
                             f"{prompt_tokens} prompt tokens")
        if not self.alive:
            # a refused connection is reported after the caller returns, as it would be live
            self._loop.call_later(0.0, self._listener.on_failure, self._loop.now_s, self.replica_id,
                                  request_id, FAILURE_KILLED)
            return
        if prompt_tokens + output_tokens > self.scheduler.blocks.capacity_tokens:
            # the scheduler would preempt it for itself forever; the engine refuses it up front
            self._loop.call_later(0.0, self._listener.on_failure, self._loop.now_s, self.replica_id,
                                  request_id, FAILURE_TOO_LONG)
            return
        params = SamplingParams(max_tokens=max(output_tokens, 1), ignore_eos=True)
        self._cut_stretch()  # the engine sees it at the end of the step in progress
        self.scheduler.add(Sequence(seq_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                                    priority=priority, unique_prompt=unique_prompt))
        self._load = None
        self._mark_busy()
        self._wake()

    def slow_down(self, factor: float) -> None:
        """Every step from the next one takes `factor` times its modelled cost (1 restores)."""
        if factor <= 0:
            raise ValueError(f"slow-down factor must be > 0, got {factor}")
        self._cut_stretch()
        self.slowdown = factor

    def share_cores(self, factor: float) -> None:
        """Other work on the machine (a gateway and clients on the same cores) stretches every step
        from the next one by `factor` (1: the cores are the engine's alone)."""
        if factor < 1:
            raise ValueError(f"contention factor must be >= 1, got {factor}")
        if factor != self.contention:
            self._cut_stretch()
            self.contention = factor

    def kill(self) -> None:
        """The replica dies: the step in flight is lost and every request it holds fails now."""
        if not self.alive:
            return
        self.alive = False
        if self._next_step is not None:
            self._next_step.cancel()
            self._next_step = None
        if self._stretch is not None:  # its steps done by now were taken; their tokens die with it
            stretch = self._stretch
            done = stretch.steps_done(self._loop.now_s)
            self._apply(stretch, done)
            if self._noise is not None:  # the step in progress drew its noise as it started
                self._noise.committed = stretch.noise_states[min(done, stretch.steps - 1)]
            self._stretch = None
        lost = [seq.seq_id for seq in (*self.scheduler.running, *self.scheduler.waiting)]
        for seq_id in lost:
            self.scheduler.abort(seq_id)
        self._load = None
        self._mark_idle()
        for seq_id in lost:
            self._listener.on_failure(self._loop.now_s, self.replica_id, seq_id, FAILURE_KILLED)

    def start(self) -> None:
        """The replica is ready (its cold start is over): it serves from now, with an empty KV
        cache; a killed replica comes back this way."""
        if self.alive:
            raise ValueError(f"replica {self.replica_id} is already serving")
        self.scheduler = Scheduler(self.spec.scheduler, BlockManager(self.spec.kv_cache_tokens))
        self._mirror_rows = MirrorRows()
        self.alive = True
        self._load = None

    def busy_s_at(self, now_s: float) -> float:
        """Busy time up to now_s, counting a busy spell still open."""
        open_s = now_s - self._busy_since_s if self._busy_since_s is not None else 0.0
        return self.busy_s + open_s

    def _wake(self) -> None:
        if self._next_step is None and self.alive and self.scheduler.has_work:
            self._next_step = self._loop.call_later(0.0, self._start_step)

    def _start_step(self) -> None:
        stretch = self._plan_stretch()
        if stretch is not None:
            self._start_stretch(stretch)
            return
        # the scheduler preempts inside `schedule` and keeps the victims waiting: count them there
        preempted_before = self._preemptions_held()
        batch = self.scheduler.schedule()
        self._load = None
        self.preemptions += self._preemptions_held() - preempted_before
        if batch.is_empty:
            # nothing can run (cannot happen with prompts that fit the cache): idle till a submit
            self._next_step = None
            return
        cost = self.spec.cost
        rows = (self._mirror_rows.attention_rows([chunk.seq for chunk in batch.chunks[:batch.num_decodes]])
                if cost.has_attention_terms else None)
        step_s = cost.batch_step_s(batch, rows) * self.slowdown * self.contention
        if self._noise is not None:
            step, now_s = self._noise.committed[0], self._loop.now_s
            factor, drift = self._noise.factor(step, now_s, self._noise.committed, now_s)
            self._noise.committed = (step + 1, now_s, drift)
            step_s *= factor
        self._next_step = self._loop.call_later(step_s, self._end_step, batch)
        if self.step_observer is not None:
            self.step_observer(self.replica_id, self._loop.now_s, step_s, batch)

    def _end_step(self, batch: ScheduledBatch) -> None:
        self._next_step = None
        self.steps += 1
        sampled = [_SAMPLED_TOKEN for chunk in batch.chunks if chunk.samples]
        outputs = self.scheduler.update(batch, sampled)
        self._load = None
        self.generated_tokens += len(sampled)
        now_s = self._loop.now_s
        for output in outputs:
            if output.num_output_tokens == 1:
                self._listener.on_first_token(now_s, self.replica_id, output.seq_id)
            if output.finish_reason is not None:
                self._listener.on_finish(now_s, self.replica_id, output.seq_id)
        if not self.scheduler.has_work:
            self._mark_idle()
        self._wake()

    # ---- stretches ---------------------------------------------------------------------------

    def _plan_stretch(self) -> _Stretch | None:
        """The steps from now in which the scheduler could only decode every running sequence and
        give the one prefilling (if any) a chunk filling the rest of the budget, with no sequence
        finishing, no prompt reaching its last chunk and nothing admitted; None when fewer than two."""
        scheduler = self.scheduler
        config = scheduler.config
        running = scheduler.running
        if not self.spec.stretches or not running:
            return None
        prefilling = [seq for seq in running if not seq.is_decoding]
        decoding = len(running) - len(prefilling)
        if len(prefilling) > 1 or decoding > config.max_batch_tokens - len(prefilling):
            return None
        prompt = prefilling[0] if prefilling else None
        if prompt is not None and (not config.chunked_prefill
                                   or any(seq.priority > prompt.priority for seq in running if seq is not prompt)):
            return None  # its chunk would come before a decode in the engine's order
        blocks = scheduler.blocks
        if scheduler.waiting:
            # a waiting prompt stays out while the engine is full, or the KV cache cannot hold it
            # (decodes only take blocks, and evictions only shorten its cached prefix), until a
            # sequence finishes; unless a running sequence starts as it does, when the blocks that
            # one computes may become the waiting one's cached prefix and let it in
            head = min(scheduler.waiting, key=lambda seq: (seq.priority, seq.arrival_index))
            if len(running) < config.max_num_seqs and (
                    scheduler.can_admit(head) or self._may_share_prefix(head, running)):
                return None
        limit = min((seq.params.max_tokens - len(seq.output_token_ids) for seq in running if seq is not prompt),
                    default=1 << 30) - 1
        chunks: list[int] = []
        if prompt is not None:
            start, remaining = prompt.num_computed_tokens, prompt.num_uncomputed_tokens
            while len(chunks) < limit:
                chunk = scheduler.prefill_chunk(start, remaining, config.max_batch_tokens - decoding)
                if chunk >= remaining:
                    break  # its last chunk samples a first token: the scheduler's step
                chunks.append(chunk)
                start, remaining = start + chunk, remaining - chunk
            limit = len(chunks)
        else:
            chunks = [0] * max(limit, 0)
        # every sequence's KV must grow without a preemption
        while len(chunks) >= 2 and self._blocks_needed(blocks, running, prompt, chunks) > blocks.num_free_blocks:
            del chunks[len(chunks) // 2:]
        if len(chunks) < 2:
            return None
        cost, ends_s, elapsed_s = self.spec.cost, [], 0.0
        slowdown = self.slowdown * self.contention
        context = sum(seq.num_tokens for seq in running if seq is not prompt)  # a decode's: its tokens so far
        longest, rows = 0, None
        if cost.has_attention_terms:
            decoders = [seq for seq in running if seq is not prompt]
            longest = max((seq.num_tokens for seq in decoders), default=0)
            # the same sequences decode in every step of the stretch: the same mirror rows
            rows = self._mirror_rows.attention_rows(decoders)
        prompt_at = prompt.num_computed_tokens if prompt is not None else 0
        noise, noise_states = self._noise, []
        now_s = self._loop.now_s
        for chunk in chunks:
            step_s = cost.step_s(chunk, decoding, context + (prompt_at + chunk if chunk else 0), longest,
                                 attention_rows=rows, decode_context_tokens=context) * slowdown
            if noise is not None:  # drawn as stepping one step at a time would draw it
                state = noise_states[-1] if noise_states else noise.committed
                factor, drift = noise.factor(state[0], now_s + elapsed_s, state, now_s)
                noise_states.append((state[0] + 1, now_s + elapsed_s, drift))
                step_s *= factor
            elapsed_s += step_s
            ends_s.append(elapsed_s)
            context += decoding
            longest += 1
            prompt_at += chunk
        return _Stretch(now_s, ends_s, prompt, chunks, noise_states)

    def _may_share_prefix(self, waiting: Sequence, running: list[Sequence]) -> bool:
        """Whether a running sequence may cache blocks that `waiting` would share: their first
        blocks match (block hashes chain, so no later block can match where the first does not)."""
        if not self.scheduler.config.enable_prefix_caching:
            return False
        size = self.scheduler.blocks.block_size
        first = waiting.token_ids(0, size)
        return any(seq.token_ids(0, size) == first for seq in running)

    @staticmethod
    def _blocks_needed(blocks: BlockManager, running: list[Sequence], prompt: Sequence | None,
                       chunks: list[int]) -> int:
        grown = sum(chunks)
        return sum(blocks.blocks_needed(seq, seq.num_computed_tokens + (grown if seq is prompt else len(chunks)))
                   for seq in running)

    def _start_stretch(self, stretch: _Stretch) -> None:
        self._stretch = stretch
        self._next_step = self._loop.call_later(stretch.ends_s[-1], self._end_stretch)

    def _cut_stretch(self) -> None:
        """Ends the stretch at the step in progress (an event the engine sees between steps)."""
        stretch = self._stretch
        if stretch is None:
            return
        cut = min(stretch.steps_done(self._loop.now_s) + 1, stretch.steps)
        if cut == stretch.steps:
            return
        assert self._next_step is not None
        self._next_step.cancel()
        stretch.cut(cut)
        self._next_step = self._loop.call_at(stretch.start_s + stretch.ends_s[-1], self._end_stretch)

    def _end_stretch(self) -> None:
        stretch = self._stretch
        assert stretch is not None
        self._stretch = self._next_step = None
        self._apply(stretch, stretch.steps)
        self._wake()

    def _apply(self, stretch: _Stretch, steps: int) -> None:
        """What `steps` steps of the scheduler do to the sequences, and the counters."""
        scheduler = self.scheduler
        running = scheduler.running
        prefilled = sum(stretch.chunks[:steps])
        for seq in running:
            if seq is stretch.prefilling:
                scheduler.blocks.grow(seq, seq.num_computed_tokens + prefilled)
                scheduler.mark_computed(seq, seq.num_computed_tokens + prefilled)
            else:
                scheduler.blocks.grow(seq, seq.num_computed_tokens + steps)
                seq.output_token_ids.extend([_SAMPLED_TOKEN] * steps)
                scheduler.mark_computed(seq, seq.num_computed_tokens + steps)
        self._load = None
        self.steps += steps
        self.generated_tokens += steps * (len(running) - (stretch.prefilling is not None))
        if self._noise is not None and steps:
            self._noise.committed = stretch.noise_states[steps - 1]

    def _preemptions_held(self) -> int:
        return sum(seq.num_preemptions for seq in (*self.scheduler.running, *self.scheduler.waiting))

    def _mark_busy(self) -> None:
        if self._busy_since_s is None:
            self._busy_since_s = self._loop.now_s

    def _mark_idle(self) -> None:
        if self._busy_since_s is not None:
            self.busy_s += self._loop.now_s - self._busy_since_s
            self._busy_since_s = None


def _distinct_prompt(request_id: int, prompt_tokens: int) -> list[int]:
    """A prompt no other request's starts like: block hashes chain, so a distinct first token
    makes every block distinct."""
    return [request_id, *[_PROMPT_TOKEN] * (prompt_tokens - 1)] if prompt_tokens else []
