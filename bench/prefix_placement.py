"""bench/prefix_cache.py's warm-up and measured run in the simulator: how its workers split.

    python bench/prefix_placement.py [--seeds 40] [--requests 256] [--factors 1.0,1.25,1.5]

Replays the bench's own tenant lists (seed 0) and lists drawn the same way from other seeds on the
modelled embedded engines (`sim.prefix_bench`), both workers at the same speed and one 1.25x and
1.5x slower (live, one engine shares its core with the gateway). Prints, per speed, the bench's own
lists' split (requests and busy fraction per worker, tenants per worker) and, over all seeds, the
requests-per-worker imbalance (the bench's bar: <= 1.5x) and the busy-fraction imbalance beside it;
first, what chance alone gives: the share of the even ways to place the tenants (4 on each worker)
whose measured-run volumes split the requests over 1.5x. `--requests` is the measured run's length,
the bench's default (256) unless given: at 64 chance alone splits 12 % of those placements over 1.5x.
Deterministic: virtual time, seeded lists.
"""

from __future__ import annotations

import argparse

import numpy as np

from tidegate.sim.prefix_bench import RUN_REQUESTS, bench_orders, bench_split, even_halvings_over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=40, help="lists: the bench's own and seeds-1 others")
    parser.add_argument("--factors", default="1.0,1.25,1.5", help="how much slower the first worker is")
    parser.add_argument("--requests", type=int, default=RUN_REQUESTS,
                        help="the measured run's requests (the bench's --requests)")
    args = parser.parse_args()
    chance = [even_halvings_over(bench_orders(seed, args.requests)[1]) for seed in range(args.seeds)]
    print(f"tenants 4 / 4 in every way, their volumes in the measured run alone split the requests over 1.5x in "
          f"{chance[0]:.0%} of the ways for the bench's own list, {np.mean(chance):.0%} as a mean over "
          f"{args.seeds} lists")
    for factor in (float(f) for f in args.factors.split(",")):
        splits = [bench_split(*bench_orders(seed, args.requests), slow_factor=factor) for seed in range(args.seeds)]
        own = splits[0]
        homes = [int(np.argmax(t)) for t in own.tenants]
        print(f"worker r0 {factor:.2f}x slower; the bench's lists: per worker {list(own.requests)} "
              f"({own.imbalance:.2f}x), busy {[f'{b:.0%}' for b in own.busy]} ({own.busy_imbalance:.2f}x), "
              f"{own.cached:.0%} of prompt tokens cached, {own.moves} moves; tenants' main worker "
              f"{homes} (r0: {homes.count(0)}), per tenant per worker {[list(t) for t in own.tenants]}")
        imbalance = np.array([s.imbalance for s in splits])
        busy = np.array([s.busy_imbalance for s in splits])
        print(f"  over {len(splits)} lists: requests per worker {np.median(imbalance):.2f}x median, "
              f"{imbalance.max():.2f}x worst, over 1.5x in {np.mean(imbalance > 1.5):.0%}; busy fraction "
              f"{np.median(busy):.2f}x median, {busy.max():.2f}x worst, over 1.5x in {np.mean(busy > 1.5):.0%}; "
              f"cached {np.mean([s.cached for s in splits]):.0%} mean; faster worker's tenants (main worker) "
              f"{np.mean([sum(int(np.argmax(t)) == 1 for t in s.tenants) for s in splits]):.1f} of 8 mean")


if __name__ == "__main__":
    main()
