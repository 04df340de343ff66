"""Adaptive slot limit against a simulated replica that is slowed 2x: a policy-level simulation.

The replica's latency rises with the requests it holds: linearly (a batch step costs more per
sequence) up to its knee, then proportionally (requests queue inside the engine). The "best" limit
is the largest number of held requests whose latency meets the target. Offered load saturates the
replica, so it always holds exactly the limit. After `--warm-s` seconds the replica is slowed 2x;
the script prints the limit trace and whether the limit settled within +-25 % of the new best
within 30 s of samples. The live measurement on real engines comes with the gateway.

Run: flock /tmp/tidegate-bench.lock python bench/overload_adaptive_slots_sim.py
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

from tidegate.policy.concurrency import AimdSlotLimit, GradientSlotLimit, SlotLimit, SlotLimitBounds


@dataclass(frozen=True)
class ReplicaModel:
    base_latency_s: float = 0.05
    per_request_s: float = 0.005  # added latency per held request up to the knee
    knee: int = 32  # requests the engine batches at once; beyond, they queue inside it
    slowdown: float = 1.0

    def latency_s(self, held: int) -> float:
        held = max(1, held)
        return self.slowdown * (self.base_latency_s + self.per_request_s * min(held, self.knee)) * max(1.0, held / self.knee)

    def best_limit(self, target_latency_s: float, ceiling: int = 1024) -> int:
        return max((n for n in range(1, ceiling + 1) if self.latency_s(n) <= target_latency_s), default=1)


@dataclass(frozen=True)
class TracePoint:
    time_s: float
    limit: int
    latency_s: float
    best_limit: int


def simulate(limit: SlotLimit, phases: list[tuple[float, ReplicaModel]], target_latency_s: float,
             seed: int = 1, noise: float = 0.1) -> list[TracePoint]:
    """Drives `limit` through phases of (duration_s, replica); one trace point per completion."""
    rng = random.Random(seed)
    now_s, trace = 0.0, []
    for duration_s, replica in phases:
        end_s = now_s + duration_s
        best = replica.best_limit(target_latency_s)
        while now_s < end_s:
            held = limit.limit
            latency = replica.latency_s(held)
            now_s += latency / held  # Little's law: a saturated replica completes held/latency per s
            sample = latency * max(0.1, 1.0 + rng.gauss(0.0, noise))
            limit.on_sample(now_s, sample, held, False)
            trace.append(TracePoint(now_s, limit.limit, sample, best))
    return trace


def settled_within(trace: list[TracePoint], since_s: float, budget_s: float, band: float = 0.25,
                   hold_s: float = 5.0) -> bool:
    """True if over the last `hold_s` of the budget every limit is within `band` of the best."""
    end_s = since_s + budget_s
    tail = [p for p in trace if end_s - hold_s <= p.time_s <= end_s]
    return bool(tail) and all(abs(p.limit - p.best_limit) <= band * p.best_limit for p in tail)


def settle_time_s(trace: list[TracePoint], since_s: float, end_s: float, band: float = 0.25) -> float | None:
    """Seconds after `since_s` from which the limit stays within `band` of the best until `end_s`."""
    entered_s: float | None = None
    for point in trace:
        if since_s <= point.time_s <= end_s:
            inside = abs(point.limit - point.best_limit) <= band * point.best_limit
            entered_s = (entered_s if entered_s is not None else point.time_s) if inside else None
    return None if entered_s is None else entered_s - since_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", choices=("gradient", "aimd"), default="gradient")
    parser.add_argument("--target-ms", type=float, default=300.0)
    parser.add_argument("--warm-s", type=float, default=60.0)
    parser.add_argument("--after-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    target_s = args.target_ms / 1000.0
    bounds = SlotLimitBounds(initial=4, minimum=1, maximum=512)
    limit: SlotLimit = (GradientSlotLimit(target_s, bounds=bounds) if args.algorithm == "gradient"
                        else AimdSlotLimit(target_s, bounds=bounds))
    fast = ReplicaModel()
    slow = replace(fast, slowdown=2.0)
    trace = simulate(limit, [(args.warm_s, fast), (args.after_s, slow)], target_s, seed=args.seed)

    print(f"algorithm={args.algorithm} target={args.target_ms:.0f}ms  best limit: "
          f"{fast.best_limit(target_s)} before, {slow.best_limit(target_s)} after the 2x slowdown at t={args.warm_s:.0f}s")
    print(f"{'t_s':>6} {'limit':>6} {'best':>5} {'p_latency_ms':>12}")
    next_print_s = 0.0
    for point in trace:
        if point.time_s >= next_print_s:
            print(f"{point.time_s:6.1f} {point.limit:6d} {point.best_limit:5d} {point.latency_s * 1000:12.1f}")
            next_print_s += 1.0 if point.time_s >= args.warm_s - 2 else 5.0
    warm_ok = settled_within(trace, 0.0, args.warm_s)
    slow_ok = settled_within(trace, args.warm_s, args.after_s)
    final = trace[-1]
    took_s = settle_time_s(trace, args.warm_s, args.warm_s + args.after_s)
    print("time from the slowdown until the limit stays within +-25 % of the new best: "
          + ("never" if took_s is None else f"{took_s:.1f} s"))
    print(f"settled before slowdown (last 5 s of warm-up within +-25 % of best): {warm_ok}")
    print(f"settled after 2x slowdown (last 5 s of the {args.after_s:.0f} s within +-25 % of best): {slow_ok}; "
          f"final limit {final.limit} vs best {final.best_limit} ({final.limit / final.best_limit:.2f}x)")
    return 0 if warm_ok and slow_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
