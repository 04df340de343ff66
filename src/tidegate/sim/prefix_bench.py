"""bench/prefix_cache.py's own request lists in the simulator: why its workers split unevenly.

The live bench warms each set-up with 16 requests from 2 closed-loop clients, then measures 256
(its default `--requests`; 64 before) from 4, every request's tenant fixed by a seeded list the
clients share (`random.Random(16)`, `random.Random(requests)`). With prefix-aware routing a tenant
stays where its prompt is cached, so the warm-up decides which worker each tenant starts on, and
the measured run's tenant volumes fall on that split: at 64 requests 3 to 11 a tenant, enough for
chance alone to split 8 of the 70 even tenant placements over the bench's 1.5x bar
(`even_halvings_over`); at 256, 27 to 38, none. `bench_split` replays one such pair of lists on
the modelled embedded engines, one of them optionally slower (live, one engine shares its core with
the gateway), and reports what the bench prints: requests and busy fraction per worker over the
measured run, the share of looked-up prompt tokens cached, and how each tenant was placed.
`bench/prefix_placement.py` runs it over the bench's lists and many seeded ones.
"""

from __future__ import annotations

import random
from collections import Counter
from itertools import combinations
from dataclasses import dataclass, replace

import numpy as np

from tidegate.loadgen.mix import LengthDistribution
from tidegate.policy.tiers import default_tiers
from tidegate.sim.harness import ClosedLoopClients, Harness, SlowReplica, TrafficClass
from tidegate.sim.profile import load_profile
from tidegate.sim.scenarios import (PREFIX_CLIENT_KV_TOKENS, PREFIX_CLIENT_PROFILE, PREFIX_CLIENT_TENANTS,
                                    SYSTEM_PROMPT_TOKENS, controller)

__all__ = ["BENCH_WARM_ORDER", "BENCH_RUN_ORDER", "BenchSplit", "bench_orders", "bench_split", "even_halvings_over"]

WARM_REQUESTS, WARM_CLIENTS = 16, 2  # bench/prefix_cache.py's warm-up
RUN_REQUESTS, RUN_CLIENTS = 256, 4  # and its measured run (its `--requests` default)
# the bench's lists: `random.Random(requests).choices(range(8), k=requests)`, as its `load` draws them
BENCH_WARM_ORDER = tuple(random.Random(WARM_REQUESTS).choices(range(PREFIX_CLIENT_TENANTS), k=WARM_REQUESTS))
BENCH_RUN_ORDER = tuple(random.Random(RUN_REQUESTS).choices(range(PREFIX_CLIENT_TENANTS), k=RUN_REQUESTS))
# a bench request's own part: "Question {i}: where is order {i * 7919}?" and the chat's framing
QUESTION = TrafficClass("shops", "standard", 1.0, LengthDistribution("const", 60, 60),
                        LengthDistribution("const", 16, 16))


@dataclass(frozen=True, slots=True)
class BenchSplit:
    requests: tuple[int, ...]  # measured run's requests served per worker
    busy: tuple[float, ...]  # each worker's busy fraction over the measured run
    cached: float  # share of looked-up prompt tokens found cached (warm-up and run)
    moves: int  # prefixes the controller moved between workers (warm-up and run)
    # per tenant, requests per worker over warm-up and run, workers in order
    tenants: tuple[tuple[int, ...], ...]

    @property
    def imbalance(self) -> float:
        return max(self.requests) / max(1, min(self.requests))

    @property
    def busy_imbalance(self) -> float:
        return max(self.busy) / max(1e-9, min(self.busy))


def bench_orders(seed: int, run_requests: int = RUN_REQUESTS) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Seed 0: the bench's own lists (`bench/prefix_cache.py --requests run_requests`); others: lists
    drawn as the bench draws them, from other seeds."""
    draw = lambda n, s: tuple(random.Random(s).choices(range(PREFIX_CLIENT_TENANTS), k=n))  # noqa: E731
    if seed == 0:
        return BENCH_WARM_ORDER, draw(run_requests, run_requests)
    return draw(WARM_REQUESTS, 1000 + seed), draw(run_requests, 2000 + seed)


def bench_split(warm_order: tuple[int, ...], run_order: tuple[int, ...], slow_factor: float = 1.0,
                slow_id: str = "r0") -> BenchSplit:
    """The bench's warm-up then measured run, with the default controller (prefix-aware routing, its
    index sized as the engines report), `slow_id`'s steps `slow_factor` x as long throughout."""
    ids = ("r0", "r1")
    profile = load_profile(PREFIX_CLIENT_PROFILE)
    specs = [replace(profile.spec(i), kv_cache_tokens=PREFIX_CLIENT_KV_TOKENS) for i in ids]
    harness = Harness(specs, controller(ids, default_tiers()))
    events = [SlowReplica(0.0, slow_id, slow_factor)] if slow_factor != 1.0 else []
    warm = harness.run([], events, clients=ClosedLoopClients(
        WARM_CLIENTS, QUESTION, 0.0, np.inf, prefixes=PREFIX_CLIENT_TENANTS, prefix_tokens=SYSTEM_PROMPT_TOKENS,
        prefix_order=warm_order))
    warmed = len(warm.records)
    run = harness.run([], clients=ClosedLoopClients(
        RUN_CLIENTS, QUESTION, warm.end_s, np.inf, seed=1, prefixes=PREFIX_CLIENT_TENANTS,
        prefix_tokens=SYSTEM_PROMPT_TOKENS, prefix_order=run_order))
    # no request is refused at this load, so the k-th request sent is the k-th of the lists
    assert len(run.records) == len(warm_order) + len(run_order) and all(r.served for r in run.records)
    measured = [r for r in run.records if r.request_id >= warmed]
    seconds = run.end_s - warm.end_s
    placed: dict[int, Counter[str]] = {t: Counter() for t in range(PREFIX_CLIENT_TENANTS)}
    for record, tenant in zip(run.records, (*warm_order, *run_order)):
        if record.replica_id is not None:
            placed[tenant][record.replica_id] += 1
    caches = [replica.scheduler.blocks for replica in harness.replicas.values()]
    return BenchSplit(
        tuple(sum(1 for r in measured if r.replica_id == i) for i in ids),
        tuple((after.busy_s - before.busy_s) / seconds for after, before in zip(run.replicas, warm.replicas)),
        sum(c.prefix_hit_tokens for c in caches) / max(1, sum(c.prefix_queried_tokens for c in caches)),
        run.prefix_moves,
        tuple(tuple(placed[t][i] for i in ids) for t in range(PREFIX_CLIENT_TENANTS)))


def even_halvings_over(run_order: tuple[int, ...], bar: float = 1.5) -> float:
    """The share of the ways to put half the tenants on each worker that split `run_order`'s requests
    over `bar` x: what the tenants' volumes alone give a placement that is as even as it can be
    before it knows them (tenants that stay where their prompts are cached)."""
    volumes = Counter(run_order)
    tenants = range(PREFIX_CLIENT_TENANTS)
    over = total = 0
    for half in combinations(tenants, PREFIX_CLIENT_TENANTS // 2):
        first = sum(volumes[t] for t in half)
        second = len(run_order) - first
        total += 1
        over += max(first, second) > bar * max(1, min(first, second))
    return over / total
