"""The shipped `tiny-random-llama-cpu` profile, regenerated: the engines' own steps while serving.

    python bench/calibrate_cpu_profile.py --out DIR [--phase-s 120] [--write-profile P.json]
    python bench/calibrate_cpu_profile.py --out bench/data/calibration/tiny-random-llama-cpu --fit-only [--step-noise]

The shipped profile's own steps are kept in bench/data/calibration/tiny-random-llama-cpu (gzip'd):
`--fit-only` fits them again, as a change to the fit needs (the logs of the profile before were
not kept, and it could not be refitted). `--step-noise` also fits the steps' variance: that is the
shipped `tiny-random-llama-cpu-vm` (the same fit with its noise, under its own name; the default
stays the mean model, docs/simulator.md "Step-time variance").

Runs the engine as `bench/sim_fidelity.py` runs it (`tidegate serve`, 2 embedded workers of 1
thread, every step logged) through the same kinds of load: a closed loop of 64 in flight, then
Poisson at 0.5x and 0.8x of the capacity it measured and a 3x surge, `--phase-s` each, prompts of
16-256 bytes and 16-64 answered tokens. So the steps cover the shapes the fidelity phases produce
(small batches with prefills riding along, full budgets of prefill chunks, decode batches up to
the tens), drawn from other seeds than the fidelity bench's: a profile fitted here is judged there
on requests it was not fitted on.
The step logs, the serve config and the profile stay in DIR; the profile is fitted as
`tidegate sim calibrate --step-log DIR/steps-*.csv` fits it (relative error, scaled by the first
pass's prediction; every third step of a shape held out), with the engine's `attention_cost_tokens`
and the cold start carried over from the shipped profile. Printed: the fit's terms, its held-out
error (the calibration bar: held-out shapes within 10 %), the cores each role used per phase, and
the steps by kind against the new profile and the shipped one.
Each held-out shape is printed with its standard error (`sim.held_out`: its steps' spread, their
noise correlated in time as the run's fitted step noise says), by third and with every step held
out once (three folds, each step predicted by a fit that never saw it), and a shape over 10 % by
less than two standard errors is marked noise-sized. `--held-out-passes N` (default 1) runs the
Poisson phases N more times after the fitted ones, on other seeds; their steps go to DIR/held-out/,
are never fitted, and are judged shape by shape against the profile: the rare shapes (prefill-only
steps: 0.5-1 % of a run's) measured on more steps, from other moments of the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from overload_measure import Processes, free_port  # noqa: E402
from sim_fidelity import PHASES, cpu_by_role, live_run, print_cores, serve_config, step_report  # noqa: E402

from tidegate.calibration import calibrate_from_step_logs, read_step_logs, step_noise_of_logs  # noqa: E402
from tidegate.engine.scheduler import SchedulerConfig  # noqa: E402
from tidegate.sim.costfit import StepSample, fit_cost_model, logged_step_s  # noqa: E402
from tidegate.sim.held_out import ShapeError, cross_validated, shape_errors, shape_order, step_class  # noqa: E402
from tidegate.sim.profile import load_profile  # noqa: E402
from tidegate.sim.step_noise import StepNoise  # noqa: E402

SHIPPED = "tiny-random-llama-cpu"
# other seeds than bench/sim_fidelity.py's (1, 2, 10-12): its requests are not the ones fitted on
SEED_BASE = 100
# the held-out pass's step logs, beside the fitted ones: steps the fit never sees
HELD_OUT = "held-out"


async def drive(url: str, gateway_pid: int, phase_s: float, capacity_s: float, held_out_passes: int) -> float | None:
    """The fitted phases, then `held_out_passes` more passes of the Poisson phases (other seeds);
    returns when the held-out passes began (the engines' step clock: perf_counter, one monotonic
    clock for every process here), None without them."""
    await live_run(url, 4.0, 10.0, seed=SEED_BASE)  # warm-up
    closed = await live_run(url, None, capacity_s, seed=SEED_BASE + 1)
    done = [r for r in closed.records if r.ok]
    span = max(r.sent_s + r.e2e_s for r in done) - min(r.sent_s for r in done)
    capacity = len(done) / span
    print(f"capacity: {capacity:.2f} req/s (closed loop)")
    for index, (label, load) in enumerate(PHASES):
        before = cpu_by_role(gateway_pid)
        result = await live_run(url, load * capacity, phase_s, seed=SEED_BASE + 10 + index)
        served = sum(1 for r in result.records if r.ok)
        print(f"{label} ({load * capacity:.2f} req/s): {len(result.records)} sent, {served} served")
        print_cores(before, cpu_by_role(gateway_pid), result.elapsed_s)
        await asyncio.sleep(5.0)
    if not held_out_passes:
        return None
    held_out_from_s = time.perf_counter()
    for number in range(held_out_passes):
        for index, (label, load) in enumerate(PHASES):
            result = await live_run(url, load * capacity, phase_s, seed=SEED_BASE + 20 + 10 * number + index)
            print(f"held-out pass {number + 1}, {label}: {len(result.records)} sent, "
                  f"{sum(1 for r in result.records if r.ok)} served")
            await asyncio.sleep(5.0)
    return held_out_from_s


def split_held_out(out: Path, held_out_from_s: float) -> None:
    """Moves each engine's steps from the held-out passes on into HELD_OUT/ (so no fit reads them)."""
    (out / HELD_OUT).mkdir(exist_ok=True)
    for log in out.glob("steps-*.csv"):
        lines = log.read_text().splitlines(keepends=True)
        log.write_text("".join(line for line in lines if float(line.split(",", 1)[0]) < held_out_from_s))
        (out / HELD_OUT / log.name).write_text(
            "".join(line for line in lines if float(line.split(",", 1)[0]) >= held_out_from_s))


