"""Forecasts of the arrival rate: seasonal-naive and Holt-Winters on series whose future is known."""

from __future__ import annotations

import math

import pytest

from tidegate.policy.forecast import HoltWinters, SeasonalNaive

BUCKET_S, SEASON = 60.0, 24  # a "day" of 24 one-minute buckets


def daily(index: int, growth: float = 0.0) -> float:
    return 100.0 + 60.0 * math.sin(2 * math.pi * index / SEASON) + growth * index


@pytest.mark.parametrize("make", [lambda: SeasonalNaive(BUCKET_S, BUCKET_S * SEASON),
                                  lambda: HoltWinters(BUCKET_S, BUCKET_S * SEASON)])
def test_a_repeating_day_is_forecast_a_bucket_ahead(make) -> None:
    forecaster = make()
    assert forecaster.forecast(0.0) is None
    for index in range(3 * SEASON):
        forecaster.observe((index + 1) * BUCKET_S, daily(index))
    errors = [abs(forecaster.forecast((3 * SEASON + ahead + 1) * BUCKET_S) - daily(3 * SEASON + ahead))
              for ahead in range(5)]
    assert max(errors) < 10.0  # of a 40-160 swing


def test_holt_winters_follows_growth_that_seasonal_naive_lags() -> None:
    naive, holt = SeasonalNaive(BUCKET_S, BUCKET_S * SEASON), HoltWinters(BUCKET_S, BUCKET_S * SEASON, beta=0.2)
    for index in range(6 * SEASON):
        for forecaster in (naive, holt):
            forecaster.observe((index + 1) * BUCKET_S, daily(index, growth=2.0))
    target_index = 6 * SEASON + 10  # ten buckets ahead
    truth = daily(target_index, growth=2.0)
    holt_error = abs(holt.forecast((target_index + 1) * BUCKET_S) - truth)
    assert holt_error < 0.05 * truth
    assert holt_error <= abs(naive.forecast((target_index + 1) * BUCKET_S) - truth)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        HoltWinters(60.0, 30.0)
    with pytest.raises(ValueError):
        HoltWinters(60.0, 600.0, alpha=1.5)
