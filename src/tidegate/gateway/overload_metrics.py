"""Prometheus metrics of overload control, registered on the gateway's registry.

Queue depth and oldest wait per tier and replicas' work budgets are read at scrape time (callback
gauges), so the hot path pays nothing for them; counters and histograms are updated as things happen.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from tidegate.policy.ttft_model import TtftFit

__all__ = ["OverloadMetrics", "PlainCounter", "PlainHistogram", "FirstTokens", "WorkTokens", "Buckets", "quantile_from_buckets", "bucket_increase"]

Buckets = list[tuple[float, float]]  # a histogram's cumulative (upper bound, count) pairs, +Inf last

_WAIT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
# time to first token against tier targets of seconds to minutes (the alert compares its P99 with 1.2x
# the target, so buckets lie close around the usual targets)
_TTFT_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.6, 4.0, 5.0, 6.0, 7.5, 10.0, 12.0, 15.0, 20.0,
                   30.0, 60.0, 120.0, 600.0)
# rejections must be answered in milliseconds: fine buckets there
_REJECTION_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 1.0)


class OverloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = self._registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        # (pool, tier) -> what `sent_at_arrival` counts: the admissions' child, the queue wait's
        # bucket counts and the index of its bucket for 0 s, the work tokens' row of the pool
        self._at_arrival: dict[tuple[str, str], tuple[_Count, list[float], int, list[float]]] = {}
        self.queue_depth = Gauge("tidegate_overload_queue_depth", "Requests waiting, by pool and tier",
                                 ["pool", "tier"], registry=r)
        self.oldest_wait = Gauge("tidegate_overload_queue_oldest_wait_seconds",
                                 "Wait so far of the oldest waiting request, by pool and tier", ["pool", "tier"],
                                 registry=r)
        # observed, and counted, once a request: plain numbers (`PlainHistogram`, `PlainCounter`)
        self.queue_wait = PlainHistogram("tidegate_overload_queue_wait_seconds",
                                         "Arrival to dispatch of dispatched requests, by pool and tier",
                                         ("pool", "tier"), _WAIT_BUCKETS_S)
        r.register(self.queue_wait)
        self.predicted_wait = Histogram("tidegate_overload_predicted_wait_seconds",
                                        "Wait predicted at arrival for requests that queued and were later "
                                        "dispatched (compare with tidegate_overload_queue_wait_seconds, which also "
                                        "counts, with 0, those sent at arrival)", ["pool", "tier"],
                                        buckets=_WAIT_BUCKETS_S, registry=r)
        self.admissions = PlainCounter("tidegate_overload_admissions", "Arrivals by outcome (queued, rate_limited, "
                                       "too_large, preset_reply, fallback_pool)", ("pool", "tier", "outcome"))
        r.register(self.admissions)
        # the work arriving, for the autoscaler's work demand (`gateway.scaling`): prompt tokens as each
        # request arrives (refused ones too: demand the fleet did not hold), output tokens as generated
        self.work_tokens = WorkTokens()
        r.register(self.work_tokens)
        self.rejections = Counter("tidegate_overload_rejections", "Requests refused or shed, by reason",
                                  ["pool", "tier", "reason"], registry=r)
        self.degraded = Counter("tidegate_overload_degraded_responses", "Responses served below the primary "
                                "rung, by rung", ["pool", "rung"], registry=r)
        # rule 9 of `policy.pool`: what preempting background work costs it
        self.preemptions = Counter("tidegate_overload_preemptions", "Preemptible (batch) requests stopped to give "
                                   "their slot to a better tier's waiting request, by the stopped one's tier",
                                   ["pool", "tier"], registry=r)
        self.preempted_seconds = Counter("tidegate_overload_preempted_seconds", "Time preempted requests had "
                                         "spent at their replica: work thrown away, run again later", ["pool"],
                                         registry=r)
        # rule 7 of `policy.pool`: a prefix handed whole from a busier replica to a quieter one (its
        # next requests there miss the engine's cache once)
        self.prefix_moves = Counter("tidegate_prefix_moves", "Prompt prefixes moved to another replica to even "
                                    "the pool's load out (prefix-aware routing)", ["pool"], registry=r)
        self.rejection_latency = Histogram("tidegate_overload_rejection_seconds",
                                           "Arrival to the answer of a request refused at admission",
                                           ["pool"], buckets=_REJECTION_BUCKETS_S, registry=r)
        self.first_tokens = FirstTokens()
        r.register(self.first_tokens)
        self.ttft_target = Gauge("tidegate_tier_ttft_target_seconds", "Each tier's time-to-first-token target",
                                 ["tier"], registry=r)
        self.over_share = Gauge("tidegate_overload_tenants_over_share", "Tenants sending more than their fair "
                                "share's over_share_factor (their tier's other tenants are protected meanwhile)",
                                ["pool", "tier"], registry=r)
        self.work_budget = Gauge("tidegate_replica_work_budget_tokens", "Prefill tokens the replica's engine may "
                                 "hold ahead of a best-tier request: its fitted TTFT line at the engine's share of "
                                 "the target (NaN before its first token is measured)", ["pool", "replica"],
                                 registry=r)
        self.slots = Gauge("tidegate_replica_slots", "Requests this gateway may hold at the replica now: its "
                           "slot_limit, less the load from outside the gateways read off its engine's gauges, or "
                           "this gateway's share of it when gateways split it", ["pool", "replica"], registry=r)
        self.prefix_index = Gauge("tidegate_replica_prefix_index_characters", "Prompt-prefix characters the "
                                  "gateway counts the replica as holding at most (prefix-aware routing): its engine's "
                                  "KV cache in tokens, configured or reported, at the characters a token its usage "
                                  "shows; 0 without prefix affinity", ["pool", "replica"], registry=r)
        self.ttft_fit = Gauge("tidegate_replica_ttft_fit_seconds", "The replica's fitted engine time to first "
                              "token: `fixed` seconds plus `per_token` seconds for each prefill token ahead (NaN "
                              "before its first token)", ["pool", "replica", "coefficient"], registry=r)

    def sent_at_arrival(self, pool: str, tier: str, prompt_tokens: int) -> None:
        """A request admitted and sent at once, the common case below capacity, counted in one call:
        its admission (`queued`), its queue wait (0: the first bucket, nothing added to the sum) and
        its prompt's work, with each series looked up once per (pool, tier) rather than per request."""
        counted = self._at_arrival.get((pool, tier))
        if counted is None:
            waits = self.queue_wait.labels(pool, tier)
            counted = self._at_arrival[(pool, tier)] = (
                self.admissions.labels(pool, tier, "queued"), waits.counts, bisect.bisect_left(waits.bounds, 0.0),
                self.work_tokens.row(pool))
        admitted, wait_counts, no_wait, work = counted
        admitted.value += 1
        wait_counts[no_wait] += 1
        work[0] += prompt_tokens

    def of(self, metric: Any, *labels: str) -> Any:
        """The labelled child, resolved once: `labels()` takes a lock and builds a key each call."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch_queue(self, pool: str, tier: str, depth: Callable[[], float], oldest_wait_s: Callable[[], float],
                    over_share: Callable[[], float] | None = None) -> None:
        self.queue_depth.labels(pool, tier).set_function(depth)
        self.oldest_wait.labels(pool, tier).set_function(oldest_wait_s)
        if over_share is not None:
            self.over_share.labels(pool, tier).set_function(over_share)

    def watch_length_class_fallbacks(self, fallbacks: Mapping[str, Callable[[], int]]) -> None:
        """Per pool with length classes: requests sent outside their class because none of its
        replicas was up (`policy.length_classes`), read at scrape time."""
        if fallbacks:
            self._registry.register(_CallbackCounter(
                "tidegate_length_class_fallbacks", "Requests sent outside their length class because none of "
                "the class's replicas was up, by pool", "pool", fallbacks))

    def watch_replica(self, pool: str, replica: str, budget_tokens: Callable[[], float | None],
                      fit: Callable[[], TtftFit | None], slots: Callable[[], float],
                      prefix_index_chars: Callable[[], float] | None = None) -> None:
        def read() -> float:
            tokens = budget_tokens()
            return math.nan if tokens is None else tokens

        def coefficient(name: str) -> Callable[[], float]:
            return lambda: math.nan if (line := fit()) is None else getattr(line, name)

        self.work_budget.labels(pool, replica).set_function(read)
        self.slots.labels(pool, replica).set_function(slots)
        if prefix_index_chars is not None:
            self.prefix_index.labels(pool, replica).set_function(prefix_index_chars)
        self.ttft_fit.labels(pool, replica, "fixed").set_function(coefficient("fixed_s"))
        self.ttft_fit.labels(pool, replica, "per_token").set_function(coefficient("s_per_token"))


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class PlainCounter:
    """A labelled counter in plain numbers, exported as `<name>_total` at scrape time: a
    prometheus-client child's `inc` takes a lock and three calls, this one addition. Single-threaded
    by design, like `FirstTokens`: counted and collected on the gateway's loop."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, labelnames
        self._children: dict[tuple[str, ...], _Count] = {}

    def labels(self, *values: str) -> _Count:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Count()
        return child

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, child in sorted(self._children.items()):
            family.add_metric(values, child.value)
        yield family


