"""Automatic prefix caching in the block manager and the scheduler, driven by the fake runner."""

from __future__ import annotations

import itertools

from tests.engine.fake_runner import FakeRunner, step
from tidegate.engine.kv_cache import BLOCK_SIZE, BlockManager
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import SamplingParams, Sequence, SequenceStatus

_ids = itertools.count(1)
SYSTEM = list(range(100, 100 + 3 * BLOCK_SIZE))  # three full blocks shared by the prompts below


def make_scheduler(kv_tokens: int = 4096, enable_prefix_caching: bool = True, max_batch_tokens: int = 256,
                   max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
                             enable_prefix_caching=enable_prefix_caching)
    return Scheduler(config, BlockManager(kv_tokens))


def make_seq(prompt: list[int], max_tokens: int = 4, unique_prompt: bool = False) -> Sequence:
    return Sequence(seq_id=next(_ids), prompt_token_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens),
                    unique_prompt=unique_prompt)


def run_to_end(scheduler: Scheduler, runner: FakeRunner) -> None:
    while scheduler.has_work:
        step(scheduler, runner)


def first_chunk(runner: FakeRunner, seq: Sequence) -> tuple[int, int]:
    """(start, tokens) of the first chunk `runner` computed for `seq`."""
    return next((c.start, c.num_tokens) for b in runner.batches for c in b.chunks if c.seq is seq)


def prefill_tokens(runner: FakeRunner, seq: Sequence) -> int:
    return sum(c.num_tokens for b in runner.batches for c in b.chunks[b.num_decodes:] if c.seq is seq)


def test_a_prompt_after_a_computed_prefix_computes_only_its_own_tokens() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    first = make_seq(SYSTEM + [1, 2, 3])
    scheduler.add(first)
    run_to_end(scheduler, runner)
    second = make_seq(SYSTEM + [4, 5, 6, 7, 8])
    scheduler.add(second)
    run_to_end(scheduler, runner)
    assert prefill_tokens(runner, first) == len(SYSTEM) + 3
    assert first_chunk(runner, second) == (len(SYSTEM), 5)
    assert prefill_tokens(runner, second) == 5


def test_without_prefix_caching_every_prompt_is_computed_whole() -> None:
    scheduler, runner = make_scheduler(enable_prefix_caching=False), FakeRunner()
    for tail in ([1, 2, 3], [4, 5, 6, 7, 8]):
        seq = make_seq(SYSTEM + tail)
        scheduler.add(seq)
        run_to_end(scheduler, runner)
        assert prefill_tokens(runner, seq) == len(SYSTEM) + len(tail)
    assert scheduler.blocks.num_cached_blocks == 0 and scheduler.blocks.prefix_queried_tokens == 0


def test_a_hit_never_covers_the_prompts_last_token() -> None:
    # the prompt is exactly three blocks, all cached: the last block is computed again, so the
    # step samples and no one writes into a shared block
    scheduler, runner = make_scheduler(), FakeRunner()
    scheduler.add(make_seq(SYSTEM))
    run_to_end(scheduler, runner)
    again = make_seq(SYSTEM)
    scheduler.add(again)
    batch, outputs = step(scheduler, runner)
    assert [(c.start, c.num_tokens, c.samples) for c in batch.chunks] == [(2 * BLOCK_SIZE, BLOCK_SIZE, True)]
    assert len(outputs) == 1 and outputs[0].num_output_tokens == 1


def test_a_prompt_shorter_than_a_block_and_one_token_over_find_nothing_and_one_block() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    scheduler.add(make_seq(SYSTEM))
    run_to_end(scheduler, runner)
    short, one_over = make_seq(SYSTEM[:BLOCK_SIZE]), make_seq(SYSTEM[: BLOCK_SIZE + 1])
    for seq in (short, one_over):
        scheduler.add(seq)
        run_to_end(scheduler, runner)
    assert first_chunk(runner, short) == (0, BLOCK_SIZE)
    assert first_chunk(runner, one_over) == (BLOCK_SIZE, 1)


