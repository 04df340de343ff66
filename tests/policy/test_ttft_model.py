"""The fitted TTFT line: exact on exact data, safe with one size of work, quick to follow a change."""

from __future__ import annotations

import pytest

from tidegate.policy.ttft_model import TtftModel


def test_no_fit_before_the_first_sample() -> None:
    assert TtftModel().fit is None


def test_recovers_a_line_from_exact_samples() -> None:
    model = TtftModel()
    for tokens in (100, 400, 900, 200, 1600):
        model.observe(tokens, 0.05 + 0.0002 * tokens)
    fit = model.fit
    assert fit is not None
    assert fit.fixed_s == pytest.approx(0.05)
    assert fit.s_per_token == pytest.approx(0.0002)
    assert fit.tokens_within(0.25) == pytest.approx(1000)


def test_one_size_of_work_gives_the_line_through_the_origin_which_errs_small() -> None:
    model = TtftModel()
    for _ in range(5):
        model.observe(500, 0.15)  # truly 0.05 + 0.0002 x 500
    fit = model.fit
    assert fit is not None and fit.fixed_s == 0.0
    assert fit.tokens_within(0.25) < 1000  # the true budget: never overstated


def test_a_replica_twice_as_slow_shows_twice_the_slope_within_its_memory() -> None:
    model = TtftModel(memory_samples=16)
    sizes = (100, 400, 900, 200, 1600, 700)
    for i in range(60):
        tokens = sizes[i % len(sizes)]
        model.observe(tokens, 0.05 + 0.0002 * tokens)
    for i in range(32):
        tokens = sizes[i % len(sizes)]
        model.observe(tokens, 2 * (0.05 + 0.0002 * tokens))
    fit = model.fit
    assert fit is not None
    assert fit.s_per_token == pytest.approx(0.0004, rel=0.25)


def test_bad_samples_are_refused() -> None:
    with pytest.raises(ValueError):
        TtftModel().observe(-1, 0.1)
    with pytest.raises(ValueError):
        TtftModel().observe(10, float("nan"))
