"""A simulated run as a `tidegate bench` report: the same report.json schema, table and plots.

A live run (`tidegate bench --out A`) and a simulated run of the same scenario (`tidegate sim run
--out B`) then compare line by line: `tidegate report compare A/report.json B/report.json`.

How the simulator's outcomes map onto what a client of the live gateway records:
- served: HTTP 200, TTFT = first token - arrival, E2E = finish - arrival, usage = the tokens;
- refused by the dispatcher: 503 (what the gateway answers a controller's refusal with, Retry-After
  or a preset reply), reason = the controller's own reason (`predicted_miss`, `no_replica`, ...),
  where a live client sees the gateway's error code (`overloaded`);
- failed on a replica (killed): 502, reason = the replica's;
- still queued or running when the run stopped: status 0, reason `unsettled`.
The simulator does not time each token: ITL percentiles are empty; TPOT comes from E2E and TTFT.
Replica samples carry the gateway's metric names where it has one (`tidegate_queue_depth`,
`tidegate_replica_outstanding`), plus `tidegate_sim_replica_busy_ratio` (share of each interval
the replica spent in model steps); an autoscaled run adds `tidegate_replicas_ready` and
`tidegate_desired_replicas` at each change of the fleet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tidegate.loadgen.driver import MetricSample
from tidegate.loadgen.driver import RunResult as BenchResult
from tidegate.loadgen.records import RequestRecord as BenchRecord
from tidegate.loadgen.report import build_report
from tidegate.loadgen.stats import Slo, tier_slos
from tidegate.policy.tiers import TierTable
from tidegate.sim.harness import RequestRecord, RunResult
from tidegate.sim.scaling import ScaleEvent

__all__ = ["REFUSED_STATUS", "FAILED_STATUS", "probe_times", "bench_records", "bench_metrics", "scaling_metrics",
           "sim_report"]

REFUSED_STATUS = 503
FAILED_STATUS = 502
_MAX_PROBES = 600  # samples per series: a readable plot, a report of a few MB for hours of 100 replicas
_MAX_REPLICA_SERIES = 16  # per-replica series up to this many replicas; a pool's mean beyond


def probe_times(last_arrival_s: float) -> tuple[float, ...]:
    """When to sample the run: every second, or coarser so that a long run has at most
    `_MAX_PROBES` samples; only up to the last arrival (a later probe would prolong the run)."""
    step_s = max(1.0, math.ceil(last_arrival_s / _MAX_PROBES))
    return tuple(k * step_s for k in range(int(last_arrival_s // step_s) + 1))


def _record(record: RequestRecord, target: int) -> BenchRecord:
    served = record.served
    if served:
        status, reason = 200, None
    elif record.refused_reason is not None:
        status, reason = REFUSED_STATUS, record.refused_reason
    elif record.failure_reason is not None:
        status, reason = FAILED_STATUS, record.failure_reason
    else:
        status, reason = 0, "unsettled"
    return BenchRecord(
        index=record.request_id, target=target, tenant=record.tenant, tier=record.tier,
        scheduled_s=record.arrival_s, sent_s=record.arrival_s, status=status, reason=reason,
        ttft_s=record.ttft_s if served else None, itl_s=(),
        e2e_s=record.finish_s - record.arrival_s if record.finish_s is not None else None,
        target_prompt_tokens=record.prompt_tokens, max_tokens=record.output_tokens,
        prompt_tokens=record.prompt_tokens if served else None,
        completion_tokens=record.output_tokens if served else None, headers={},
    )


def bench_records(result: RunResult, target: int) -> list[BenchRecord]:
    """The run's requests as the load generator would have recorded them (see the module doc)."""
    return [_record(record, target) for record in result.records]


def bench_metrics(result: RunResult, target: int, pool: str) -> list[MetricSample]:
    """The run's probes as the scrapes of a live gateway's /metrics would have read them."""
    samples: list[MetricSample] = []
    ids = [stats.replica_id for stats in result.replicas]
    per_replica = len(ids) <= _MAX_REPLICA_SERIES
    previous = None
    for probe in result.probes:
        samples.append(MetricSample(probe.t_s, target, f'tidegate_queue_depth{{pool="{pool}"}}', float(probe.queued)))
        busy = None
        if previous is not None and probe.t_s > previous.t_s:
            span_s = probe.t_s - previous.t_s
            busy = [(now - before) / span_s for now, before in zip(probe.busy_s, previous.busy_s)]
        if per_replica:
            for index, replica_id in enumerate(ids):
                labels = f'{{pool="{pool}",replica="{replica_id}"}}'
                samples.append(MetricSample(probe.t_s, target, f"tidegate_replica_outstanding{labels}",
                                            float(probe.sequences[index])))
                if busy is not None:
                    samples.append(MetricSample(probe.t_s, target, f"tidegate_sim_replica_busy_ratio{labels}",
                                                busy[index]))
        elif busy is not None:
            samples.append(MetricSample(probe.t_s, target, f'tidegate_sim_replica_busy_ratio{{pool="{pool}",'
                                                           f'replica="mean of {len(ids)}"}}', sum(busy) / len(busy)))
        previous = probe
    return samples


def scaling_metrics(events: Sequence[ScaleEvent], target: int, pool: str) -> list[MetricSample]:
    """An autoscaled run's fleet: replicas ready and desired at each change (and at the ends)."""
    samples: list[MetricSample] = []
    previous = None
    for index, event in enumerate(events):
        if previous is None or (event.ready, event.desired) != (previous.ready, previous.desired) \
                or index == len(events) - 1:
            samples.append(MetricSample(event.t_s, target, f'tidegate_replicas_ready{{pool="{pool}"}}',
                                        float(event.ready)))
            samples.append(MetricSample(event.t_s, target, f'tidegate_desired_replicas{{pool="{pool}"}}',
                                        float(event.desired)))
        previous = event
    return samples


def sim_report(runs: Mapping[str, RunResult], tiers: TierTable, *, pool: str, config: dict[str, Any],
               credits: Sequence[str] = (),
               scaling: Mapping[str, Sequence[ScaleEvent]] | None = None) -> tuple[dict[str, Any], BenchResult]:
    """One report for one or more arms of a scenario (e.g. overload control and FIFO), each a
    target; every request judged by its tier's TTFT target. Deterministic: no wall clock in it."""
    records: list[BenchRecord] = []
    metrics: list[MetricSample] = []
    for target, (label, result) in enumerate(runs.items()):
        records.extend(bench_records(result, target))
        metrics.extend(bench_metrics(result, target, pool))
        metrics.extend(scaling_metrics((scaling or {}).get(label, ()), target, pool))
    end_s = max((result.end_s for result in runs.values()), default=0.0)
    # requests in flight (queued or on a replica) at the busiest probe: a sample, not every instant
    peak = max((sum(p.sequences) + p.queued for result in runs.values() for p in result.probes), default=0)
    result = BenchResult(records=records, metrics=metrics, started_at_unix=0.0, elapsed_s=end_s,
                         connections_opened=0, peak_in_flight=peak)
    report = build_report(result, config=config, slo=Slo(), targets=len(runs), lag_threshold_ms=10.0,
                          credits=credits, open_loop=False, tier_slos=tier_slos(tiers), target_names=list(runs))
    return report, result
