"""How much a served step's time varies around the cost model's mean, and a seeded draw of it.

A cost model (`replica.StepCostModel`) predicts a step's mean time. Live steps spread around it
(measured over predicted on the fidelity loads: p10 0.83, p99 1.5) and the spread is not white:
on the shipped profile's own calibration steps a step's residual correlates +0.7 with the next
one's and about +0.3 with those a second later (the OS, a neighbour, the other engine on the same
cores: slow stretches, not slow steps). At 0.8x of capacity the P99 of the time to first token is
a queueing tail that such stretches feed, and a model that runs every step at its mean
under-predicts it (docs/simulator.md, "Step-time variance").

The model, with the fewest parameters the logs support: a step's time is its mean times
`exp(drift(t) + shared(t) + white + c)`, where
- `drift` is the replica's own Ornstein-Uhlenbeck process in time (variance `drift_share * sd**2`,
  time constant `drift_time_s`), evaluated at each step's start: it carries on through idle
  spells as a machine's speed does;
- `shared` is one for every replica of a run (`SharedDrift`; variance `shared_share * sd**2`, time
  constant `shared_time_s`): on the 2-core machine the two engines' residuals correlate with each
  other (+0.15..+0.3) flat over lags of 0-2 s, where each one's own correlation falls from +0.8 to
  +0.1: a slow speed of the machine under a fast one of each engine; and a pool whose replicas
  slow down together queues longer than one whose don't;
- `white` is drawn afresh for each step (the rest of the variance);
- the constant `c` keeps the mean multiplier *a step* 1, as the fit made the mean measured / predicted
  a logged step (`costfit`), so a busy replica's throughput is the cost model's. It is not
  `- sd**2 / 2`: a drift is a function of time, and a replica takes more steps while it runs fast
  than while it runs slow, so its steps see the drift's fast values more often than its slow ones
  (log-normal: a step's drift is its time distribution shifted by -its variance; with
  `- sd**2 / 2` a busy replica ran 2 % faster than the mean model, on the shipped profile's noise).

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

__all__ = ["StepNoise", "StepNoiseStream", "SharedDrift", "NoiseFit", "fit_step_noise", "time_autocorrelation",
           "cross_correlation", "residuals"]

_BLOCK = 1024  # normals drawn at a time per replica (two a step: the drift's and the white part's)


@dataclass(frozen=True, slots=True)
class StepNoise:
    """Multiplicative noise on each modelled step: log(measured / predicted) ~ drift + white."""

    sd: float  # of log(step time / the cost model's mean), all parts together
    drift_share: float  # the share of its variance in the replica's own drift
    drift_time_s: float  # that drift's time constant: its correlation after a lag L is exp(-L / this)
    shared_share: float = 0.0  # the share in the drift every replica of a run shares (one machine)
    shared_time_s: float = 1.0  # that one's time constant; the rest of the variance is per step

    def __post_init__(self) -> None:
        if (self.sd < 0 or self.drift_share < 0 or self.shared_share < 0 or self.drift_share + self.shared_share > 1.0
                or self.drift_time_s <= 0 or self.shared_time_s <= 0):
            raise ValueError("step noise needs sd >= 0, shares >= 0 that sum to <= 1 and time constants > 0: "
                             f"{self}")

    @property
    def white_share(self) -> float:
        return max(1.0 - self.drift_share - self.shared_share, 0.0)

    def describe(self) -> str:
        return (f"step time x exp(N), sd {self.sd:.3f}: {self.drift_share:.0%} the replica's own drift "
                f"(time constant {self.drift_time_s:.2f} s), {self.shared_share:.0%} the replicas' shared drift "
                f"({self.shared_time_s:.1f} s), {self.white_share:.0%} per step")


class SharedDrift:
    """The drift every replica of a run shares: a unit Ornstein-Uhlenbeck process on a grid of an
    eighth of its time constant, linear between points (so a step's value moves with its start
    time continuously: stretches and single steps agree to rounding), a function of the seed and
    the time alone. Points before the earliest time still asked for are dropped."""

    _POINTS_PER_TIME_CONSTANT = 8

    def __init__(self, noise: StepNoise, seed: int) -> None:
        self._step_s = noise.shared_time_s / self._POINTS_PER_TIME_CONSTANT
        self._keep = math.exp(-1.0 / self._POINTS_PER_TIME_CONSTANT)
        self._rng = np.random.default_rng([seed, 0x5AED])
        self._first = 0  # the grid index of `_values[0]`
        self._values = [float(self._rng.standard_normal())]

    def at(self, time_s: float, now_s: float) -> float:
        """Its value at `time_s` (>= `now_s`, the loop's time: nothing earlier is asked again)."""
        position = time_s / self._step_s if time_s > 0.0 else 0.0
        index = int(position)
        at = index - self._first
        if at + 1 >= len(self._values):
            self._extend(index, now_s)
            at = index - self._first
        low = self._values[at]
        return low + (self._values[at + 1] - low) * (position - index)

    def _extend(self, index: int, now_s: float) -> None:
        """Points up to `index + 1`, dropping those before `now_s` (the drift's draws depend on
        the seed alone: points are drawn in order, 256 at a time)."""
        drop = int(max(now_s, 0.0) / self._step_s) - self._first
        if drop > 1024:
            del self._values[:drop]
            self._first += drop
        spread = math.sqrt(1.0 - self._keep * self._keep)
        while self._first + len(self._values) <= index + 1:
            for normal in self._rng.standard_normal(256).tolist():
                self._values.append(self._values[-1] * self._keep + spread * normal)


class StepNoiseStream:
    """One replica's multipliers. `factor(step, start_s, state)` is a pure function of its
    arguments and the stream's seed: the caller keeps the drift's state (`committed`) and commits
    the state of the last step it took, so steps planned ahead and then dropped cost nothing."""

    def __init__(self, noise: StepNoise, seed: int, replica_id: str, shared: SharedDrift | None = None) -> None:
        self.noise = noise
        self._rng_seed = [seed, zlib.crc32(replica_id.encode())]
        self._block, self._block_values = -1, [0.0]  # the block of normals last read
        self._drift_time_s = noise.drift_time_s
        self._drift_sd = noise.sd * math.sqrt(noise.drift_share)
        self._shared_sd = noise.sd * math.sqrt(noise.shared_share)
        self._shared = shared if shared is not None or not noise.shared_share else SharedDrift(noise, seed)
        self._white_sd = noise.sd * math.sqrt(noise.white_share)
        # E[exp(white)] = exp(white variance / 2); a step's drift has mean -(its variance) (module doc)
        drift_variance = noise.sd * noise.sd * (noise.drift_share + noise.shared_share)
        self._mean_shift = 0.5 * drift_variance - 0.5 * noise.sd * noise.sd * noise.white_share
        # (steps taken, the last one's start, its drift): the next step is number steps taken
        self.committed: tuple[int, float, float] = (0, 0.0, 0.0)

    def _normals_block(self, block: int) -> list[float]:
        """Block `block`'s normals (two a step), a function of its number alone: a block drawn
        again (a stretch planned across a block's end, then cut) draws the same."""
        self._block = block
        self._block_values = np.random.default_rng([*self._rng_seed, block]).standard_normal(2 * _BLOCK).tolist()
        return self._block_values

    def factor(self, step: int, start_s: float, previous: tuple[int, float, float],
               now_s: float = 0.0) -> tuple[float, float]:
        """(multiplier, the replica's own drift) of step number `step` starting at `start_s`, after
        `previous` (the state `committed` holds, or one `factor` gave for the step before); `now_s`:
        the loop's time (the shared drift forgets what lies before it)."""
        values = self._block_values if step // _BLOCK == self._block else self._normals_block(step // _BLOCK)
        offset = 2 * (step % _BLOCK)
        if step == 0:
            drift = self._drift_sd * values[offset]  # the stationary distribution
        else:
            keep = math.exp((previous[1] - start_s) / self._drift_time_s) if start_s > previous[1] else 1.0
            drift = previous[2] * keep + self._drift_sd * math.sqrt(1.0 - keep * keep) * values[offset]
        shared = self._shared_sd * self._shared.at(start_s, now_s) if self._shared is not None else 0.0
        return math.exp(drift + shared + self._white_sd * values[offset + 1] + self._mean_shift), drift


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


def cross_correlation(first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray],
                      edges_s: Sequence[float] = _LAG_EDGES_S) -> list[tuple[float, float, int]]:
    """(mean lag s, correlation, pairs) by lag bin between two engines' residuals, a step of one
    against each step of the other that started within the bin's lag of it (before or after)."""
    (starts_a, values_a), (starts_b, values_b) = first, second
    values_a, values_b = values_a - values_a.mean(), values_b - values_b.mean()
    order = np.argsort(starts_b, kind="stable")
    starts_b, values_b = starts_b[order], values_b[order]
    bins = len(edges_s) - 1
    products, lags, counts = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    for start_s, value in zip(starts_a, values_a):
        low, high = np.searchsorted(starts_b, [start_s - edges_s[-1], start_s + edges_s[-1]])
        lag_s = np.abs(starts_b[low:high] - start_s)
        index = np.searchsorted(edges_s, lag_s, side="right") - 1
        inside = index < bins
        np.add.at(products, index[inside], value * values_b[low:high][inside])
        np.add.at(lags, index[inside], lag_s[inside])
        np.add.at(counts, index[inside], 1)
    scale = float(np.sqrt(np.mean(values_a ** 2) * np.mean(values_b ** 2)))
    return [(lags[b] / counts[b], products[b] / counts[b] / scale, int(counts[b]))
            for b in range(bins) if counts[b] > 0 and scale > 0]


