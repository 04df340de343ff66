"""`tidegate sim`: calibrate a replica profile against a running engine, or simulate a pool on it.

    tidegate sim calibrate --url http://127.0.0.1:8001 --model tiny-random-llama --out my.json
    tidegate sim run --profile tiny-random-llama-cpu --replicas 2 --speedup 60 --duration-s 600
    tidegate sim run --config serve.yaml --profile P --trace T --rate-scale 2 --fifo
    tidegate sim profiles

`run` drives the pool controller `tidegate serve` would build from the same config (tiers, limits,
slot limits, isolation) through modelled replicas of the profile, on virtual time, and prints per
tier TTFT percentiles, goodput and refusals, and per replica utilisation; `--fifo` runs overload
control off beside it. A run is a function of its inputs and `--seed`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from tidegate.config import ConfigError
from tidegate.loadgen.trace import AZURE_TRACE_CREDIT, default_trace_path
from tidegate.sim.harness import Harness
from tidegate.sim.profile import ReplicaProfile, load_profile, save_profile, shipped_profiles
from tidegate.sim.report import format_summary
from tidegate.sim.seam import SimRequest
from tidegate.simulate import Simulation, SimulatedRun, poisson_requests, trace_requests

__all__ = ["configure_parser", "run"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", metavar="SUBCOMMAND", required=True)
    cal = sub.add_parser("calibrate", help="measure a running engine and write its replica profile")
    cal.add_argument("--url", action="append",
                     help="an engine's base URL, e.g. http://127.0.0.1:8001; repeat it for replicas that share a "
                          "host: they are measured at once, as they run")
    cal.add_argument("--model", help="the model name the server answers to (with --url)")
    cal.add_argument("--step-log", nargs="+", help="instead of probing a server: fit on the steps engines logged "
                                                   "while serving (`tidegate engine --step-log`; .csv or .csv.gz)")
    cal.add_argument("--attention-cost-tokens", type=int,
                     help="the engine's budget charge per prefill token at context c is 1 + c / this "
                          "(the embedded engine states it)")
    cal.add_argument("--step-noise", action="store_true",
                     help="with --step-log: also fit how the steps vary around the fitted mean, in time and "
                          "between the engines logged side by side (docs/simulator.md, \"Step-time variance\"); "
                          "the simulator then draws each step's time, seeded by `sim run --seed`")
    cal.add_argument("--decode-attention", action="store_true",
                     help="with --step-log: fit the decode attention as the engine runs it (mirror rows x the "
                          "longest decode context) and the prefill chunks' context apart; needs logs of "
                          "engines that log the attention's shape")
    cal.add_argument("--out", required=True, help="profile file to write (JSON)")
    cal.add_argument("--name", help="the profile's name (default: the file's stem)")
    cal.add_argument("--description", default="", help="what was measured: engine, model, machine")
    # the embedded engine states its limits on /v1/models; give them for other servers
    cal.add_argument("--max-num-seqs", type=int, help="the engine's sequence limit (vLLM: max_num_seqs)")
    cal.add_argument("--max-batch-tokens", type=int, help="its per-step token budget (vLLM: max_num_batched_tokens)")
    cal.add_argument("--kv-cache-tokens", type=int, help="its KV-cache capacity in tokens")
    cal.add_argument("--cold-start-s", type=float, default=0.0, help="measured time from start to ready")
    cal.add_argument("--prompt-tokens", type=_ints, help="prefill grid, e.g. 8,32,96,256")
    cal.add_argument("--batches", type=_ints, help="decode batch sizes, e.g. 1,4,16")
    cal.add_argument("--contexts", type=_ints, help="decode contexts in tokens, e.g. 16,256")
    cal.add_argument("--repeats", type=int, default=3)
    cal.add_argument("--seed", type=int, default=0)
    sub.add_parser("profiles", help="list the shipped replica profiles")
    sim = sub.add_parser("run", help="simulate a pool on a replica profile")
    sim.add_argument("--profile", default="tiny-random-llama-cpu", help="shipped profile name or profile file")
    sim.add_argument("--config", help="a `tidegate serve` YAML: tiers, limits, slot limits, pool size")
    sim.add_argument("--pool", help="the config's pool to simulate (default: its first)")
    sim.add_argument("--replicas", type=int, help="replicas (default: the config's, else 2)")
    sim.add_argument("--trace", nargs="?", const="", help="replay an Azure-format trace (default: the shipped one)")
    sim.add_argument("--speedup", type=float, default=1.0, help="trace: time compression")
    sim.add_argument("--rate-scale", type=float, default=1.0, help="trace: thin (<1) or duplicate (>1) requests")
    sim.add_argument("--rate", type=float, help="Poisson arrivals at this rate (requests/s) instead of a trace")
    sim.add_argument("--prompt-tokens", type=_ints, default=(64, 1024), help="Poisson: uniform prompt range")
    sim.add_argument("--output-tokens", type=_ints, default=(32, 256), help="Poisson: uniform output range")
    sim.add_argument("--duration-s", type=float, help="arrivals in the first DURATION seconds (virtual)")
    sim.add_argument("--mix", default="", help="tiers by share, e.g. critical:0.2,standard:0.8 "
                                                "(default: all the default tier)")
    sim.add_argument("--fifo", action="store_true", help="also run with overload control off")
    sim.add_argument("--autoscale", action="store_true",
                     help="size the pool with tidegate's autoscaler between --min-replicas and --replicas (replicas "
                          "start after the profile's cold start, stop after draining); its timeline is in the report")
    sim.add_argument("--min-replicas", type=int, default=1, help="with --autoscale: the fleet's floor and start")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--out", help="a directory for report.json and records.jsonl (the schema of `tidegate bench`), "
                                   "plots, and summary.json (the per-replica figures printed)")
    sim.add_argument("--no-plots", action="store_true", help="with --out: no PNG plots")
    sim.add_argument("--no-progress", action="store_true",
                     help="no progress bar (shown on a terminal for runs of 10,000 requests and more)")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    try:
        if args.sim_command == "calibrate":
            return _calibrate(args)
        if args.sim_command == "profiles":
            for name in shipped_profiles():
                profile = load_profile(name)
                print(f"{name:<28} {'estimate' if profile.estimate else 'measured':<9} {profile.description}")
            return 0
        return _simulate(args)
    except (ValueError, ConfigError, OSError, RuntimeError) as error:
        print(f"tidegate sim: {error}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from tidegate.calibration import CalibrationGrid, calibrate, calibrate_from_step_logs  # aiohttp only here

    if args.step_log:
        profile = calibrate_from_step_logs(args.step_log, name=args.name or Path(args.out).stem,
                                           description=args.description, max_num_seqs=args.max_num_seqs,
                                           max_batch_tokens=args.max_batch_tokens,
                                           kv_cache_tokens=args.kv_cache_tokens,
                                           attention_cost_tokens=args.attention_cost_tokens,
                                           cold_start_s=args.cold_start_s,
                                           decode_attention=args.decode_attention, step_noise=args.step_noise)
        return _wrote(profile, args.out)
    if not args.url or not args.model:
        raise ValueError("give --url and --model (a running engine), or --step-log")

    defaults = CalibrationGrid()
    grid = CalibrationGrid(prompt_tokens=args.prompt_tokens or defaults.prompt_tokens,
                           batches=args.batches or defaults.batches, contexts=args.contexts or defaults.contexts,
                           repeats=args.repeats)
    profile = calibrate([url.rstrip("/").removesuffix("/v1") for url in args.url], args.model, name=args.name or Path(args.out).stem,
                        description=args.description, max_num_seqs=args.max_num_seqs,
                        max_batch_tokens=args.max_batch_tokens, kv_cache_tokens=args.kv_cache_tokens,
                        attention_cost_tokens=args.attention_cost_tokens,
                        cold_start_s=args.cold_start_s, grid=grid, seed=args.seed,
                        progress=lambda line: print(line, file=sys.stderr))
    return _wrote(profile, args.out)


def _wrote(profile: ReplicaProfile, out: str) -> int:
    save_profile(profile, out)
    cost, fit = profile.cost, profile.fit
    print(cost.describe())
    if fit is not None:
        print(f"held-out shapes: {fit.held_out_samples}, relative error mean {fit.held_out_mean:.1%}, "
              f"max {fit.held_out_max:.1%} (fitted on {fit.fitted_samples})")
    if profile.noise is not None:
        print(profile.noise.describe())
    print(f"wrote {out}")
    return 0


def _requests(args: argparse.Namespace, mix: dict[str, float]) -> tuple[SimRequest, ...]:
    if args.rate is not None:
        return poisson_requests(args.rate, args.duration_s or 60.0, mix=mix, prompt_tokens=_pair(args.prompt_tokens),
                                output_tokens=_pair(args.output_tokens), seed=args.seed)
    path = Path(args.trace) if args.trace else default_trace_path()
    requests = trace_requests(path, speedup=args.speedup, rate_scale=args.rate_scale, duration_s=args.duration_s,
                              mix=mix, seed=args.seed)
    print(f"trace: {path.name} ({AZURE_TRACE_CREDIT}), {len(requests)} requests", file=sys.stderr)
    return requests


def _pair(values: tuple[int, ...]) -> tuple[int, int]:
    if len(values) != 2 or values[0] > values[1]:
        raise ValueError(f"expected LOW,HIGH, got {values}")
    return values[0], values[1]


def _mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        tier, _, share = part.partition(":")
        try:
            mix[tier.strip()] = float(share)
        except ValueError:
            raise ValueError(f"--mix: expected TIER:SHARE, got {part!r}") from None
    return mix


@contextmanager
def _progress_bar(requests: tuple[SimRequest, ...], label: str, shown: bool) -> Iterator[Callable[[Harness], None] | None]:
    """A bar over the arrivals' virtual time, as a `before_run` hook that schedules its ticks (every
    1 % of it; they change nothing else, so the records are those of a run without them)."""
    if not shown:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    last_s = max((r.arrival_s for r in requests), default=0.0)
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), TextColumn("{task.percentage:>3.0f}% of arrivals"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(label, total=last_s or 1.0)

        def schedule_ticks(harness: Harness) -> None:
            for index in range(1, 101):
                harness.loop.call_at(last_s * index / 100, lambda: progress.update(task, completed=harness.loop.now_s))

        yield schedule_ticks


def _scaling_summary(run: SimulatedRun) -> str:
    events = run.scaling
    changes = [e for previous, e in zip(events, events[1:]) if e.desired != previous.desired]
    ready = [e.ready for e in events]
    lines = [f"autoscaler: {run.replica_hours:.2f} replica-hours; ready {min(ready)}-{max(ready)}, "
             f"{len(changes)} decisions that changed the fleet"]
    lines += [f"  {e.t_s:8.0f} s  desired {e.desired:>3} (ready {e.ready}, starting {e.starting})  "
              f"{e.layer.value}: {e.reason}" for e in changes[:20]]
    if len(changes) > 20:
        lines.append(f"  ... {len(changes) - 20} more in the report's series")
    return "\n".join(lines)


def _simulate(args: argparse.Namespace) -> int:
    simulation = Simulation(args.config, profile=args.profile, replicas=args.replicas, pool=args.pool)
    mix = _mix(args.mix)
    for tier in mix:
        if tier not in simulation.tiers:
            raise ValueError(f"--mix: unknown tier {tier!r}")
    requests = _requests(args, mix or {simulation.tiers.default.name: 1.0})
    profile, count = simulation.profile, len(simulation.replica_ids)
    print(f"profile {profile.name} ({'estimate' if profile.estimate else 'measured'}), {count} replicas, "
          f"slot limit {simulation.slot_limit}, {len(requests)} requests")
    shown = not args.no_progress and sys.stderr.isatty() and len(requests) >= 10_000
    summary = {"profile": profile.name, "replicas": count, "requests": len(requests), "seed": args.seed, "runs": {}}
    runs: dict[str, SimulatedRun] = {}
    for label, fifo in (("overload control", False), ("FIFO", True))[:2 if args.fifo else 1]:
        scaling = {}
        if args.autoscale:
            scaling = {"autoscaler": simulation.autoscaler(min_replicas=args.min_replicas),
                       "initial_replicas": args.min_replicas}
        with _progress_bar(requests, label, shown) as before_run:
            runs[label] = simulation.run(requests, fifo=fifo, before_run=before_run, noise_seed=args.seed, **scaling)
        print(f"\n{label}\n{format_summary(runs[label].summary)}")
        if runs[label].scaling:
            print(_scaling_summary(runs[label]))
        summary["runs"][label] = asdict(runs[label].summary)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        # the inputs only: where it was written would make two runs' reports differ
        config = {key: value for key, value in sorted(vars(args).items()) if not key.startswith("_") and key != "out"}
        path = simulation.write(runs, out, plots=not args.no_plots, config=config,
                                credits=(AZURE_TRACE_CREDIT,) if args.rate is None else ())
        print(f"\nwrote {path} (the schema of `tidegate bench`; compare with `tidegate report compare`) "
              f"and {out / 'summary.json'}")
    return 0
