"""Each new ejection of a replica is counted once, with its reason, in
`tidegate_replica_ejections_total{pool,replica,reason}`, and logged."""

from __future__ import annotations

import logging

import pytest

from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.gateway.upstream import ConnectionPool, Endpoint
from tidegate.policy.health import BreakerPolicy
from tidegate.telemetry.metrics import GatewayMetrics

_ENDPOINT = Endpoint("127.0.0.1", 9, False, b"/v1", b"127.0.0.1:9")


def _pool(count: int) -> tuple[ModelPool, GatewayMetrics]:
    replicas = [Replica(f"r{i}", "pool", ConnectionPool(_ENDPOINT, 1.0), 1, "m", None, health_url=None)
                for i in range(count)]
    pool = ModelPool("pool", replicas, BreakerPolicy(failure_threshold=3, cooldown_s=5.0), 10, 5.0, retry_after_s=2)
    metrics = GatewayMetrics()
    pool.ejections = metrics.replica_ejections
    return pool, metrics


def _ejections(metrics: GatewayMetrics, replica: str, reason: str) -> float:
    value = metrics.registry.get_sample_value("tidegate_replica_ejections_total",
                                              {"pool": "pool", "replica": replica, "reason": reason})
    return value or 0.0


def test_consecutive_failures_count_one_ejection_and_log_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    pool, metrics = _pool(3)
    replica = pool.replicas[0]
    with caplog.at_level(logging.WARNING, logger="tidegate.dispatch"):
        for _ in range(5):  # the failures after the third are stale (sent before it was ejected)
            pool.record_failure(replica, 1.0, 0.5)
    assert _ejections(metrics, "r0", "consecutive") == 1.0
    assert [r.getMessage() for r in caplog.records] == ["replica ejected"]
    assert caplog.records[0].fields["reason"] == "consecutive"  # type: ignore[attr-defined]


def test_a_failed_probe_counts_a_second_ejection() -> None:
    pool, metrics = _pool(3)
    replica = pool.replicas[0]
    for _ in range(3):
        pool.record_failure(replica, 1.0, 0.5)
    probe_s = replica.breaker.reopen_at_s
    replica.breaker = replica.breaker.on_dispatch(probe_s)
    pool.record_failure(replica, probe_s + 0.1, probe_s)
    assert _ejections(metrics, "r0", "consecutive") == 2.0


def test_a_replica_failing_like_the_rest_of_its_pool_is_kept() -> None:
    # every replica has failed as often: the median is as high as the replica's own ratio
    pool, metrics = _pool(3)
    for index in range(40):
        for replica in pool.replicas:
            if index % 3 == 2:
                pool.record_failure(replica, 1.0, 1.0)
            else:
                pool.record_success(replica, 1.0, 1.0)
    assert all(_ejections(metrics, f"r{i}", "success_rate") == 0.0 for i in range(3))
