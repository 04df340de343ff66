"""Predicted queue wait and early rejection. Time is an argument.

Follows Mooncake's prediction-based early rejection (Qin et al., FAST 2025): rather than let a
request time out in the queue, predict when it would start, from the work queued ahead of it and
the measured rate at which the pool drains the queue, and refuse (or degrade) at once if that is
after its deadline, telling the client when retrying makes sense.

The service rate is an exponentially weighted moving average over time (time constant
`time_constant_s`) of the work dispatched per second, sampled only over intervals when requests
were waiting: when the queue is empty, dispatch follows arrivals and says nothing of capacity.
Work is counted in requests or in tokens (prompt + expected output), as configured.

Strict priority: a request of a lower tier is served only with what the better tiers leave, and
their requests still to come go ahead of it too. So its queue drains at the service rate less the
better tiers' arrival rate (queued work, averaged like the service rate), not at the whole service
rate; with critical traffic taking nearly all capacity, a standard request's wait was predicted
short, it queued, and it was refused only at its deadline
(`test_lower_tier_is_refused_at_once_when_better_tiers_take_the_capacity`).

The predictor corrects itself. Its rate is an average over the last ten seconds, so it lags a
change, and at a burst's start it is taken from the fill's trough (the replicas just filled, none
finishes for a while): in `critical_burst` waits predicted at 7.4 s were 3.5 s, requests that would
have started in time were refused at arrival, the queue ended the burst short, and 124 fewer
requests were served within target than FIFO over its ten seeds (2.7 %). So each request that
leaves the queue for a replica reports the wait it really had against the one predicted for it
(uncorrected), and predictions are scaled by the `correction_quantile` of the last `error_samples`
such ratios. The loop is stable: a correction that admits too many makes the next waits longer
than predicted, and the ratios rise. A low quantile leans towards queueing, since a request
refused that would have made it is capacity lost once the queue runs dry, while one queued that
then misses is refused at its deadline, as FIFO refuses all. Measured on `critical_burst`'s ten
seeds (within target against FIFO's 4631; share of refusals made at arrival): uncorrected 4507,
100 %; median of 64 ratios 4549, -; quarter of 64 4565, -; quarter of 16 4413; quarter of 128
4587, 67 % (the default; `goodput` at 2x and 4x within noise of FIFO or above); median of 128 4535,
77 %; quarter of 256 4586. (`test_predictions_are_scaled_by_the_waits_they_turned_out_to_be`)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

from tidegate.policy.queueing import QueueAhead

__all__ = ["WorkUnit", "PredictionOutcome", "WaitPrediction", "WaitPredictor"]


class WorkUnit(Enum):
    REQUESTS = "requests"
    TOKENS = "tokens"


# read on every request's way as a module name: through its class, on Python 3.10 and 3.11, the read
# goes through `EnumType.__getattr__`'s slot hook (some 850 instructions)
_REQUESTS = WorkUnit.REQUESTS


class PredictionOutcome(Enum):
    NO_ESTIMATE = "no_estimate"  # work waits ahead but no service rate is measured yet: queue it
    MEETS_DEADLINE = "meets_deadline"
    MISSES_DEADLINE = "misses_deadline"  # answer now: reject (429/503 + Retry-After) or degrade


@dataclass(frozen=True, slots=True)
class WaitPrediction:
    outcome: PredictionOutcome
    predicted_wait_s: float | None  # None with NO_ESTIMATE
    # predicted wait / the wait the deadline allows; >= 1 misses; the degradation ladder compares
    # it with each tier's `degrade_at_pressure`. 0 with NO_ESTIMATE.
    pressure: float
    retry_after_s: float | None  # with MISSES_DEADLINE: when the queue ahead should have drained enough
    uncorrected_wait_s: float = 0.0  # before the correction: what `on_waited` is to be told

    @property
    def misses_deadline(self) -> bool:
        return self.outcome is PredictionOutcome.MISSES_DEADLINE


class WaitPredictor:
    """Measures a pool's service rate from dispatches and predicts the wait of a new request."""

    def __init__(self, unit: WorkUnit = WorkUnit.TOKENS, *, time_constant_s: float = 10.0,
                 min_retry_after_s: float = 1.0, correction_quantile: float = 0.25,
                 error_samples: int = 128) -> None:
        if time_constant_s <= 0 or min_retry_after_s < 0 or not 0 <= correction_quantile < 1 or error_samples < 8:
            raise ValueError("time_constant_s > 0, min_retry_after_s >= 0, correction_quantile in [0, 1), "
                             "error_samples >= 8 needed")
        self._correction_quantile = correction_quantile
        # realised wait / uncorrected predicted wait of the last dispatched requests that waited
        self._ratios: deque[float] = deque(maxlen=error_samples)
        self._correction = 1.0  # their `correction_quantile` quantile, once 8 are measured
        self.unit = unit
        self._time_constant_s = time_constant_s
        self._min_retry_after_s = min_retry_after_s
        self._rate_per_s: float | None = None
        self._first_window_s = time_constant_s / 10.0
        self._first_work = 0.0  # backlogged work and time gathered for the first estimate
        self._first_elapsed_s = 0.0
        self._last_dispatch_s: float | None = None
        self._backlogged = False  # requests were still waiting after the last dispatch
        self._same_instant_work = 0.0  # work dispatched at the last dispatch's instant, not yet sampled
        # tier rank -> (queued work per second, decayed to `_arrivals_at_s`)
        self._arrival_rate_per_s: dict[int, float] = {}
        self._arrivals_at_s = 0.0

    @property
    def service_rate_per_s(self) -> float | None:
        """Work units dispatched per second while backlogged; None until measured."""
        return self._rate_per_s

    def on_dispatch(self, now_s: float, request_tokens: int, queued_after: int) -> None:
        """Call at each dispatch with the request's tokens and the requests still queued after it."""
        work = 1.0 if self.unit is WorkUnit.REQUESTS else float(request_tokens)
        last_s = self._last_dispatch_s
        if self._backlogged and last_s is not None:
            if now_s <= last_s:
                # several slots freed at once: count this work in the next interval, not lose it
                self._same_instant_work += work
                self._backlogged = queued_after > 0
                return
            elapsed_s = now_s - last_s
            sample_per_s = (work + self._same_instant_work) / elapsed_s
            self._same_instant_work = 0.0
            if self._rate_per_s is None:
                # the first estimate waits for `first_window_s` of backlogged dispatches: taken from one
                # interval, two dispatches 0.7 ms apart read as 145,000 tokens/s, and every prediction
                # said "no wait" for the next minute while requests queued to their deadlines
                # (`test_first_rate_is_not_taken_from_one_short_interval`)
                self._first_work += sample_per_s * elapsed_s
                self._first_elapsed_s += elapsed_s
                if self._first_elapsed_s >= self._first_window_s:
                    self._rate_per_s = self._first_work / self._first_elapsed_s
            else:
                # continuous-time EWMA of throughput: the interval's weight grows with its length
                weight = 1.0 - math.exp(-elapsed_s / self._time_constant_s)
                self._rate_per_s += weight * (sample_per_s - self._rate_per_s)
        self._same_instant_work = 0.0
        self._last_dispatch_s = now_s
        self._backlogged = queued_after > 0

    def on_waited(self, uncorrected_wait_s: float, waited_s: float) -> None:
        """Call when a request predicted to wait `uncorrected_wait_s` (its prediction's, > 0) leaves the
        queue for a replica after `waited_s`: the predictor's error, which corrects what it predicts."""
        if uncorrected_wait_s <= 0:
            return
        self._ratios.append(waited_s / uncorrected_wait_s)
        if len(self._ratios) >= 8:  # sorting 64 floats: about 2 us, only while requests queue
            ordered = sorted(self._ratios)
            self._correction = ordered[int(self._correction_quantile * (len(ordered) - 1))]

    @property
    def correction(self) -> float:
        """What predictions are scaled by: realised over predicted waits, lately (1 until measured)."""
        return self._correction

    def on_queued(self, now_s: float, rank: int, request_tokens: int) -> None:
        """Call when a request of the tier of `rank` joins the queue (its arrival rate ahead of worse tiers)."""
        decay = self._decay(now_s)
        for other in self._arrival_rate_per_s:
            self._arrival_rate_per_s[other] *= decay
        self._arrivals_at_s = max(self._arrivals_at_s, now_s)
        work = 1.0 if self.unit is WorkUnit.REQUESTS else float(request_tokens)
        # an impulse of `work` spread over the time constant: the average's units are work per second
        self._arrival_rate_per_s[rank] = self._arrival_rate_per_s.get(rank, 0.0) + work / self._time_constant_s

    def on_sent_at_once(self, now_s: float, rank: int, request_tokens: int) -> None:
        """`on_queued` then `on_dispatch` with nothing queued after it, in one call: a request that found
        nobody waiting went to a replica at once (the pool controller's rule 1), the common case."""
        rates = self._arrival_rate_per_s
        last_s = self._arrivals_at_s
        time_constant_s = self._time_constant_s
        if rates:
            elapsed_s = now_s - last_s  # `max(0.0, elapsed_s)` as an expression: no builtin call
            decay = math.exp(-(elapsed_s if elapsed_s > 0.0 else 0.0) / time_constant_s)
            for other, rate in rates.items():  # values replaced in place: the dict keeps its size
                rates[other] = rate * decay
        if now_s > last_s:
            self._arrivals_at_s = now_s
        # tokens divide as their float would (`on_queued`), without calling `float`
        work = 1.0 if self.unit is _REQUESTS else request_tokens
        rates[rank] = rates.get(rank, 0.0) + work / time_constant_s
        if self._backlogged:  # the interval of the last backlogged dispatch ends here
            self.on_dispatch(now_s, request_tokens, queued_after=0)
            return
        self._same_instant_work = 0.0
        self._last_dispatch_s = now_s

    def arrival_rate_above(self, now_s: float, rank: int) -> float:
        """Work per second recently queued by tiers better than `rank` (a query: changes nothing)."""
        total = sum(rate for other, rate in self._arrival_rate_per_s.items() if other < rank)
        return total * self._decay(now_s)

    def _decay(self, now_s: float) -> float:
        return math.exp(-max(0.0, now_s - self._arrivals_at_s) / self._time_constant_s)

    def on_queue_emptied(self) -> None:
        """Call when the queue empties other than by a dispatch (expiry, cancellation, shedding).

        The next dispatch then starts a new backlogged interval instead of closing one that spans
        the idle time: a sample over that gap would read as a near-zero rate, and every arrival
        after it would be predicted to miss its deadline until the average recovered.
        """
        self._backlogged = False
        self._same_instant_work = 0.0

    def predict(self, now_s: float, ahead: QueueAhead, deadline_s: float, rank: int = 0) -> WaitPrediction:
        """The wait of a request of the tier of `rank` that would queue behind `ahead` and must start
        by `deadline_s`."""
        budget_s = deadline_s - now_s
        work_ahead = float(ahead.requests if self.unit is WorkUnit.REQUESTS else ahead.tokens)
        if ahead.requests == 0:
            wait_s = uncorrected_s = 0.0
        elif self._rate_per_s is None or self._rate_per_s <= 0:
            return WaitPrediction(PredictionOutcome.NO_ESTIMATE, None, 0.0, None)
        else:
            left_per_s = self.rate_left_per_s(now_s, rank)
            uncorrected_s = work_ahead / left_per_s if left_per_s > 0 else math.inf
            wait_s = uncorrected_s * self._correction if math.isfinite(uncorrected_s) else math.inf
        pressure = wait_s / budget_s if budget_s > 0 else math.inf
        if wait_s < budget_s:
            return WaitPrediction(PredictionOutcome.MEETS_DEADLINE, wait_s, pressure, None, uncorrected_s)
        # Retrying is worth it once the queue ahead has drained by the excess (absent new arrivals).
        excess_s = wait_s - max(0.0, budget_s) if math.isfinite(wait_s) else work_ahead / (self._rate_per_s or 1.0)
        retry_after_s = max(self._min_retry_after_s, excess_s)
        return WaitPrediction(PredictionOutcome.MISSES_DEADLINE, wait_s, pressure, retry_after_s)

    def rate_left_per_s(self, now_s: float, rank: int) -> float:
        """The service rate left to the tier of `rank` and worse tiers: the measured rate less what the
        better tiers keep queueing; 0 when none is measured or nothing is left (a query)."""
        if self._rate_per_s is None:
            return 0.0
        return max(0.0, self._rate_per_s - self.arrival_rate_above(now_s, rank))
