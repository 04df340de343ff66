"""Arrival processes: when requests are sent, as offsets in seconds from the start of a run.

PURE (shared with the simulator): every process takes a seeded `numpy.random.Generator` and a
horizon; nothing here reads a clock or does I/O. `rate_rps` is always the long-run *mean* rate, so
processes with the same rate offer the same load and only their shape differs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = [
    "ArrivalProcess",
    "Constant",
    "Poisson",
    "GammaBursty",
    "OnOff",
    "Step",
    "Ramp",
    "Surge",
    "Diurnal",
    "WorkingDay",
    "sample_arrivals",
]

# Inhomogeneous processes are sampled in windows of this length so that a run bounded only by a
# request count never has to guess its duration.
_WINDOW_S = 60.0


class ArrivalProcess(Protocol):
    def sample(self, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
        """Sorted send offsets in [0, horizon_s)."""
        ...

    def mean_rate_rps(self, horizon_s: float) -> float:
        """Expected arrivals per second averaged over [0, horizon_s)."""
        ...


def sample_arrivals(
    process: ArrivalProcess,
    rng: np.random.Generator,
    duration_s: float | None = None,
    max_requests: int | None = None,
) -> np.ndarray:
    """Offsets bounded by a duration, a count, or both (whichever comes first)."""
    if duration_s is None and max_requests is None:
        raise ValueError("bound the arrivals by a duration, a request count, or both")
    if duration_s is not None:
        offsets = process.sample(rng, duration_s)
        return offsets if max_requests is None else offsets[:max_requests]
    # Count-bounded only: grow the horizon until enough arrivals exist. Re-sampling from scratch
    # with a fresh child generator keeps the result a function of the seed alone.
    assert max_requests is not None
    horizon_s = max(1.0, max_requests / max(process.mean_rate_rps(_WINDOW_S), 1e-9) * 1.5)
    seed_sequence = rng.integers(0, 2**63)
    while True:
        offsets = process.sample(np.random.default_rng(seed_sequence), horizon_s)
        if len(offsets) >= max_requests:
            return offsets[:max_requests]
        horizon_s *= 2.0


@dataclass(frozen=True, slots=True)
class Constant:
    rate_rps: float

    def sample(self, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
        count = math.ceil(horizon_s * self.rate_rps)
        offsets = np.arange(count, dtype=np.float64) / self.rate_rps
        return offsets[offsets < horizon_s]

    def mean_rate_rps(self, horizon_s: float) -> float:
        return self.rate_rps


def _renewal(gaps_sampler, rate_rps: float, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
    """Cumulative sums of i.i.d. gaps until the horizon (draws in blocks, vectorised)."""
    block = max(16, int(horizon_s * rate_rps * 1.2) + 16)
    chunks: list[np.ndarray] = []
    last = 0.0
    while last < horizon_s:
        times = last + np.cumsum(gaps_sampler(rng, block))
        chunks.append(times)
        last = float(times[-1])
    offsets = np.concatenate(chunks) if chunks else np.empty(0)
    return offsets[offsets < horizon_s]


@dataclass(frozen=True, slots=True)
class Poisson:
    rate_rps: float

    def sample(self, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
        return _renewal(lambda r, n: r.exponential(1.0 / self.rate_rps, n), self.rate_rps, rng, horizon_s)

    def mean_rate_rps(self, horizon_s: float) -> float:
        return self.rate_rps


@dataclass(frozen=True, slots=True)
class GammaBursty:
    """Gamma-distributed gaps with coefficient of variation `cv` (1 = Poisson, >1 = bursty)."""

    rate_rps: float
    cv: float = 2.0

    def sample(self, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
        shape = 1.0 / self.cv**2
        scale = 1.0 / (self.rate_rps * shape)
        return _renewal(lambda r, n: r.gamma(shape, scale, n), self.rate_rps, rng, horizon_s)

    def mean_rate_rps(self, horizon_s: float) -> float:
        return self.rate_rps


class _RateFunction:
    """Inhomogeneous Poisson process by thinning (Lewis-Shedler) under `peak_rps`."""

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def peak_rps(self) -> float:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, horizon_s: float) -> np.ndarray:
        peak = self.peak_rps()
        if peak <= 0:
            return np.empty(0)
        candidates = Poisson(peak).sample(rng, horizon_s)
        keep = rng.random(len(candidates)) * peak < self.rate_at(candidates)
        return candidates[keep]

    def mean_rate_rps(self, horizon_s: float) -> float:
        grid = (np.arange(4096) + 0.5) / 4096 * horizon_s
        return float(np.mean(self.rate_at(grid)))


@dataclass(frozen=True, slots=True)
class OnOff(_RateFunction):
    """Poisson bursts: `on_s` seconds at rate_rps*(on+off)/on, then `off_s` seconds of silence."""

    rate_rps: float
    on_s: float = 1.0
    off_s: float = 1.0

    def peak_rps(self) -> float:
        return self.rate_rps * (self.on_s + self.off_s) / self.on_s

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        on = np.mod(t_s, self.on_s + self.off_s) < self.on_s
        return np.where(on, self.peak_rps(), 0.0)


@dataclass(frozen=True, slots=True)
class Step(_RateFunction):
    """Rates held for `step_s` each, in order; the last rate holds to the end."""

    rates_rps: tuple[float, ...]
    step_s: float

    def peak_rps(self) -> float:
        return max(self.rates_rps)

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        index = np.minimum((np.asarray(t_s) // self.step_s).astype(int), len(self.rates_rps) - 1)
        return np.asarray(self.rates_rps, dtype=np.float64)[index]


@dataclass(frozen=True, slots=True)
class Ramp(_RateFunction):
    """Linear from start to end rate over `ramp_s`, then held at the end rate."""

    start_rps: float
    end_rps: float
    ramp_s: float

    def peak_rps(self) -> float:
        return max(self.start_rps, self.end_rps)

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        fraction = np.clip(np.asarray(t_s) / self.ramp_s, 0.0, 1.0)
        return self.start_rps + (self.end_rps - self.start_rps) * fraction


@dataclass(frozen=True, slots=True)
class Surge(_RateFunction):
    """Baseline, then `factor` x baseline during [start_s, start_s + length_s), then baseline."""

    base_rps: float
    factor: float = 3.0
    start_s: float = 10.0
    length_s: float = 10.0

    def peak_rps(self) -> float:
        return self.base_rps * max(self.factor, 1.0)

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        t_s = np.asarray(t_s)
        surging = (t_s >= self.start_s) & (t_s < self.start_s + self.length_s)
        return np.where(surging, self.base_rps * self.factor, self.base_rps)


@dataclass(frozen=True, slots=True)
class Diurnal(_RateFunction):
    """mean * (1 + amplitude * sin(2 pi t / period)): a day compressed into `period_s`."""

    mean_rps: float
    amplitude: float = 0.5  # 0..1, fraction of the mean
    period_s: float = 60.0

    def peak_rps(self) -> float:
        return self.mean_rps * (1.0 + abs(self.amplitude))

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        return self.mean_rps * (1.0 + self.amplitude * np.sin(2.0 * np.pi * np.asarray(t_s) / self.period_s))


@dataclass(frozen=True, slots=True)
class WorkingDay(_RateFunction):
    """A working day compressed into `period_s` (86,400 for a real one): a floor all day and a bump
    centred on `peak_hour`, shaped so that the busiest hour's mean rate is `peak_to_mean` x the
    day's (a day's traffic is read by the hour; the instant peak is a little higher) and
    `busy_share` of the day's requests arrive between `busy_from_hour` and `busy_to_hour` (the
    seeds' day: peak 4.2x the mean, 65 % of requests between 10:00 and 20:00). The bump is a
    Gaussian in the hour of the day; its width is solved for the share (bisection), its floor for
    the peak ratio, so both figures hold exactly whatever the period."""

    mean_rps: float
    period_s: float = 86_400.0
    peak_to_mean: float = 4.2
    busy_share: float = 0.65
    busy_from_hour: float = 10.0
    busy_to_hour: float = 20.0
    peak_hour: float = 15.0

    def _shape(self) -> tuple[float, float]:
        """(floor, width in hours) of floor + exp(-d^2 / 2 width^2), d the hours from the peak."""
        return _working_day_shape(self.peak_to_mean, self.busy_share, self.busy_from_hour, self.busy_to_hour,
                                  self.peak_hour)

    def peak_rps(self) -> float:
        floor, width = self._shape()
        mean_shape = floor + float(_bump(_MINUTES_H, width, self.peak_hour).mean())
        return self.mean_rps * (floor + 1.0) / mean_shape

    def rate_at(self, t_s: np.ndarray) -> np.ndarray:
        floor, width = self._shape()
        hours = np.mod(np.asarray(t_s, dtype=np.float64) / self.period_s * 24.0, 24.0)
        mean_shape = floor + float(_bump(_MINUTES_H, width, self.peak_hour).mean())
        return self.mean_rps * (floor + _bump(hours, width, self.peak_hour)) / mean_shape


_MINUTES_H = (np.arange(24 * 60) + 0.5) / 60  # a day's minutes, in hours: the grid the shape is solved on


def _bump(hours: np.ndarray, width: float, peak_hour: float) -> np.ndarray:
    distance = np.abs(np.mod(hours - peak_hour + 12.0, 24.0) - 12.0)  # hours from the peak, across midnight
    return np.exp(-0.5 * (distance / width) ** 2)


@functools.lru_cache(maxsize=32)
def _working_day_shape(peak_to_mean: float, busy_share: float, busy_from_hour: float, busy_to_hour: float,
                       peak_hour: float) -> tuple[float, float]:
    """Bisection on the width: the busy hours' share rises with it until the floor the peak ratio
    leaves falls below zero (a bump too wide for that ratio)."""
    busy = (_MINUTES_H >= busy_from_hour) & (_MINUTES_H < busy_to_hour)

    def floor_and_share(width: float) -> tuple[float, float]:
        bump = _bump(_MINUTES_H, width, peak_hour)
        peak = float(_bump(peak_hour - 0.5 + _MINUTES_H[:60], width, peak_hour).mean())  # the busiest hour's mean
        floor = (peak - peak_to_mean * bump.mean()) / (peak_to_mean - 1.0)  # (floor + peak) / mean = ratio
        shape = floor + bump
        return floor, float(shape[busy].sum() / shape.sum())

    low, high = 0.05, 12.0
    for _ in range(60):
        width = (low + high) / 2
        floor, share = floor_and_share(width)
        if floor < 0 or share > busy_share:
            high = width
        else:
            low = width
    floor, share = floor_and_share(low)
    if floor < 0 or abs(share - busy_share) > 1e-3:
        raise ValueError(f"no working day with peak {peak_to_mean}x the mean and {busy_share:.0%} of requests "
                         f"in {busy_from_hour:g}-{busy_to_hour:g} h")
    return float(floor), float(low)
