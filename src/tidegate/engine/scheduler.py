"""Iteration-level continuous batching (Orca) with a per-step token budget and chunked prefill (Sarathi).

PURE: no torch, no asyncio, no clock. Each step:
1. running sequences, decodes first, best priority first, one token each (a sequence part-way
   through a chunked prefill continues with the next chunk);
2. waiting sequences admitted, best priority then oldest first, under the token budget and
   `max_num_seqs`; a prompt longer than what is left of the budget is split across steps
   (a chunk deep in a long prompt is charged for its attention over the context, see
   `attention_cost_tokens`, so it is shorter and the step no slower); with several priorities,
   1 and 2 go class by class (a worse class's decodes wait for a better class's prompts);
3. if a running sequence cannot get a KV block, the worst running sequence (lowest priority, then
   newest) is preempted: its blocks are freed and it is recomputed from its tokens later.
`update` then appends the sampled tokens; finished sequences leave at once and free their blocks.

With prefix caching (`enable_prefix_caching`, on by default as in vLLM v1), a sequence being
admitted shares the cached blocks of its leading full blocks (`BlockManager.cached_prefix`) and
starts computing after them: a prompt that repeats a system prompt computed before is charged only
for its new tokens. `update` registers each full block once it is computed.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.sequence import FinishReason, Sequence, SequenceStatus

__all__ = ["SchedulerConfig", "ScheduledChunk", "ScheduledBatch", "StepOutput", "Scheduler"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # per-step token budget: bounds one step's time, hence the inter-token gap. 96 kept the largest
    # gap of 16 streams under ~3.8x their median while a 2,000-token prompt prefilled
    # (bench/engine_chunked_prefill.py, 2 threads); 128 gave ~3.9-4.5x once decodes got faster
    max_batch_tokens: int = 96
    chunked_prefill: bool = True
    eos_token_ids: frozenset[int] = frozenset()
    # context length at which a token's attention costs as much as its pass through the Linear
    # layers (the model's flops ratio); a prefill chunk token at context c is charged 1 + c / this
    # against the budget. None charges 1 per token whatever the context.
    attention_cost_tokens: int | None = None
    # share the KV blocks of prompt prefixes computed before (see kv_cache.py): fewer prefill
    # tokens computed; greedy tokens matched computing every prompt whole
    # (tests/engine/test_prefix_cache_model.py)
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # position of the first token computed in this step
    num_tokens: int
    samples: bool  # the chunk ends at the sequence's last token: sample the next one


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    chunks: tuple[ScheduledChunk, ...]  # decodes first, then prefill chunks
    num_decodes: int

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq_id: int
    token_id: int | None  # None when the sequence left without a new token (abort)
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_prompt_tokens: int = 0  # of the prompt, found in the prefix cache at admission


def _rank(seq: Sequence) -> tuple[int, int]:
    """Smaller is more important: priority first, then older."""
    return (seq.priority, seq.arrival_index)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._arrivals = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self._arrivals += 1
        seq.arrival_index = self._arrivals
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)  # `schedule` sorts

    def abort(self, seq_id: int) -> StepOutput | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    return self._finish(seq, FinishReason.ABORT, token_id=None)
        return None

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        # Class by class of priority: a class's running sequences (decodes first), then its waiting
        # prompts, then the next class. With one class that is all decodes, then the prompts; with
        # several, a better class's prompt is not left waiting while the step's budget goes to a
        # worse class's decodes (a flood's hundred decodes would otherwise take most of every step).
        # Among equals, best rank first, so that victims come from the tail.
        candidates = sorted(self.running, key=lambda s: (s.priority, not s.is_decoding, s.arrival_index))
        self.waiting.sort(key=_rank)
        admitting = True  # a prompt that cannot be admitted stops admissions: the order holds
        while budget > 0:
            head = self.waiting[0] if admitting and self.waiting else None
            if candidates and (head is None or candidates[0].priority <= head.priority):
                seq = candidates.pop(0)
                want = 1 if seq.is_decoding else self._chunk_size(seq, budget, bool(chunks))
                granted = self._reserve(seq, want, candidates)
                if granted == 0:
                    continue  # preempted itself, or no room for it in this step
                chunks.append(self._chunk(seq, granted))
                budget -= granted if seq.is_decoding else self._prefill_cost(seq.num_computed_tokens, granted)
                continue
            if head is None:
                break
            if len(self.running) >= self.config.max_num_seqs:
                # no room for the prompt: the worse classes' running sequences still go (stopping
                # here would leave the engine full, idle and waiting for one of them to finish)
                admitting = False
                continue
            prefix = self._cached_prefix(head)
            start = len(prefix) * self.blocks.block_size
            has_prefill = any(not c.seq.is_decoding for c in chunks)
            want = self._chunk_size(head, budget, has_prefill, start=start)
            # admit only when the whole prompt fits: a half-admitted prompt would be preempted
            # by the next decode that needs a block, and its chunks computed again and again
            if want == 0 or not self.blocks.can_hold(head, head.num_tokens, prefix):
                admitting = False
                continue
            self.waiting.pop(0)
            if self.config.enable_prefix_caching:
                self.blocks.share_prefix(head, prefix)  # with no hit too: the lookup counts
            head.num_computed_tokens = start
            if not head.num_preemptions:  # a recompute's hits are its own blocks, not the prompt's
                head.num_cached_prompt_tokens = start
            self.blocks.grow(head, start + want)
            head.status = SequenceStatus.RUNNING
            self.running.append(head)
            chunks.append(self._chunk(head, want))
            budget -= self._prefill_cost(head.num_computed_tokens, want)
        # the runner takes the decodes first (one token each), then the prefill chunks
        decodes = [chunk for chunk in chunks if chunk.seq.is_decoding]
        prefills = [chunk for chunk in chunks if not chunk.seq.is_decoding]
        return ScheduledBatch(chunks=(*decodes, *prefills), num_decodes=len(decodes))

    def update(self, batch: ScheduledBatch, sampled: list[int]) -> list[StepOutput]:
        """Applies one step's results; `sampled` holds a token per chunk with `samples`, in order."""
        outputs: list[StepOutput] = []
        tokens = iter(sampled)
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted between schedule and update
            self.mark_computed(seq, chunk.start + chunk.num_tokens)
            if not chunk.samples:
                continue
            token = next(tokens)
            seq.output_token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is None:
                outputs.append(self._output(seq, token, None))
            else:
                self.running.remove(seq)
                outputs.append(self._finish(seq, reason, token))
        return outputs

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """The keys and values of `seq`'s first `num_computed_tokens` tokens are in its blocks
        (`update` calls it; the simulator too, for the steps it takes as one event)."""
        seq.num_computed_tokens = num_computed_tokens
        # most steps fill no block (a decode fills one every 16 steps); a unique prompt's blocks
        # are registered when it releases them, as no one else can find them before (`_release`)
        if (self.config.enable_prefix_caching and not seq.unique_prompt
                and num_computed_tokens // self.blocks.block_size > seq.num_cached_blocks):
            self.blocks.cache_computed_blocks(seq)

    def can_admit(self, seq: Sequence) -> bool:
        """Whether the KV cache can take waiting `seq` whole now, its cached prefix shared (the
        admission test of `schedule`; a query, for the simulator's planning)."""
        return self.blocks.can_hold(seq, seq.num_tokens, self._cached_prefix(seq))

    def prefill_chunk(self, start: int, remaining: int, budget: int) -> int:
        """Tokens a chunked prefill at position `start`, with `remaining` to go, gets from `budget`
        (a query: the simulator plans steps ahead with it)."""
        return min(remaining, self._tokens_affordable(start, budget))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        return self.blocks.cached_prefix(seq) if self.config.enable_prefix_caching else []

    def _chunk_size(self, seq: Sequence, budget: int, has_prefill: bool, start: int | None = None) -> int:
        """Tokens of `seq` to compute this step from position `start` (default: its computed
        tokens; a sequence being admitted starts after its cached prefix)."""
        if start is None:
            start = seq.num_computed_tokens
        remaining = seq.num_tokens - start
        if self.config.chunked_prefill:
            return min(remaining, self._tokens_affordable(start, budget))
        # without chunking a prompt runs whole: alone past the budget, never two at once past it
        return remaining if remaining <= budget or not has_prefill else 0

    def _prefill_cost(self, start: int, num_tokens: int) -> int:
        """Budget charged for prefilling positions [start, start + num_tokens)."""
        scale = self.config.attention_cost_tokens
        if scale is None:
            return num_tokens
        mean_context = start + (num_tokens + 1) / 2
        return math.ceil(num_tokens * (1 + mean_context / scale))

    def _tokens_affordable(self, start: int, budget: int) -> int:
        """The longest chunk from `start` whose cost fits `budget` (at least 1 while budget lasts)."""
        scale = self.config.attention_cost_tokens
        if scale is None or budget <= 0:
            return max(budget, 0)
        # n (1 + (start + (n + 1) / 2) / scale) <= budget, a quadratic in n
        a, b = 1 / (2 * scale), 1 + (start + 0.5) / scale
        tokens = int((-b + math.sqrt(b * b + 4 * a * budget)) / (2 * a))
        while tokens > 1 and self._prefill_cost(start, tokens) > budget:  # float rounding
            tokens -= 1
        return max(tokens, 1)

    def _reserve(self, seq: Sequence, want: int, candidates: list[Sequence]) -> int:
        """Finds KV room for `want` more tokens of `seq`, preempting the worst others if needed."""
        if want == 0:
            return 0
        while not self.blocks.can_hold(seq, seq.num_computed_tokens + want):
            holdable = self.blocks.max_tokens_holdable(seq) - seq.num_computed_tokens
            if not seq.is_decoding and self.config.chunked_prefill and holdable > 0:
                want = holdable
                break
            victim = self._pick_victim(candidates)
            if victim is None or _rank(victim) < _rank(seq):
                self._preempt(seq)
                return 0
            candidates.remove(victim)
            self._preempt(victim)
        self.blocks.grow(seq, seq.num_computed_tokens + want)
        return want

    @staticmethod
    def _pick_victim(candidates: list[Sequence]) -> Sequence | None:
        return max(candidates, key=_rank, default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq, finished=False)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_rank)  # `schedule` may still admit from it this step

    def _release(self, seq: Sequence, finished: bool) -> None:
        if self.config.enable_prefix_caching and seq.unique_prompt:
            self.blocks.cache_unique_blocks(seq, finished)
        self.blocks.free(seq)

    @staticmethod
    def _chunk(seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        return ScheduledChunk(seq=seq, start=start, num_tokens=num_tokens, samples=start + num_tokens == seq.num_tokens)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
            return FinishReason.STOP
        if len(seq.output_token_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason, token_id: int | None) -> StepOutput:
        self._release(seq, finished=True)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        return self._output(seq, token_id, reason)

    @staticmethod
    def _output(seq: Sequence, token_id: int | None, reason: FinishReason | None) -> StepOutput:
        return StepOutput(
            seq_id=seq.seq_id,
            token_id=token_id,
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
        )
