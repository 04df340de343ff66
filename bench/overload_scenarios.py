"""The overload scenarios, simulated: each bar's verdict, with utilisation and served work beside it.

Deterministic (seeded, virtual time): the same code prints the same figures on any machine. Each
scenario runs the pool controller (`policy.pool`) and FIFO (overload control off) on the same
requests and modelled replicas (`sim.scenarios`). Run:
    python bench/overload_scenarios.py [--only NAME]
"""

from __future__ import annotations

import argparse
import sys
import time

from tidegate.sim.scenarios import SCENARIOS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the scenario of this name only")
    args = parser.parse_args()
    failed = 0
    for scenario in SCENARIOS:
        if args.only and scenario.__name__ != args.only:
            continue
        started = time.perf_counter()
        verdict = scenario()
        failed += not verdict.passed
        print(f"{'PASS' if verdict.passed else 'FAIL'}  {verdict.scenario}: {verdict.bar} "
              f"({time.perf_counter() - started:.1f} s)")
        for line in verdict.figures:
            print(f"      {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
