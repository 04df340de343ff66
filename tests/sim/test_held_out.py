"""The calibration bar's held-out shapes: cross-validation that never predicts a step it fitted on,
and a standard error that counts how the steps' noise correlates in time."""

from __future__ import annotations

import numpy as np

from tidegate.sim.costfit import StepSample
from tidegate.sim.held_out import cross_validated, shape_errors, shape_order, step_class
from tidegate.sim.step_noise import StepNoise

# the shipped VM's noise, as fitted on its calibration steps (rounded)
VM_NOISE = StepNoise(sd=0.17, drift_share=0.55, drift_time_s=0.5, shared_share=0.3, shared_time_s=3.0)


def _step(decodes: int, prefill: int, start_s: float, step_s: float = 0.05) -> StepSample:
    return StepSample(prefill, decodes, 10 * decodes + prefill, step_s, start_s=start_s)


def test_every_step_is_predicted_by_a_fit_that_never_saw_it() -> None:
    steps = [_step(i % 5, 32 * (i % 2), i * 0.05) for i in range(60)]
    seen: list[set[int]] = []

    def fit_then_predict(fitted: list[StepSample]):
        ids = {id(step) for step in fitted}
        seen.append(ids)
        return lambda step: 0.0 if id(step) in ids else 1.0

    predicted = cross_validated(steps, fit_then_predict)
    assert (predicted == 1.0).all()
    assert len(seen) == 3 and all(len(ids) == 40 for ids in seen)
    # the bar's folds: every third step of the shape-ordered list
    order = shape_order(steps)
    assert {id(steps[i]) for i in order[2::3]}.isdisjoint(seen[2])


def test_steps_predicted_ten_percent_slow_have_that_error_and_no_spread() -> None:
    steps = [_step(0, 64, i * 1.0) for i in range(20)] + [_step(4, 0, i * 0.1 + 0.05) for i in range(200)]
    predicted = [1.1 * s.step_s for s in steps]
    rows = {row.shape: row for row in shape_errors(steps, predicted, [0] * len(steps), VM_NOISE)}
    assert set(rows) == {(0, True), (4, False)}
    assert all(abs(row.error - 0.10) < 1e-12 and row.standard_error < 1e-9 for row in rows.values())
    classes = {row.shape: row for row in shape_errors(steps, predicted, [0] * len(steps), None, key=step_class)}
    assert set(classes) == {"prefill-only", "decode-only"}
    assert abs(classes["decode-only"].error - 0.10) < 1e-12


def _ou(starts_s: np.ndarray, time_s: float, rng: np.random.Generator) -> np.ndarray:
    """A unit Ornstein-Uhlenbeck process sampled at sorted times."""
    values = np.empty(len(starts_s))
    values[0] = rng.standard_normal()
    for i in range(1, len(starts_s)):
        keep = np.exp(-(starts_s[i] - starts_s[i - 1]) / time_s)
        values[i] = keep * values[i - 1] + np.sqrt(1.0 - keep * keep) * rng.standard_normal()
    return values


def test_a_clustered_rare_shapes_standard_error_is_what_its_error_spreads_by() -> None:
    """One replica's steps: a busy run (a step every 60 ms for 600 s) and, in 12 clusters of 4 back
    to back, a rare shape; noise drawn as the model says (a drift in time and a part a step). Over
    draws, the rare shape's error (against a fit to the run's mean) spreads as its standard error
    says, and far more than its steps taken as independent would say."""
    rng = np.random.default_rng(7)
    busy = np.arange(0.0, 600.0, 0.06)
    rare = np.concatenate([start + 0.1 * np.arange(4) for start in np.linspace(20.0, 580.0, 12)])
    starts = np.concatenate([busy, rare])
    order = np.argsort(starts)
    starts = starts[order]
    is_rare = np.concatenate([np.zeros(len(busy), bool), np.ones(len(rare), bool)])[order]
    noise = StepNoise(sd=0.17, drift_share=0.7, drift_time_s=0.5)
    errors, standard_errors, independent = [], [], []
    for draw in range(300):
        log_noise = (noise.sd * np.sqrt(noise.drift_share) * _ou(starts, noise.drift_time_s, rng)
                     + noise.sd * np.sqrt(noise.white_share) * rng.standard_normal(len(starts)))
        measured = 0.05 * np.exp(log_noise)
        predicted = np.full(len(starts), measured.mean())  # the fit: the run's mean step
        errors.append(predicted[is_rare].sum() / measured[is_rare].sum() - 1.0)
        if draw < 5:
            steps = [_step(0 if r else 4, 64 if r else 0, s, m) for r, s, m in zip(is_rare, starts, measured)]
            rows = {row.shape: row for row in shape_errors(steps, predicted, [0] * len(steps), noise)}
            standard_errors.append(rows[(0, True)].standard_error)
            alone = {row.shape: row for row in shape_errors(steps, predicted, [0] * len(steps), None)}
            independent.append(alone[(0, True)].standard_error)
    spread = float(np.std(errors))
    assert 0.75 < float(np.mean(standard_errors)) / spread < 1.33, (np.mean(standard_errors), spread)
    assert float(np.mean(independent)) < 0.75 * spread


def test_a_shape_spanning_the_fitted_run_moves_less_than_one_from_a_pass_never_fitted() -> None:
    """The run's drift is in a fit made alongside it: judged against it, a shape that spans the run
    has a small standard error; the same steps from a pass the fit never saw keep their own mean's."""
    rng = np.random.default_rng(3)
    starts = np.arange(0.0, 300.0, 0.05)
    log_noise = 0.17 * np.sqrt(0.6) * _ou(starts, 3.0, rng) + 0.17 * np.sqrt(0.4) * rng.standard_normal(len(starts))
    steps = [_step(4, 0, start, 0.05 * float(np.exp(n))) for start, n in zip(starts, log_noise)]
    predicted = [0.05] * len(steps)
    noise = StepNoise(sd=0.17, drift_share=0.0, drift_time_s=1.0, shared_share=0.6, shared_time_s=3.0)
    alongside, = shape_errors(steps, predicted, [0] * len(steps), noise)
    unseen, = shape_errors(steps, predicted, [0] * len(steps), noise, fitted_alongside=False)
    assert alongside.error == unseen.error
    assert alongside.standard_error < 0.1 * unseen.standard_error
