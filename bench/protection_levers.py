"""What meeting the `critical_burst` and `noisy_tenant` P99 bars would cost: each lever that shortens
the step a protected prompt arrives during, swept, with the work it leaves against FIFO's.

    python bench/protection_levers.py [--scenario critical_burst|noisy_tenant] [--levels 32,24,16,8]
                                      [--engine-caps 256,128,64,32] [--budgets 256,128]

`bench/protection_anatomy.py --tail` shows where the extra time of the TTFTs that set the P99 goes:
nothing waits at the gateway or for an engine slot; the step in flight when the prompt arrives (a
full batch of worse work) is the difference. So a slot reserved for the protected class (rule 5's
headroom is one) has nothing left to win, and the bound is what shortening that step costs:
- the dispatch lever: fewer worse requests in each engine (`PoolReplica.max_requests`, the slots
  of a level and better, the rest headroom), so shorter decode steps and fewer prompts to prefill;
- an engine lever no engine has (vLLM, SGLang and ours do not): at most N prompt tokens of a
  priority worse than the best a step, so a worse prefill step is short (critical_burst only; the
  unloaded baseline, critical alone, never meets the cap);
- the engines' whole step budget, every priority alike (`--budgets`; the loaded runs only).
First, the bar's own noise: the unloaded run against itself with every arrival moved by up to
+-5 ms (`JITTER_DRAWS` seeded draws), no load added, read as the bar reads a loaded run.
Each line: the bar's ratio over the seeds (worst, mean, per seed) and requests within target over
the whole runs against FIFO's on the engine as it is.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from tidegate.engine.scheduler import Scheduler
from tidegate.policy.pool import PoolController, PoolReplica, PoolSettings
from tidegate.policy.shares import TenantShares
from tidegate.sim import scenarios as S
from tidegate.sim.harness import RequestRecord
from tidegate.sim.replica import ReplicaSpec
from tidegate.sim.seam import SimRequest


@contextmanager
def step_budget(tokens: int) -> Iterator[None]:
    """The scenarios' engines with a step budget of `tokens` (every priority alike)."""
    original = S.replica_spec

    def spec(replica_id: str) -> ReplicaSpec:
        made = original(replica_id)
        return replace(made, scheduler=replace(made.scheduler, max_batch_tokens=tokens))

    S.replica_spec = spec
    try:
        yield
    finally:
        S.replica_spec = original


@contextmanager
def worse_prefill_capped(tokens: int) -> Iterator[None]:
    """A hypothetical engine: a prompt of a priority worse than 0 gets at most `tokens` a step."""
    original = Scheduler._chunk_size

    def capped(self: Scheduler, seq, budget: int, has_prefill: bool, start: int | None = None) -> int:
        return original(self, seq, min(budget, tokens) if seq.priority > 0 else budget, has_prefill, start)

    Scheduler._chunk_size = capped  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler._chunk_size = original  # type: ignore[method-assign]


def controller_with_level_slots(slots: int) -> S.Kind:
    total = S.CEILING + S.HEADROOM
    return lambda ids, tiers: PoolController([PoolReplica(i, slots, total - slots) for i in ids], tiers,
                                             PoolSettings(), shares=TenantShares())


def critical_burst_seed(seed: int, cap: float):
    """(requests with the burst, the protected requests alone, which records the bar is about, window)"""
    critical = S.mixed(0.15 * cap, S.DURATION_S, (("vip", "critical", 1.0),), seed=seed)
    burst = S.mixed(3.0 * cap, 30.0, (("bulk", "sheddable", 1.0),), seed=seed + 1)
    return (S._merge(critical, burst, offsets_s=(0.0, 15.0)), critical, lambda r: r.tier == "critical",
            (15.0, 45.0), 1.2)


def noisy_tenant_seed(seed: int, cap: float):
    quiet = S.mixed(0.6 * cap, S.DURATION_S, tuple((f"t{i}", "standard", 1.0) for i in range(4)), seed=seed)
    noisy = S.mixed(1.5 * cap, 40.0, (("noisy", "standard", 1.0),), seed=seed + 1)
    return (S._merge(quiet, noisy, offsets_s=(0.0, 10.0)), quiet, lambda r: r.tenant != "noisy", (15.0, 50.0), 1.1)


