"""Arrival processes: mean rates (statistical, seeded), bounds, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from tidegate.loadgen.arrivals import (
    Constant, Diurnal, GammaBursty, OnOff, Poisson, Ramp, Step, Surge, sample_arrivals,
)

HORIZON_S = 400.0
PROCESSES = {
    "constant": Constant(25.0),
    "poisson": Poisson(25.0),
    "gamma": GammaBursty(25.0, cv=2.0),
    "onoff": OnOff(25.0, on_s=2.0, off_s=3.0),
    "step": Step((10.0, 20.0, 40.0), step_s=100.0),
    "ramp": Ramp(5.0, 45.0, ramp_s=200.0),
    "surge": Surge(20.0, factor=3.0, start_s=100.0, length_s=100.0),
    "diurnal": Diurnal(25.0, amplitude=0.8, period_s=100.0),
}
# analytic mean rates over HORIZON_S, written out rather than taken from the code under test
EXPECTED_MEAN_RPS = {
    "constant": 25.0, "poisson": 25.0, "gamma": 25.0, "onoff": 25.0,
    "step": (10 + 20 + 40 + 40) / 4, "ramp": (25.0 * 200 + 45.0 * 200) / 400,
    "surge": (20 * 300 + 60 * 100) / 400, "diurnal": 25.0,
}


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_mean_rate_matches_the_configured_one(name: str) -> None:
    offsets = PROCESSES[name].sample(np.random.default_rng(7), HORIZON_S)
    # ~10k arrivals: Poisson noise is ~1 %, gamma with CV 2 ~2 %; 6 % is > 3 sigma for all
    assert len(offsets) / HORIZON_S == pytest.approx(EXPECTED_MEAN_RPS[name], rel=0.06)


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_offsets_are_sorted_and_inside_the_horizon(name: str) -> None:
    offsets = PROCESSES[name].sample(np.random.default_rng(1), 50.0)
    assert np.all(np.diff(offsets) >= 0)
    assert offsets.min() >= 0 and offsets.max() < 50.0


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_declared_mean_rate_is_the_analytic_one(name: str) -> None:
    assert PROCESSES[name].mean_rate_rps(HORIZON_S) == pytest.approx(EXPECTED_MEAN_RPS[name], rel=0.01)


def test_same_seed_gives_the_same_schedule() -> None:
    first = Poisson(10.0).sample(np.random.default_rng(3), 20.0)
    second = Poisson(10.0).sample(np.random.default_rng(3), 20.0)
    assert np.array_equal(first, second)


def test_count_bound_returns_exactly_that_many() -> None:
    offsets = sample_arrivals(Surge(5.0), np.random.default_rng(0), max_requests=1234)
    assert len(offsets) == 1234


def test_duration_and_count_bounds_take_the_earlier() -> None:
    offsets = sample_arrivals(Constant(10.0), np.random.default_rng(0), duration_s=5.0, max_requests=1000)
    assert len(offsets) == 50


def test_unbounded_run_is_refused() -> None:
    with pytest.raises(ValueError):
        sample_arrivals(Poisson(1.0), np.random.default_rng(0))


def test_surge_window_runs_at_factor_times_baseline() -> None:
    offsets = Surge(20.0, factor=3.0, start_s=100.0, length_s=100.0).sample(np.random.default_rng(2), 300.0)
    inside = np.sum((offsets >= 100.0) & (offsets < 200.0)) / 100.0
    before = np.sum(offsets < 100.0) / 100.0
    assert inside / before == pytest.approx(3.0, rel=0.12)


def test_gamma_gaps_have_the_configured_variability() -> None:
    gaps = np.diff(GammaBursty(50.0, cv=3.0).sample(np.random.default_rng(4), 400.0))
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)


def test_onoff_is_silent_when_off() -> None:
    offsets = OnOff(10.0, on_s=1.0, off_s=1.0).sample(np.random.default_rng(5), 100.0)
    assert np.all(np.mod(offsets, 2.0) < 1.0)