def fold_predictions(steps: list[StepSample], attention_cost_tokens: int | None,
                     decode_attention: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each step predicted by a fit on the two thirds without it (the bar's thirds: every third step
    of the shape-ordered steps), and its third."""
    budget = SchedulerConfig().max_batch_tokens

    def fit_then_predict(fitted: list[StepSample]):
        model = fit_cost_model(fitted, budget, attention_cost_tokens, by_rows=True,
                               decode_attention=decode_attention).model
        return lambda step: logged_step_s(model, step)

    third = np.zeros(len(steps), dtype=int)
    for position, index in enumerate(shape_order(steps)):
        third[index] = position % 3
    return cross_validated(steps, fit_then_predict), third


def _over(rows: list[ShapeError]) -> str:
    """The shapes over the bar, each marked where its side of the bar is noise's (within 2 s.e.)."""
    over = [f"{row.describe()}{' (noise-sized)' if row.undecided() else ''}" for row in rows if abs(row.error) > 0.10]
    return ", ".join(over) or "none"


def held_out_report(steps_by_log: list[list[StepSample]], profile, noise: StepNoise | None,
                    decode_attention: bool) -> None:
    """The bar's held-out shapes by third, then every step held out once; each shape's error with
    its standard error (`sim.held_out`: its steps' spread, correlated in time as the run's noise)."""
    steps = [step for log in steps_by_log for step in log]
    replicas = [index for index, log in enumerate(steps_by_log) for _ in log]
    predicted, third = fold_predictions(steps, profile.attention_cost_tokens, decode_attention)
    print("held out by shape (decodes, with a prefill chunk or not): steps, predicted / measured - 1, "
          "+- its standard error (the steps' spread, their noise correlated in time)")
    for held in (2, 0, 1):
        chosen = np.flatnonzero(third == held)
        rows = shape_errors([steps[i] for i in chosen], predicted[chosen], [replicas[i] for i in chosen], noise)
        classes = shape_errors([steps[i] for i in chosen], predicted[chosen], [replicas[i] for i in chosen], noise,
                               key=step_class)
        label = "steps 2 mod 3 held out (the profile's bar)" if held == 2 else f"steps {held} mod 3 held out instead"
        print(f"  {label}: {len(rows)} shapes, error mean {np.mean([abs(r.error) for r in rows]):.1%}; "
              + "; ".join(row.describe() for row in classes) + f"; over 10 %: {_over(rows)}")
        if held == 2:
            print("    " + "; ".join(row.describe() for row in rows))
    rows = shape_errors(steps, predicted, replicas, noise)
    classes = shape_errors(steps, predicted, replicas, noise, key=step_class)
    print(f"  every step held out once (3 folds): {len(rows)} shapes, error mean "
          f"{np.mean([abs(r.error) for r in rows]):.1%}; " + "; ".join(row.describe() for row in classes)
          + f"; over 10 %: {_over(rows)}")


def held_out_pass_report(out: Path, profile, noise: StepNoise | None) -> None:
    """The steps of the held-out pass (`--held-out-passes`): never fitted, each against the profile."""
    logs = sorted(str(p) for p in [*(out / HELD_OUT).glob("steps-*.csv"), *(out / HELD_OUT).glob("steps-*.csv.gz")])
    if not logs:
        return
    by_log = read_step_logs(logs)
    steps = [step for log in by_log for step in log]
    replicas = [index for index, log in enumerate(by_log) for _ in log]
    predicted = [logged_step_s(profile.cost, step) for step in steps]
    # the fit never saw this stretch of time: its drift is not in the fit, nothing of it subtracted
    rows = shape_errors(steps, predicted, replicas, noise, fitted_alongside=False)
    classes = shape_errors(steps, predicted, replicas, noise, key=step_class, fitted_alongside=False)
    print(f"held-out pass ({len(steps)} steps in {HELD_OUT}/, none fitted) against the profile fitted on the rest: "
          f"{len(rows)} shapes, error mean {np.mean([abs(r.error) for r in rows]):.1%}; "
          + "; ".join(row.describe() for row in classes) + f"; over 10 %: {_over(rows)}")
    print("    " + "; ".join(row.describe() for row in rows))


def fit(out: Path, write_profile: str | None, decode_attention: bool = False, step_noise: bool = False) -> None:
    shipped = load_profile(SHIPPED)
    logs = sorted(str(p) for p in [*out.glob("steps-*.csv"), *out.glob("steps-*.csv.gz")])
    profile = calibrate_from_step_logs(
        logs, name=SHIPPED, attention_cost_tokens=shipped.attention_cost_tokens, cold_start_s=shipped.cold_start_s,
        description=shipped.description, decode_attention=decode_attention, step_noise=step_noise)
    profile = replace(profile, sources=profile.sources + (
        "bench/calibrate_cpu_profile.py: a closed loop of 64, Poisson at 0.5x and 0.8x of its capacity and a 3x "
        "surge, the requests of bench/sim_fidelity.py's phases from other seeds",))
    (out / "profile.json").write_text(profile.to_json())
    cost, error = profile.cost, profile.fit
    assert error is not None
    print(f"\nfitted on {error.fitted_samples} steps: {cost.describe()}")
    print(f"held-out shapes: {error.held_out_samples}, error mean {error.held_out_mean:.1%}, "
          f"worst {error.held_out_max:.1%} (bar: 10 %)")
    steps_by_log = read_step_logs(logs)
    # the correlation of the steps' noise in time, the run's own (the profile's where fitted)
    noise = profile.noise or step_noise_of_logs(steps_by_log, profile.cost).noise
    held_out_report(steps_by_log, profile, noise, decode_attention)
    held_out_pass_report(out, profile, noise)
    if profile.noise is not None:
        print(f"step noise: {profile.noise.describe()} (bench/step_variance.py --logs '{out}/steps-*' for its figures)")
    step_report([Path(p) for p in logs], str(out / "profile.json"))
    step_report([Path(p) for p in logs], SHIPPED)
    if write_profile:
        Path(write_profile).write_text(profile.to_json())
        print(f"wrote {write_profile}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="a directory for the step logs, the config and the profile")
    parser.add_argument("--phase-s", type=float, default=120.0)
    parser.add_argument("--capacity-s", type=float, default=30.0)
    parser.add_argument("--held-out-passes", type=int, default=1,
                        help="after the fitted phases, this many more passes of the Poisson phases (other seeds) whose "
                             "steps are never fitted: the held-out shapes measured on more steps")
    parser.add_argument("--fit-only", action="store_true", help="no live run: fit the step logs already in --out")
    parser.add_argument("--write-profile", help="also write the profile here (the shipped one's path to replace it)")
    parser.add_argument("--decode-attention", action="store_true",
                        help="fit the decode attention by mirror rows x the longest decode context "
                             "(`tidegate sim calibrate --decode-attention`)")
    parser.add_argument("--step-noise", action="store_true",
                        help="also fit the steps' variance around the fit (`tidegate sim calibrate --step-noise`)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.fit_only:
        if any(out.glob("steps-*.csv")):
            raise SystemExit(f"{out} already holds step logs: the engines append to them")
        processes = Processes()
        try:
            port = free_port()
            config = serve_config(port, out.resolve() / "steps-{pid}.csv")
            (out / "serve.yaml").write_text(yaml.safe_dump(config))
            processes.start([sys.executable, "-m", "tidegate", "serve", "--config", str(out / "serve.yaml"),
                             "--no-access-log", "--log-level", "warning"], f"http://127.0.0.1:{port}/ready")
            print(f"tidegate serve, 2 x embedded tiny-random-llama (1 thread); cores: {os.cpu_count()}; "
                  f"phases {args.phase_s:.0f} s")
            held_out_from_s = asyncio.run(drive(f"http://127.0.0.1:{port}", processes.started[0].pid, args.phase_s,
                                                args.capacity_s, args.held_out_passes))
        finally:
            processes.stop_all()  # the engines flush their step logs as they stop
        if held_out_from_s is not None:
            split_held_out(out, held_out_from_s)
    fit(out, args.write_profile, args.decode_attention, args.step_noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
