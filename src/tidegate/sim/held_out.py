"""The calibration bar's held-out shapes, each with how far its error moves by the steps' noise alone.

The bar (docs/simulator.md, "Profiles"): a profile fitted on logged steps predicts the mean step of
each held-out shape (decode batch, a prefill chunk riding along or not) within 10 %. A shape's
error is a mean over its held-out steps, and served steps are noisy (on the 2-core VM a step's
time spreads by a sixth around its mean) and not independent: a step's noise correlates +0.7 with
the next one's and still +0.3 a second later (`sim.step_noise`). A rare shape's steps come in
clusters (the prefill-only steps: one prompt's chunks back to back, at a burst's start), so its
20-60 steps hold only a few independent draws of the machine's speed, and a standard error that
takes them as independent is too small.

`standard_error` here is the spread of the shape's own steps (measured / predicted), so a heavy
tail counts as measured, combined with the correlation of the steps' noise in time that the run's
fitted `StepNoise` gives: a replica's own drift between its own steps, the drift every replica shares
between any two, each fading with the time between them. Without a noise model, steps count as
independent. What is judged is the shape against a fit to the whole run, so what moves its error is
how far its steps' noise strays from the run's mean noise (`shape_errors`).

`cross_validated` holds out every step once (a step in the shape-ordered list goes to the fold of
its index mod `folds`, as the bar's third does), each predicted by a fit that never saw it: three
times the held-out steps of one third, the split as honest.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from tidegate.sim.costfit import StepSample
from tidegate.sim.step_noise import StepNoise

__all__ = ["Shape", "ShapeError", "shape_of", "step_class", "shape_order", "cross_validated", "shape_errors",
           "describe_shape"]

Shape = tuple[int, bool]  # (decoding sequences, a prefill chunk in the step or not)


def shape_of(step: StepSample) -> Shape:
    return step.shape


def step_class(step: StepSample) -> str:
    """The shape's class: decode-only, mixed (decodes and a prefill chunk) or prefill-only."""
    if step.prefill_tokens == 0:
        return "decode-only"
    return "mixed" if step.decodes else "prefill-only"


def describe_shape(shape: Hashable) -> str:
    if isinstance(shape, tuple):
        decodes, chunk = shape
        return f"{decodes}{'+chunk' if chunk else ''}"
    return str(shape)


def shape_order(steps: Sequence[StepSample]) -> list[int]:
    """The steps' indices by shape (stable: a shape's steps keep their order), the order in which
    the bar takes every third step."""
    return sorted(range(len(steps)), key=lambda i: steps[i].shape)


@dataclass(frozen=True, slots=True)
class ShapeError:
    shape: Hashable  # a `Shape`, or a class of them (`step_class`)
    steps: int
    error: float  # predicted / measured - 1, over the shape's steps summed
    standard_error: float  # of `error`, by the steps' spread and their noise's correlation in time

    def undecided(self, bar: float = 0.10) -> bool:
        """Whether the error lies within two standard errors of the bar: its side of the bar is noise's."""
        return abs(abs(self.error) - bar) < 2.0 * self.standard_error

    def describe(self) -> str:
        return f"{describe_shape(self.shape)} {self.steps} {self.error:+.1%} +-{self.standard_error:.1%}"


def cross_validated(steps: Sequence[StepSample],
                    fit_then_predict: Callable[[list[StepSample]], Callable[[StepSample], float]],
                    folds: int = 3) -> np.ndarray:
    """Each step's predicted time by a fit on the folds without it; `fit_then_predict(fitted steps)`
    returns the fit's prediction of a step."""
    order = shape_order(steps)
    predicted = np.zeros(len(steps))
    for fold in range(folds):
        predict = fit_then_predict([steps[i] for n, i in enumerate(order) if n % folds != fold])
        for i in order[fold::folds]:
            predicted[i] = predict(steps[i])
    return predicted


