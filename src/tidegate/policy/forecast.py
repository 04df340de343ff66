"""Forecasts of a pool's arrival rate, for scaling ahead of demand. Pure: time is an argument.

A forecaster sees one value per bucket (`observe(t_s, value)`: e.g. requests per second over the
last minute) and answers `forecast(t_s)` for a later time. Two are built in:
- `SeasonalNaive`: the value one season before the asked time (last day's same minute), scaled by
  how the last bucket compares with its own season-ago value; the baseline every forecasting study
  starts from, and hard to beat on strongly daily traffic.
- `HoltWinters`: additive level + trend + season (Holt 1957, Winters 1960), updated per bucket;
  follows growth and a shifting daily shape.
Any object with the same two methods (an ML model behind a function) plugs in where they do.
"""

from __future__ import annotations

import math
from typing import Protocol

__all__ = ["Forecaster", "SeasonalNaive", "HoltWinters", "make_forecaster"]


class Forecaster(Protocol):
    def observe(self, t_s: float, value: float) -> None:
        """Records the value of the bucket that ends at `t_s` (changes the forecaster's state)."""
        ...

    def forecast(self, t_s: float) -> float | None:
        """The value expected for the bucket that ends at `t_s`; None until enough was seen."""
        ...


def _check(bucket_s: float, season_s: float) -> int:
    if bucket_s <= 0 or season_s < bucket_s:
        raise ValueError(f"need bucket_s > 0 and season_s >= bucket_s, got {bucket_s}, {season_s}")
    return max(1, round(season_s / bucket_s))


class SeasonalNaive:
    """The value one season earlier, scaled by the last bucket's ratio to its own season-ago value
    (clamped to [1/4, 4]: one odd bucket must not multiply the forecast by a hundred)."""

    def __init__(self, bucket_s: float, season_s: float) -> None:
        self.bucket_s = bucket_s
        self.buckets = _check(bucket_s, season_s)
        self._values: dict[int, float] = {}  # bucket index -> value, the last two seasons
        self._last: int | None = None

    def _index(self, t_s: float) -> int:
        return math.floor(t_s / self.bucket_s + 1e-9)

    def observe(self, t_s: float, value: float) -> None:
        index = self._index(t_s)
        self._values[index] = value
        self._last = index
        for old in [i for i in self._values if i < index - 2 * self.buckets]:
            del self._values[old]

    def forecast(self, t_s: float) -> float | None:
        if self._last is None:
            return None
        index = self._index(t_s)
        season_ago = self._values.get(index - self.buckets)
        if season_ago is None:
            return self._values[self._last]  # under a season seen: the last value (naive)
        last, last_season_ago = self._values[self._last], self._values.get(self._last - self.buckets)
        ratio = 1.0 if not last_season_ago else min(4.0, max(0.25, last / last_season_ago))
        return season_ago * ratio


class HoltWinters:
    """Additive Holt-Winters. `alpha` (level), `beta` (trend), `gamma` (season) in (0, 1). Starts
    from its first two seasons (level: the second's mean; trend: the change of the mean between
    them; season: each slot's mean offset), so it forecasts after two seasons; before, the last
    value. Started from one season, the season shape kept that season's growth as a ramp and the
    trend went negative on a series growing 2 a bucket (`test_holt_winters_follows_growth_that_seasonal_naive_lags`)."""

    def __init__(self, bucket_s: float, season_s: float, *, alpha: float = 0.3, beta: float = 0.05,
                 gamma: float = 0.3) -> None:
        for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma)):
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value}")
        self.bucket_s = bucket_s
        self.buckets = _check(bucket_s, season_s)
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self._start: list[tuple[int, float]] = []  # (bucket index, value) of the first two seasons
        self._season: list[float] = []
        self._level = 0.0
        self._trend = 0.0
        self._last_index: int | None = None
        self._last_value = 0.0

    @property
    def started(self) -> bool:
        return bool(self._season)

    def observe(self, t_s: float, value: float) -> None:
        index = math.floor(t_s / self.bucket_s + 1e-9)
        self._last_index, self._last_value = index, value
        if not self.started:
            self._start.append((index, value))
            if len(self._start) == 2 * self.buckets:
                self._initialise()
            return
        slot = index % self.buckets
        previous_level = self._level
        self._level = self.alpha * (value - self._season[slot]) + (1 - self.alpha) * (self._level + self._trend)
        self._trend = self.beta * (self._level - previous_level) + (1 - self.beta) * self._trend
        self._season[slot] = self.gamma * (value - self._level) + (1 - self.gamma) * self._season[slot]

    def _initialise(self) -> None:
        n = self.buckets
        first = [v for _, v in self._start[:n]]
        second = [v for _, v in self._start[n:]]
        mean1, mean2 = sum(first) / n, sum(second) / n
        self._trend = (mean2 - mean1) / n
        # the level at the last bucket seen: the second season's mean, half a season of trend later
        self._level = mean2 + self._trend * (n - 1) / 2
        season = [0.0] * n
        for k, (index, value) in enumerate(self._start):
            season_mean = mean1 if k < n else mean2
            # the offset from the season's mean, less the trend's part at that point of the season
            season[index % n] += (value - season_mean - self._trend * ((k % n) - (n - 1) / 2)) / 2
        self._season = season

    def forecast(self, t_s: float) -> float | None:
        if self._last_index is None:
            return None
        if not self.started:
            return self._last_value  # under two seasons seen: the last value (naive)
        index = math.floor(t_s / self.bucket_s + 1e-9)
        ahead = max(0, index - self._last_index)
        return max(0.0, self._level + ahead * self._trend + self._season[index % self.buckets])


def make_forecaster(method: str, bucket_s: float, season_s: float, *, alpha: float = 0.3, beta: float = 0.05,
                    gamma: float = 0.3) -> Forecaster:
    """A built-in forecaster by name: "holt_winters" or "seasonal_naive"."""
    if method == "holt_winters":
        return HoltWinters(bucket_s, season_s, alpha=alpha, beta=beta, gamma=gamma)
    if method == "seasonal_naive":
        return SeasonalNaive(bucket_s, season_s)
    raise ValueError(f"unknown forecast method {method!r}: holt_winters or seasonal_naive")
