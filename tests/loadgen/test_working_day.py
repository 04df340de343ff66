"""The working day of the seeds: its figures hold by construction, and sampled arrivals show them."""

from __future__ import annotations

import numpy as np
import pytest

from tidegate.loadgen.arrivals import WorkingDay


def test_the_rate_function_has_the_asked_peak_ratio_and_busy_share() -> None:
    day = WorkingDay(10.0, period_s=2400.0)
    t_s = (np.arange(240_000) + 0.5) / 100
    rate = day.rate_at(t_s)
    assert rate.mean() == pytest.approx(10.0, rel=1e-3)
    hours = t_s / 100
    busiest_hour = rate[(hours >= 14.5) & (hours < 15.5)].mean()
    assert busiest_hour / rate.mean() == pytest.approx(4.2, rel=1e-3)
    assert rate.max() <= day.peak_rps() + 1e-9
    assert rate[(hours >= 10) & (hours < 20)].sum() / rate.sum() == pytest.approx(0.65, abs=1e-3)


def test_sampled_arrivals_show_the_day() -> None:
    day = WorkingDay(20.0, period_s=2400.0)  # 48,000 arrivals: Poisson noise under 1 %
    offsets = day.sample(np.random.default_rng(5), 2400.0)
    assert len(offsets) / 2400.0 == pytest.approx(20.0, rel=0.03)
    busy = np.count_nonzero((offsets >= 1000) & (offsets < 2000)) / len(offsets)
    assert busy == pytest.approx(0.65, abs=0.02)
    busiest_hour = np.count_nonzero((offsets >= 1450) & (offsets < 1550)) / 100
    assert busiest_hour / 20.0 == pytest.approx(4.2, rel=0.05)  # 8,400 arrivals: noise ~1 %


def test_another_day_is_solved_for_its_own_figures() -> None:
    day = WorkingDay(1.0, period_s=24.0, peak_to_mean=3.0, busy_share=0.6)
    rate = day.rate_at((np.arange(24_000) + 0.5) / 1000)
    assert rate[14_500:15_500].mean() / rate.mean() == pytest.approx(3.0, rel=1e-3)
    assert rate[10_000:20_000].sum() / rate.sum() == pytest.approx(0.6, abs=1e-3)


def test_an_impossible_day_is_refused() -> None:
    with pytest.raises(ValueError, match="no working day"):
        WorkingDay(1.0, peak_to_mean=4.2, busy_share=0.2).rate_at(np.zeros(1))
