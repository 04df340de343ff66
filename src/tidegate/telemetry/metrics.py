"""Gateway metrics (prometheus-client) in a registry of their own; label children resolved once per pool."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GatewayMetrics", "PoolMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class PoolMetrics:
    """The hot path's handles for one pool: no label lookup per request except status."""

    __slots__ = ("_requests", "_pool", "_by_status", "in_flight", "ttft", "e2e", "queue_depth")

    def __init__(self, metrics: GatewayMetrics, pool: str) -> None:
        self._requests = metrics.requests
        self._pool = pool
        self._by_status: dict[int, Counter] = {}
        self.in_flight = metrics.in_flight.labels(pool)
        self.ttft = metrics.ttft.labels(pool)
        self.e2e = metrics.e2e.labels(pool)
        self.queue_depth = metrics.queue_depth.labels(pool)

    def count(self, status: int) -> None:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self._requests.labels(self._pool, str(status))
        counter.inc()


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tidegate_requests", "Requests answered, by pool and HTTP status",
                                ["pool", "status"], registry=r)
        self.in_flight = Gauge("tidegate_requests_in_flight", "Requests being served, by pool", ["pool"], registry=r)
        self.ttft = Histogram("tidegate_time_to_first_token_seconds",
                              "Streaming requests: arrival to first chunk sent", ["pool"],
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("tidegate_request_duration_seconds", "Arrival to last byte sent", ["pool"],
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.queue_depth = Gauge("tidegate_queue_depth", "Requests waiting for a replica slot", ["pool"], registry=r)
        self.upstream_errors = Counter("tidegate_upstream_errors", "Failed upstream exchanges",
                                       ["pool", "replica", "kind"], registry=r)
        self.upstream_retries = Counter("tidegate_upstream_retries", "Requests retried on another replica "
                                        "before anything reached the client", ["pool", "reason"], registry=r)
        self.stream_failovers = Counter("tidegate_stream_failovers", "Streams broken mid-answer by their replica "
                                        "(dead or silent), by outcome: resumed on another replica, failed (the "
                                        "continuation failed too), refused (not continued: error event)",
                                        ["pool", "outcome"], registry=r)
        self.replica_ejections = Counter("tidegate_replica_ejections", "Replicas ejected by their pool's "
                                         "outlier detection, by reason: consecutive (failures in a row), "
                                         "success_rate (failing far more than the pool's median), latency "
                                         "(far slower than the pool's median)", ["pool", "replica", "reason"],
                                         registry=r)
        self.replica_healthy = Gauge("tidegate_replica_healthy", "1 when the replica takes traffic",
                                     ["pool", "replica"], registry=r)
        self.replica_outstanding = Gauge("tidegate_replica_outstanding", "Requests sent and not finished",
                                         ["pool", "replica"], registry=r)
        self.unrouted = Counter("tidegate_unrouted_requests", "Requests answered before any pool: bad path, "
                                "bad body, unknown model, auth", ["status"], registry=r)
        self.client_connections_open = Gauge("tidegate_client_connections_open", "Client connections open now",
                                             registry=r)
        self.client_connections_closed = Counter(
            "tidegate_client_connections_closed", "Client connections the gateway closed or refused because a "
            "limit bit: idle_timeout, head_timeout, body_timeout, idle_evicted (room under the cap), "
            "over_capacity (refused with 503)", ["reason"], registry=r)

    def for_pool(self, pool: str) -> PoolMetrics:
        return PoolMetrics(self, pool)

    def render(self) -> bytes:
        return generate_latest(self.registry)
