"""The hot path's plain-number metrics export what prometheus-client's own counter and histogram would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from tidegate.gateway.overload_metrics import OverloadMetrics, PlainCounter, PlainHistogram

_BOUNDS = (0.005, 0.1, 1.0)
_VALUES = (0.0, 0.005, 0.0051, 0.1, 0.5, 2.0, 2.0)  # on a bound, just past one, and past the last


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in registry.collect() if family.name == name
            for sample in family.samples if not sample.name.endswith("_created")}


def test_a_plain_histogram_exports_the_buckets_count_and_sum_of_a_prometheus_one() -> None:
    plain_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    plain = PlainHistogram("wait_seconds", "doc", ("pool", "tier"), _BOUNDS)
    plain_registry.register(plain)
    reference = Histogram("wait_seconds", "doc", ["pool", "tier"], buckets=_BOUNDS, registry=reference_registry)
    for value in _VALUES:
        plain.labels("m", "standard").observe(value)
        reference.labels("m", "standard").observe(value)
    assert _samples(plain_registry, "wait_seconds") == _samples(reference_registry, "wait_seconds")


def test_a_plain_counter_exports_the_total_of_a_prometheus_one() -> None:
    plain_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    plain = PlainCounter("arrivals", "doc", ("pool", "outcome"))
    plain_registry.register(plain)
    reference = Counter("arrivals", "doc", ["pool", "outcome"], registry=reference_registry)
    for outcome in ("queued", "queued", "rate_limited"):
        plain.labels("m", outcome).inc()
        reference.labels("m", outcome).inc()
    assert _samples(plain_registry, "arrivals") == _samples(reference_registry, "arrivals")


def test_admissions_and_queue_wait_keep_their_metric_names() -> None:
    registry = CollectorRegistry()
    metrics = OverloadMetrics(registry)
    metrics.of(metrics.admissions, "m", "standard", "queued").inc()
    metrics.of(metrics.queue_wait, "m", "standard").observe(0.02)
    labels = {"pool": "m", "tier": "standard"}
    assert registry.get_sample_value("tidegate_overload_admissions_total", {**labels, "outcome": "queued"}) == 1
    assert registry.get_sample_value("tidegate_overload_queue_wait_seconds_count", labels) == 1
    assert registry.get_sample_value("tidegate_overload_queue_wait_seconds_bucket", {**labels, "le": "0.025"}) == 1


def test_a_request_sent_at_arrival_counts_as_its_admission_its_wait_of_zero_and_its_prompt() -> None:
    """`sent_at_arrival` exports what the three separate observations it stands for would."""
    one_call, separate = CollectorRegistry(), CollectorRegistry()
    counted, reference = OverloadMetrics(one_call), OverloadMetrics(separate)
    for pool, tier, prompt_tokens in (("m", "standard", 12), ("m", "standard", 30), ("m", "critical", 7),
                                      ("n", "standard", 1)):
        counted.sent_at_arrival(pool, tier, prompt_tokens)
        reference.of(reference.admissions, pool, tier, "queued").inc()
        reference.of(reference.queue_wait, pool, tier).observe(0.0)
        reference.work_tokens.add(pool, prompt_tokens, 0)
    counted.queue_wait.labels("m", "standard").observe(0.3)  # a waited request beside them
    reference.queue_wait.labels("m", "standard").observe(0.3)
    for name in ("tidegate_overload_admissions", "tidegate_overload_queue_wait_seconds",
                 "tidegate_overload_work_tokens"):
        assert _samples(one_call, name) == _samples(separate, name) != {}
    assert counted.work_tokens.totals() == reference.work_tokens.totals()
