"""Assembles a running gateway from a GatewayConfig: replicas, pools, workers, health checks, server."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tidegate import __version__
from tidegate.config import BatchConfig, EmbeddedBackend, GatewayConfig, TracingConfig, UpstreamBackend
from tidegate.control.health_checks import HealthChecker
from tidegate.control.priority import LoadingPriority
from tidegate.control.supervisor import WorkerSpec, WorkerSupervisor
from tidegate.gateway.batch_api import BatchApi
from tidegate.gateway.batch_store import BatchStore
from tidegate.gateway.batch_worker import BatchWorker
from tidegate.gateway.connections import ConnectionLimits, ConnectionRegistry, connection_cap, raise_open_file_limit
from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.gateway.failover import TOKEN_IDS_HEADER, FailoverPolicy
from tidegate.gateway.http import HttpConnection
from tidegate.gateway.overload import OverloadRuntime
from tidegate.overload_config import build_policies
from tidegate.gateway.overload_metrics import OverloadMetrics
from tidegate.gateway.proxy import Proxy, ProxySettings
from tidegate.gateway.response_cache import CacheSettings, PoolCacheSettings, ResponseCache
from tidegate.gateway.semantic_cache import Embedder, SemanticCache, SemanticMetrics, SemanticSettings
from tidegate.gateway.shared_limits import SharedLimits, SharedLimitSettings
from tidegate.gateway.shared_dispatch import SharedDispatch, SharedDispatchSettings
from tidegate.gateway.spares import replace_dead_worker
from tidegate.gateway.tracing import Tracing, TracingSettings
from tidegate.gateway.scaling import KubernetesActuator, LocalActuator, ScaleLoop
from tidegate.gateway.upstream import ConnectionPool, Endpoint
from tidegate.policy.health import BreakerPolicy
from tidegate.policy.retry import RetryBudgetPolicy
from tidegate.ports import free_port as _free_port
from tidegate.telemetry.logs import AccessLog
from tidegate.telemetry.metrics import GatewayMetrics
from tidegate.types import ReplicaHealth

__all__ = ["Gateway"]

log = logging.getLogger("tidegate.gateway")

_SERVING = (ReplicaHealth.HEALTHY, ReplicaHealth.UNKNOWN, ReplicaHealth.UNHEALTHY)  # in traffic, or to be


def _upstream_replica(pool: str, index: int, backend: UpstreamBackend, connect_timeout_s: float) -> Replica:
    parts = urlsplit(backend.url)
    tls = parts.scheme == "https"
    host = parts.hostname or "localhost"
    port = parts.port or (443 if tls else 80)
    default_port = port == (443 if tls else 80)
    endpoint = Endpoint(host=host, port=port, use_tls=tls, base_path=parts.path.encode(),
                        host_header=(host if default_port else f"{host}:{port}").encode())
    health_url = f"{parts.scheme}://{host}:{port}{backend.health_path}" if backend.health_path else None
    scrape_url = f"{parts.scheme}://{host}:{port}{backend.metrics_path}" if backend.metrics_path else None
    return Replica(
        replica_id=f"{pool}#{index}@{host}:{port}", pool_name=pool,
        connections=ConnectionPool(endpoint, connect_timeout_s), slot_limit=backend.slot_limit,
        upstream_model=backend.model or pool,
        api_key=backend.api_key.get_secret_value() if backend.api_key else None, health_url=health_url,
        scrape_url=scrape_url, forward_priority=backend.forward_priority)


def _tracing(config: TracingConfig, registry: CollectorRegistry) -> tuple[Tracing, Any]:
    """The tracer and its span sink (exporter), from the `tracing` section."""
    resource: dict[str, str] = {"service.name": config.service_name, "service.version": __version__,
                                **config.resource_attributes}
    headers = {name: value.get_secret_value() for name, value in config.headers.items()}
    sink: Any
    if config.exporter == "builtin":
        from tidegate.gateway.trace_export import OtlpHttpExporter

        sink = OtlpHttpExporter(config.endpoint, resource, scope_version=__version__, headers=headers,
                                max_queue_spans=config.max_queue_spans, max_batch_spans=config.max_batch_spans,
                                interval_s=config.export_interval_s, timeout_s=config.export_timeout_s,
                                registry=registry)
    else:
        from tidegate.telemetry.otel_sdk import SdkSpanSink, sdk_exporter

        exporter = sdk_exporter(config.protocol, config.endpoint, headers, config.export_timeout_s)
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # there: sdk_exporter found the SDK

        processor = BatchSpanProcessor(exporter, max_queue_size=config.max_queue_spans,
                                       max_export_batch_size=min(config.max_batch_spans, config.max_queue_spans),
                                       schedule_delay_millis=config.export_interval_s * 1000)
        sink = SdkSpanSink(processor, resource, __version__)
    settings = TracingSettings(config.sampling_ratio, config.parent_based, config.propagate)
    return Tracing(settings, sink), sink


def _embedded_replica(pool: str, index: int, backend: EmbeddedBackend, connect_timeout_s: float,
                      max_body_bytes: int) -> tuple[Replica, WorkerSpec]:
    port = _free_port()
    endpoint = Endpoint(host="127.0.0.1", port=port, use_tls=False, base_path=b"/v1",
                        host_header=f"127.0.0.1:{port}".encode())
    replica_id = f"{pool}#{index}@127.0.0.1:{port}"
    replica = Replica(
        replica_id=replica_id, pool_name=pool, connections=ConnectionPool(endpoint, connect_timeout_s),
        slot_limit=backend.slot_limit, upstream_model=backend.model, api_key=None,
        health_url=f"http://127.0.0.1:{port}/health", scrape_url=f"http://127.0.0.1:{port}/metrics",
        forward_priority=True, extra_headers=TOKEN_IDS_HEADER)  # exact continuations (gateway/failover.py)
    # the gateway's limit is the one clients see: the worker takes whatever got past it, with room
    # for the gateway's rewrites of the body (`model`, `priority`, numbers re-serialized)
    worker_max_body_bytes = 2 * max_body_bytes + 64 * 1024
    argv = (sys.executable, "-m", "tidegate", "engine", "--model", backend.model, "--port", str(port),
            "--threads", str(backend.threads), "--max-body-bytes", str(worker_max_body_bytes),
            *backend.engine_args)
    return replica, WorkerSpec(name=replica_id, argv=argv)


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        server, health = config.server, config.health
        breaker_policy = BreakerPolicy(health.failure_threshold, health.cooldown_s, health.max_cooldown_s,
                                       failure_ratio=health.failure_ratio,
                                       ratio_confidence=health.ratio_confidence, run_chance=health.run_chance,
                                       max_ejected_fraction=health.max_ejected_fraction,
                                       latency_factor=health.latency_factor)
        retry_budget = RetryBudgetPolicy(ratio=health.retry_budget_ratio, min_per_s=health.retry_budget_min_per_s)
        self.pools: dict[str, ModelPool] = {}
        workers: list[WorkerSpec] = []
        configured_kv_tokens: dict[str, int | None] = {}  # replica id -> its backend's kv_cache_tokens
        for pool_config in config.pools:
            replicas: list[Replica] = []
            for backend in pool_config.backends:
                if isinstance(backend, UpstreamBackend):
                    replicas.append(_upstream_replica(pool_config.name, len(replicas), backend,
                                                      server.connect_timeout_s))
                    configured_kv_tokens[replicas[-1].replica_id] = backend.kv_cache_tokens
                    continue
                for _ in range(backend.count):
                    replica, spec = _embedded_replica(pool_config.name, len(replicas), backend,
                                                      server.connect_timeout_s, server.max_body_bytes)
                    replicas.append(replica)
                    workers.append(spec)
            self.pools[pool_config.name] = ModelPool(
                pool_config.name, replicas, breaker_policy, server.max_queued_requests,
                server.queue_timeout_s, server.retry_after_s, retry_budget=retry_budget, created_s=time.monotonic())
            failover = pool_config.failover
            self.pools[pool_config.name].failover = FailoverPolicy(failover.enabled, failover.max_failovers)
        self.metrics = GatewayMetrics()
        for pool in self.pools.values():
            pool.ejections = self.metrics.replica_ejections
        self.access_log = AccessLog(server.access_log)
        api_keys = frozenset(b"Bearer " + key.get_secret_value().encode() for key in server.api_keys)
        metrics_key = b"Bearer " + server.metrics_api_key.get_secret_value().encode() \
            if server.metrics_api_key is not None else None
        # overload control: each pool's controller owns its queue and slots; off: FIFO and static limits
        self.overload: OverloadRuntime | None = None
        if config.overload_control:
            limits = config.overload.limits
            pool_replicas = {name: [limits.pool_replica(r.replica_id, r.slot_limit, r.forward_priority,
                                                        configured_kv_tokens.get(r.replica_id))
                                    for r in pool.replicas] for name, pool in self.pools.items()}
            length_classes = {p.name: classes for p in config.pools
                              if (classes := p.length_class_policy([r.replica_id for r in self.pools[p.name].replicas]))
                              is not None}
            self.overload = OverloadRuntime(build_policies(config.overload, pool_replicas, breaker_policy,
                                                           length_classes), self.pools,
                                            OverloadMetrics(self.metrics.registry))
            self.overload.metrics.watch_length_class_fallbacks({
                name: lambda c=self.overload.control.pools[name].controller: c.length_class_fallbacks
                for name in length_classes})
        # tenants' rate limits kept in Redis, shared by every gateway (docs/scale-out.md)
        self.shared_limits: SharedLimits | None = None
        shared_state = config.shared_state
        if shared_state.backend == "redis" and self.overload is not None:
            assert shared_state.redis_url is not None
            self.shared_limits = SharedLimits(
                SharedLimitSettings(shared_state.redis_url, shared_state.on_redis_error, shared_state.gateway_count,
                                    shared_state.redis_timeout_s, shared_state.redis_retry_s, shared_state.key_prefix),
                self.overload.control.limiter, self.metrics.registry)
            self.overload.shared_limits = self.shared_limits
        elif shared_state.backend == "redis":
            log.warning("shared_state: backend redis keeps rate limits, which need overload_control; ignored")
        # gateways in front of the same replicas split their slots (gateway/shared_dispatch.py)
        self.shared_dispatch: SharedDispatch | None = None
        if shared_state.backend == "redis" and shared_state.dispatch == "split" and self.overload is not None:
            assert shared_state.redis_url is not None
            self.shared_dispatch = SharedDispatch(
                SharedDispatchSettings(shared_state.redis_url, heartbeat_s=shared_state.heartbeat_s,
                                       member_ttl_s=shared_state.member_ttl_s,
                                       gateway_count=shared_state.gateway_count,
                                       redis_timeout_s=shared_state.redis_timeout_s,
                                       key_prefix=shared_state.key_prefix),
                self.overload.bodies, self.metrics.registry)
        settings = ProxySettings(server.max_tokens_cap, server.first_byte_timeout_s, server.request_timeout_s,
                                 api_keys, metrics_key, metrics_on_main_port=server.metrics_port is None,
                                 whole_answer_timeout_s=server.whole_answer_timeout_s,
                                 stream_idle_timeout_s=server.stream_idle_timeout_s,
                                 status_page=server.status_page)
        # autoscaling: desired replicas per pool, exported for the HPA/KEDA (gateway/scaling.py); an
        # embedded pool's workers follow it here, starting with `min_replicas` of them
        autoscaled = {pool.name: pool.autoscale for pool in config.pools if pool.autoscale is not None}
        local = [p for p in config.pools if p.autoscale is not None
                 and all(isinstance(b, EmbeddedBackend) for b in p.backends)]
        held: set[str] = set()
        for pool_config in local:  # `min_replicas` workers serve, `standby` more load out of traffic
            assert pool_config.autoscale is not None
            serving, standby = pool_config.autoscale.min_replicas, pool_config.autoscale.standby
            for index, replica in enumerate(self.pools[pool_config.name].replicas):
                if index >= serving + standby:
                    replica.health = ReplicaHealth.STOPPED
                    held.add(replica.replica_id)
                elif index >= serving:
                    replica.health = ReplicaHealth.WARMING
        for pool_config in config.pools:  # warm spares load out of traffic (gateway/spares.py)
            for replica in self.pools[pool_config.name].replicas[len(self.pools[pool_config.name].replicas)
                                                                 - pool_config.spare:]:
                replica.health = ReplicaHealth.WARMING
        spared = [p.name for p in config.pools if p.spare or (p in local and p.autoscale and p.autoscale.standby)]
        self._spared_pool_of = {replica.replica_id: self.pools[name] for name in spared
                                for replica in self.pools[name].replicas}
        # a spare loads at a lower CPU priority, leaving the cores to the workers serving, where that
        # priority can be restored on its promotion (control/priority.py)
        self.supervisor = WorkerSupervisor(workers, held=frozenset(held),
                                           loading_priority=LoadingPriority.detect() if spared else None)
        if spared:
            self.supervisor.on_exit = self._worker_exited
            self.supervisor.loads_out_of_traffic = self._loads_out_of_traffic
            for name in spared:
                self.pools[name].on_replica_failed = self._check_worker
        actuators: dict[str, LocalActuator | KubernetesActuator] = {
            p.name: LocalActuator(self.pools[p.name], self.supervisor, self._wake_pools,
                                  standby=p.autoscale.standby if p.autoscale else 0,
                                  drain_timeout_s=server.request_timeout_s) for p in local}
        for pool_config in config.pools:
            target = pool_config.autoscale.kubernetes if pool_config.autoscale is not None else None
            if target is not None:
                from tidegate.control.kubernetes_scaler import KubernetesScaler, ScaleTarget, WorkloadKind

                scaler = KubernetesScaler(ScaleTarget(target.namespace, WorkloadKind(target.kind), target.name))
                replicas, autoscale = self.pools[pool_config.name].replicas, pool_config.autoscale
                # a StatefulSet's pods listed in ordinal order, all of them: a scale-in drains the ones it
                # removes, and standbys are the pods past those serving (config checks standby needs it)
                ordered = target.kind == "StatefulSet" and len(replicas) == autoscale.max_replicas + autoscale.standby
                if not ordered:
                    log.info("scale-in is written as decided, not drained first: list the StatefulSet's pods as the "
                             "pool's backends in ordinal order, max_replicas of them, to drain them",
                             extra={"fields": {"pool": pool_config.name, "kind": target.kind}})
                actuators[pool_config.name] = KubernetesActuator(
                    scaler, ordinals=list(replicas) if ordered else None, wake=self._wake_pools,
                    standby=autoscale.standby, drain_timeout_s=server.request_timeout_s)
        self.scaling = ScaleLoop(self.pools, autoscaled, self.metrics.registry, self.overload,
                                 actuators=actuators) if autoscaled else None
        self.cache: ResponseCache | None = None
        cached_pools = {p.name: PoolCacheSettings(p.response_cache.cache_sampled, p.response_cache.coalesce)
                        for p in config.pools if p.response_cache is not None}
        if cached_pools:
            tiers = config.cache
            semantic: dict[str, SemanticCache] = {}
            semantic_metrics = None
            for pool_config in config.pools:
                wanted = pool_config.response_cache.semantic if pool_config.response_cache is not None else None
                if wanted is None:
                    continue
                semantic_metrics = semantic_metrics or SemanticMetrics(self.metrics.registry)
                embedder = Embedder(self.pools[wanted.embedding_pool].replicas, time.monotonic, wanted.embed_timeout_s)
                semantic[pool_config.name] = SemanticCache(
                    SemanticSettings(wanted.embedding_pool, wanted.threshold, wanted.rung_threshold,
                                     wanted.max_entries, wanted.embed_timeout_s), embedder, semantic_metrics,
                    pool_config.name)
            self.cache = ResponseCache(
                CacheSettings(tiers.memory_bytes, tiers.redis_url, tiers.ttl_s, tiers.redis_timeout_s,
                              tiers.redis_retry_s), cached_pools, self.metrics.registry,
                opted_out_tenants=frozenset(name for name, t in config.tenants.items() if not t.response_cache),
                sampled_tenants=frozenset(name for name, t in config.tenants.items() if t.response_cache == "sampled"),
                semantic=semantic)
        # OpenTelemetry spans of requests (gateway/tracing.py); off: no tracer at all
        self.tracing: Tracing | None = None
        self._span_sink: Any = None
        if config.tracing.enabled:
            self.tracing, self._span_sink = _tracing(config.tracing, self.metrics.registry)
        self.proxy = Proxy(self.pools, settings, self.metrics, self.access_log, overload=self.overload,
                           scaling=self.scaling, cache=self.cache, tracing=self.tracing)
        # the Batch API (docs/batch.md): its routes on every gateway, its worker where `batch.worker` is on
        self.batch_store: BatchStore | None = None
        self.batch_worker: BatchWorker | None = None
        batch, batch_url = config.batch, config.batch_redis_url
        if batch_url is not None:
            if not config.overload_control:
                log.warning("batch: without overload_control its requests queue FIFO with interactive ones")
            self.batch_store = BatchStore(batch_url, batch.key_prefix, batch.retention_s, batch.dead_letter_max_len)
            self.proxy.batch_api = BatchApi(self.batch_store, lambda: self.pools.keys(), batch.max_file_bytes,
                                            batch.max_requests_per_batch)
            if batch.worker:
                self.batch_worker = BatchWorker(self.batch_store, self.proxy.handle, batch.tier, batch.max_in_flight,
                                                batch.max_attempts, batch.claim_idle_s, batch.sweep_interval_s,
                                                server.request_timeout_s, batch.retention_sweep_interval_s,
                                                batch.consumer_idle_s, self._background_share_inputs(batch),
                                                batch.share_memory_s, preemptible=batch.preemptible)
        all_replicas = [replica for pool in self.pools.values() for replica in pool.replicas]
        # each request in flight holds an upstream connection: their descriptors are kept out of the cap
        open_file_limit = raise_open_file_limit()
        max_connections = connection_cap(server.max_connections, sum(r.slot_limit for r in all_replicas),
                                         open_file_limit)
        self.connections = ConnectionRegistry(
            ConnectionLimits(server.keepalive_timeout_s, server.head_timeout_s, server.body_timeout_s,
                             max_connections), self.metrics)
        self.health_checker = HealthChecker(all_replicas, health.interval_s, health.timeout_s, self._wake_pools,
                                            self._engine_load_read(shared_state))
        # how long `serve` waits for every pool to turn ready before it warns
        self.startup_timeout_s = max((b.startup_timeout_s for p in config.pools for b in p.backends
                                      if isinstance(b, EmbeddedBackend)), default=60.0)
        self._server: asyncio.base_events.Server | None = None
        self._metrics_server: asyncio.base_events.Server | None = None
        self.port = server.port
        self.metrics_port = server.metrics_port

    def _worker_exited(self, replica_id: str) -> None:
        """A worker of a pool with spares died: a spare takes its traffic now (gateway/spares.py)."""
        pool = self._spared_pool_of.get(replica_id)
        if pool is not None and replace_dead_worker(pool.replicas, replica_id):
            for replica in pool.replicas:  # the promoted spare serves at the gateway's priority
                if replica.health in _SERVING and self.supervisor.priority_lowered(replica.replica_id):
                    self.supervisor.restore_priority(replica.replica_id)
            self._wake_pools()

    def _loads_out_of_traffic(self, replica_id: str) -> bool:
        """Asked as a worker (re)starts: it loads as a spare (WARMING), not to serve."""
        pool = self._spared_pool_of.get(replica_id)
        return pool is not None and any(r.replica_id == replica_id and r.health is ReplicaHealth.WARMING
                                        for r in pool.replicas)

    def _check_worker(self, replica: Replica) -> None:
        """A request to this replica failed: when its worker has exited (its connections break a few
        ms before the supervisor hears of the exit), its spare takes over now, so that the request's
        retry or failover finds it (`tests/gateway/test_spare_worker.py`)."""
        if self.supervisor.exited(replica.replica_id):
            self._worker_exited(replica.replica_id)

    def _engine_load_read(self, shared_state: Any) -> Callable[[Replica], None] | None:
        """What reads outside load off the engines' gauges at each scrape: the slot split among the
        gateways, or this gateway's controller when it is alone; nothing where each gateway fills
        every replica as if alone (`dispatch: per_gateway`, where the others' requests would read
        as outside load) or without overload control."""
        if self.shared_dispatch is not None:
            return self.shared_dispatch.observe_engine
        if self.overload is None or (shared_state.backend == "redis" and shared_state.dispatch == "per_gateway"):
            return None
        return self.overload.observe_engine

    def _wake_pools(self) -> None:
        now_s = time.monotonic()
        for pool in self.pools.values():
            pool.dispatch_waiting(now_s)

    def ready(self) -> bool:
        now_s = time.monotonic()
        return all(pool.ready(now_s) for pool in self.pools.values())

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await self.supervisor.start()
        await self.health_checker.start()
        if self.shared_limits is not None:
            await self.shared_limits.start()
        if self.shared_dispatch is not None:
            await self.shared_dispatch.start()
        if self.scaling is not None:
            await self.scaling.start()
        if self.batch_store is not None:
            await self._start_batch()
        self.access_log.start()
        if self._span_sink is not None:
            await self._span_sink.start()
        if self.cache is not None and self.cache.semantic:
            self._loading = loop.create_task(self.cache.load_semantic())  # shared entries, in the background
        server = self.config.server
        max_body = server.max_body_bytes
        handle = self.proxy.handle
        connections = self.connections
        write_timeout_s = server.client_write_timeout_s
        self._server = await loop.create_server(lambda: HttpConnection(handle, max_body, connections, write_timeout_s),
                                                server.host, server.port, backlog=4096, reuse_address=True,
                                                reuse_port=server.reuse_port or None)
        connections.start()
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("listening", extra={"fields": {"host": server.host, "port": self.port,
                                                "pools": {n: len(p.replicas) for n, p in self.pools.items()},
                                                "max_connections": connections.limits.max_connections}})
        if server.metrics_port is not None:
            metrics_host = server.metrics_host or server.host
            handle_metrics = self.proxy.handle_metrics_listener
            # a scrape has no body: anything over 1 KiB is no scrape
            self._metrics_server = await loop.create_server(lambda: HttpConnection(handle_metrics, 1024),
                                                            metrics_host, server.metrics_port, reuse_address=True)
            self.metrics_port = self._metrics_server.sockets[0].getsockname()[1]
            log.info("metrics listening", extra={"fields": {"host": metrics_host, "port": self.metrics_port}})

    def _background_share_inputs(self, batch: BatchConfig) -> Callable[[], tuple[int, int]] | None:
        """(level slots, demand of tiers better than batch's) over the pools' controllers, for the
        batch worker's share (`policy.background_share`); None without overload control or a memory."""
        overload = self.overload
        if overload is None or batch.share_memory_s <= 0:
            return None
        controllers = [body.controller for body in overload.bodies.values()]

        def inputs() -> tuple[int, int]:
            now_s = overload.clock()
            return (sum(c.level_slots(now_s) for c in controllers),
                    sum(c.demand_above(batch.tier) for c in controllers))

        return inputs

    async def _start_batch(self) -> None:
        """The stream's consumer group, then the worker; a Redis not up yet is waited for by the
        worker's own loop (it creates the group when it finds it missing)."""
        assert self.batch_store is not None
        try:
            await self.batch_store.ensure_group()
        except (RedisConnectionError, RedisTimeoutError, OSError) as error:
            log.warning("batch: redis unavailable at start", extra={"fields": {"error": str(error)}})
        if self.batch_worker is not None:
            await self.batch_worker.start()

    async def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return True
            await asyncio.sleep(0.1)
        return self.ready()

    async def drain(self) -> None:
        """Shutdown's first half: /ready says 503 while requests are still served for
        `shutdown_delay_s`; then the listener closes, the requests in flight finish and the client
        connections close (each after its next answer, or once idle), for up to `drain_timeout_s`.
        `stop` then ends what is left."""
        server = self.config.server
        self.proxy.draining = True
        if self.batch_worker is not None:
            await self.batch_worker.hand_back()  # internal and durable: not waited for like clients' requests
        log.info("draining", extra={"fields": {"shutdown_delay_s": server.shutdown_delay_s,
                                               "in_flight": self.proxy.active}})
        if server.shutdown_delay_s:
            await asyncio.sleep(server.shutdown_delay_s)
        if self._server is not None:
            self._server.close()
        self.connections.drain()
        deadline = time.monotonic() + server.drain_timeout_s
        # until the requests in flight are answered and every client connection has closed: each
        # closes after its next answer, or idle (connections.DRAIN_IDLE_S)
        while (self.proxy.active or len(self.connections)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.proxy.active:
            log.warning("drain timed out", extra={"fields": {"in_flight": self.proxy.active}})

    async def stop(self) -> None:
        for listener in (self._server, self._metrics_server):
            if listener is not None:
                listener.close()
        self.connections.stop()
        if self.scaling is not None:
            await self.scaling.stop()
        await self.health_checker.stop()
        await self.supervisor.stop()
        if self.cache is not None:
            await self.cache.close()
        if self.shared_limits is not None:
            await self.shared_limits.close()
        if self.shared_dispatch is not None:
            await self.shared_dispatch.close()
        if self.batch_worker is not None:
            await self.batch_worker.stop()
        if self.batch_store is not None:
            await self.batch_store.close()
        for pool in self.pools.values():
            for replica in pool.replicas:
                replica.connections.close()
        await self.access_log.stop()
        if self._span_sink is not None:
            await self._span_sink.stop()  # what is queued goes out, within the export timeout
