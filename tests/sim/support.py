"""Shared scenario pieces for the simulator tests: one request shape, tiers, a run-and-summarise."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.mix import LengthDistribution
from tidegate.policy.tiers import TierTable
from tidegate.sim.capacity import patient_tiers, saturated_rps
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import Harness, RunResult, TrafficClass, make_requests
from tidegate.sim.replica import ReplicaSpec
from tidegate.sim.seam import SimRequest

PROMPT_TOKENS, OUTPUT_TOKENS, SLOT_LIMIT = 64, 32, 8


def chat_class(tier: str = "standard") -> TrafficClass:
    return TrafficClass("acme", tier, 1.0, LengthDistribution("const", PROMPT_TOKENS),
                        LengthDistribution("const", OUTPUT_TOKENS))


@lru_cache(maxsize=1)
def capacity_rps() -> float:
    """Requests per second one default replica completes at the test shape behind SLOT_LIMIT slots."""
    return saturated_rps(ReplicaSpec("r0"), PROMPT_TOKENS, OUTPUT_TOKENS, SLOT_LIMIT)


def poisson_requests(rate_rps: float, duration_s: float, seed: int = 7,
                     tier: str = "standard") -> tuple[SimRequest, ...]:
    return make_requests(Poisson(rate_rps), duration_s, [chat_class(tier)], seed)


def run_fifo(requests: Sequence[SimRequest], replica_ids: Sequence[str] = ("r0",), tiers: TierTable | None = None,
             events: Sequence = (), until_s: float | None = None, slot_limit: int = SLOT_LIMIT,
             specs: Sequence[ReplicaSpec] | None = None) -> tuple[RunResult, FifoDispatcher]:
    tiers = tiers or patient_tiers()
    dispatcher = FifoDispatcher(list(replica_ids), tiers, slot_limit=slot_limit)
    harness = Harness(specs or [ReplicaSpec(r) for r in replica_ids], dispatcher)
    return harness.run(requests, events, until_s), dispatcher