def _fit_exponential(lags: np.ndarray, correlations: np.ndarray, most: float) -> tuple[float, float]:
    """(share, time constant s) of `share * exp(-lag / time)` closest to `correlations` by least
    squares, each lag bin alike; share within [0, most]."""
    best: tuple[float, float, float] | None = None
    for time_s in np.geomspace(0.02, 200.0, 241):
        shape = np.exp(-lags / time_s)
        share = float(np.clip(np.dot(shape, correlations) / np.dot(shape, shape), 0.0, most))
        error = float(np.sum((share * shape - correlations) ** 2))
        if best is None or error < best[0]:
            best = (error, share, float(time_s))
    assert best is not None
    return best[1], best[2]


def fit_step_noise(series: Sequence[tuple[np.ndarray, np.ndarray]]) -> NoiseFit:
    """The noise of residuals `(start times, log(measured / predicted))`, one series an engine:
    `sd` their spread (each engine's about its own mean); with several engines logged side by
    side, the shared drift from their correlation with each other by lag bin; then the replica's
    own drift from what is left of each one's autocorrelation (`_fit_exponential` both)."""
    values = [v for _, v in series if len(v) >= 2]
    if sum(len(v) for v in values) < 30:
        raise ValueError("too few logged steps to fit their variance")
    sd = float(np.sqrt(np.mean(np.concatenate([v - v.mean() for v in values]) ** 2)))
    shared_share, shared_time_s = 0.0, 1.0
    if len(series) >= 2:
        cross = [point for i in range(len(series)) for j in range(i + 1, len(series))
                 for point in cross_correlation(series[i], series[j])]
        shared_share, shared_time_s = _fit_exponential(np.array([lag for lag, _, _ in cross]),
                                                        np.array([c for _, c, _ in cross]), 1.0)
    measured = time_autocorrelation(series)
    lags = np.array([lag for lag, _, _ in measured])
    correlations = np.array([c for _, c, _ in measured])
    shared_part = shared_share * np.exp(-lags / shared_time_s)
    drift_share, drift_time_s = _fit_exponential(lags, correlations - shared_part, 1.0 - shared_share)
    noise = StepNoise(round(sd, 4), round(drift_share, 3), round(drift_time_s, 3), round(shared_share, 3),
                      round(shared_time_s, 3))
    ratio = float(np.mean(np.exp(np.concatenate(values))))
    fitted = tuple((float(lag), float(c), float(drift_share * math.exp(-lag / drift_time_s) + shared))
                   for lag, c, shared in zip(lags, correlations, shared_part))
    return NoiseFit(noise, sum(len(v) for v in values), ratio, fitted)
