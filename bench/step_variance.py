"""How served steps vary around the cost model's mean, and how well `sim.step_noise` models it.

    python bench/step_variance.py [--logs 'DIR/steps-*.csv' ...] [--profile P] [--refit]

For each set of step logs (default: the shipped profile's own calibration steps,
bench/data/calibration/tiny-random-llama-cpu), the residual of every served step against the
profile's prediction, log(measured / predicted): its spread and tails, its autocorrelation from one
step to the next and over lags in seconds, the spread of its means over windows of 1, 5 and 30 s
(against what white noise would give), and how the two engines' windows move together. Then the
step noise fitted on them (`tidegate sim calibrate --step-log ... --step-noise`) and the same
figures drawn from it on the same step times (two seeds), beside the measured ones.
`--refit`: the residuals against a profile fitted on these logs themselves (in sample: the run's
own mean speed), not against `--profile`.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import numpy as np

from tidegate.calibration import read_step_logs, calibrate_from_step_logs, step_noise_of_logs
from tidegate.sim.costfit import logged_step_s
from tidegate.sim.profile import load_profile
from tidegate.sim.step_noise import SharedDrift, StepNoise, StepNoiseStream, residuals, time_autocorrelation

SHIPPED_LOGS = str(Path(__file__).resolve().parent / "data/calibration/tiny-random-llama-cpu/steps-*.csv.gz")
WINDOWS_S = (1.0, 5.0, 30.0)
MODEL_SEEDS = 2
QUANTILES = (1, 10, 50, 90, 99, 99.9)


def window_means(starts_s: np.ndarray, values: np.ndarray, window_s: float, origin_s: float) -> dict[int, float]:
    """Mean residual per window of `window_s` with at least 5 steps."""
    bins = ((starts_s - origin_s) // window_s).astype(int)
    means = {}
    for b in np.unique(bins):
        inside = values[bins == b]
        if len(inside) >= 5:
            means[int(b)] = float(inside.mean())
    return means


def window_figures(series: list[tuple[np.ndarray, np.ndarray]]) -> dict[float, tuple[float, float, float]]:
    """By window: (sd of the window means, what white noise of the same spread would give,
    correlation of the engines' window means when there are two)."""
    origin_s = min(float(s.min()) for s, _ in series)
    figures = {}
    for window_s in WINDOWS_S:
        per_engine = [window_means(s, v - v.mean(), window_s, origin_s) for s, v in series]
        means = np.array([m for engine in per_engine for m in engine.values()])
        white = []
        for s, v in series:
            bins = ((s - origin_s) // window_s).astype(int)
            counts = np.bincount(bins)
            white += [v.var() / c for c in counts if c >= 5]
        cross = float("nan")
        if len(per_engine) == 2:
            shared = sorted(set(per_engine[0]) & set(per_engine[1]))
            if len(shared) >= 3:
                cross = float(np.corrcoef([per_engine[0][b] for b in shared], [per_engine[1][b] for b in shared])[0, 1])
        figures[window_s] = (float(means.std()), float(np.sqrt(np.mean(white))), cross)
    return figures


def drawn(noise: StepNoise, starts_s: np.ndarray, seed: int, replica_id: str, shared: SharedDrift) -> np.ndarray:
    """log multipliers the simulator would draw for steps starting at `starts_s`."""
    stream = StepNoiseStream(noise, seed, replica_id, shared)
    out = np.empty(len(starts_s))
    state = stream.committed
    for step, start_s in enumerate(starts_s):
        factor, drift = stream.factor(step, float(start_s), state)
        state = (step + 1, float(start_s), drift)
        out[step] = np.log(factor)
    return out


def describe(label: str, series: list[tuple[np.ndarray, np.ndarray]]) -> None:
    values = np.concatenate([v for _, v in series])
    centred = np.concatenate([v - v.mean() for _, v in series])
    sd = centred.std()
    skew = float(np.mean(centred ** 3) / sd ** 3)
    kurtosis = float(np.mean(centred ** 4) / sd ** 4 - 3.0)
    ratios = np.exp(values)
    print(f"  {label}: {len(values)} steps; measured/predicted mean {ratios.mean():.3f}; "
          f"log residual sd {sd:.3f}, skew {skew:+.2f}, excess kurtosis {kurtosis:.1f}")
    print("    ratio p" + "/p".join(f"{q:g}" for q in QUANTILES) + ": "
          + " ".join(f"{x:.2f}" for x in np.percentile(ratios, QUANTILES))
          + f"; engine time in steps over 1.5x: {ratios[ratios > 1.5].sum() / ratios.sum():.1%}")
    lags = (1, 2, 5, 10, 20, 50, 100)
    acf = [np.mean([np.corrcoef(v[:-k], v[k:])[0, 1] for _, v in series if len(v) > k + 2]) for k in lags]
    print("    autocorrelation by steps apart " + " ".join(f"{k}: {a:+.2f}" for k, a in zip(lags, acf)))
    print("    autocorrelation by seconds apart "
          + " ".join(f"{lag:.2g}: {c:+.2f}" for lag, c, _ in time_autocorrelation(series)))
    for window_s, (spread, white, cross) in window_figures(series).items():
        print(f"    {window_s:>4.0f} s windows: mean log residual sd {spread:.3f} (white noise: {white:.3f}); "
              f"range x{np.exp(-2 * spread):.2f}..x{np.exp(2 * spread):.2f} (2 sd)"
              + (f"; the engines' windows correlate {cross:+.2f}" if not np.isnan(cross) else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", action="append", help="a glob of step logs (one set; repeat for more)")
    parser.add_argument("--profile", default="tiny-random-llama-cpu")
    parser.add_argument("--refit", action="store_true", help="residuals against a profile fitted on the logs")
    args = parser.parse_args()
    for pattern in args.logs or [SHIPPED_LOGS]:
        paths = sorted(glob.glob(pattern))
        if not paths:
            raise SystemExit(f"no step logs match {pattern}")
        profile = load_profile(args.profile)
        if args.refit:
            profile = calibrate_from_step_logs(paths, name="in-sample", description="",
                                               attention_cost_tokens=profile.attention_cost_tokens)
        logs = read_step_logs(paths)
        print(f"\n{pattern}: {len(paths)} engine(s); residuals against {profile.name}")
        series = [(np.array([s.start_s for s in log]),
                   residuals([logged_step_s(profile.cost, s) for s in log], [s.step_s for s in log])) for log in logs]
        describe("measured", series)
        fit = step_noise_of_logs(logs, profile.cost)
        print(f"  fitted: {fit.noise.describe()}")
        print("    autocorrelation by seconds apart, measured / fitted: "
              + " ".join(f"{lag:.2g}: {c:+.2f}/{m:+.2f}" for lag, c, m in fit.autocorrelation))
        for seed in range(MODEL_SEEDS):
            shared = SharedDrift(fit.noise, seed)  # the engines logged side by side: one machine
            model_series = [(s, drawn(fit.noise, s, seed, f"r{i}", shared)) for i, (s, _) in enumerate(series)]
            describe(f"drawn from the fit (seed {seed}, on the same step times)", model_series)
    return 0


if __name__ == "__main__":
    sys.exit(main())
