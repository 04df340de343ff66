"""Autoscaling policies side by side in the simulator, on the same traffic and the same profile.

    python bench/autoscale_sim.py [--profile llama-3-8b-h100-80gb] [--cold-start-s 60] [--only surge]

Scenarios (the seeds'), at 1/100 of their rates so that an hour simulates in seconds:
  surge  10 min at 30 req/s, a ramp to 120 req/s within 15 min (the seeds' 3,000 -> 12,000), 15 min
         at 120 req/s;
  trace  the Azure conversation trace, one hour, rate-scaled x10 (~54 req/s, bursty).
Policies: tidegate (`policy.autoscale.Autoscaler`: reactive + triggers + panic + Holt-Winters
predictive), an HPA-default rule (`HpaRule`: 15 s sync, 10 % tolerance, 300 s scale-down window),
static provisioning for twice the peak, and an oracle (the tidegate autoscaler whose forecaster
knows the true future rate). Each run: a pool of up to `--max-replicas` modelled replicas of the
profile behind the pool controller, `--slots` requests per replica.
Printed per policy: success (served / arrived), P99 TTFT, replica-hours and their ratio to the
oracle's, slot utilisation at the peak, the first scale-out after the surge starts, and
oscillations (a scale-in followed by a scale-out within the 300 s window).
Bars (issue: elastic capacity): success >= 99.5 %, P99 TTFT <= 800 ms, replica-hours <= 1.15x
the oracle's, utilisation >= 80 % at peak, scale-out decided <= 10 s after the surge starts, no
oscillation. Not yet here: the working-day scenario, warm standby, a 300 s cold start table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from tidegate.loadgen.arrivals import Poisson, Ramp
from tidegate.loadgen.mix import LengthDistribution
from tidegate.policy.autoscale import AutoscaleSettings, Autoscaler, FixedFleet, HpaRule, ScalePolicy
from tidegate.policy.forecast import HoltWinters
from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.tiers import default_tiers
from tidegate.sim.capacity import saturated_rps
from tidegate.sim.harness import Harness, TrafficClass, make_requests
from tidegate.sim.profile import load_profile
from tidegate.sim.scaling import ScalingLoop, oscillations
from tidegate.sim.seam import SimRequest
from tidegate.simulate import trace_requests

BUCKET_S = 60.0


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: tuple[SimRequest, ...]
    rate_at: object  # t_s -> the true arrival rate (req/s), for the oracle
    surge_start_s: float | None
    peak: tuple[float, float]  # the window whose utilisation is judged


def surge() -> Scenario:
    chat = TrafficClass("app", "standard", 1.0, LengthDistribution("uniform", 64, 1024),
                        LengthDistribution("uniform", 32, 256))
    phases = [(Poisson(30.0), 600.0), (Ramp(30.0, 120.0, 900.0), 900.0), (Poisson(120.0), 900.0)]
    requests: list[SimRequest] = []
    offset = 0.0
    for index, (process, length_s) in enumerate(phases):
        for r in make_requests(process, length_s, [chat], seed=40 + index):
            requests.append(SimRequest(len(requests), r.arrival_s + offset, r.tenant, r.tier, r.prompt_tokens,
                                       r.output_tokens))
        offset += length_s

    def rate_at(t_s: float) -> float:
        return 30.0 if t_s < 600 else 30.0 + 90.0 * min(1.0, (t_s - 600) / 900) if t_s < 1500 else 120.0

    return Scenario("surge", tuple(requests), rate_at, 600.0, (1800.0, 2400.0))


def trace() -> Scenario:
    requests = trace_requests(rate_scale=10.0, seed=3)
    arrivals = np.asarray([r.arrival_s for r in requests])
    counts = np.bincount((arrivals // BUCKET_S).astype(int))

    def rate_at(t_s: float) -> float:
        index = int(t_s // BUCKET_S)
        return float(counts[index]) / BUCKET_S if 0 <= index < len(counts) else 0.0

    busiest = int(np.argmax(np.convolve(counts, np.ones(10), mode="valid")))
    return Scenario("trace", requests, rate_at, None, (busiest * BUCKET_S, (busiest + 10) * BUCKET_S))


class Oracle:
    """A forecaster that knows the scenario's true rate."""

    def __init__(self, rate_at) -> None:
        self.rate_at = rate_at

    def observe(self, t_s: float, value: float) -> None:
        pass

    def forecast(self, t_s: float) -> float | None:
        return self.rate_at(t_s)