class _Series:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * (len(bounds) + 1)  # per bucket, +Inf last
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class PlainHistogram:
    """A labelled histogram in plain numbers, exported at scrape time (`PlainCounter`'s reasons:
    a prometheus-client observation takes two locks and five calls, this a bisect and two additions)."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self._name, self._documentation, self._labelnames = name, documentation, labelnames
        self._bounds = tuple(buckets)
        self._children: dict[tuple[str, ...], _Series] = {}

    def labels(self, *values: str) -> _Series:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Series(self._bounds)
        return child

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        for values, series in sorted(self._children.items()):
            running, buckets = 0.0, []
            for bound, count in zip((*self._bounds, math.inf), series.counts):
                running += count
                buckets.append(("+Inf" if math.isinf(bound) else repr(float(bound)), running))
            family.add_metric(values, buckets, series.sum)
        yield family


def quantile_from_buckets(q: float, buckets: Buckets) -> float:
    """Prometheus's `histogram_quantile`: linear within the bucket; NaN with no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            width = count - lower_count
            return bound if width <= 0 else lower_bound + (bound - lower_bound) * (rank - lower_count) / width
        lower_bound, lower_count = bound, count
    return lower_bound


def bucket_increase(now: Buckets, before: Buckets) -> Buckets:
    """What a histogram gained since `before` (a read of the same series earlier; empty: nothing)."""
    earlier = dict(before)
    return [(bound, count - earlier.get(bound, 0.0)) for bound, count in now]


