"""A replica's time to first token as a function of the prefill work ahead of a request. Pure.

TTFT is set by the prompt tokens an engine must prefill before (and including) a request's own,
and by how slow each step is (its fixed cost and its decode batch). So the model is a line,
`ttft_s = fixed_s + s_per_token * tokens_ahead`, fitted by exponentially weighted least squares
to what the replica really did: each first token gives one point (the prefill tokens that were
ahead of the request when it was sent, its own included; the engine time it took). The decode
batch's effect is in the fit: while the batch is big, steps are slow and the slope is steep.

Why a fitted model and not a limit grown from a start value (AIMD, gradient, slow start): a model
of the replica's speed does not go stale while the replica idles, so a burst after an idle minute
meets the limit the replica had, not one that must grow again (`scenario: burst_after_idle`);
and a replica twice as slow shows twice the slope within a few samples
(`test_a_replica_twice_as_slow_shows_twice_the_slope_within_its_memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["TtftFit", "TtftModel"]


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


class TtftModel:
    """Exponentially weighted least squares over (tokens ahead, engine TTFT) samples."""

    def __init__(self, memory_samples: float = 16.0) -> None:
        if memory_samples < 1:
            raise ValueError("memory_samples must be >= 1")
        # each sample's weight decays by this per later sample: about `memory_samples` count
        self._keep = 1.0 - 1.0 / memory_samples
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._fit: TtftFit | None = None

    @property
    def fit(self) -> TtftFit | None:
        """None until the first sample."""
        return self._fit

    def observe(self, tokens_ahead: float, ttft_s: float) -> None:
        """One first token: `tokens_ahead` (own included) when it was sent, `ttft_s` engine time."""
        if tokens_ahead < 0 or not math.isfinite(ttft_s) or ttft_s < 0:
            raise ValueError(f"bad sample ({tokens_ahead}, {ttft_s})")
        keep = self._keep
        self._w = self._w * keep + 1.0
        self._x = self._x * keep + tokens_ahead
        self._y = self._y * keep + ttft_s
        self._xx = self._xx * keep + tokens_ahead * tokens_ahead
        self._xy = self._xy * keep + tokens_ahead * ttft_s
        self._fit = self._solve()

    def _solve(self) -> TtftFit:
        w, x, y = self._w, self._x, self._y
        spread = w * self._xx - x * x
        if spread > 1e-9 * max(1.0, w * self._xx):
            slope = (w * self._xy - x * y) / spread
            fixed = (y - slope * x) / w
            if slope > 0 and fixed >= 0:
                return TtftFit(fixed, slope, w)
        # one size of work seen so far (or a fit bending below zero): the line through the origin,
        # which overstates the cost of more tokens, so the budget errs small, never large
        slope = y / x if x > 0 else 0.0
        if slope <= 0:
            return TtftFit(y / w, 1e-9, w)  # no tokens seen: every request costs the mean time
        return TtftFit(0.0, slope, w)
