"""How much a served step's time varies around the cost model's mean, and a seeded draw of it.

A cost model (`replica.StepCostModel`) predicts a step's mean time. Live steps spread around it
(measured over predicted on the fidelity loads: p10 0.83, p99 1.5) and the spread is not white:
on the shipped profile's own calibration steps a step's residual correlates +0.7 with the next
one's and about +0.3 with those a second later (the OS, a neighbour, the other engine on the same
cores: slow stretches, not slow steps). At 0.8x of capacity the P99 of the time to first token is
a queueing tail that such stretches feed, and a model that runs every step at its mean
under-predicts it (docs/simulator.md, "Step-time variance").

The model, with the fewest parameters the logs support: a step's time is its mean times
`exp(drift(t) + white - sd**2 / 2)`, where
- `drift` is an Ornstein-Uhlenbeck process in time (variance `drift_share * sd**2`, time constant
  `drift_time_s`), evaluated at each step's start: it carries on through idle spells as a
  machine's speed does;
- `white` is drawn afresh for each step (variance `(1 - drift_share) * sd**2`);
- `- sd**2 / 2` keeps the mean multiplier 1, so a replica's throughput is the cost model's.

A replica's draws are a function of (seed, replica id, step number, step start time) alone, so a
stretch of steps taken as one event (`replica._Stretch`) draws what stepping one step at a time
draws, and a cut stretch draws its remaining steps again as stepping would have.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["StepNoise", "StepNoiseStream", "NoiseFit", "fit_step_noise", "time_autocorrelation", "residuals"]

_BLOCK = 1024  # normals drawn at a time per replica (two a step: the drift's and the white part's)


@dataclass(frozen=True, slots=True)
class StepNoise:
    """Multiplicative noise on each modelled step: log(measured / predicted) ~ drift + white."""

    sd: float  # of log(step time / the cost model's mean), all parts together
    drift_share: float  # the share of its variance that drifts (correlated in time); the rest is per step
    drift_time_s: float  # the drift's time constant: its correlation after a lag L is exp(-L / this)

    def __post_init__(self) -> None:
        if self.sd < 0 or not 0.0 <= self.drift_share <= 1.0 or self.drift_time_s <= 0:
            raise ValueError(f"step noise needs sd >= 0, 0 <= drift_share <= 1 and drift_time_s > 0: {self}")

    def describe(self) -> str:
        return (f"step time x exp(N), sd {self.sd:.3f}: {self.drift_share:.0%} drifting "
                f"(time constant {self.drift_time_s:.2f} s), the rest per step")


class StepNoiseStream:
    """One replica's multipliers. `factor(step, start_s, state)` is a pure function of its
    arguments and the stream's seed: the caller keeps the drift's state (`committed`) and commits
    the state of the last step it took, so steps planned ahead and then dropped cost nothing."""

    def __init__(self, noise: StepNoise, seed: int, replica_id: str) -> None:
        self.noise = noise
        self._rng_seed = [seed, zlib.crc32(replica_id.encode())]
        self._blocks: dict[int, list[float]] = {}
        self._drift_sd = noise.sd * math.sqrt(noise.drift_share)
        self._white_sd = noise.sd * math.sqrt(1.0 - noise.drift_share)
        self._mean_shift = -0.5 * noise.sd * noise.sd
        # (steps taken, the last one's start, its drift): the next step is number steps taken
        self.committed: tuple[int, float, float] = (0, 0.0, 0.0)

    def _normals(self, step: int) -> tuple[float, float]:
        block = step // _BLOCK
        values = self._blocks.get(block)
        if values is None:
            # a block's draws depend on its number alone; blocks behind the committed step are dropped
            committed_block = self.committed[0] // _BLOCK
            for old in [b for b in self._blocks if b < committed_block]:
                del self._blocks[old]
            values = np.random.default_rng([*self._rng_seed, block]).standard_normal(2 * _BLOCK).tolist()
            self._blocks[block] = values
        offset = 2 * (step % _BLOCK)
        return values[offset], values[offset + 1]

    def factor(self, step: int, start_s: float, previous: tuple[int, float, float]) -> tuple[float, float]:
        """(multiplier, drift) of step number `step` starting at `start_s`, after `previous`
        (the state `committed` holds, or one `factor` gave for the step before)."""
        drift_normal, white_normal = self._normals(step)
        _, previous_start_s, previous_drift = previous
        if step == 0:
            drift = self._drift_sd * drift_normal  # the stationary distribution
        else:
            keep = math.exp(-max(start_s - previous_start_s, 0.0) / self.noise.drift_time_s)
            drift = previous_drift * keep + self._drift_sd * math.sqrt(1.0 - keep * keep) * drift_normal
        return math.exp(drift + self._white_sd * white_normal + self._mean_shift), drift


@dataclass(frozen=True, slots=True)
class NoiseFit:
    noise: StepNoise
    steps: int
    mean_ratio: float  # measured / predicted, step by step, averaged
    # (lag bin's mean lag s, autocorrelation measured, the fitted model's) for each lag bin
    autocorrelation: tuple[tuple[float, float, float], ...]


# lag bins of the autocorrelation, s: log-spaced so each time scale weighs alike in the fit
_LAG_EDGES_S = (0.0, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8, 25.6)


def residuals(predicted_s: Sequence[float], measured_s: Sequence[float]) -> np.ndarray:
    """log(measured / predicted), step by step."""
    return np.log(np.asarray(measured_s, dtype=np.float64) / np.asarray(predicted_s, dtype=np.float64))


def time_autocorrelation(series: Sequence[tuple[np.ndarray, np.ndarray]],
                         edges_s: Sequence[float] = _LAG_EDGES_S) -> list[tuple[float, float, int]]:
    """(mean lag s, autocorrelation, pairs) by lag bin of residuals `(start times, residuals)`,
    each series (one engine's steps) demeaned by itself, pairs taken within a series only."""
    bins = len(edges_s) - 1
    products, lags, counts = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    variance_sum, variance_count = 0.0, 0
    for starts_s, values in series:
        order = np.argsort(starts_s, kind="stable")
        starts_s, values = starts_s[order], values[order] - values.mean()
        variance_sum += float(np.sum(values * values))
        variance_count += len(values)
        for ahead in range(1, len(values)):  # pairs `ahead` steps apart, until all lie past the last bin
            lag_s = starts_s[ahead:] - starts_s[:-ahead]
            if lag_s.min() >= edges_s[-1]:
                break
            index = np.searchsorted(edges_s, lag_s, side="right") - 1
            inside = index < bins
            np.add.at(products, index[inside], values[ahead:][inside] * values[:-ahead][inside])
            np.add.at(lags, index[inside], lag_s[inside])
            np.add.at(counts, index[inside], 1)
    variance = variance_sum / max(variance_count, 1)
    return [(lags[b] / counts[b], products[b] / counts[b] / variance, int(counts[b]))
            for b in range(bins) if counts[b] > 0 and variance > 0]


def fit_step_noise(series: Sequence[tuple[np.ndarray, np.ndarray]]) -> NoiseFit:
    """The noise of residuals `(start times, log(measured / predicted))`, one series an engine:
    `sd` their spread (each engine's about its own mean), the drift's share and time constant by
    least squares of `share * exp(-lag / time)` on their autocorrelation by lag bin, each bin alike."""
    values = [v for _, v in series if len(v) >= 2]
    if sum(len(v) for v in values) < 30:
        raise ValueError("too few logged steps to fit their variance")
    sd = float(np.sqrt(np.mean(np.concatenate([v - v.mean() for v in values]) ** 2)))
    measured = time_autocorrelation(series)
    lags = np.array([lag for lag, _, _ in measured])
    correlations = np.array([c for _, c, _ in measured])
    best: tuple[float, float, float] | None = None
    for time_s in np.geomspace(0.02, 200.0, 241):
        shape = np.exp(-lags / time_s)
        share = float(np.clip(np.dot(shape, correlations) / np.dot(shape, shape), 0.0, 1.0))
        error = float(np.sum((share * shape - correlations) ** 2))
        if best is None or error < best[0]:
            best = (error, share, float(time_s))
    assert best is not None
    _, share, time_s = best
    noise = StepNoise(round(sd, 4), round(share, 3), round(time_s, 3))
    ratio = float(np.mean(np.exp(np.concatenate(values))))
    fitted = tuple((float(lag), float(c), float(share * math.exp(-lag / time_s))) for lag, c in zip(lags, correlations))
    return NoiseFit(noise, sum(len(v) for v in values), ratio, fitted)
