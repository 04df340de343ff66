"""A run's summary: per tier TTFT percentiles, goodput, served/refused; per replica busy fraction.

Goodput here is requests finished with a TTFT within their tier's `ttft_target_s`, per second of
the run's virtual time (DistServe's headline metric, on TTFT alone until TPOT targets exist).
Text output is deterministic: fixed formats, tiers by rank, replicas in the order given.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from tidegate.policy.tiers import TierTable
from tidegate.sim.harness import RequestRecord, RunResult

__all__ = ["TierSummary", "ReplicaSummary", "RunSummary", "summarize", "format_summary"]


@dataclass(frozen=True, slots=True)
class TierSummary:
    tier: str
    arrived: int
    served: int  # finished
    refused: int  # by the dispatcher, at arrival or after waiting
    failed: int  # on a replica
    unsettled: int  # still queued or running when the run stopped
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    good: int  # served within the tier's TTFT target
    goodput_rps: float
    refusals: tuple[tuple[str, int], ...]  # (reason, count), by reason


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    replica_id: str
    busy_fraction: float  # busy time / run time
    generated_tokens: int
    output_tokens_per_s: float
    preemptions: int
    alive: bool


@dataclass(frozen=True, slots=True)
class RunSummary:
    duration_s: float
    tiers: tuple[TierSummary, ...]
    replicas: tuple[ReplicaSummary, ...]

    def tier(self, name: str) -> TierSummary:
        return next(t for t in self.tiers if t.tier == name)

    @property
    def goodput_rps(self) -> float:
        return sum(t.goodput_rps for t in self.tiers)

    @property
    def mean_busy_fraction(self) -> float:
        return sum(r.busy_fraction for r in self.replicas) / len(self.replicas) if self.replicas else 0.0


def _percentile_s(values_s: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values_s, dtype=np.float64), q)) if values_s else None


def _tier_summary(name: str, records: list[RequestRecord], target_s: float | None, duration_s: float) -> TierSummary:
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    served = [r for r in records if r.served]
    good = sum(1 for r in served if target_s is not None and r.ttft_s is not None and r.ttft_s <= target_s)
    refused = [r for r in records if r.refused_reason is not None]
    failed = sum(1 for r in records if r.failure_reason is not None)
    reasons = Counter(r.refused_reason for r in refused)
    return TierSummary(
        tier=name,
        arrived=len(records),
        served=len(served),
        refused=len(refused),
        failed=failed,
        unsettled=len(records) - len(served) - len(refused) - failed,
        ttft_p50_s=_percentile_s(ttfts, 50),
        ttft_p99_s=_percentile_s(ttfts, 99),
        good=good,
        goodput_rps=good / duration_s if duration_s > 0 else 0.0,
        refusals=tuple(sorted((str(reason), count) for reason, count in reasons.items())),
    )


def summarize(result: RunResult, tiers: TierTable) -> RunSummary:
    duration_s = result.end_s
    by_tier: dict[str, list[RequestRecord]] = {}
    for record in result.records:
        by_tier.setdefault(record.tier, []).append(record)
    # configured tiers by rank, then any unknown tier by name (its requests were refused)
    names = [t.name for t in tiers if t.name in by_tier] + sorted(n for n in by_tier if n not in tiers)
    tier_summaries = tuple(
        _tier_summary(name, by_tier[name], tiers[name].ttft_target_s if name in tiers else None, duration_s)
        for name in names
    )
    replica_summaries = tuple(
        ReplicaSummary(
            replica_id=stats.replica_id,
            busy_fraction=stats.busy_s / duration_s if duration_s > 0 else 0.0,
            generated_tokens=stats.generated_tokens,
            output_tokens_per_s=stats.generated_tokens / duration_s if duration_s > 0 else 0.0,
            preemptions=stats.preemptions,
            alive=stats.alive,
        )
        for stats in result.replicas
    )
    return RunSummary(duration_s, tier_summaries, replica_summaries)


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1000:.0f}"


def format_summary(summary: RunSummary) -> str:
    lines = [f"run {summary.duration_s:.3f} s (virtual)",
             f"{'tier':<10} {'arrived':>7} {'served':>6} {'refused':>7} {'failed':>6} {'open':>4} "
             f"{'p50 TTFT ms':>11} {'p99 TTFT ms':>11} {'goodput/s':>9}  refusals"]
    for t in summary.tiers:
        refusals = ", ".join(f"{reason} {count}" for reason, count in t.refusals) or "-"
        lines.append(f"{t.tier:<10} {t.arrived:>7} {t.served:>6} {t.refused:>7} {t.failed:>6} {t.unsettled:>4} "
                     f"{_ms(t.ttft_p50_s):>11} {_ms(t.ttft_p99_s):>11} {t.goodput_rps:>9.3f}  {refusals}")
    lines.append(f"{'replica':<10} {'busy':>6} {'tokens/s':>9} {'preempted':>9} state")
    for r in summary.replicas:
        lines.append(f"{r.replica_id:<10} {r.busy_fraction:>6.1%} {r.output_tokens_per_s:>9.1f} "
                     f"{r.preemptions:>9} {'up' if r.alive else 'killed'}")
    return "\n".join(lines)