def test_running_sequences_share_the_same_blocks_and_keep_them_while_either_holds_them() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    first = make_seq(SYSTEM + [1], max_tokens=20)
    scheduler.add(first)
    step(scheduler, runner)  # prefilled; its three full blocks are cached now
    second = make_seq(SYSTEM + [2, 3], max_tokens=2)
    scheduler.add(second)
    step(scheduler, runner)
    assert second.block_table[:3] == first.block_table[:3]
    assert second.block_table[3] != first.block_table[3]
    blocks = scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks - 5  # 4 of the first's, 1 of the second's own
    run_to_end(scheduler, runner)
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.usage == 0.0


def test_a_freed_cached_block_counts_as_free_and_is_still_found() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    scheduler.add(make_seq(SYSTEM + [1]))
    run_to_end(scheduler, runner)
    blocks = scheduler.blocks
    assert blocks.usage == 0.0 and blocks.num_free_blocks == blocks.num_blocks
    assert blocks.num_cached_blocks == 3
    later = make_seq(SYSTEM + [2])
    assert blocks.cached_prefix(later) != [] and len(blocks.cached_prefix(later)) == 3


def test_allocation_takes_uncached_blocks_before_evicting_the_least_recently_freed() -> None:
    blocks = BlockManager(8 * BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_batch_tokens=256), blocks)
    runner = FakeRunner()
    old = make_seq(list(range(1000, 1000 + 2 * BLOCK_SIZE + 1)), max_tokens=1)  # 2 cached blocks
    scheduler.add(old)
    run_to_end(scheduler, runner)
    new = make_seq(list(range(2000, 2000 + 2 * BLOCK_SIZE + 1)), max_tokens=1)  # 2 more, freed later
    scheduler.add(new)
    run_to_end(scheduler, runner)
    assert blocks.num_cached_blocks == 4 and blocks.evicted_blocks == 0
    # 4 blocks were never cached: a 4-block prompt takes them and evicts nothing
    filler = make_seq(list(range(3000, 3000 + 4 * BLOCK_SIZE)), max_tokens=1)
    scheduler.add(filler)
    step(scheduler, runner)
    assert blocks.evicted_blocks == 0
    assert len(blocks.cached_prefix(make_seq(old.prompt_token_ids))) == 2
    # one more block evicts the least recently freed cached block: the old prompt's, tail first
    scheduler.add(make_seq([1], max_tokens=1))
    step(scheduler, runner)
    assert blocks.evicted_blocks == 1
    assert len(blocks.cached_prefix(make_seq(old.prompt_token_ids))) == 1
    assert len(blocks.cached_prefix(make_seq(new.prompt_token_ids))) == 2


def test_admission_counts_the_blocks_a_hit_saves() -> None:
    # 7 blocks; a decoding sequence holds 5 of them: a 5-block prompt sharing 3 of its blocks
    # needs only 2 new blocks (fits), where without the hit it would need 5 (does not)
    for caching, admitted in ((True, True), (False, False)):
        scheduler, runner = make_scheduler(kv_tokens=7 * BLOCK_SIZE, enable_prefix_caching=caching), FakeRunner()
        holder = make_seq(SYSTEM + list(range(BLOCK_SIZE)), max_tokens=30)
        scheduler.add(holder)
        step(scheduler, runner)
        sharer = make_seq(SYSTEM + list(range(500, 500 + 2 * BLOCK_SIZE - 8)), max_tokens=1)
        scheduler.add(sharer)
        step(scheduler, runner)
        assert len(holder.block_table) == 5
        assert (sharer.status is not SequenceStatus.WAITING) is admitted


def test_admission_counts_cached_blocks_nobody_holds_as_taken_by_the_hit() -> None:
    # 5 blocks, 3 of them cached and free: a prompt of 3 cached blocks + 3 new ones needs 3 new
    # blocks, and only 2 are free once it holds its 3 cached ones
    scheduler, runner = make_scheduler(kv_tokens=5 * BLOCK_SIZE), FakeRunner()
    scheduler.add(make_seq(SYSTEM + [1], max_tokens=1))
    run_to_end(scheduler, runner)
    too_big = make_seq(SYSTEM + list(range(2 * BLOCK_SIZE + 1)), max_tokens=1)
    fits = make_seq(SYSTEM + list(range(2 * BLOCK_SIZE)), max_tokens=1)
    assert not scheduler.can_admit(too_big)
    assert scheduler.can_admit(fits)


