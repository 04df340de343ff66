"""Simulator fidelity: the same arrival schedule, live on `tidegate serve` and in the simulator.

    python bench/sim_fidelity.py [--phase-s 120] [--profile tiny-random-llama-cpu]

Live: `tidegate serve` with 2 embedded workers (tiny-random-llama, 1 thread each), overload control
on, default tiers, one anonymous tenant. Its capacity is measured first (a closed loop, 64 in
flight); then Poisson arrivals at 0.5x and 0.8x of it and a 3x surge, `--phase-s` each, chat
requests with prompts of 16-256 bytes (the engine's byte tokenizer: a byte is a token) and 16-64
answered tokens. Simulated: the same requests (their send times, their prompt tokens as the engine
counted them, their answer lengths) through the controller `tidegate serve` builds from the same
config, on 2 modelled replicas of the shipped profile. Printed side by side: P50/P99 TTFT and
end-to-end latency of the requests served, requests completed, requests refused.
Bars (issue: the simulator): latency within 15 %, completed within 5 %, refused within 10 % in the
surge. The live arm shares 2 cores between the workers, the gateway and this load generator; the
profile was measured on one worker alone: the gap between them is part of what this measures, and
each phase prints the cores each of them used, and other work on the machine (a phase where it
took over 0.1 core is flagged void: it slows the engines). `--out DIR` writes each phase's live and simulated
reports (the schema of `tidegate bench`) and their comparison (`tidegate report compare`).
`--baseline-profile P` simulates P beside the shipped profile on the same requests; `--keep DIR`
keeps the live run (its requests, the engines' step logs, the in-situ profile), and `--replay DIR
--profile P` simulates it again on other profiles without a live run: a profile's before and after
on one live run. On a profile with step noise (`sim.step_noise`) the simulated arms draw seed 0;
`--noise-seeds N` also prints each phase over N seeds against the profile's mean alone (mean and
range of the seeds, and how many are within each bar): one live run is one draw of its tail too.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from overload_measure import Processes, free_port  # noqa: E402

from tidegate.config import GatewayConfig  # noqa: E402
from tidegate.loadgen.arrivals import Poisson  # noqa: E402
from tidegate.loadgen.driver import Driver, RunConfig  # noqa: E402
from tidegate.loadgen.http_client import parse_url  # noqa: E402
from tidegate.loadgen.mix import DEFAULT_TENANT, LengthDistribution  # noqa: E402
from tidegate.loadgen.plan import TrafficStream, build_plan  # noqa: E402
from tidegate.loadgen.records import RequestRecord  # noqa: E402
from tidegate.loadgen.stats import Slo  # noqa: E402
from tidegate.sim.harness import Harness  # noqa: E402
from tidegate.sim.harness import RequestRecord as SimRecord  # noqa: E402
from tidegate.sim.harness import RunResult as SimRunResult  # noqa: E402
from tidegate.calibration import calibrate_from_step_logs  # noqa: E402
from tidegate.sim.costfit import logged_step_s, read_step_log  # noqa: E402
from tidegate.sim.profile import ReplicaProfile, load_profile  # noqa: E402
from tidegate.sim.seam import SimRequest  # noqa: E402
from tidegate.simulate import pool_controller  # noqa: E402

MODEL = "tiny-random-llama"
PROMPT = LengthDistribution("uniform", 16, 256)
ANSWER = LengthDistribution("uniform", 16, 64)
CAPACITY_IN_FLIGHT = 64


def serve_config(port: int, step_log: Path) -> dict:
    return {"server": {"port": port, "access_log": False},
            "pools": [{"name": MODEL, "backends": [{"type": "embedded", "model": MODEL, "count": 2, "threads": 1,
                                                     "engine_args": ["--step-log", str(step_log)]}]}]}


def step_report(paths: list[Path], profile_name: str) -> None:
    """The live engines' own steps against what the shipped profile predicts for each, by kind."""
    cost = load_profile(profile_name).cost
    kinds: dict[str, list[float]] = {}
    for path in paths:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        for step in read_step_log(text.splitlines()):
            kind = "decode only" if step.prefill_tokens == 0 else "prefill only" if step.decodes == 0 else "mixed"
            kinds.setdefault(kind, [0.0, 0.0, 0.0])
            totals = kinds[kind]
            totals[0] += 1
            totals[1] += step.step_s
            totals[2] += logged_step_s(cost, step)
    print(f"\nlive engine steps against {profile_name}'s prediction for each:")
    for kind, (count, measured_s, predicted_s) in sorted(kinds.items()):
        print(f"  {kind:<13} {int(count):>6} steps  measured {measured_s:7.1f} s  predicted {predicted_s:7.1f} s  "
              f"({measured_s / predicted_s - 1:+.0%})")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


