"""A replica's capacity for one request shape, measured in the simulator itself.

Load in scenarios is stated as a multiple of capacity (0.5x, 2x), so capacity must come from the
same model the scenario runs on: a backlog is kept in front of one replica behind a FIFO slot
limit, and the completions per second while it stays saturated are its capacity.
"""

from __future__ import annotations

from tidegate.policy.tiers import TierSpec, TierTable
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import Harness
from tidegate.sim.replica import ReplicaSpec
from tidegate.sim.seam import SimRequest

__all__ = ["saturated_rps", "patient_tiers"]


def patient_tiers(name: str = "standard", ttft_target_s: float = 5.0) -> TierTable:
    """One tier that never gives up waiting: for measuring what a backlog does."""
    tier = TierSpec(name, rank=0, queue_bound=10**9, max_queue_wait_s=1e9, ttft_target_s=ttft_target_s)
    return TierTable((tier,), default_tier=name)


def saturated_rps(spec: ReplicaSpec, prompt_tokens: int, output_tokens: int, slot_limit: int,
                  requests: int = 200) -> float:
    """Completions per second between the first and the last tenth of a backlog of `requests`
    (the ramp-up of the first batch and the draining tail are left out)."""
    backlog = [SimRequest(i, 0.0, "capacity", "standard", prompt_tokens, output_tokens) for i in range(requests)]
    dispatcher = FifoDispatcher([spec.replica_id], patient_tiers(), slot_limit=slot_limit)
    result = Harness([spec], dispatcher).run(backlog)
    finishes_s = sorted(r.finish_s for r in result.records if r.finish_s is not None)
    if len(finishes_s) < 20:
        raise ValueError("too few requests to measure a steady rate")
    first, last = len(finishes_s) // 10, len(finishes_s) - len(finishes_s) // 10 - 1
    return (last - first) / (finishes_s[last] - finishes_s[first])
