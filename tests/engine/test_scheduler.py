"""The pure scheduler driven by a fake runner: no torch, no threads, no clock."""

from __future__ import annotations

import itertools

from tests.engine.fake_runner import EOS, FakeRunner, step
from tidegate.engine.kv_cache import BlockManager
from tidegate.engine.scheduler import Scheduler, SchedulerConfig
from tidegate.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus

_ids = itertools.count(1)


def make_scheduler(
    kv_tokens: int = 4096,
    max_num_seqs: int = 8,
    max_batch_tokens: int = 64,
    chunked: bool = True,
    attention_cost_tokens: int | None = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_batch_tokens=max_batch_tokens,
        chunked_prefill=chunked,
        eos_token_ids=frozenset({EOS}),
        attention_cost_tokens=attention_cost_tokens,
    )
    return Scheduler(config, BlockManager(kv_tokens))


def make_seq(prompt_len: int = 4, max_tokens: int = 8, priority: int = 0) -> Sequence:
    return Sequence(
        seq_id=next(_ids),
        prompt_token_ids=[7] * prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
    )


def test_running_decodes_come_before_new_prefills() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    first = make_seq()
    scheduler.add(first)
    step(scheduler, runner)
    second = make_seq()
    scheduler.add(second)
    batch, _ = step(scheduler, runner)
    assert [c.seq for c in batch.chunks] == [first, second]
    assert batch.num_decodes == 1


def test_step_never_exceeds_token_budget() -> None:
    scheduler, runner = make_scheduler(max_batch_tokens=10, max_num_seqs=16), FakeRunner()
    for _ in range(3):
        scheduler.add(make_seq(prompt_len=6))
    batch, _ = step(scheduler, runner)
    assert batch.num_tokens == 10


def test_long_prompt_is_prefilled_in_chunks_while_decodes_continue() -> None:
    scheduler, runner = make_scheduler(max_batch_tokens=16), FakeRunner()
    decoder = make_seq(prompt_len=4, max_tokens=50)
    scheduler.add(decoder)
    step(scheduler, runner)
    scheduler.add(make_seq(prompt_len=40))
    for _ in range(3):
        batch, _ = step(scheduler, runner)
        assert batch.chunks[0].seq is decoder and batch.num_tokens <= 16
    prefill_sizes = [c.num_tokens for b in runner.batches[1:] for c in b.chunks if c.seq is not decoder]
    assert prefill_sizes == [15, 15, 10]


def test_chunks_shrink_as_their_context_grows_when_attention_is_charged() -> None:
    # attention over c context positions costs c / 100 of a token's Linear work here
    scheduler, runner = make_scheduler(max_batch_tokens=64, attention_cost_tokens=100), FakeRunner()
    scheduler.add(make_seq(prompt_len=400, max_tokens=1))
    while scheduler.has_work:
        step(scheduler, runner)
    chunks = [(c.start, c.num_tokens) for b in runner.batches for c in b.chunks]
    assert sum(n for _, n in chunks) == 400 and [s for s, _ in chunks] == list(itertools.accumulate([0] + [n for _, n in chunks[:-1]]))
    sizes = [n for _, n in chunks[:-1]]  # the last one is only what was left
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1]
    for start, n in chunks:
        # the chunk is the longest whose charge n (1 + mean context / 100) fits the budget
        charge = lambda k: k * (1 + (start + (k + 1) / 2) / 100)  # noqa: E731
        assert charge(n) <= 64 and (n == 400 - start or charge(n + 1) > 64)


def test_charged_chunk_leaves_less_budget_for_others() -> None:
    scheduler, runner = make_scheduler(max_batch_tokens=64, attention_cost_tokens=100), FakeRunner()
    scheduler.add(make_seq(prompt_len=30))
    scheduler.add(make_seq(prompt_len=30))
    batch, _ = step(scheduler, runner)
    # 30 tokens at mean context 15.5 are charged 30 * 1.155 -> 35, so 29 budget is left for the second
    first, second = batch.chunks
    assert first.num_tokens == 30 and second.num_tokens == 25  # 25 * (1 + 13 / 100) <= 29 < 26 * 1.135


