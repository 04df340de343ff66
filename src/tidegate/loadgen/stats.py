"""Aggregates over request records: percentiles, goodput, schedule lag, a per-second timeline.

Goodput follows DistServe (Zhong et al., OSDI 2024): a request counts when it succeeded AND met
both the TTFT and the TPOT SLO; goodput is such requests per second, attainment their share of
all requests issued. A non-streaming request has one "token time": its TTFT is the whole response
and its TPOT 0, so only the TTFT SLO can fail it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from tidegate.loadgen.records import RequestRecord

__all__ = ["Slo", "Percentiles", "GroupSummary", "LagSummary", "summarize", "lag_summary", "meets_slo",
           "timeline", "tier_slos", "PERCENTILES"]

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    if not record.ok:
        return False
    if slo.ttft_s is not None and (record.ttft_s is None or record.ttft_s > slo.ttft_s):
        return False
    # TPOT is unknown only when no output tokens were reported (embeddings): nothing to judge
    tpot = record.tpot_s
    if slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Percentiles:
    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None

    @staticmethod
    def of(values_s: Iterable[float]) -> "Percentiles":
        array = np.fromiter(values_s, dtype=np.float64)
        if len(array) == 0:
            return Percentiles(0, None, None, None, None, None)
        p50, p90, p99 = (float(v) * 1000 for v in np.percentile(array, PERCENTILES))
        return Percentiles(len(array), float(array.mean()) * 1000, p50, p90, p99, float(array.max()) * 1000)


@dataclass(frozen=True, slots=True)
class GroupSummary:
    target: int
    tier: str  # "all" for the whole target
    requests: int
    succeeded: int
    dropped: int
    degraded: int
    statuses: dict[str, int]  # "200", "429", ..., "0" for no response
    reasons: dict[str, int]  # error code/type -> count
    ttft: Percentiles
    itl: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    throughput_rps: float  # successful requests per second of run time
    output_tokens_per_s: float
    mean_prompt_tokens_target: float | None
    mean_prompt_tokens_reported: float | None  # from usage; differs from target for non-byte tokenizers
    good: int | None  # None when no SLO was given
    goodput_rps: float | None
    slo_attainment_pct: float | None


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(records: Sequence[RequestRecord], *, target: int, tier: str, elapsed_s: float, slo: Slo,
              tier_slos: Mapping[str, Slo] | None = None) -> GroupSummary:
    """`tier_slos`: a tier's own SLO (its TTFT target) for its requests; `slo` for the others."""
    ok = [r for r in records if r.ok]
    duration = max(elapsed_s, 1e-9)
    tier_slos = tier_slos or {}
    judged = slo.given or any(s.given for s in tier_slos.values())
    good = sum(1 for r in records if meets_slo(r, tier_slos.get(r.tier, slo))) if judged else None
    reported = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return GroupSummary(
        target=target,
        tier=tier,
        requests=len(records),
        succeeded=len(ok),
        dropped=sum(1 for r in records if r.reason == "dropped_inflight_cap"),
        degraded=sum(1 for r in records if r.degraded),
        statuses=dict(Counter(str(r.status) for r in records)),
        reasons=dict(Counter(r.reason for r in records if r.reason is not None)),
        ttft=Percentiles.of(r.ttft_s for r in ok if r.ttft_s is not None),
        itl=Percentiles.of(gap for r in ok for gap in r.itl_s),
        tpot=Percentiles.of(t for r in ok if (t := r.tpot_s) is not None and (r.completion_tokens or 0) > 1),
        e2e=Percentiles.of(r.e2e_s for r in ok if r.e2e_s is not None),
        throughput_rps=len(ok) / duration,
        output_tokens_per_s=sum(r.completion_tokens or 0 for r in ok) / duration,
        mean_prompt_tokens_target=_mean([r.target_prompt_tokens for r in records]),
        mean_prompt_tokens_reported=_mean(reported),
        good=good,
        goodput_rps=None if good is None else good / duration,
        slo_attainment_pct=None if good is None else (100.0 * good / len(records) if records else 0.0),
    )


@dataclass(frozen=True, slots=True)
class LagSummary:
    """How late the generator sent requests against its schedule (open loop only)."""

    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    late_count: int  # sent later than the threshold
    threshold_ms: float
    behind_schedule: bool  # p99 lag over the threshold: the offered load was not what was asked


def lag_summary(records: Sequence[RequestRecord], threshold_ms: float) -> LagSummary:
    lags = np.asarray([r.sent_s - r.scheduled_s for r in records if r.reason != "dropped_inflight_cap"])
    if len(lags) == 0:
        return LagSummary(None, None, None, None, 0, threshold_ms, False)
    p50, p90, p99 = (float(v) * 1000 for v in np.percentile(lags, PERCENTILES))
    return LagSummary(p50, p90, p99, float(lags.max()) * 1000, int((lags * 1000 > threshold_ms).sum()),
                      threshold_ms, p99 > threshold_ms)


def timeline(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[dict]:
    """Per bucket of send time: sent, ok, rejected (429/503), errors, TTFT p50/p99 (overall, and per
    tier as `ttft_by_tier: {tier: [p50_ms, p99_ms]}`); and completions and output tokens by
    completion time."""
    if not records:
        return []
    last = max(r.sent_s + (r.e2e_s or 0.0) for r in records)
    buckets = [
        {"t_s": i * bucket_s, "sent": 0, "ok": 0, "rejected": 0, "errors": 0, "degraded": 0,
         "completed": 0, "output_tokens": 0, "_ttft": [], "_by_tier": {}}
        for i in range(int(last // bucket_s) + 1)
    ]
    for r in records:
        sent = buckets[min(int(max(r.sent_s, 0.0) // bucket_s), len(buckets) - 1)]
        sent["sent"] += 1
        if r.ok:
            sent["ok"] += 1
            if r.ttft_s is not None:
                sent["_ttft"].append(r.ttft_s)
                sent["_by_tier"].setdefault(r.tier, []).append(r.ttft_s)
            done = buckets[min(int((r.sent_s + (r.e2e_s or 0.0)) // bucket_s), len(buckets) - 1)]
            done["completed"] += 1
            done["output_tokens"] += r.completion_tokens or 0
        elif r.status in (429, 503):
            sent["rejected"] += 1
        else:
            sent["errors"] += 1
        if r.degraded:
            sent["degraded"] += 1
    for bucket in buckets:
        ttft = bucket.pop("_ttft")
        bucket["ttft_p50_ms"] = float(np.percentile(ttft, 50)) * 1000 if ttft else None
        bucket["ttft_p99_ms"] = float(np.percentile(ttft, 99)) * 1000 if ttft else None
        bucket["ttft_by_tier"] = {tier: [float(v) * 1000 for v in np.percentile(values, (50, 99))]
                                  for tier, values in sorted(bucket.pop("_by_tier").items())}
    return buckets


def tier_slos(tiers: Iterable) -> dict[str, Slo]:
    """Each configured tier's SLO from its TTFT target (`policy.tiers.TierSpec`, or anything with
    `name` and `ttft_target_s`): what the gateway itself counts as goodput."""
    return {tier.name: Slo(ttft_s=tier.ttft_target_s) for tier in tiers}
