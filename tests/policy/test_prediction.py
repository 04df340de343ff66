"""Queue-wait prediction: service rate measured while backlogged; early rejection with Retry-After."""

from __future__ import annotations

import pytest

from tidegate.policy.prediction import PredictionOutcome, WaitPredictor, WorkUnit
from tidegate.policy.queueing import QueueAhead


def _measured(unit: WorkUnit, rate_per_s: float, dispatches: int = 200) -> WaitPredictor:
    """A predictor that watched a backlogged pool dispatch 10-token requests at `rate_per_s` units."""
    predictor = WaitPredictor(unit, time_constant_s=5.0)
    work = 1.0 if unit is WorkUnit.REQUESTS else 10.0
    for i in range(dispatches):
        predictor.on_dispatch(i * work / rate_per_s, request_tokens=10, queued_after=5)
    return predictor


@pytest.mark.parametrize(("unit", "rate_per_s"), [(WorkUnit.REQUESTS, 4.0), (WorkUnit.TOKENS, 100.0)])
def test_measures_the_backlogged_service_rate(unit: WorkUnit, rate_per_s: float) -> None:
    assert _measured(unit, rate_per_s).service_rate_per_s == pytest.approx(rate_per_s)


def test_idle_intervals_do_not_count() -> None:
    predictor = _measured(WorkUnit.REQUESTS, 4.0)
    t_s = 200 / 4.0  # the next dispatch on the backlogged schedule
    predictor.on_dispatch(t_s, 10, queued_after=0)  # and the queue is empty after it
    predictor.on_dispatch(t_s + 100.0, 10, queued_after=0)  # an arrival-limited gap of 100 s
    assert predictor.service_rate_per_s == pytest.approx(4.0)


@pytest.mark.parametrize(
    ("ahead_requests", "deadline_in_s", "outcome", "wait_s"),
    [
        (0, 1.0, PredictionOutcome.MEETS_DEADLINE, 0.0),
        (8, 5.0, PredictionOutcome.MEETS_DEADLINE, 2.0),
        (40, 5.0, PredictionOutcome.MISSES_DEADLINE, 10.0),
    ],
)
def test_predicts_wait_from_the_queue_ahead(ahead_requests: int, deadline_in_s: float,
                                            outcome: PredictionOutcome, wait_s: float) -> None:
    prediction = _measured(WorkUnit.REQUESTS, 4.0).predict(0.0, QueueAhead(ahead_requests, 0), deadline_in_s)
    assert prediction.outcome is outcome
    assert prediction.predicted_wait_s == pytest.approx(wait_s)
    assert prediction.pressure == pytest.approx(wait_s / deadline_in_s)


def test_retry_after_is_the_excess_wait() -> None:
    prediction = _measured(WorkUnit.REQUESTS, 4.0).predict(0.0, QueueAhead(40, 0), 5.0)
    assert prediction.retry_after_s == pytest.approx(10.0 - 5.0)


def test_no_estimate_before_any_backlogged_dispatch() -> None:
    prediction = WaitPredictor().predict(0.0, QueueAhead(3, 30), 5.0)
    assert prediction.outcome is PredictionOutcome.NO_ESTIMATE and not prediction.misses_deadline


def test_tokens_unit_weighs_long_requests() -> None:
    predictor = _measured(WorkUnit.TOKENS, 100.0)
    assert predictor.predict(0.0, QueueAhead(2, 1000), 20.0).predicted_wait_s == pytest.approx(10.0)


def test_rate_follows_a_slowdown() -> None:
    predictor = _measured(WorkUnit.REQUESTS, 4.0)
    start_s = 200 / 4.0
    for i in range(1, 100):  # 50 s at 2 requests/s: 10 time constants
        predictor.on_dispatch(start_s + i / 2.0, 10, queued_after=5)
    assert predictor.service_rate_per_s == pytest.approx(2.0, rel=0.01)


def test_dispatches_at_one_instant_all_count() -> None:
    predictor = WaitPredictor(WorkUnit.REQUESTS, time_constant_s=5.0)
    for second in range(200):  # two slots free together every second: 2 requests/s
        predictor.on_dispatch(float(second), 10, queued_after=5)
        predictor.on_dispatch(float(second), 10, queued_after=5)
    assert predictor.service_rate_per_s == pytest.approx(2.0)


def test_a_queue_emptied_without_a_dispatch_ends_the_backlogged_interval() -> None:
    predictor = _measured(WorkUnit.REQUESTS, 4.0)  # its last dispatch left requests waiting
    predictor.on_queue_emptied()  # they expired or were cancelled
    predictor.on_dispatch(200 / 4.0 + 30.0, 10, queued_after=5)  # the next burst, 30 s later
    assert predictor.service_rate_per_s == pytest.approx(4.0)