def run(scenario: Scenario, policy: ScalePolicy, args, initial: int) -> dict:
    profile = load_profile(args.profile)
    ids = [f"r{i}" for i in range(args.max_replicas)]
    specs = [replace(profile.spec(i), cold_start_s=args.cold_start_s) for i in ids]
    controller = PoolController([PoolReplica(i, args.slots, args.slots // 4) for i in ids], default_tiers(),
                                PoolSettings())
    harness = Harness(specs, controller)
    loop = ScalingLoop(harness, policy, period_s=1.0)
    last_s = max(r.arrival_s for r in scenario.requests)
    loop.install(last_s, initial)
    started = time.process_time()
    result = harness.run(scenario.requests)
    cpu_s = time.process_time() - started
    served = [r for r in result.records if r.served]
    ttfts = [r.ttft_s for r in served]
    start, end = scenario.peak
    peak_events = [e for e in loop.events if start <= e.t_s < end]
    peak_ready = np.mean([e.ready for e in peak_events]) if peak_events else float("nan")
    peak_arrivals = sum(1 for r in result.records if start <= r.arrival_s < end)
    peak_demand = sum(r.finish_s - r.dispatch_s for r in served if start <= r.arrival_s < end) / (end - start)
    first_out = None
    if scenario.surge_start_s is not None:
        first_out = next((e.t_s - scenario.surge_start_s for e in loop.events
                          if e.t_s >= scenario.surge_start_s and e.desired > initial_fleet(loop, scenario)), None)
    return {"success": len(served) / len(result.records), "p99_ttft_s": float(np.percentile(ttfts, 99)),
            "replica_hours": loop.replica_hours, "peak_ready": peak_ready,
            "peak_utilisation": peak_demand / (peak_ready * args.slots) if peak_ready else float("nan"),
            "peak_rps": peak_arrivals / (end - start), "first_out_s": first_out,
            "oscillations": oscillations(loop.events, 300.0), "max_ready": max(e.ready for e in loop.events),
            "cpu_s": cpu_s}


def initial_fleet(loop: ScalingLoop, scenario: Scenario) -> int:
    before = [e for e in loop.events if e.t_s < (scenario.surge_start_s or 0.0)]
    return before[-1].ready + before[-1].starting if before else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="llama-3-8b-h100-80gb")
    parser.add_argument("--cold-start-s", type=float, default=60.0)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--max-replicas", type=int, default=16)
    parser.add_argument("--only", choices=["surge", "trace"])
    args = parser.parse_args()
    profile = load_profile(args.profile)
    capacity = saturated_rps(profile.spec("probe"), 544, 144, args.slots, requests=600)
    print(f"profile {args.profile} ({'estimate' if profile.estimate else 'measured'}): {capacity:.1f} req/s per "
          f"replica at {args.slots} slots (chat 544/144 tokens); cold start {args.cold_start_s:g} s")
    ok = True
    for scenario in (surge(), trace()):
        if args.only and scenario.name != args.only:
            continue
        peak_rate = max(scenario.rate_at(t) for t in np.arange(0, max(r.arrival_s for r in scenario.requests), 10))
        static = min(args.max_replicas, math.ceil(2 * peak_rate / capacity))
        first_rate = scenario.rate_at(0.0)
        initial = max(1, math.ceil(first_rate / (capacity * 0.7)))
        settings = AutoscaleSettings(args.slots, min_replicas=1, max_replicas=args.max_replicas,
                                     cold_start_s=args.cold_start_s, forecast_bucket_s=BUCKET_S)
        policies: dict[str, ScalePolicy] = {
            "tidegate": Autoscaler(settings, HoltWinters(BUCKET_S, BUCKET_S * 1)),
            "HPA default": HpaRule(settings),
            "static 2x peak": FixedFleet(static),
            "oracle": Autoscaler(settings, Oracle(scenario.rate_at)),
        }
        print(f"\n{scenario.name}: {len(scenario.requests)} requests, peak {peak_rate:.0f} req/s; "
              f"start with {initial} replicas (static: {static})")
        print(f"  {'policy':<15} {'success':>8} {'P99 TTFT':>9} {'rep-hours':>9} {'vs oracle':>9} {'peak ready':>10} "
              f"{'peak util':>9} {'first out':>9} {'flaps':>5} {'cpu s':>6}")
        rows = {}
        for name, policy in policies.items():
            fleet = static if isinstance(policy, FixedFleet) else initial
            rows[name] = run(scenario, policy, args, fleet)
        oracle_hours = rows["oracle"]["replica_hours"]
        for name, row in rows.items():
            first = "-" if row["first_out_s"] is None else f"{row['first_out_s']:.0f} s"
            print(f"  {name:<15} {row['success']:>8.2%} {row['p99_ttft_s'] * 1000:>7.0f}ms {row['replica_hours']:>9.2f} "
                  f"{row['replica_hours'] / oracle_hours:>8.2f}x {row['peak_ready']:>10.1f} "
                  f"{row['peak_utilisation']:>9.0%} {first:>9} {row['oscillations']:>5d} {row['cpu_s']:>6.1f}")
        ours = rows["tidegate"]
        bars = [("success >= 99.5 %", ours["success"] >= 0.995), ("P99 TTFT <= 800 ms", ours["p99_ttft_s"] <= 0.8),
                ("replica-hours <= 1.15x oracle", ours["replica_hours"] <= 1.15 * oracle_hours),
                ("utilisation >= 80 % at peak", ours["peak_utilisation"] >= 0.8),
                ("no oscillation", ours["oscillations"] == 0)]
        if scenario.surge_start_s is not None:
            bars.append(("scale-out decided <= 10 s after the surge starts",
                         ours["first_out_s"] is not None and ours["first_out_s"] <= 10.0))
        for bar, passed in bars:
            print(f"  {'PASS' if passed else 'FAIL'}  tidegate: {bar}")
            ok &= passed
    print(f"\nall bars: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
