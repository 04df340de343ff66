"""What one replica serves at its slot limit, in tokens per second, measured from the work a
saturated pool serves. Pure: observations in (time passed in), an estimate out.

The autoscaler's work demand divides the tokens arriving by this throughput. Set by hand, it goes
stale: the same worker measured 448, 687 and 766 tokens/s on three live runs of one machine
(docs/autoscaling.md). The gateway and the simulator already count the tokens they serve; while
every replica holds all its slots or requests wait for one, what they serve is what the replicas
can serve, so the tokens served over those replica-seconds measure the throughput itself
(`tests/policy/test_throughput.py`). An unsaturated pool serves what arrives, less than it could:
those ticks say nothing about the throughput and are left out
(`test_an_unsaturated_pool_teaches_nothing`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["SaturatedThroughput", "PoolSample"]


@dataclass(frozen=True, slots=True)
class PoolSample:
    """The pool at one tick."""

    now_s: float
    ready: int  # replicas serving
    held: int  # requests on the replicas
    queued: int  # requests waiting for a replica
    served_tokens: int  # prompt + output tokens of the requests answered since the previous tick


class SaturatedThroughput:
    """Tokens served per replica-second over the ticks the pool was saturated at both ends (every
    slot held, or a queue): a tick that starts or ends with room served arrivals, not capacity.
    Tokens are counted as requests finish, in clumps, so the estimate waits for `min_replica_s` of
    saturation (`test_the_estimate_waits_for_enough_saturated_time`) and keeps the last
    `memory_replica_s` of it, so that a replica's speed as it is now wins over the past
    (`test_the_estimate_follows_a_change_of_speed`)."""

    def __init__(self, slots_per_replica: int, *, min_replica_s: float = 60.0, memory_replica_s: float = 900.0) -> None:
        if slots_per_replica < 1 or not 0 < min_replica_s <= memory_replica_s:
            raise ValueError("need slots_per_replica >= 1 and 0 < min_replica_s <= memory_replica_s")
        self.slots_per_replica = slots_per_replica
        self.min_replica_s, self.memory_replica_s = min_replica_s, memory_replica_s
        self._spans: deque[tuple[float, float]] = deque()  # (tokens served, replica-seconds), saturated ticks
        self._tokens = 0.0
        self._replica_s = 0.0
        self._previous: PoolSample | None = None

    def _saturated(self, sample: PoolSample) -> bool:
        return sample.ready > 0 and (sample.queued > 0 or sample.held >= sample.ready * self.slots_per_replica)

    @property
    def tokens_per_s(self) -> float | None:
        """One replica's tokens per second at its slot limit; None until enough saturation was seen."""
        if self._replica_s < self.min_replica_s:
            return None
        return self._tokens / self._replica_s if self._tokens > 0 else None

    def observe(self, sample: PoolSample) -> None:
        """Records one tick (changes state)."""
        previous, self._previous = self._previous, sample
        if previous is None or not (self._saturated(previous) and self._saturated(sample)):
            return
        # the more of the two counts: a replica that joined within the tick and served in it lowers
        # the estimate rather than raising it (the autoscaler errs towards a replica more)
        replica_s = max(previous.ready, sample.ready) * (sample.now_s - previous.now_s)
        if replica_s <= 0:
            return
        self._spans.append((float(sample.served_tokens), replica_s))
        self._tokens += sample.served_tokens
        self._replica_s += replica_s
        while self._replica_s - self._spans[0][1] >= self.memory_replica_s:
            tokens, old_s = self._spans.popleft()
            self._tokens -= tokens
            self._replica_s -= old_s
