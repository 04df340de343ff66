"""Simulator speed: the Azure conversation trace, rate-scaled to keep N replicas at ~70 % load.

    python bench/sim_speed.py [--replicas 10,100,1000] [--minutes 60] [--profile tiny-random-llama-cpu]

For each pool size, the trace's first `--minutes` (virtual) are replayed at the rate that loads
that many replicas of the profile to 70 % of their capacity on the trace's mean shape, through the
pool controller `tidegate serve` builds, on one core. Prints wall time, simulated requests and
requests/s, engine steps taken and the events they took, and the wall time one simulated hour
would take at that size (measured minutes scaled to 60). Bar (issue: the simulator): one hour at
100 replicas in < 60 s.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tidegate.config import GatewayConfig
from tidegate.loadgen.trace import default_trace_path, load_azure_trace
from tidegate.sim.capacity import saturated_rps
from tidegate.sim.harness import Harness, requests_from_trace
from tidegate.sim.profile import load_profile
from tidegate.simulate import pool_controller

LOAD = 0.7


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="10,100,1000")
    parser.add_argument("--minutes", type=float, default=60.0, help="virtual minutes of the trace to replay")
    parser.add_argument("--max-requests", type=int, default=200_000,
                        help="replay fewer minutes at a size whose replay would pass this many requests")
    parser.add_argument("--profile", default="tiny-random-llama-cpu")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    trace = load_azure_trace(default_trace_path())
    prompt, output = int(np.mean(trace.context_tokens)), int(np.mean(trace.generated_tokens))
    per_replica = saturated_rps(profile.spec("r0"), prompt, output, slot_limit=profile.max_num_seqs)
    trace_rps = len(trace) / (trace.offsets_s[-1] - trace.offsets_s[0])
    print(f"profile {args.profile}: {per_replica:.3f} req/s a replica at the trace's mean shape ({prompt} prompt, "
          f"{output} output tokens); trace {trace_rps:.2f} req/s; load {LOAD:.0%}")
    ok = True
    for count in (int(c) for c in args.replicas.split(",")):
        rate = LOAD * count * per_replica
        minutes = min(args.minutes, args.max_requests / rate / 60.0)
        scaled = trace.scaled(np.random.default_rng(0), rate_scale=rate / trace_rps)
        requests = [r for r in requests_from_trace(scaled) if r.arrival_s < minutes * 60.0]
        config = GatewayConfig.model_validate({"pools": [{"name": "sim", "backends": [
            {"type": "embedded", "model": "m", "count": min(count, 64), "slot_limit": profile.max_num_seqs}]}]})
        ids = [f"r{i}" for i in range(count)]
        controller, _ = pool_controller(config, None, ids)
        harness = Harness([profile.spec(i) for i in ids], controller)
        started = time.process_time()
        result = harness.run(requests)
        cpu_s = time.process_time() - started
        steps = sum(r.steps for r in result.replicas)
        served = sum(1 for r in result.records if r.served)
        hour_s = cpu_s * 60.0 / minutes
        verdict = ""
        if count == 100:
            ok = hour_s < 60.0
            verdict = f"  (bar < 60 s: {'PASS' if ok else 'FAIL'})"
        print(f"{count:>5} replicas: {len(requests):>7} requests in {minutes:.1f} virtual min ({served} served); "
              f"CPU {cpu_s:.1f} s, {len(requests) / cpu_s:,.0f} req/s simulated, {steps:,} engine steps; "
              f"one hour: {hour_s:,.0f} s{verdict}")
        sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