def test_without_chunking_a_long_prompt_runs_whole() -> None:
    scheduler, runner = make_scheduler(max_batch_tokens=16, chunked=False), FakeRunner()
    scheduler.add(make_seq(prompt_len=40))
    batch, _ = step(scheduler, runner)
    assert batch.num_tokens == 40


def test_sampled_token_appears_only_after_the_last_chunk() -> None:
    scheduler, runner = make_scheduler(max_batch_tokens=16), FakeRunner()
    seq = make_seq(prompt_len=20)
    scheduler.add(seq)
    _, outputs = step(scheduler, runner)
    assert outputs == [] and seq.num_computed_tokens == 16
    _, outputs = step(scheduler, runner)
    assert [o.seq_id for o in outputs] == [seq.seq_id]


def test_finished_sequence_leaves_and_frees_its_blocks() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    seq = make_seq(max_tokens=2)
    scheduler.add(seq)
    step(scheduler, runner)
    _, outputs = step(scheduler, runner)
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert not scheduler.running and scheduler.blocks.usage == 0.0


def test_eos_finishes_with_stop_unless_ignored() -> None:
    scheduler = make_scheduler()
    seq = make_seq()
    scheduler.add(seq)
    batch = scheduler.schedule()
    outputs = scheduler.update(batch, [EOS])
    assert outputs[0].finish_reason is FinishReason.STOP


def test_max_num_seqs_caps_running() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    for _ in range(3):
        scheduler.add(make_seq())
    step(scheduler, runner)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 1


def test_better_priority_is_admitted_first() -> None:
    scheduler, runner = make_scheduler(max_num_seqs=1), FakeRunner()
    background = make_seq(priority=5)
    urgent = make_seq(priority=0)
    scheduler.add(background)
    scheduler.add(urgent)
    step(scheduler, runner)
    assert scheduler.running == [urgent]


def _running(scheduler: Scheduler, runner: FakeRunner, count: int, **seq) -> list[Sequence]:
    """`count` sequences of 1-token prompts, admitted and past their first step."""
    running = [make_seq(prompt_len=1, **seq) for _ in range(count)]
    for each in running:
        scheduler.add(each)
    step(scheduler, runner)
    return running


def test_a_better_class_prompt_takes_the_budget_before_a_worse_class_decodes() -> None:
    # 8 worse-priority sequences decoding use 8 of a 10-token budget; a better prompt of 6 tokens
    # must not wait for them: it is prefilled whole, and the worse decodes share what is left
    scheduler, runner = make_scheduler(max_batch_tokens=10, max_num_seqs=16), FakeRunner()
    flood = _running(scheduler, runner, 8, max_tokens=50, priority=3)
    assert all(seq.is_decoding for seq in flood)
    quiet = make_seq(prompt_len=6, priority=2)
    scheduler.add(quiet)
    batch, _ = step(scheduler, runner)
    prefills = batch.chunks[batch.num_decodes:]
    assert [(c.seq, c.num_tokens) for c in prefills] == [(quiet, 6)]
    assert batch.num_decodes == 4 and all(c.seq in flood for c in batch.chunks[:4])  # oldest first
    assert batch.num_tokens == 10


def test_a_full_engine_keeps_decoding_a_worse_class_while_a_better_prompt_waits() -> None:
    # no room to admit the better prompt: the worse class's sequences must still run, or none
    # would ever finish to make room
    scheduler, runner = make_scheduler(max_num_seqs=2), FakeRunner()
    worse = _running(scheduler, runner, 2, max_tokens=3, priority=3)
    better = make_seq(priority=0)
    scheduler.add(better)
    batch, _ = step(scheduler, runner)
    assert [c.seq for c in batch.chunks] == worse
    for _ in range(5):
        step(scheduler, runner)
    assert all(seq.status is SequenceStatus.FINISHED for seq in worse) and better in scheduler.running


