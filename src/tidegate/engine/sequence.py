"""One generation request as the scheduler sees it: tokens, progress, KV blocks, named states."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["SequenceStatus", "FinishReason", "SamplingParams", "Sequence"]


class SequenceStatus(Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


class FinishReason(Enum):
    STOP = "stop"  # end-of-sequence token or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # client went away


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False  # benchmarks need a fixed number of generated tokens


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower value is served first (vLLM's convention)
    arrival_index: int = 0  # set by the scheduler: larger means newer
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose keys/values are in the KV cache
    block_table: list[int] = field(default_factory=list)
    # prefix caching: chained hashes of the full blocks hashed so far (they depend on the tokens
    # alone, so they outlive a preemption), and how many leading blocks of `block_table` are
    # registered in the cache or were found there
    block_hashes: list[bytes | int] = field(default_factory=list)
    num_cached_blocks: int = 0
    # prompt tokens found cached when first admitted: OpenAI's `usage.prompt_tokens_details.cached_tokens`
    num_cached_prompt_tokens: int = 0
    # no other sequence's tokens start as this one's do (the simulator's made-up prompts): its
    # blocks are cached under its own id, not hashed, where only its own recompute (after a
    # preemption) can find them; hashing cost the simulator as much as the rest of its bookkeeping
    unique_prompt: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    sampler_state: object | None = None  # the runner's per-sequence RNG; survives preemption

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks KV: one token per step from now on."""
        return bool(self.output_token_ids) and self.num_uncomputed_tokens == 1

    def token_ids(self, start: int, count: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        end = start + count
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        # slices, not prompt + output: a long sequence's generated blocks are hashed one at a time
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]
