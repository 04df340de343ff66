"""Outlier detection in a fleet failing alike, measured on the breaker policy alone (no processes).

    python bench/outlier_alike.py [--trials 200] [--outcomes 200]

A trial: five replicas, each given `--outcomes` request outcomes in turn (a failure at its share, drawn
with the trial's seed), each failure judged by `Breaker.on_failure` against the median failure ratio
of the other four, with the pool's ejection cap (`max_ejected_fraction`), exactly as the pool
controller calls it. An ejected replica gets no more outcomes. Printed per rule set and fleet:
trials in which at least one replica was ejected, and the share of replica-outcomes lost to
ejections (capacity given away). Fleets:
- alike 30 % / alike 10 %: every replica fails that share (an overloaded fleet, a bad request
  pattern): no replica is an outlier, every ejection is a false one;
- one 30 % among healthy / among 2 %: the outlier must still be ejected, the others never;
- one 60 % among 30 %: an outlier in a failing fleet.
Rule sets: the success-rate rule alone (consecutive threshold out of reach), before
(`ratio_confidence` 0) and after (the default); both rules, before (`run_chance` 1: always
`failure_threshold` in a row) and after.
"""
from __future__ import annotations

import argparse
import random

from tidegate.policy.health import CLOSED_BREAKER, BreakerPolicy, BreakerState, median

FLEETS = {
    "alike 30 %": (0.3,) * 5,
    "alike 10 %": (0.1,) * 5,
    "one 30 % among healthy": (0.3, 0.0, 0.0, 0.0, 0.0),
    "one 30 % among 2 %": (0.3, 0.02, 0.02, 0.02, 0.02),
    "one 60 % among 30 %": (0.6, 0.3, 0.3, 0.3, 0.3),
}


def trial(policy: BreakerPolicy, shares: tuple[float, ...], outcomes_each: int, seed: int) -> tuple[list, int]:
    """(the reason each replica was first ejected for, or None; replica-outcomes lost to ejections)."""
    rng = random.Random(seed)
    count = len(shares)
    breakers = [CLOSED_BREAKER] * count
    first_reason: list = [None] * count
    lost = 0
    cap = max(1, int(count * policy.max_ejected_fraction))
    for _ in range(outcomes_each):
        for index in range(count):
            breaker = breakers[index]
            if breaker.state is not BreakerState.CLOSED:
                lost += 1  # ejected for good here: no probe brings it back within a trial
                continue
            if rng.random() < shares[index]:
                ejected = sum(1 for other in breakers if other.state is not BreakerState.CLOSED)
                pool = median([other.failure_ratio for j, other in enumerate(breakers) if j != index])
                breaker = breaker.on_failure(0.0, 0.0, policy, ejected < cap, pool)
                if breaker.state is BreakerState.OPEN and first_reason[index] is None:
                    first_reason[index] = breaker.reason.value
            else:
                breaker = breaker.on_success(0.0, 0.0, policy)
            breakers[index] = breaker
    return first_reason, lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--outcomes", type=int, default=200, help="request outcomes per replica per trial")
    args = parser.parse_args()
    default = BreakerPolicy()
    rule_sets = {
        "ratio rule, ratio_confidence 0 (before)": BreakerPolicy(failure_threshold=10**9, ratio_confidence=0.0),
        f"ratio rule, ratio_confidence {default.ratio_confidence:g} (default)": BreakerPolicy(failure_threshold=10**9),
        f"both rules (consecutive {default.failure_threshold} + ratio), before": BreakerPolicy(ratio_confidence=0.0,
                                                                                           run_chance=1.0),
        "both rules, run_chance 1e-3": BreakerPolicy(run_chance=1e-3),
        f"both rules, run_chance {default.run_chance:g} (default)": default,
    }
    print(f"{args.trials} trials of 5 replicas x {args.outcomes} outcomes; ejection cap "
          f"{default.max_ejected_fraction:g}; failure_ratio {default.failure_ratio:g}, window {default.ratio_window}")
    for name, policy in rule_sets.items():
        print(f"\n{name}: margin over the pool's ratio at 0 / 0.1 / 0.3: {policy.ratio_margin(0.0):.3f} / "
              f"{policy.ratio_margin(0.1):.3f} / {policy.ratio_margin(0.3):.3f}; failures in a row at 0 / 0.1 / 0.3: "
              f"{policy.consecutive_threshold(0.0):g} / {policy.consecutive_threshold(0.1):g} / "
              f"{policy.consecutive_threshold(0.3):g}")
        for fleet, shares in FLEETS.items():
            results = [trial(policy, shares, args.outcomes, seed) for seed in range(args.trials)]
            any_ejected = sum(any(reasons) for reasons, _ in results)
            outlier = sum(reasons[0] is not None for reasons, _ in results)
            others = sum(any(reasons[1:]) for reasons, _ in results)
            reasons = sorted({r for rs, _ in results for r in rs if r})
            lost_pct = 100.0 * sum(lost for _, lost in results) / (args.trials * len(shares) * args.outcomes)
            served_pct = 100.0 - lost_pct
            detail = (f"first replica ejected in {outlier}/{args.trials}, another in {others}/{args.trials}"
                      if len(set(shares)) > 1 else f"trials with an ejection {any_ejected}/{args.trials}")
            print(f"  {fleet:<24} {detail}; capacity kept {served_pct:.1f} % of replica-outcomes "
                  f"(reasons: {', '.join(reasons) or '-'})")


if __name__ == "__main__":
    main()
