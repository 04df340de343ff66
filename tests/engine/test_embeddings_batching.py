"""The batch-forming policy: pure, no event loop, time passed in."""

from __future__ import annotations

import pytest

from tidegate.engine.batching import BatchAction, BatchFormingPolicy, PendingText, padded_tokens


def texts(token_counts: list[int], arrived_s: float = 0.0, request_id: int = 0) -> list[PendingText]:
    return [PendingText(request_id, i, tokens, arrived_s) for i, tokens in enumerate(token_counts)]


def policy(**overrides) -> BatchFormingPolicy:
    options = {"max_batch_size": 4, "max_queue_delay_s": 0.010, "max_batches_per_round": 2,
               "max_batch_tokens": 1000}
    return BatchFormingPolicy(**{**options, **overrides})


def test_idle_when_nothing_waits() -> None:
    assert policy().decide([], now_s=5.0).action is BatchAction.IDLE


def test_partial_batch_waits_until_oldest_deadline() -> None:
    decision = policy().decide(texts([3, 3], arrived_s=1.0), now_s=1.004)
    assert decision.action is BatchAction.WAIT
    assert decision.wake_at_s == pytest.approx(1.010)


def test_partial_batch_runs_once_oldest_is_overdue() -> None:
    decision = policy().decide(texts([3, 3], arrived_s=1.0), now_s=1.010)
    assert decision.action is BatchAction.RUN
    assert [len(batch) for batch in decision.batches] == [2]


def test_full_batch_runs_without_waiting() -> None:
    decision = policy().decide(texts([3, 3, 3, 3], arrived_s=1.0), now_s=1.0)
    assert decision.action is BatchAction.RUN
    assert [len(batch) for batch in decision.batches] == [4]


def test_enough_tokens_run_without_waiting() -> None:
    decision = policy(max_batch_tokens=100).decide(texts([60, 40], arrived_s=1.0), now_s=1.0)
    assert decision.action is BatchAction.RUN


def test_round_takes_every_waiting_text_up_to_the_cap() -> None:
    decision = policy().decide(texts([1, 2, 3, 4, 5, 6], arrived_s=1.0), now_s=1.0)
    assert [len(batch) for batch in decision.batches] == [4, 2]


def test_batches_keep_within_padded_token_budget() -> None:
    decision = policy(max_batch_tokens=100).decide(texts([10, 10, 10, 40, 40, 45]), now_s=1.0)
    assert [[text.tokens for text in batch] for batch in decision.batches] == [[10, 10, 10], [40, 40], [45]]


def test_text_longer_than_budget_runs_alone() -> None:
    decision = policy(max_batch_tokens=10).decide(texts([50, 60]), now_s=1.0)
    assert [len(batch) for batch in decision.batches] == [1, 1]


def test_round_is_capped_to_max_batches_per_round() -> None:
    decision = policy().decide(texts([5] * 20, arrived_s=1.0), now_s=2.0)
    assert [len(batch) for batch in decision.batches] == [4, 4]


def test_round_takes_oldest_texts_first() -> None:
    old = texts([9] * 8, arrived_s=1.0, request_id=1)
    new = texts([1] * 4, arrived_s=1.5, request_id=2)
    decision = policy().decide(old + new, now_s=2.0)
    assert {text.request_id for batch in decision.batches for text in batch} == {1}


def test_sorting_groups_like_lengths() -> None:
    decision = policy().decide(texts([100, 2, 100, 2, 100, 2, 100, 2]), now_s=0.0)
    assert [[text.tokens for text in batch] for batch in decision.batches] == [[2] * 4, [100] * 4]


def test_unsorted_keeps_arrival_order() -> None:
    decision = policy(sort_by_length=False).decide(texts([100, 2, 100, 2, 100, 2, 100, 2]), now_s=0.0)
    assert [[text.tokens for text in batch] for batch in decision.batches] == [[100, 2] * 2] * 2


def test_sorting_reduces_padded_tokens() -> None:
    pending = texts([100, 2, 100, 2, 100, 2, 100, 2])
    sorted_cost = sum(map(padded_tokens, policy().decide(pending, 0.0).batches))
    unsorted_cost = sum(map(padded_tokens, policy(sort_by_length=False).decide(pending, 0.0).batches))
    assert sorted_cost < unsorted_cost


def test_padded_tokens_pads_to_longest() -> None:
    assert padded_tokens(texts([3, 10, 5])) == 30


@pytest.mark.parametrize(
    "bad", [{"max_batch_size": 0}, {"max_queue_delay_s": -1.0}, {"max_batches_per_round": 0}, {"max_batch_tokens": 0}]
)
def test_rejects_nonsense_limits(bad: dict) -> None:
    with pytest.raises(ValueError):
        policy(**bad)
