"""Prefix caching on the real tiny-random-llama: greedy tokens are the ones computing every prompt
from scratch gives, and no step writes into a block another sequence may read."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tidegate.engine.kv_cache import BLOCK_SIZE, BlockManager
from tidegate.engine.models import load_model
from tidegate.engine.runner import ModelRunner, RunnerConfig
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.slow

KV_TOKENS = 4096
SYSTEM = [(7 * i) % 250 + 3 for i in range(10 * BLOCK_SIZE + 5)]  # 165 tokens: 10 full blocks and 5
# distinct user turns, one of which makes a prompt of exactly 11 blocks
TAILS = [[40, 41, 42, 43, 44, 45, 46], [50, 51], [60] * 20, list(range(70, 81)), [90]]


@pytest.fixture(scope="module")
def runner() -> Iterator[ModelRunner]:
    yield ModelRunner(load_model("tiny-random-llama"), RunnerConfig(kv_cache_tokens=KV_TOKENS, threads=2))


@pytest.fixture(params=[0, 1 << 16], ids=["gathered-kv", "mirrored-kv"])
def mirror_budget(runner: ModelRunner, request: pytest.FixtureRequest) -> Iterator[int]:
    saved = runner.model.mirror.budget_tokens
    runner.model.mirror.budget_tokens = request.param
    runner.model.mirror.reset()
    yield request.param
    runner.model.mirror.budget_tokens = saved
    runner.model.mirror.reset()


def _generate(runner: ModelRunner, prompts: list[list[int]], caching: bool, kv_tokens: int = KV_TOKENS,
              add_at_step: list[int] | None = None, max_tokens: int = 8) -> tuple[list[Sequence], Scheduler]:
    """Greedy tokens of each prompt; prompt i joins at step `add_at_step[i]` (default: all at once).
    Checks before every step that no token is written into a cached block."""
    config = SchedulerConfig(max_batch_tokens=96, enable_prefix_caching=caching)
    scheduler = Scheduler(config, BlockManager(kv_tokens))
    blocks = scheduler.blocks
    seqs = [Sequence(seq_id=i, prompt_token_ids=prompt, params=SamplingParams(max_tokens, temperature=0,
                                                                             ignore_eos=True))
            for i, prompt in enumerate(prompts, start=1)]
    arrivals = add_at_step or [0] * len(seqs)
    for step in range(10_000):
        for seq, at in zip(seqs, arrivals):
            if at == step:
                scheduler.add(seq)
        if step > max(arrivals) and not scheduler.has_work:
            break
        batch = scheduler.schedule()
        for chunk in batch.chunks:
            for position in range(chunk.start, chunk.start + chunk.num_tokens):
                block = chunk.seq.block_table[position // BLOCK_SIZE]
                assert not blocks.is_cached(block), (chunk.seq.seq_id, position, block)
        scheduler.update(batch, runner.run(batch))
    return seqs, scheduler


def _tokens(seqs: list[Sequence]) -> list[list[int]]:
    return [seq.output_token_ids for seq in seqs]


def _prompts() -> list[list[int]]:
    """Six prompts sharing 10 blocks; the last is those 10 blocks alone: exactly a multiple of the
    block size and all cached, it finds 9 and computes the last one again."""
    prompts = [SYSTEM + tail for tail in TAILS] + [SYSTEM[: 10 * BLOCK_SIZE]]
    assert len(prompts[3]) == 11 * BLOCK_SIZE
    return prompts


@torch.inference_mode()
def test_prompts_one_after_another_get_the_tokens_of_computing_them_whole(runner: ModelRunner,
                                                                           mirror_budget: int) -> None:
    prompts = _prompts()
    expected, _ = _generate(runner, prompts, caching=False, add_at_step=[40 * i for i in range(len(prompts))])
    got, scheduler = _generate(runner, prompts, caching=True, add_at_step=[40 * i for i in range(len(prompts))])
    assert _tokens(got) == _tokens(expected)
    # each later prompt found the 10 system blocks (the first computed them); the last, 9 of them
    assert scheduler.blocks.prefix_hit_tokens == (4 * 10 + 9) * BLOCK_SIZE


@torch.inference_mode()
def test_prompts_arriving_while_others_run_get_the_tokens_of_computing_them_whole(runner: ModelRunner,
                                                                               mirror_budget: int) -> None:
    # two at once (neither finds the other's blocks), the rest while those prefill and decode,
    # sharing blocks still being read by the sequences that computed them
    prompts = _prompts()
    arrivals = [0, 0, 3, 4, 6, 7]
    expected, _ = _generate(runner, prompts, caching=False, add_at_step=arrivals)
    got, scheduler = _generate(runner, prompts, caching=True, add_at_step=arrivals)
    assert _tokens(got) == _tokens(expected)
    assert scheduler.blocks.prefix_hit_tokens >= 3 * 10 * BLOCK_SIZE


@torch.inference_mode()
def test_a_preempted_sequence_recomputed_from_shared_blocks_gets_the_same_tokens(runner: ModelRunner) -> None:
    # 28 blocks for six ~11-block prompts growing by 40 tokens each: sequences are preempted and
    # come back through the cache (their own blocks and the shared ones)
    prompts = _prompts()
    expected, _ = _generate(runner, prompts, caching=False, max_tokens=40)
    got, scheduler = _generate(runner, prompts, caching=True, kv_tokens=28 * BLOCK_SIZE,
                               add_at_step=[0, 1, 2, 3, 4, 5], max_tokens=40)
    assert _tokens(got) == _tokens(expected)
    assert sum(seq.num_preemptions for seq in got) > 0 and sum(seq.num_preemptions for seq in expected) == 0
    assert scheduler.blocks.prefix_hit_tokens > 4 * 10 * BLOCK_SIZE  # the recomputes found blocks too