class WorkTokens:
    """Tokens of work arriving by pool, prompt and output, counted in plain numbers on the event
    loop's thread and exported as `tidegate_overload_work_tokens_total{pool,kind}` at scrape time,
    and the work served (prompt + output of the requests that generated output), from which the
    autoscaler measures a replica's throughput (`policy.throughput`),
    `tidegate_overload_served_tokens_total{pool}`:
    a labelled prometheus-client counter's increment costs ~0.6 us with its child lookup (a lock,
    a tuple key), two of them a request on the hot path; this, two additions.
    Single-threaded by design, like `FirstTokens`."""

    def __init__(self) -> None:
        self._by_pool: dict[str, list[float]] = {}  # pool -> [prompt tokens, output tokens, tokens served]

    def row(self, pool: str) -> list[float]:
        """The pool's [prompt tokens, output tokens, tokens served], created at 0 (counted into in place)."""
        row = self._by_pool.get(pool)
        if row is None:
            row = self._by_pool[pool] = [0.0, 0.0, 0.0]
        return row

    def add(self, pool: str, prompt_tokens: int, output_tokens: int) -> None:
        row = self.row(pool)
        row[0] += prompt_tokens
        row[1] += output_tokens

    def add_served(self, pool: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request that generated `output_tokens` settled: its output arrives as work, and its
        prompt and output were served."""
        row = self._by_pool.get(pool) or self.row(pool)  # the pool's row is there after its first request
        row[1] += output_tokens
        row[2] += prompt_tokens + output_tokens

    def totals(self) -> dict[str, float]:
        """Tokens (prompt + output) counted so far by pool: a query, for the autoscaler's tick."""
        return {pool: prompt + output for pool, (prompt, output, _) in self._by_pool.items()}

    def served_totals(self) -> dict[str, float]:
        """Tokens served so far by pool: a query, for the autoscaler's tick."""
        return {pool: served for pool, (_, _, served) in self._by_pool.items()}

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("tidegate_overload_work_tokens", "Work arriving by pool and kind: prompt "
                                     "tokens of every arrival (refused ones too), output tokens as generated",
                                     labels=["pool", "kind"])
        served = CounterMetricFamily("tidegate_overload_served_tokens", "Work served by pool: prompt + output "
                                     "tokens of the requests that generated output", labels=["pool"])
        for pool, (prompt, output, served_tokens) in sorted(self._by_pool.items()):
            family.add_metric([pool, "prompt"], prompt)
            family.add_metric([pool, "output"], output)
            served.add_metric([pool], served_tokens)
        yield family
        yield served


class FirstTokens:
    """Streamed requests' time to first token by pool and tier, and whether it met the tier's target
    (the latency SLO's events): counted in plain lists on the event loop's thread and turned into
    `tidegate_overload_time_to_first_token_seconds` and `tidegate_overload_first_tokens_total` at
    scrape time. A labelled prometheus-client histogram and counter cost 3-5 us a streamed request
    (locks, child lookups; +0.05 on `bench/gateway_overhead.py`'s streaming CPU ratio); this, a bisect
    and three increments. Single-threaded by design: observed and collected on the gateway's loop."""

    def __init__(self, buckets_s: tuple[float, ...] = _TTFT_BUCKETS_S) -> None:
        self._bounds = buckets_s
        # (pool, tier) -> [count per bucket (+Inf last)..., sum of seconds, within target, late]
        self._series: dict[tuple[str, str], list[float]] = {}

    def observe(self, pool: str, tier: str, ttft_s: float, within_target: bool) -> None:
        row = self._series.get((pool, tier))
        if row is None:
            row = self._series[(pool, tier)] = [0.0] * (len(self._bounds) + 4)
        row[bisect.bisect_left(self._bounds, ttft_s)] += 1
        row[-3] += ttft_s
        row[-2 if within_target else -1] += 1

    def cumulative(self) -> dict[tuple[str, str], Buckets]:
        """Each (pool, tier)'s cumulative buckets now (a query: the status page and the autoscaler
        read them without parsing a scrape)."""
        series = {}
        for key, row in self._series.items():
            running, buckets = 0.0, []
            for bound, count in zip((*self._bounds, math.inf), row):
                running += count
                buckets.append((bound, running))
            series[key] = buckets
        return series

    def collect(self) -> Iterator[Metric]:
        histogram = HistogramMetricFamily("tidegate_overload_time_to_first_token_seconds",
                                          "Streamed requests: arrival to their first token, by pool and tier",
                                          labels=["pool", "tier"])
        events = CounterMetricFamily("tidegate_overload_first_tokens", "Streamed requests' first tokens, by "
                                     "whether they came within their tier's TTFT target (outcome: within_target, "
                                     "late): the latency SLO's events", labels=["pool", "tier", "outcome"])
        cumulative = self.cumulative()
        for (pool, tier), row in sorted(self._series.items()):
            buckets = [("+Inf" if math.isinf(bound) else repr(float(bound)), count)
                       for bound, count in cumulative[(pool, tier)]]
            histogram.add_metric([pool, tier], buckets, row[-3])
            events.add_metric([pool, tier, "within_target"], row[-2])
            events.add_metric([pool, tier, "late"], row[-1])
        yield histogram
        yield events


class _CallbackCounter:
    """A counter, one series per label value, each read from its callback at scrape time."""

    def __init__(self, name: str, documentation: str, label: str, values: Mapping[str, Callable[[], int]]) -> None:
        self._name, self._documentation, self._label, self._values = name, documentation, label, dict(values)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._documentation, labels=[self._label])
        for value, read in self._values.items():
            family.add_metric([value], read())
        yield family