SCENARIOS = {"critical_burst": (critical_burst_seed, S.BURST_SEEDS), "noisy_tenant": (noisy_tenant_seed, S.NOISY_SEEDS)}


JITTER_S = 0.005
JITTER_DRAWS = 5


def window_p99(kind: S.Kind, requests, about: Callable, window, **options) -> float:
    """P99 TTFT of the requests `about` picks, among those in `window`, with `kind` serving `requests`."""
    run_ = S.run(kind, S.REPLICAS, requests, **options)
    return run_.p99_ttft_s([r for r in run_.records(None, *window) if about(r)])


def jittered(requests, draw: int) -> tuple[SimRequest, ...]:
    rng = np.random.default_rng(1000 + draw)
    return tuple(replace(r, arrival_s=max(0.0, r.arrival_s + rng.uniform(-JITTER_S, JITTER_S))) for r in requests)


def self_noise(make: Callable, seeds) -> None:
    """The unloaded P99 of each seed over its own, arrivals jittered: what the bar reads with no load added."""
    cap = S.capacity_rps(S.REPLICAS)
    ratios = []
    for seed in seeds:
        _, alone_requests, about, window, _ = make(seed, cap)
        p99 = window_p99(S.controller, alone_requests, about, window)
        for draw in range(JITTER_DRAWS):
            ratios.append(window_p99(S.controller, jittered(alone_requests, draw), about, window) / p99)
    print(f"unloaded against itself, arrivals jittered +-{JITTER_S * 1000:.0f} ms ({JITTER_DRAWS} draws a seed): "
          f"{min(ratios):.2f}x-{max(ratios):.2f}x, {sum(r > 1.0 for r in ratios)} of {len(ratios)} over 1.0x")


def sweep(make: Callable, seeds, levels: list[int], engine_caps: list[int], budgets: list[int]) -> None:
    cap = S.capacity_rps(S.REPLICAS)
    cases, fifo_good = [], 0
    for seed in seeds:
        requests, alone_requests, about, window, bar = make(seed, cap)
        unloaded = window_p99(S.controller, alone_requests, about, window)
        cases.append((requests, about, window, unloaded))
        fifo_good += S.run(S.fifo, S.REPLICAS, requests, probes_s=window).good()
    print(f"bar {bar}x; FIFO within target over {len(seeds)} whole runs: {fifo_good}")

    def line(label: str, kind: S.Kind) -> None:
        ratios, good = [], 0
        for requests, about, window, unloaded in cases:
            run_ = S.run(kind, S.REPLICAS, requests, probes_s=window)
            protected: list[RequestRecord] = [r for r in run_.records(None, *window) if about(r)]
            ratios.append(run_.p99_ttft_s(protected) / unloaded)
            good += run_.good()
        print(f"{label:<42} worst {max(ratios):.2f}x mean {np.mean(ratios):.2f}x "
              f"({' '.join(f'{r:.2f}' for r in ratios)}); within target {good} ({good - fifo_good:+d} vs FIFO)",
              flush=True)

    for slots in levels:
        line(f"slots of a level and better {slots} (of {S.CEILING + S.HEADROOM})", controller_with_level_slots(slots))
    for tokens in engine_caps:
        with worse_prefill_capped(tokens):
            line(f"engine: worse prompts <= {tokens} tokens a step", S.controller)
    for tokens in budgets:
        with step_budget(tokens):
            line(f"engine: every step <= {tokens} tokens", S.controller)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="critical_burst")
    parser.add_argument("--levels", default="32,24,16,8", help="slots of a level and better a replica, to sweep")
    parser.add_argument("--engine-caps", default="256,128,64,32",
                        help="worse prompt tokens a step, to sweep (critical_burst; empty: none)")
    parser.add_argument("--budgets", default="", help="engine step budgets for the loaded runs, to sweep "
                        "(the unloaded baseline and FIFO keep the scenarios' 512)")
    args = parser.parse_args()
    make, seeds = SCENARIOS[args.scenario]
    levels = [int(x) for x in args.levels.split(",") if x]
    caps = [int(x) for x in args.engine_caps.split(",") if x] if args.scenario == "critical_burst" else []
    self_noise(make, seeds)
    sweep(make, seeds, levels, caps, [int(x) for x in args.budgets.split(",") if x])


if __name__ == "__main__":
    main()