def _correlated_sums(noise: StepNoise | None, starts_s: np.ndarray, replicas: np.ndarray,
                     weights: np.ndarray) -> np.ndarray:
    """For each step i: sum over the steps j of correlation(i, j) x weights[j], itself included (1).
    Two steps' noise correlates by the shared drift, `shared_share x exp(-lag / shared_time_s)`, and
    if one replica's, its own too, `drift_share x exp(-lag / drift_time_s)`. Steps more than ten time
    constants apart count as uncorrelated: a window in time a step, not the whole matrix (a run has
    10,000 steps)."""
    if noise is None:
        return weights.copy()
    order = np.argsort(starts_s, kind="stable")
    sorted_s, sorted_replicas, sorted_weights = starts_s[order], replicas[order], weights[order]
    reach_s = 10.0 * max(noise.shared_time_s, noise.drift_time_s)
    lows = np.searchsorted(sorted_s, sorted_s - reach_s)
    highs = np.searchsorted(sorted_s, sorted_s + reach_s, side="right")
    sums = np.zeros(len(starts_s))
    for position, (low, high) in enumerate(zip(lows, highs)):
        lag_s = np.abs(sorted_s[low:high] - sorted_s[position])
        same = sorted_replicas[low:high] == sorted_replicas[position]
        row = (noise.shared_share * np.exp(-lag_s / noise.shared_time_s)
               + noise.drift_share * np.exp(-lag_s / noise.drift_time_s) * same)
        row[position - low] = 1.0
        sums[order[position]] = float(row @ sorted_weights[low:high])
    return sums


def shape_errors(steps: Sequence[StepSample], predicted_s: Sequence[float], replicas: Sequence[int | str],
                 noise: StepNoise | None, least: int = 10,
                 key: Callable[[StepSample], Hashable] = shape_of,
                 fitted_alongside: bool = True) -> list[ShapeError]:
    """Each shape (`key`: or class) with at least `least` steps: its error and standard error.

    The error is measured against a fit to the run's steps, which took the run's mean speed: what
    moves a shape's error is how far its steps' noise strays from the run's mean noise, so the
    variance is that of (the shape's weighted mean ratio - the run's mean ratio), the shape's steps
    with their own spread, the run's with the run's, correlated as `_correlated_sums` says. For a
    rare shape in clusters (prefill-only steps) it is nearly its own mean's; for one spread over the
    whole run, much less than its own mean's (the run's drift is in the fit too). `fitted_alongside`
    False: steps of a pass the fit never saw (another stretch of time), judged by their own mean's
    variance alone."""
    predicted_all = np.asarray(predicted_s, dtype=np.float64)
    measured_all = np.array([step.step_s for step in steps])
    starts_all = np.array([step.start_s for step in steps])
    replica_all = np.asarray([str(r) for r in replicas])
    ratio_all = measured_all / predicted_all
    run_spread = float(np.std(ratio_all, ddof=1)) if len(steps) > 1 else 0.0
    # each step's correlation with the run's mean noise (the run's steps weighed alike)
    run_mean_correlation = _correlated_sums(noise, starts_all, replica_all, np.full(len(steps), 1.0 / len(steps)))
    run_variance = run_spread ** 2 * float(run_mean_correlation.mean()) if fitted_alongside else 0.0
    by_shape: dict[Hashable, list[int]] = {}
    for index, step in enumerate(steps):
        by_shape.setdefault(key(step), []).append(index)
    rows = []
    for shape, indices in sorted(by_shape.items(), key=lambda item: _sort_key(item[0])):
        if len(indices) < least:
            continue
        predicted, ratio = predicted_all[indices], ratio_all[indices]
        weights = predicted / predicted.sum()
        mean = float(weights @ ratio)  # = measured / predicted, summed
        # the weighted spread of the ratios, unbiased (1 - sum of squared weights: n - 1 of n when equal)
        spread = np.sqrt(float(weights @ (ratio - mean) ** 2) / max(1.0 - float(weights @ weights), 1e-12))
        own = spread ** 2 * float(weights @ _correlated_sums(noise, starts_all[indices], replica_all[indices], weights))
        with_run = spread * run_spread * float(weights @ run_mean_correlation[indices]) if fitted_alongside else 0.0
        variance = max(own - 2.0 * with_run + run_variance, 0.0)
        rows.append(ShapeError(shape, len(indices), 1.0 / mean - 1.0, float(np.sqrt(variance)) / mean ** 2))
    return rows


def _sort_key(shape: Hashable) -> tuple[int, object]:
    """Shapes by decodes then chunk; classes by name (a tuple and a name never compared)."""
    return (0, shape) if isinstance(shape, tuple) else (1, str(shape))