def test_with_one_priority_every_decode_comes_before_a_new_prompt() -> None:
    scheduler, runner = make_scheduler(max_batch_tokens=10, max_num_seqs=16), FakeRunner()
    _running(scheduler, runner, 8, max_tokens=50)
    newcomer = make_seq(prompt_len=6)
    scheduler.add(newcomer)
    batch, _ = step(scheduler, runner)
    assert batch.num_decodes == 8 and [(c.seq, c.num_tokens) for c in batch.chunks[8:]] == [(newcomer, 2)]


def test_out_of_blocks_preempts_the_newest_of_equal_priority() -> None:
    # 3 blocks of 16: two sequences of 16 prompt tokens each fill one block; the third block goes
    # to the first that grows; the next one to grow must evict the newest
    scheduler, runner = make_scheduler(kv_tokens=48), FakeRunner()
    older, newer = make_seq(prompt_len=16, max_tokens=40), make_seq(prompt_len=16, max_tokens=40)
    scheduler.add(older)
    scheduler.add(newer)
    for _ in range(20):
        step(scheduler, runner)
    assert newer.num_preemptions >= 1 and older.num_preemptions == 0


def test_out_of_blocks_preempts_lowest_priority_even_if_older() -> None:
    scheduler, runner = make_scheduler(kv_tokens=48), FakeRunner()
    background, urgent = make_seq(prompt_len=16, max_tokens=40, priority=9), make_seq(prompt_len=16, max_tokens=40)
    scheduler.add(background)
    scheduler.add(urgent)
    for _ in range(20):
        step(scheduler, runner)
    assert background.num_preemptions >= 1 and urgent.num_preemptions == 0


def test_preempted_sequence_is_recomputed_and_completes_identically() -> None:
    tight, roomy = make_scheduler(kv_tokens=48), make_scheduler()
    results = []
    for scheduler in (tight, roomy):
        runner = FakeRunner()
        seqs = [make_seq(prompt_len=16, max_tokens=30) for _ in range(2)]
        for seq in seqs:
            scheduler.add(seq)
        for _ in range(200):
            if not scheduler.has_work:
                break
            step(scheduler, runner)
        results.append(([seq.output_token_ids for seq in seqs], sum(seq.num_preemptions for seq in seqs)))
    (tight_tokens, tight_preemptions), (roomy_tokens, roomy_preemptions) = results
    assert tight_preemptions > 0 and roomy_preemptions == 0
    assert tight_tokens == roomy_tokens and tight.blocks.usage == 0.0


def test_abort_frees_blocks_and_removes_sequence() -> None:
    scheduler, runner = make_scheduler(), FakeRunner()
    seq = make_seq(max_tokens=100)
    scheduler.add(seq)
    step(scheduler, runner)
    output = scheduler.abort(seq.seq_id)
    assert output is not None and output.finish_reason is FinishReason.ABORT
    assert seq.status is SequenceStatus.FINISHED and scheduler.blocks.usage == 0.0 and not scheduler.has_work


def test_abort_of_waiting_sequence_removes_it() -> None:
    scheduler = make_scheduler()
    seq = make_seq()
    scheduler.add(seq)
    assert scheduler.abort(seq.seq_id) is not None and not scheduler.waiting


def test_abort_of_unknown_sequence_is_none() -> None:
    assert make_scheduler().abort(123456) is None


def test_waiting_prompt_is_not_admitted_when_it_cannot_fit() -> None:
    scheduler, runner = make_scheduler(kv_tokens=32), FakeRunner()
    first = make_seq(prompt_len=20, max_tokens=10)
    scheduler.add(first)
    step(scheduler, runner)
    scheduler.add(make_seq(prompt_len=20))
    step(scheduler, runner)
    assert scheduler.running == [first] and len(scheduler.waiting) == 1
