"""An offline oracle for autoscaling: the fewest replica-hours that serve a known future.

It knows every arrival ahead of time. For each bucket of `bucket_s` it needs enough replicas that
the work arriving (prompt + output tokens per second) is at most `ceiling` of their measured
token throughput (95 %: past it, queueing grows without bound for any burst). Replicas are nested
levels: level k serves while the need is >= k. A level's replica is requested one cold start
before it must serve (paid from the request, as every policy pays), and a gap between two of its
busy stretches is bridged when it is no longer than a cold start (keeping it costs the gap;
stopping and restarting it costs a cold start). Per level that choice is optimal, and the levels
are independent, so the total is the least replica-time with which the need is met. The fleet
present at the start is ready at 0, as for the policies it is compared with.

What it cannot know is sub-bucket burstiness: the schedule is run in the simulator like any policy
(`ScheduledFleet`) and its success and latency are printed beside its cost
(`bench/autoscale_sim.py` says whether it met the SLO).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tidegate.policy.autoscale import ScaleDecision, ScaleLayer, ScaleSignals
from tidegate.sim.seam import SimRequest

__all__ = ["OracleSchedule", "oracle_schedule", "work_per_bucket", "ScheduledFleet"]


@dataclass(frozen=True, slots=True)
class OracleSchedule:
    bucket_s: float
    needed: tuple[int, ...]  # replicas serving in each bucket
    requested: tuple[tuple[float, float], ...]  # per replica stretch: (requested at, stopped at), seconds
    replica_s: float  # replica-seconds paid: starting + serving

    @property
    def replica_hours(self) -> float:
        return self.replica_s / 3600.0

    def desired_at(self, t_s: float) -> int:
        """Replicas requested (starting or serving) at `t_s`."""
        return sum(1 for start_s, stop_s in self.requested if start_s <= t_s < stop_s)


def work_per_bucket(requests: Sequence[SimRequest], bucket_s: float) -> list[float]:
    """Prompt + output tokens arriving in each bucket, from the first to the last arrival."""
    last = max(r.arrival_s for r in requests)
    work = [0.0] * (int(last // bucket_s) + 1)
    for r in requests:
        work[int(r.arrival_s // bucket_s)] += r.prompt_tokens + r.output_tokens
    return work


def oracle_schedule(work: Sequence[float], bucket_s: float, replica_tokens_per_s: float, cold_start_s: float, *,
                    ceiling: float = 0.95, min_replicas: int = 1, max_replicas: int | None = None) -> OracleSchedule:
    if not 0 < ceiling <= 1 or replica_tokens_per_s <= 0 or bucket_s <= 0 or cold_start_s < 0:
        raise ValueError("need 0 < ceiling <= 1, replica_tokens_per_s > 0, bucket_s > 0, cold_start_s >= 0")
    needed = [max(min_replicas, math.ceil(w / bucket_s / (replica_tokens_per_s * ceiling) - 1e-9)) for w in work]
    if max_replicas is not None:
        needed = [min(n, max_replicas) for n in needed]
    end_s = len(needed) * bucket_s
    requested: list[tuple[float, float]] = []
    for level in range(1, max(needed, default=0) + 1):
        stretches: list[list[float]] = []  # [serve from, serve until] of this level
        for index, n in enumerate(needed):
            if n < level:
                continue
            start_s, stop_s = index * bucket_s, (index + 1) * bucket_s
            if stretches and start_s - stretches[-1][1] <= cold_start_s:
                stretches[-1][1] = stop_s  # bridge the gap: cheaper than a restart
            else:
                stretches.append([start_s, stop_s])
        for serve_s, stop_s in stretches:
            requested_s = serve_s if serve_s == 0.0 else serve_s - cold_start_s  # the start's fleet is ready
            requested.append((max(0.0, requested_s), min(stop_s, end_s)))
    replica_s = sum(stop_s - start_s for start_s, stop_s in requested)
    return OracleSchedule(bucket_s, tuple(needed), tuple(requested), replica_s)


class ScheduledFleet:
    """A scaling policy that follows a schedule made in advance (the oracle's)."""

    def __init__(self, schedule: OracleSchedule) -> None:
        self.schedule = schedule

    def on_tick(self, signals: ScaleSignals) -> ScaleDecision:
        return ScaleDecision(max(1, self.schedule.desired_at(signals.now_s)), ScaleLayer.HOLD, "scheduled")