def test_a_preempted_sequence_is_recomputed_from_its_cached_blocks() -> None:
    # 10 blocks; two sequences grow until one must be preempted; its computed blocks stay cached
    # and its recompute starts past them
    scheduler, runner = make_scheduler(kv_tokens=10 * BLOCK_SIZE, max_batch_tokens=64), FakeRunner()
    older = make_seq(list(range(1000, 1000 + 2 * BLOCK_SIZE)), max_tokens=60)
    newer = make_seq(list(range(2000, 2000 + 2 * BLOCK_SIZE)), max_tokens=60)
    scheduler.add(older)
    scheduler.add(newer)
    while newer.num_preemptions == 0:
        step(scheduler, runner)
    computed_before = [c for b in runner.batches for c in b.chunks if c.seq is newer][-1]
    computed_tokens = computed_before.start + computed_before.num_tokens
    run_to_end(scheduler, runner)
    recompute = [c for b in runner.batches for c in b.chunks if c.seq is newer and c.start == 0]
    assert len(recompute) == 1  # computed from position 0 once only: the first time
    assert older.output_token_ids and len(newer.output_token_ids) == 60
    assert scheduler.blocks.prefix_hit_tokens >= (computed_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE > 0


def test_no_step_writes_into_a_cached_block() -> None:
    scheduler, runner = make_scheduler(max_batch_tokens=40), FakeRunner()
    for tail in range(6):
        scheduler.add(make_seq(SYSTEM + list(range(tail * 7, tail * 7 + 20)), max_tokens=30))
    blocks = scheduler.blocks
    while scheduler.has_work:
        batch = scheduler.schedule()
        cached = {block for block in range(blocks.num_blocks) if blocks.is_cached(block)}
        for chunk in batch.chunks:
            positions = range(chunk.start, chunk.start + chunk.num_tokens)
            written = {chunk.seq.block_table[p // BLOCK_SIZE] for p in positions}
            assert not written & cached, (chunk.seq.seq_id, chunk.start, chunk.num_tokens)
        scheduler.update(batch, runner.run(batch))
    assert blocks.prefix_hit_tokens > 0  # the prompts did share


def test_the_counters_say_how_many_prompt_tokens_were_looked_up_and_found() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    for tail in ([1, 2], [3, 4, 5]):
        scheduler.add(make_seq(SYSTEM + tail))
        run_to_end(scheduler, runner)
    blocks = scheduler.blocks
    assert blocks.prefix_queried_tokens == 2 * len(SYSTEM) + 5
    assert blocks.prefix_hit_tokens == len(SYSTEM)


def test_a_unique_prompt_is_found_by_its_own_recompute_only() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    unique = make_seq(SYSTEM + [1], unique_prompt=True, max_tokens=1)
    scheduler.add(unique)
    run_to_end(scheduler, runner)
    assert scheduler.blocks.cached_prefix(make_seq(SYSTEM + [1])) == []
    # two unique prompts outgrow the cache as in the test above: the preempted one comes back
    # past the blocks it had computed, which no one else could find
    scheduler, runner = make_scheduler(kv_tokens=10 * BLOCK_SIZE, max_batch_tokens=64), FakeRunner()
    older = make_seq(list(range(1000, 1000 + 2 * BLOCK_SIZE)), max_tokens=60, unique_prompt=True)
    newer = make_seq(list(range(2000, 2000 + 2 * BLOCK_SIZE)), max_tokens=60, unique_prompt=True)
    scheduler.add(older)
    scheduler.add(newer)
    while newer.num_preemptions == 0:
        step(scheduler, runner)
    assert scheduler.blocks.cached_prefix(make_seq(newer.prompt_token_ids)) == []
    run_to_end(scheduler, runner)
    starts = [c.start for b in runner.batches for c in b.chunks if c.seq is newer and c.start % BLOCK_SIZE == 0
              and c.num_tokens > 1]
    assert starts[0] == 0 and starts[1] >= 4 * BLOCK_SIZE
