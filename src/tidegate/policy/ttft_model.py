"""A replica's time to first token as a function of the prefill work ahead of a request. Pure.

TTFT is set by the prompt tokens an engine must prefill before (and including) a request's own,
and by how slow each step is (its fixed cost and its decode batch). So the model is a line,
`ttft_s = factor * (fixed_s + s_per_token * tokens_ahead)`: the line is the pool's, fitted by
exponentially weighted least squares to what its replicas really did (each first token gives one
point: the prefill tokens that were ahead of the request when it was sent, its own included; the
engine time it took), and the factor is the replica's speed against it (`pool_line`). The decode
batch's effect is in the fit: while the batch is big, steps are slow and the slope is steep.

Why a fitted model and not a limit grown from a start value (AIMD, gradient, slow start): a model
of the replica's speed does not go stale while the replica idles, so a burst after an idle minute
meets the limit the replica had, not one that must grow again (`scenario: burst_after_idle`);
and a replica twice as slow shows twice the cost within its memory
(`test_a_replica_that_turns_twice_as_slow_shows_it_within_its_memory`, `slowed_replica`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TtftFit", "ReplicaSpeed", "fit_line", "pool_line"]


@dataclass(frozen=True, slots=True)
class TtftFit:
    fixed_s: float  # engine time a request of no tokens would take (a step, the network)
    s_per_token: float  # engine time each prefill token ahead adds
    samples: float  # weight behind the fit (decayed sample count)

    def predict_s(self, tokens_ahead: float) -> float:
        return self.fixed_s + self.s_per_token * tokens_ahead

    def tokens_within(self, engine_s: float) -> float:
        """Most prefill tokens ahead that still give a first token within `engine_s`."""
        return max(0.0, (engine_s - self.fixed_s) / self.s_per_token)


def fit_line(w: float, x: float, y: float, xx: float, xy: float) -> TtftFit:
    """Weighted least squares from its sums (weight, Σx, Σy, Σx², Σxy)."""
    spread = w * xx - x * x
    if spread > 1e-9 * max(1.0, w * xx):
        slope = (w * xy - x * y) / spread
        fixed = (y - slope * x) / w
        if slope > 0 and fixed >= 0:
            return TtftFit(fixed, slope, w)
    # one size of work seen so far (or a fit bending below zero): the line through the origin,
    # which overstates the cost of more tokens, so the budget errs small, never large
    slope = y / x if x > 0 else 0.0
    if slope <= 0:
        return TtftFit(y / w, 1e-9, w)  # no tokens seen: every request costs the mean time
    return TtftFit(0.0, slope, w)


class ReplicaSpeed:
    """One replica's first tokens, kept as the sums a least-squares fit needs (`pool_line`)."""

    def __init__(self, memory_samples: float = 16.0) -> None:
        if memory_samples < 1:
            raise ValueError("memory_samples must be >= 1")
        self._keep = 1.0 - 1.0 / memory_samples
        self.samples = 0.0  # decayed sample count
        self.tokens = self.engine_s = self.tokens_sq = self.tokens_engine_s = 0.0  # decayed sums

    def observe(self, tokens_ahead: float, engine_s: float) -> None:
        """One first token here: the prefill tokens ahead of it (own included) and its engine time."""
        if tokens_ahead < 0 or not math.isfinite(engine_s) or engine_s < 0:
            raise ValueError(f"bad sample ({tokens_ahead}, {engine_s})")
        keep = self._keep
        self.samples = self.samples * keep + 1.0
        self.tokens = self.tokens * keep + tokens_ahead
        self.engine_s = self.engine_s * keep + engine_s
        self.tokens_sq = self.tokens_sq * keep + tokens_ahead * tokens_ahead
        self.tokens_engine_s = self.tokens_engine_s * keep + tokens_ahead * engine_s

    def factor(self, line: TtftFit) -> float:
        """Engine time here over the line's for the same samples (never below 1e-3: engine times of
        zero, as a clock that has not moved reports them, say nothing of speed)."""
        predicted_s = line.fixed_s * self.samples + line.s_per_token * self.tokens
        return max(self.engine_s / predicted_s, 1e-3) if predicted_s > 0 else 1.0


def pool_line(speeds: Sequence[ReplicaSpeed], factors: Sequence[float] | None = None,
              rounds: int = 1) -> tuple[TtftFit, tuple[float, ...]] | None:
    """The pool's TTFT line and each replica's speed factor against it (their sample-weighted mean
    is 1): `ttft = factor * (fixed + per_token * tokens)`, by alternating least squares on every
    replica's samples: the line on the samples divided by their replica's factor, then the factors
    against the line. `factors`: the last answer's, to start from (one round a sample then keeps
    up with the samples; exact answers take a few rounds). None before the first sample.

    The replicas of a pool run the same model on the same engine, so the shape of TTFT against the
    prefill work ahead is theirs together; what differs is a factor (a noisy neighbour, throttling,
    a slower card). A factor from a replica's samples against a line fitted on all of them is far
    steadier than a slope fitted to its own few points: in `slowed_replica` a replica's own line
    read a 2x slowdown as anything from 1.3x to 2.5x, since each TTFT also carries decode work.
    """
    measured = [speed for speed in speeds if speed.samples > 0]
    if len(measured) == 1:  # one replica alone is the pool's speed (the common case: a line, no rounds)
        only = measured[0]
        line = fit_line(only.samples, only.tokens, only.engine_s, only.tokens_sq, only.tokens_engine_s)
        return line, (1.0,) * len(speeds)
    current = list(factors) if factors is not None and len(factors) == len(speeds) else [1.0] * len(speeds)
    line: TtftFit | None = None
    for _ in range(rounds):
        weight = tokens = engine_s = tokens_sq = tokens_engine_s = 0.0
        for speed, factor in zip(speeds, current):
            if speed.samples > 0:
                weight += speed.samples
                tokens += speed.tokens
                tokens_sq += speed.tokens_sq
                engine_s += speed.engine_s / factor
                tokens_engine_s += speed.tokens_engine_s / factor
        if weight <= 0:
            return None
        line = fit_line(weight, tokens, engine_s, tokens_sq, tokens_engine_s)
        raw = [speed.factor(line) if speed.samples > 0 else 1.0 for speed in speeds]
        mean = sum(f * speed.samples for f, speed in zip(raw, speeds)) / weight
        current = [f / mean if speed.samples > 0 else 1.0 for f, speed in zip(raw, speeds)]
    assert line is not None
    return line, tuple(current)