def test_better_tiers_arrivals_slow_a_lower_tiers_queue() -> None:
    predictor = WaitPredictor(WorkUnit.REQUESTS, time_constant_s=5.0)
    for step in range(1, 200):  # a backlog served at 10 requests/s
        predictor.on_dispatch(step * 0.1, 100, queued_after=5)
    for step in range(160):  # the best tier queues 8 requests/s meanwhile (4 time constants)
        predictor.on_queued(step / 8, 0, 100)
    now_s = 159 / 8
    assert predictor.predict(now_s, QueueAhead(10, 1000), now_s + 4.0, rank=0).predicted_wait_s < 1.5
    slowed = predictor.predict(now_s, QueueAhead(10, 1000), now_s + 4.0, rank=1)
    assert slowed.misses_deadline  # 10 requests at the ~2/s the best tier leaves: about 5 s
    assert 3.0 < slowed.predicted_wait_s < 8.0


def test_first_rate_is_not_taken_from_one_short_interval() -> None:
    predictor = WaitPredictor(WorkUnit.TOKENS, time_constant_s=10.0)
    predictor.on_dispatch(0.0, 96, queued_after=3)
    predictor.on_dispatch(0.0007, 96, queued_after=3)  # two slots freed a moment apart
    assert predictor.service_rate_per_s is None  # not 137,000 tokens/s
    for step in range(1, 12):  # then one 96-token request every 0.1 s
        predictor.on_dispatch(0.0007 + step * 0.1, 96, queued_after=3)
    assert 800 < predictor.service_rate_per_s < 1100


def test_predictions_are_scaled_by_the_waits_they_turned_out_to_be() -> None:
    """Waits turn out half of what was predicted (a rate measured in a burst's fill trough): once
    eight are reported, predictions halve, and a request the raw figure refused now queues."""
    predictor = _measured(WorkUnit.REQUESTS, 4.0)
    ahead, deadline_s = QueueAhead(24, 0), 4.5  # 24 ahead at 4/s: 6 s raw, past the deadline
    assert predictor.predict(0.0, ahead, deadline_s).misses_deadline
    for _ in range(7):
        predictor.on_waited(6.0, 3.0)
    assert predictor.correction == 1.0  # not from fewer than eight
    predictor.on_waited(6.0, 3.0)
    prediction = predictor.predict(0.0, ahead, deadline_s)
    assert prediction.outcome is PredictionOutcome.MEETS_DEADLINE
    assert prediction.predicted_wait_s == pytest.approx(3.0)
    assert prediction.uncorrected_wait_s == pytest.approx(6.0)  # what the request reports when it leaves


def test_the_correction_leans_towards_queueing() -> None:
    """A lower quantile of the reported ratios than the median: a request refused that would have
    made it is capacity lost, one queued that misses is refused at its deadline."""
    predictor = _measured(WorkUnit.REQUESTS, 4.0)
    for ratio in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2):
        predictor.on_waited(10.0, 10.0 * ratio)
    assert predictor.correction == pytest.approx(0.6)
    predictor.on_waited(0.0, 5.0)  # nothing was predicted: nothing to learn
    assert predictor.correction == pytest.approx(0.6)


def test_a_request_sent_at_once_is_accounted_as_queued_then_dispatched() -> None:
    """`on_sent_at_once` is `on_queued` then `on_dispatch` with nothing queued after it, in one call:
    the same rates and predictions, whether or not a backlogged interval was open."""
    one, two = WaitPredictor(WorkUnit.TOKENS), WaitPredictor(WorkUnit.TOKENS)
    now_s = 0.0
    for step in range(200):
        now_s += (step % 7) * 0.013
        rank, tokens = step % 3, 50 + 37 * (step % 11)
        if step % 5 == 0:  # a backlog: dispatches with requests left behind them
            for predictor in (one, two):
                predictor.on_queued(now_s, rank, tokens)
                predictor.on_dispatch(now_s, tokens, queued_after=2)
            continue
        one.on_queued(now_s, rank, tokens)
        one.on_dispatch(now_s, tokens, queued_after=0)
        two.on_sent_at_once(now_s, rank, tokens)
        ahead = QueueAhead(3, 900)
        for asked in range(3):
            assert one.predict(now_s, ahead, now_s + 5.0, asked) == two.predict(now_s, ahead, now_s + 5.0, asked)
        assert one.service_rate_per_s == two.service_rate_per_s