# other work on the machine, in cores, past which a live phase is void: it slows the engines' steps
# (bench/storm_fidelity.py's rule: a run with unit tests beside it took 0.5-1 core, every step 1.5-2x slower)
OTHER_WORK_CORES = 0.1


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy so far (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(gateway_pid: int) -> dict[str, float]:
    """CPU seconds so far of the engine workers (the gateway's children), the gateway, this generator,
    and everything else on the machine (other work there slows the engines: the phase is void while it runs)."""
    times = os.times()
    used = {"engines": sum(_cpu_s(child) for child in _children(gateway_pid)), "gateway": _cpu_s(gateway_pid),
            "load generator": times.user + times.system}
    used["other work"] = machine_busy_s() - sum(used.values())
    return used


def print_cores(before: dict[str, float], after: dict[str, float], wall_s: float) -> None:
    used = {role: (after[role] - before[role]) / wall_s for role in after}
    print("  cores used: " + ", ".join(f"{role} {cores:.2f}" for role, cores in used.items())
          + f" (of {os.cpu_count()}; the model's replicas have theirs to themselves)"
          + (f"; CONTENDED: other work took {used['other work']:.2f} cores, this phase's figures are void"
             if used["other work"] > OTHER_WORK_CORES else ""), flush=True)


async def live(url: str, rate: float | None, duration_s: float, seed: int) -> list[RequestRecord]:
    return (await live_run(url, rate, duration_s, seed)).records


# a phase's requests are numbered from here on (seed x this): the load generator puts a request's
# number at the head of its prompt, so that no prompt shares a cached prefix with another one. The
# plans of the phases each number theirs from 0, and the engines' prefix caches served request
# 17 of one phase from the blocks request 17 of the phase before had left (the same number, the
# same filler text after it, up to the shorter prompt; 7-13 % of a run's prompt tokens were never
# computed). The simulator replays each phase alone on fresh replicas, so it computed them all:
# on a profile fitted on the same run's steps its TTFT P50 at 0.5x came out 35 % over live
# (prompts of two chunks 18-25 %, of one chunk alike); numbered apart, -6 %
PHASE_NUMBERS = 1_000_000


async def live_run(url: str, rate: float | None, duration_s: float, seed: int):
    """Open loop at `rate`, or a closed loop of CAPACITY_IN_FLIGHT when None."""
    plan = build_plan([TrafficStream(Poisson(rate or 1000.0), (DEFAULT_TENANT,), PROMPT, ANSWER)],
                      np.random.default_rng(seed), duration_s=duration_s if rate else duration_s * 3)
    plan = [replace(request, index=request.index + seed * PHASE_NUMBERS) for request in plan]
    config = RunConfig(targets=(parse_url(url),), model=MODEL, stream=True, timeout_s=60.0, ignore_eos=True,
                       concurrency=None if rate else CAPACITY_IN_FLIGHT, duration_s=None if rate else duration_s)
    return await Driver(config, plan).run()


def simulate(records: list[RequestRecord], profile: ReplicaProfile, config: GatewayConfig,
             noise_seed: int = 0) -> list[SimRecord]:
    return list(simulate_run(records, profile, config, noise_seed).records)


def simulate_run(records: list[RequestRecord], profile: ReplicaProfile, config: GatewayConfig,
                 noise_seed: int = 0) -> SimRunResult:
    """The live run's requests, as sent, through the same controller on modelled replicas."""
    counted = [r for r in records if r.prompt_tokens]
    # a refused request's prompt was never counted by the engine: the served ones' ratio to the target
    extra = int(np.median([r.prompt_tokens - r.target_prompt_tokens for r in counted])) if counted else 0
    requests = [SimRequest(i, r.sent_s, "default", r.tier or "standard",
                           r.prompt_tokens or r.target_prompt_tokens + extra, r.max_tokens)
                for i, r in enumerate(sorted(records, key=lambda r: r.sent_s))]
    ids = ["r0", "r1"]
    controller, _ = pool_controller(config, None, ids)
    return Harness([profile.spec(i, noise_seed) for i in ids], controller).run(requests)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _latencies(records: list[RequestRecord], simulated: list[list[SimRecord]]) -> list[tuple[str, list[float]]]:
    live_ok = [r for r in records if r.ok]
    rows = []
    for name, q in (("TTFT p50 ms", 50), ("TTFT p99 ms", 99), ("E2E p50 ms", 50), ("E2E p99 ms", 99)):
        ttft = name.startswith("TTFT")
        values = [_pct([r.ttft_s if ttft else r.e2e_s for r in live_ok], q)]
        for run in simulated:
            values.append(_pct([r.ttft_s if ttft else r.finish_s - r.arrival_s for r in run if r.served], q))
        rows.append((name, values))
    return rows


def compare(label: str, records: list[RequestRecord], simulated: list[list[SimRecord]], surge: bool,
            names: tuple[str, ...] = ("shipped", "in situ")) -> bool:
    """Live against each simulated arm (named by `names`); the bars hold the first (the shipped profile's)."""
    ok = True
    print(f"\n{label}: {len(records)} requests")
    print(f"  {'':<12} {'live':>7} {names[0]:>8} {'diff':>6}  {'bar':<10}" + "".join(f" {n:>8} {'diff':>6}" for n in names[1:]))
    for name, (live_v, *sims) in _latencies(records, simulated):
        diffs = [sim_v / live_v - 1.0 for sim_v in sims]
        ok &= abs(diffs[0]) <= 0.15
        print(f"  {name:<12} {live_v * 1000:>7.0f} {sims[0] * 1000:>8.0f} {diffs[0]:>+6.0%}  "
              f"{'+-15% ' + ('PASS' if abs(diffs[0]) <= 0.15 else 'FAIL'):<10}"
              + "".join(f" {v * 1000:>8.0f} {d:>+6.0%}" for v, d in zip(sims[1:], diffs[1:])))
    live_refused = sum(1 for r in records if r.status in (429, 503))
    for name, live_n, sims_n, bar in (
            ("completed", sum(1 for r in records if r.ok), [sum(1 for r in run if r.served) for run in simulated], 0.05),
            ("refused", live_refused, [sum(1 for r in run if r.refused_reason is not None) for run in simulated],
             0.10 if surge else None)):
        diffs = [(n - live_n) / max(live_n, 1) for n in sims_n]
        verdict = "" if bar is None else f"+-{bar:.0%} {'PASS' if abs(diffs[0]) <= bar else 'FAIL'}"
        ok &= bar is None or abs(diffs[0]) <= bar
        print(f"  {name:<12} {live_n:>7d} {sims_n[0]:>8d} {diffs[0]:>+6.0%}  {verdict:<10}"
              + "".join(f" {n:>8d} {d:>+6.0%}" for n, d in zip(sims_n[1:], diffs[1:])))
    others = sum(1 for r in records if not r.ok and r.status not in (429, 503))
    if others:
        print(f"  live requests failed otherwise (timeouts, errors): {others}")
    return ok


def write_reports(out: Path, result, simulated: SimRunResult, config: GatewayConfig) -> None:
    """The phase live and simulated, each as a `tidegate bench` report, and their comparison."""
    from tidegate.loadgen.report import build_report, write_report
    from tidegate.loadgen.report_cli import compare_rows
    from tidegate.loadgen.stats import tier_slos
    from tidegate.sim_report import sim_report

    tiers = config.overload.tiers.table()
    live_report = build_report(result, config={"fidelity": "live"}, slo=Slo(), targets=1, lag_threshold_ms=10.0,
                               tier_slos=tier_slos(tiers), target_names=["live"])
    write_report(live_report, result, out / "live")
    sim, sim_result = sim_report({"simulated": simulated}, tiers, pool=MODEL, config={"fidelity": "simulated"})
    write_report(sim, sim_result, out / "sim")
    rows = compare_rows(live_report, sim)
    (out / "compare.json").write_text(json.dumps(rows, indent=1))
    print(f"  reports: {out}/live, {out}/sim (tidegate report compare {out}/live/report.json {out}/sim/report.json)")


PHASES = (("0.5x capacity", 0.5), ("0.8x capacity", 0.8), ("3x surge", 3.0))


def simulated_side(done: list[RequestRecord], span: float, phases: list[tuple[str, float, list[RequestRecord]]],
                   profiles: list[ReplicaProfile], config: GatewayConfig) -> bool:
    """The live run's requests on each profile (the first one's bars count), phase by phase."""
    for profile in profiles:
        sim_closed = simulate(done, profile, config)
        sim_span = max(r.finish_s for r in sim_closed if r.served) - min(r.arrival_s for r in sim_closed)
        print(f"  the same requests on {profile.name}: {sim_span:.1f} s against {span:.1f} s live "
              f"({span / sim_span - 1:+.0%} faster modelled)")
    ok = True
    for label, rate, records in phases:
        simulated = [simulate(records, profile, config) for profile in profiles]
        ok &= compare(f"{label} ({rate:.1f} req/s)", records, simulated, surge="surge" in label,
                      names=("shipped", *(p.name for p in profiles[1:])))
    return ok


def noise_spread(phases: list[tuple[str, float, list[RequestRecord]]], profile: ReplicaProfile,
                 config: GatewayConfig, seeds: int) -> None:
    """Each phase on `profile` without its step noise (every step its mean) and with it, seed by
    seed: the noise's figures as their mean and range over the seeds, each against live."""
    assert profile.noise is not None
    mean_only = replace(profile, noise=None)
    print(f"\nstep noise ({profile.noise.describe()}) against the mean only, {seeds} seeds: "
          "figure, live, mean only (diff), with noise: mean of the seeds (diff) [range of the diffs], "
          "seeds within the bar")
    for label, rate, records in phases:
        runs = [simulate(records, mean_only, config)]
        runs += [simulate(records, profile, config, seed) for seed in range(seeds)]
        print(f"{label} ({rate:.1f} req/s): {len(records)} requests")
        rows = [(name, [v for v in values]) for name, values in _latencies(records, runs)]
        rows.append(("completed", [float(sum(1 for r in records if r.ok))]
                     + [float(sum(1 for r in run if r.served)) for run in runs]))
        rows.append(("refused", [float(sum(1 for r in records if r.status in (429, 503)))]
                     + [float(sum(1 for r in run if r.refused_reason is not None)) for run in runs]))
        for name, (live_v, flat, *noisy) in rows:
            scale = 1000.0 if "ms" in name else 1.0
            diffs = [v / live_v - 1.0 if live_v else 0.0 for v in noisy]
            flat_diff = flat / live_v - 1.0 if live_v else 0.0
            bar = 0.15 if "ms" in name else 0.05 if name == "completed" else 0.10 if "surge" in label else None
            within = "" if bar is None else f" {sum(abs(d) <= bar for d in diffs)}/{len(diffs)} within +-{bar:.0%}"
            print(f"  {name:<12} {live_v * scale:>7.0f} {flat * scale:>8.0f} {flat_diff:>+6.0%}   "
                  f"{np.mean(noisy) * scale:>8.0f} {np.mean(noisy) / live_v - 1.0 if live_v else 0.0:>+6.0%} "
                  f"[{min(diffs):+.0%}..{max(diffs):+.0%}]{within}")


def replay(args: argparse.Namespace) -> int:
    """`--keep`'s live run again, simulated on the profiles given now (live figures as they were)."""
    kept = Path(args.replay)
    saved = pickle.loads((kept / "live.pkl").read_bytes())
    config = GatewayConfig.model_validate(saved["config"])
    profiles = [load_profile(args.profile), load_profile(kept / "in-situ.json"),
                *(load_profile(p) for p in args.baseline_profile)]
    print(f"replay of {kept}: live capacity {saved['capacity']:.2f} req/s; profile {args.profile}")
    ok = simulated_side(saved["done"], saved["span"], saved["phases"], profiles, config)
    if args.noise_seeds and profiles[0].noise is not None:
        noise_spread(saved["phases"], profiles[0], config, args.noise_seeds)
    step_report(sorted(kept.glob("steps-*.csv")), args.profile)
    print(f"\nall bars: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


async def main_async(args: argparse.Namespace) -> int:
    processes = Processes()
    try:
        port = free_port()
        workdir = Path(tempfile.mkdtemp(prefix="tidegate-fidelity-"))
        config_dict = serve_config(port, workdir / "steps-{pid}.csv")
        (workdir / "serve.yaml").write_text(yaml.safe_dump(config_dict))
        processes.start([sys.executable, "-m", "tidegate", "serve", "--config", str(workdir / "serve.yaml"),
                         "--no-access-log", "--log-level", "warning"], f"http://127.0.0.1:{port}/ready")
        config = GatewayConfig.model_validate(config_dict)
        url = f"http://127.0.0.1:{port}"
        print(f"live: tidegate serve, 2 x embedded {MODEL} (1 thread); cores: {os.cpu_count()}; "
              f"profile {args.profile}; phases {args.phase_s:.0f} s")
        await live(url, 4.0, 10.0, seed=1)  # warm-up: the controller measures its first tokens
        closed = await live(url, None, args.capacity_s, seed=2)
        done = [r for r in closed if r.ok]
        span = max(r.sent_s + r.e2e_s for r in done) - min(r.sent_s for r in done)
        capacity = len(done) / span
        shipped = load_profile(args.profile)
        # earlier profiles, simulated on the same live requests: a new profile's before and after
        baselines = [load_profile(p) for p in args.baseline_profile]
        # in situ: a profile fitted on the steps the two workers logged so far (warm-up and capacity)
        in_situ = calibrate_from_step_logs([str(p) for p in sorted(workdir.glob("steps-*.csv"))], name="in-situ",
                                           description="this run's capacity phase",
                                           attention_cost_tokens=shipped.attention_cost_tokens)
        print(f"capacity: live {capacity:.2f} req/s (closed loop, {CAPACITY_IN_FLIGHT} in flight)")
        fit = in_situ.fit
        assert fit is not None
        print(f"  in-situ profile: {in_situ.cost.describe()}; "
              f"held-out shapes {fit.held_out_samples}, error mean {fit.held_out_mean:.1%} max {fit.held_out_max:.1%}")
        phases = []
        gateway_pid = processes.started[0].pid
        for index, (label, load) in enumerate(PHASES):
            cpu_before = cpu_by_role(gateway_pid)
            result = await live_run(url, load * capacity, args.phase_s, seed=10 + index)
            print_cores(cpu_before, cpu_by_role(gateway_pid), result.elapsed_s)
            phases.append((label, load * capacity, result.records))
            if args.out:
                write_reports(Path(args.out) / f"{index}-{label.split()[0]}", result,
                              simulate_run(result.records, shipped, config), config)
            await asyncio.sleep(5.0)  # let the surge's queue drain before the next phase
        processes.stop_all()  # the engines flush their step logs as they stop
        ok = simulated_side(done, span, phases, [shipped, in_situ, *baselines], config)
        if args.noise_seeds and shipped.noise is not None:
            noise_spread(phases, shipped, config, args.noise_seeds)
        step_report(sorted(workdir.glob("steps-*.csv")), args.profile)
        if args.keep:
            kept = Path(args.keep)
            kept.mkdir(parents=True, exist_ok=True)
            (kept / "live.pkl").write_bytes(pickle.dumps({"config": config_dict, "capacity": capacity, "span": span,
                                                          "done": done, "phases": phases}))
            (kept / "in-situ.json").write_text(in_situ.to_json())
            for log in workdir.glob("steps-*.csv"):
                shutil.copy(log, kept / log.name)
            print(f"kept: {kept} (python bench/sim_fidelity.py --replay {kept} --profile P)")
        print(f"\nall bars: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    finally:
        processes.stop_all()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=120.0)
    parser.add_argument("--capacity-s", type=float, default=30.0)
    parser.add_argument("--profile", default="tiny-random-llama-cpu")
    parser.add_argument("--out", help="a directory for each phase's live and simulated reports")
    parser.add_argument("--baseline-profile", action="append", default=[],
                        help="a profile (name or file) simulated beside the shipped one on the same live requests")
    parser.add_argument("--keep", help="a directory to keep the live run in (requests, step logs, in-situ profile)")
    parser.add_argument("--replay", help="no live run: simulate a kept one again on the profiles given")
    parser.add_argument("--noise-seeds", type=int, default=0,
                        help="on a profile with step noise: each phase with and without the noise, over this many "
                             "seeds (the bars above are judged on seed 0)")
    args = parser.parse_args()
    return replay(args) if args.replay else asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
