"""The retry storm live and in the simulator, side by side, and the live engines' steps against the
profile's prediction for each.

    python bench/storm_fidelity.py [--clients 64] [--storm-s 40] [--caching on,off] [--profile P]
        [--baseline-profile Q ...]

Live: `bench/retry_storm.py`'s storm (closed-loop clients that resend at once on a refusal, one
250-byte prompt of `hello`s, 32 tokens answered, tier standard) on two `tidegate engine` replicas
(tiny-random-llama, one thread each, every step logged), behind the FIFO gateway and behind tidegate.
`--caching off` starts the engines with `--no-prefix-caching`: the storm sends one prompt again and
again, which an engine with prefix caching computes once.
Simulated: the same clients, prompt tokens as the engine counts them (the chat template's included),
answer length and resend behaviour, through the same dispatcher (FIFO, or the controller `tidegate
serve` builds) on two modelled replicas of the profile, the prompt shared by every request when the
live engines cache it; mean of three seeds. Each refusal's round trip takes
`SHARED_CORES_REFUSAL_CPU_S` from the replicas' cores, as in bench/retry_storm_sim.py.
Printed per arm: the cores the engines, the gateways, the clients and other work on the machine
used (other work slows the engines: an arm where it took over 0.1 core is flagged void);
completed within the storm, within the TTFT target, refused, TTFT p50/p99; then
the live steps by kind and decode batch, measured against predicted (the terms of the cost model
that are off show there). Bar (issue: the simulator): completed within 5 %.
`--fit-out P.json` fits a profile on all the steps logged (`tidegate sim calibrate --step-log`).

Run: flock /tmp/tidegate-bench.lock python bench/storm_fidelity.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from overload import gateway_config, start_gateway  # noqa: E402
from overload_measure import EMBEDDED_MODEL, TTFT_TARGET_S, Processes, drain, free_port  # noqa: E402
from retry_storm import PROMPT_TOKENS, TIER, TOKENS, storm  # noqa: E402
from sim_fidelity import _cpu_s  # noqa: E402

from tidegate.loadgen.mix import LengthDistribution  # noqa: E402
from tidegate.sim.fifo import FifoDispatcher  # noqa: E402
from tidegate.sim.harness import ClosedLoopClients, Harness, TrafficClass  # noqa: E402
from tidegate.sim.costfit import logged_step_s, read_step_log  # noqa: E402
from tidegate.sim.profile import ReplicaProfile, load_profile  # noqa: E402
from tidegate.sim.scenarios import SHARED_CORES_REFUSAL_CPU_S  # noqa: E402
from tidegate.simulate import Simulation, pool_controller  # noqa: E402

SEEDS = (1, 2, 3)
ARMS = ("fifo", "tidegate")
# other work on the machine, in cores, past which a live arm is void: it slows the engines' steps
# (a run with unit tests beside it took 0.5-1 core and made every step 1.5-2x slower)
OTHER_WORK_CORES = 0.1


def start_engines(processes: Processes, step_log: Path, caching: bool) -> list[str]:
    upstreams = []
    for _ in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "tidegate", "engine", "--model", EMBEDDED_MODEL, "--threads", "1",
                "--port", str(port), "--step-log", str(step_log)] + ([] if caching else ["--no-prefix-caching"])
        processes.start(argv, f"http://127.0.0.1:{port}/health")
        upstreams.append(f"http://127.0.0.1:{port}/v1")
    return upstreams


def counted_prompt_tokens(upstream: str) -> int:
    """The storm's prompt as the engine counts it (the chat template's tokens too)."""
    prompt = ("hello " * PROMPT_TOKENS)[:PROMPT_TOKENS]
    body = json.dumps({"model": EMBEDDED_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": prompt}]}).encode()
    request = urllib.request.Request(upstream + "/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(json.loads(response.read())["usage"]["prompt_tokens"])


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy so far (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(processes: Processes) -> dict[str, float]:
    """CPU seconds so far: the engines (started first), the gateways, these clients, and everything
    else on the machine (other work there slows the engines: the comparison is void while it runs)."""
    pids = [p.pid for p in processes.started]
    times = os.times()
    used = {"engines": sum(_cpu_s(pid) for pid in pids[:2]), "gateways": sum(_cpu_s(pid) for pid in pids[2:]),
            "clients": times.user + times.system}
    used["other work"] = machine_busy_s() - sum(used.values())
    return used


def live_storm(clients: int, storm_s: float, caching: bool, workdir: Path) -> tuple[int, dict[str, dict]]:
    processes = Processes()
    try:
        upstreams = start_engines(processes, workdir / f"steps-{'on' if caching else 'off'}-{{pid}}.csv", caching)
        gateways = {arm: start_gateway(processes, workdir, arm, gateway_config(free_port(), upstreams, arm == "tidegate",
                                                                               upstream_model=EMBEDDED_MODEL))
                    for arm in ARMS}
        prompt_tokens = counted_prompt_tokens(upstreams[0])
        results = {}
        for arm in ARMS:
            before, started_s = cpu_by_role(processes), time.monotonic()
            measured, busy, tokens_s = asyncio.run(storm(gateways[arm], clients, storm_s, upstreams))
            after, wall_s = cpu_by_role(processes), time.monotonic() - started_s
            cores = {role: (after[role] - before[role]) / wall_s for role in after}
            print(f"  {arm}: cores used: " + ", ".join(f"{role} {used:.2f}" for role, used in cores.items())
                  + f" (of {os.cpu_count()})" + (f"; CONTENDED: other work took {cores['other work']:.2f} cores, "
                                                 "this arm's figures are void" if cores["other work"] > OTHER_WORK_CORES
                                                 else ""), flush=True)
            results[arm] = {"completed": measured.completed, "within": measured.within_target,
                            "refused": measured.refused, "ttfts": measured.ttfts_s, "busy": busy,
                            "tokens_s": tokens_s}
            drain(upstreams, 60.0)
        return prompt_tokens, results
    finally:
        processes.stop_all()  # the engines flush their step logs as they stop


def simulated_storm(profile: ReplicaProfile, clients: int, storm_s: float, prompt_tokens: int,
                    caching: bool) -> dict[str, dict]:
    sim = Simulation(profile=profile, replicas=2)
    traffic = TrafficClass("t1", TIER, 1.0, LengthDistribution("const", prompt_tokens),
                           LengthDistribution("const", TOKENS), shared_prefix_tokens=prompt_tokens if caching else 0)
    target_s = sim.tiers[TIER].ttft_target_s
    results = {}
    for arm in ARMS:
        completed = within = refused = 0
        ttfts: list[float] = []
        busy = []
        for seed in SEEDS:
            dispatcher = (FifoDispatcher(sim.replica_ids, sim.tiers, slot_limit=sim.slot_limit) if arm == "fifo"
                          else pool_controller(sim.config, sim.pool.name, sim.replica_ids)[0])
            harness = Harness([profile.spec(i) for i in sim.replica_ids], dispatcher,
                              refusal_cpu_s=SHARED_CORES_REFUSAL_CPU_S)
            result = harness.run((), clients=ClosedLoopClients(clients, traffic, 0.0, storm_s, resend_s=0.002,
                                                               seed=seed), probes_s=(0.0, storm_s))
            done = [r for r in result.records if r.finish_s is not None and r.finish_s < storm_s]
            completed += len(done)
            within += sum(1 for r in done if r.ttft_s is not None and r.ttft_s <= target_s)
            refused += sum(1 for r in result.records if r.refused_reason is not None)
            ttfts += [r.ttft_s for r in done if r.ttft_s is not None]
            busy.append(result.busy_fraction(0.0, storm_s))
        n = len(SEEDS)
        results[arm] = {"completed": completed / n, "within": within / n, "refused": refused / n, "ttfts": ttfts,
                        "busy": float(np.mean(busy))}
    return results


def side_by_side(live: dict[str, dict], simulated: dict[str, dict]) -> bool:
    ok = True
    print(f"  {'':<9} {'':<22} {'live':>8} {'sim':>8} {'diff':>6}")
    for arm in ARMS:
        a, b = live[arm], simulated[arm]
        for name, key in (("completed", "completed"), (f"within {TTFT_TARGET_S[TIER]:.0f} s target", "within"),
                          ("refused", "refused")):
            diff = (b[key] - a[key]) / max(a[key], 1)
            bar = ""
            if key == "completed":
                bar = f"  +-5 % {'PASS' if abs(diff) <= 0.05 else 'FAIL'}"
                ok &= abs(diff) <= 0.05
            print(f"  {arm:<9} {name:<22} {a[key]:>8.0f} {b[key]:>8.0f} {diff:>+6.0%}{bar}")
        for q in (50, 99):
            live_v = float(np.percentile(a["ttfts"], q)) if a["ttfts"] else float("nan")
            sim_v = float(np.percentile(b["ttfts"], q)) if b["ttfts"] else float("nan")
            print(f"  {arm:<9} {'TTFT p%d ms' % q:<22} {live_v * 1000:>8.0f} {sim_v * 1000:>8.0f} "
                  f"{sim_v / live_v - 1:>+6.0%}")
        print(f"  {arm:<9} {'replicas busy':<22} {100 * a['busy']:>7.0f}% {100 * b['busy']:>7.0f}%")
    return ok


def step_report(paths: list[Path], profile: ReplicaProfile) -> None:
    """The live steps, by kind and decode batch, measured against the profile's prediction."""
    cost = profile.cost
    groups: dict[tuple[str, str], list[float]] = {}
    for path in paths:
        for step in read_step_log(path.read_text().splitlines()):
            decodes = step.decodes
            kind = "decode only" if step.prefill_tokens == 0 else "prefill only" if decodes == 0 else "mixed"
            batch = "0" if decodes == 0 else "1-7" if decodes < 8 else "8-23" if decodes < 24 else "24+"
            for key in ((kind, "all"), (kind, batch)):
                totals = groups.setdefault(key, [0, 0.0, 0.0, 0.0, 0.0])
                totals[0] += 1
                totals[1] += step.step_s
                totals[2] += logged_step_s(cost, step)
                totals[3] += step.prefill_tokens
                totals[4] += step.context_tokens
    print(f"  {'kind':<13} {'decodes':>7} {'steps':>6} {'prefill':>8} {'context':>8} {'measured':>9} "
          f"{'predicted':>9} {'diff':>6}   (means a step: tokens, ms)")
    for (kind, batch), (count, measured, predicted, prefill, context) in sorted(groups.items()):
        print(f"  {kind:<13} {batch:>7} {int(count):>6} {prefill / count:>8.1f} {context / count:>8.0f} "
              f"{1000 * measured / count:>9.1f} {1000 * predicted / count:>9.1f} {measured / predicted - 1:>+6.0%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--storm-s", type=float, default=40.0)
    parser.add_argument("--caching", default="on", help="on, off or on,off: the live engines' prefix caching")
    parser.add_argument("--profile", default="tiny-random-llama-cpu")
    parser.add_argument("--fit-out", help="fit a profile on the steps logged and write it here")
    parser.add_argument("--baseline-profile", action="append", default=[],
                        help="a profile (name or file) simulated beside --profile against the same live storm")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    baselines = [load_profile(name) for name in args.baseline_profile]
    workdir = Path(tempfile.mkdtemp(prefix="tidegate-storm-fidelity-"))
    ok = True
    for mode in args.caching.split(","):
        caching = mode == "on"
        print(f"\n{args.clients} clients, storm {args.storm_s:.0f} s, prefix caching {mode}; "
              f"simulated on {profile.name}, mean of {len(SEEDS)} seeds", flush=True)
        prompt_tokens, live = live_storm(args.clients, args.storm_s, caching, workdir)
        print(f"  prompt: {prompt_tokens} tokens as the engine counts them; {TOKENS} answered")
        ok &= side_by_side(live, simulated_storm(profile, args.clients, args.storm_s, prompt_tokens, caching))
        print("  live engine steps against the profile:")
        step_report(sorted(workdir.glob(f"steps-{mode}-*.csv")), profile)
        for baseline in baselines:  # not a bar: a before and after on the same live storm
            print(f"\n  the same live storm against {baseline.name} ({baseline.cost.describe()}):")
            side_by_side(live, simulated_storm(baseline, args.clients, args.storm_s, prompt_tokens, caching))
            step_report(sorted(workdir.glob(f"steps-{mode}-*.csv")), baseline)
    if args.fit_out:
        from tidegate.calibration import calibrate_from_step_logs
        fitted = calibrate_from_step_logs([str(p) for p in sorted(workdir.glob("steps-*.csv"))], name="storm",
                                          description="bench/storm_fidelity.py's steps",
                                          attention_cost_tokens=profile.attention_cost_tokens)
        Path(args.fit_out).write_text(fitted.to_json())
        print(f"fitted on the storm's steps: {args.fit_out} (held-out error {fitted.fit})")
    print(f"step logs: {workdir}")
    print(f"\nbar: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
