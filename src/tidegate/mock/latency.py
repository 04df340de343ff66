"""Latency models for the mock upstream, with their analytic quantiles (so a load generator's
reported percentiles can be checked against the truth)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from enum import Enum
from statistics import NormalDist

__all__ = ["Distribution", "LatencyModel"]


class Distribution(Enum):
    CONST = "const"
    EXP = "exp"  # exponential with the given mean
    LOGNORMAL = "lognormal"  # given mean; sigma is the log-space standard deviation
    UNIFORM = "uniform"  # mean * [1 - sigma, 1 + sigma], sigma clamped to [0, 1]


@dataclass(frozen=True, slots=True)
class LatencyModel:
    mean_s: float
    distribution: Distribution = Distribution.CONST
    sigma: float = 0.5

    @property
    def is_zero(self) -> bool:
        return self.mean_s <= 0.0

    def _lognormal_mu(self) -> float:
        return math.log(self.mean_s) - self.sigma**2 / 2

    def sample_s(self, rng: random.Random) -> float:
        if self.is_zero:
            return 0.0
        if self.distribution is Distribution.CONST:
            return self.mean_s
        if self.distribution is Distribution.EXP:
            return rng.expovariate(1.0 / self.mean_s)
        if self.distribution is Distribution.LOGNORMAL:
            return rng.lognormvariate(self._lognormal_mu(), self.sigma)
        spread = min(max(self.sigma, 0.0), 1.0)
        return rng.uniform(self.mean_s * (1 - spread), self.mean_s * (1 + spread))

    def quantile_s(self, q: float) -> float:
        """The exact q-quantile (0 < q < 1) of the configured distribution."""
        if not 0.0 < q < 1.0:
            raise ValueError("q must be in (0, 1)")
        if self.is_zero or self.distribution is Distribution.CONST:
            return max(self.mean_s, 0.0)
        if self.distribution is Distribution.EXP:
            return -self.mean_s * math.log(1.0 - q)
        if self.distribution is Distribution.LOGNORMAL:
            return math.exp(self._lognormal_mu() + self.sigma * NormalDist().inv_cdf(q))
        spread = min(max(self.sigma, 0.0), 1.0)
        return self.mean_s * (1 - spread + 2 * spread * q)
