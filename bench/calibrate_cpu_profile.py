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
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from overload_measure import Processes, free_port  # noqa: E402
from sim_fidelity import PHASES, cpu_by_role, live_run, print_cores, serve_config, step_report  # noqa: E402

from tidegate.calibration import calibrate_from_step_logs  # noqa: E402
from tidegate.engine.scheduler import SchedulerConfig  # noqa: E402
from tidegate.sim.costfit import fit_cost_model, predict_s, read_step_log  # noqa: E402
from tidegate.sim.profile import load_profile  # noqa: E402

SHIPPED = "tiny-random-llama-cpu"
# other seeds than bench/sim_fidelity.py's (1, 2, 10-12): its requests are not the ones fitted on
SEED_BASE = 100


async def drive(url: str, gateway_pid: int, phase_s: float, capacity_s: float) -> None:
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


def held_out_by_shape(logs: list[str], attention_cost_tokens: int | None, decode_attention: bool = False,
                      third: int = 2) -> list[tuple[tuple[int, bool], int, float, float]]:
    """`fit_with_held_out`'s shapes one by one (`third` 2, the profile's bar): every third step of a
    shape held out, the rest fitted. Each shape: its held-out steps, predicted / measured - 1, and the
    standard error of its steps' measured / predicted, how far that mean moves with which steps were
    held out (a shape of 20 steps on a shared VM: 4-9 %; a figure within two of them is noise)."""
    steps = [step for log in logs
             for step in read_step_log((gzip.open(log, "rt") if log.endswith(".gz") else open(log)).read().splitlines())]
    steps.sort(key=lambda s: (s.decodes, s.prefill_tokens > 0))
    budget = SchedulerConfig().max_batch_tokens
    partial = fit_cost_model([s for i, s in enumerate(steps) if i % 3 != third], budget, attention_cost_tokens,
                             by_rows=True, decode_attention=decode_attention)
    shapes: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    for step in steps[third::3]:
        shapes.setdefault((step.decodes, step.prefill_tokens > 0), []).append(
            (predict_s(partial, step, budget, attention_cost_tokens), step.step_s))
    rows = []
    for shape, pairs in sorted(shapes.items()):
        if len(pairs) >= 10:
            predicted, measured = (float(sum(column)) for column in zip(*pairs))
            ratios = [m / p for p, m in pairs]
            rows.append((shape, len(pairs), predicted / measured - 1.0, float(np.std(ratios) / np.sqrt(len(ratios)))))
    return rows


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
    print("held out by shape (decodes, with a prefill chunk or not): steps, predicted / measured - 1, "
          "+- the standard error of its steps' mean")
    print("  " + "; ".join(f"{decodes}{'+chunk' if chunk else ''} {count} {error:+.1%} +-{noise:.1%}"
                           for (decodes, chunk), count, error, noise in held_out_by_shape(
                               logs, shipped.attention_cost_tokens, decode_attention)))
    # the other two thirds held out in turn: which shapes miss 10 % depends on which steps were held out
    for third in (0, 1):
        shapes = held_out_by_shape(logs, shipped.attention_cost_tokens, decode_attention, third)
        worst = max(shapes, key=lambda row: abs(row[2]))
        print(f"  steps {third} mod 3 held out instead: {len(shapes)} shapes, error mean "
              f"{np.mean([abs(row[2]) for row in shapes]):.1%}, worst {worst[2]:+.1%} +-{worst[3]:.1%} "
              f"({worst[0][0]}{'+chunk' if worst[0][1] else ''}, {worst[1]} steps); over 10 %: "
              + (", ".join(f"{d}{'+chunk' if c else ''} {e:+.1%} +-{n:.1%}" for (d, c), _, e, n in shapes
                           if abs(e) > 0.10) or "none"))
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
            asyncio.run(drive(f"http://127.0.0.1:{port}", processes.started[0].pid, args.phase_s, args.capacity_s))
        finally:
            processes.stop_all()  # the engines flush their step logs as they stop
    fit(out, args.write_profile, args.decode_attention, args.step_noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
