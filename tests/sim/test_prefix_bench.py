"""bench/prefix_cache.py's tenant lists replayed in the simulator (`sim.prefix_bench`)."""

from __future__ import annotations

from collections import Counter

from tidegate.loadgen.mix import LengthDistribution
from tidegate.policy.tiers import default_tiers
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import ClosedLoopClients, Harness, TrafficClass
from tidegate.sim.prefix_bench import (BENCH_RUN_ORDER, BENCH_WARM_ORDER, bench_orders, bench_split,
                                       even_halvings_over)
from tidegate.sim.replica import ReplicaSpec
from tidegate.types import ArrivalDecision, PoolRequest


class _Recording(FifoDispatcher):
    """FIFO that keeps the prefix blocks of every request it is offered, in arrival order."""

    def __init__(self) -> None:
        super().__init__(["r0"], default_tiers(), slot_limit=4)
        self.prefixes: list[tuple[int, ...]] = []

    def on_arrival(self, now_s: float, request: PoolRequest) -> ArrivalDecision:
        self.prefixes.append(request.prefix)
        return super().on_arrival(now_s, request)


def test_clients_sharing_a_list_send_its_prefixes_in_order_and_stop_at_its_end() -> None:
    traffic = TrafficClass("t", "standard", 1.0, LengthDistribution("const", 40), LengthDistribution("const", 4))
    dispatcher = _Recording()
    listed = (2, 0, 2, 1, 1)
    result = Harness([ReplicaSpec("r0")], dispatcher).run((), clients=ClosedLoopClients(
        3, traffic, 0.0, 1e9, prefixes=3, prefix_tokens=128, prefix_order=listed))
    assert len(result.records) == len(listed) and all(r.served for r in result.records)
    heads = [prefix[0] for prefix in dispatcher.prefixes]  # a prefix's first block names it
    assert [heads.index(head) for head in heads] == [0, 1, 0, 3, 3]  # the list's pattern of repeats
    assert all(r.prompt_tokens == 40 + 128 for r in result.records)


def test_seed_zero_is_the_bench_s_own_lists() -> None:
    assert bench_orders(0) == (BENCH_WARM_ORDER, BENCH_RUN_ORDER)
    assert len(BENCH_WARM_ORDER) == 16 and len(BENCH_RUN_ORDER) == 256  # the bench's default --requests
    assert sorted(Counter(BENCH_RUN_ORDER).values()) == [27, 29, 30, 31, 33, 33, 35, 38]
    short = bench_orders(0, run_requests=64)[1]  # `--requests 64`, the bench's count before
    assert sorted(Counter(short).values()) == [3, 6, 6, 9, 9, 10, 10, 11]  # 3 to 11 a tenant


def test_a_replayed_bench_counts_every_listed_request_once() -> None:
    warm, run = bench_orders(3)
    split = bench_split(warm, run)
    assert sum(split.requests) == len(run)
    volumes = Counter((*warm, *run))
    assert [sum(per_worker) for per_worker in split.tenants] == [volumes[t] for t in range(8)]
    assert all(0 < busy <= 1 for busy in split.busy) and 0 < split.cached < 1
    assert bench_split(warm, run) == split  # deterministic


def test_at_64_requests_the_tenant_volumes_alone_split_a_tenth_of_even_placements_over_the_bar() -> None:
    # why the bench measures 256: 8 of the 70 ways to put 4 tenants on each worker split 64 requests
    # over 1.5x, none of them its 256
    assert abs(even_halvings_over(bench_orders(0, run_requests=64)[1]) - 8 / 70) < 1e-9
    assert even_halvings_over(BENCH_RUN_ORDER) == 0.0
