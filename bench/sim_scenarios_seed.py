"""FIFO in the simulator at 0.5x, 1x and 2x of capacity: goodput, P99 TTFT, utilisation.

The baseline every overload mechanism is compared with (DESIGN: never do less good work than
FIFO), on virtual time: seeded Poisson arrivals of one chat shape to modelled replicas running the
engine's own scheduler. Two tier settings: the default `standard` tier (a request still queued
after 4 s is refused; TTFT target 5 s) and a patient one that never gives up, where the queue,
and so TTFT, grows without bound past capacity. Runs in about a second. Run:
    python bench/sim_scenarios_seed.py [--replicas 2] [--duration-s 60] [--seed 1]
"""

from __future__ import annotations

import argparse

from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.mix import LengthDistribution
from tidegate.policy.tiers import TierTable, default_tiers
from tidegate.sim.capacity import patient_tiers, saturated_rps
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import Harness, TrafficClass, make_requests
from tidegate.sim.replica import ReplicaSpec
from tidegate.sim.report import summarize

LOADS = (0.5, 1.0, 2.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slot-limit", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    ids = [f"r{i}" for i in range(args.replicas)]
    one_rps = saturated_rps(ReplicaSpec("r0"), args.prompt_tokens, args.output_tokens, args.slot_limit)
    capacity_rps = one_rps * args.replicas
    traffic = [TrafficClass("acme", "standard", 1.0, LengthDistribution("const", args.prompt_tokens),
                            LengthDistribution("const", args.output_tokens))]
    print(f"{args.replicas} replicas x {args.slot_limit} slots, prompt {args.prompt_tokens} / output "
          f"{args.output_tokens} tokens, capacity {capacity_rps:.2f} req/s, {args.duration_s:g} s of Poisson "
          f"arrivals, seed {args.seed}")
    print(f"{'tiers':<8} {'load':>4} {'rate/s':>6} {'arrived':>7} {'served':>6} {'refused':>7} "
          f"{'goodput/s':>9} {'p50 TTFT ms':>11} {'p99 TTFT ms':>11} {'busy':>6}")
    settings: tuple[tuple[str, TierTable], ...] = (("default", default_tiers()), ("patient", patient_tiers()))
    for label, tiers in settings:
        for load in LOADS:
            requests = make_requests(Poisson(load * capacity_rps), args.duration_s, traffic, args.seed)
            dispatcher = FifoDispatcher(ids, tiers, slot_limit=args.slot_limit)
            result = Harness([ReplicaSpec(i) for i in ids], dispatcher).run(requests)
            summary = summarize(result, tiers)
            tier = summary.tier("standard")
            print(f"{label:<8} {load:>3.1f}x {load * capacity_rps:>6.2f} {tier.arrived:>7} {tier.served:>6} "
                  f"{tier.refused:>7} {tier.goodput_rps:>9.2f} {tier.ttft_p50_s * 1000:>11.0f} "
                  f"{tier.ttft_p99_s * 1000:>11.0f} {summary.mean_busy_fraction:>6.1%}")


if __name__ == "__main__":
    main()
