"""Typed gateway configuration: YAML plus `${ENV}` substitution. The only module reading the environment.

Every model forbids unknown keys, so a typo is named in the error instead of silently ignored.
The overload control sections `tenants`, `tiers`, `limits` and `degradation` are typed in
`tidegate.overload_config`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from tidegate.overload_config import (
    DegradationConfig,
    LimitsConfig,
    OverloadConfig,
    TenantConfig,
    TiersConfig,
    check_tenant_tiers,
)
from tidegate.policy.length_classes import LengthClass, LengthClasses

__all__ = [
    "ConfigError",
    "ServerConfig",
    "HealthConfig",
    "AutoscaleConfig",
    "ForecastConfig",
    "CacheConfig",
    "BatchConfig",
    "SharedStateConfig",
    "TracingConfig",
    "PoolCacheConfig",
    "SemanticCacheConfig",
    "EmbeddedBackend",
    "UpstreamBackend",
    "FailoverConfig",
    "PoolConfig",
    "LengthClassConfig",
    "GatewayConfig",
    "load_config",
    "parse_config",
    "default_config",
    "embedded_sizing",
]

_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file, key and reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)  # larger requests get 413
    max_tokens_cap: int = Field(1_000_000, ge=1)  # max_tokens above this is a 400
    connect_timeout_s: float = Field(2.0, gt=0)
    # Upstream timeouts, each from the request's dispatch to a replica -> 504 (mid-stream: an error
    # event, then the stream ends). A stalled replica once held clients until request_timeout_s.
    first_byte_timeout_s: float = Field(60.0, gt=0)  # stream: no event with output by then
    stream_idle_timeout_s: float = Field(30.0, gt=0)  # stream: upstream silent this long between events
    whole_answer_timeout_s: float = Field(120.0, gt=0)  # not streamed: the whole answer by then
    request_timeout_s: float = Field(600.0, gt=0)  # whole request, stream included
    # a client that reads none of its answer for this long is dropped and its upstream work cancelled
    client_write_timeout_s: float = Field(30.0, gt=0)
    queue_timeout_s: float = Field(30.0, gt=0)  # waiting for a free replica slot -> 503
    max_queued_requests: int = Field(10_000, ge=0)  # per pool; beyond -> 503
    retry_after_s: int = Field(1, ge=0)  # Retry-After sent with 503
    access_log: bool = True  # one compact JSON line per request on stderr
    api_keys: tuple[SecretStr, ...] = ()  # when set, clients must send one as a Bearer token
    # Client connections; a connection whose request is being handled is never timed out. Idle: no
    # byte of a request yet, on a new connection or between keep-alive requests; closed silently.
    # 75 s (nginx's default) outlasts the 60 s idle timeout of common load balancers and the pools of
    # client libraries (httpx 5 s, aiohttp 15 s), so that the other side closes first and never sends
    # a request into a connection being closed; an idle connection is cheap, and the first to go
    # when the cap is reached.
    keepalive_timeout_s: float = Field(75.0, gt=0)
    # first byte of a request to the end of its headers -> 408 and close. A head is one packet from
    # any real client; 20 s still survives four TCP retransmissions, and bounds how long a
    # slowloris client trickling header lines holds its connection.
    head_timeout_s: float = Field(20.0, gt=0)
    # end of the headers to the end of the body -> 408 and close: 60 s (nginx's) takes a
    # max_body_bytes body at 70 KB/s; raise it with max_body_bytes for slow links
    body_timeout_s: float = Field(60.0, gt=0)
    # open client connections; past it a new one gets 503 (after the longest-idle one is closed to make
    # room, if any). Lowered at start to fit the open file limit, less one descriptor per upstream slot.
    max_connections: int = Field(10_000, ge=1)
    # who reads /metrics, whose labels name every replica's host:port (docs/configuration.md,
    # "Metrics access"); with none of these, /metrics takes the same keys as the API
    metrics_api_key: SecretStr | None = None  # then /metrics needs this Bearer token, and no other
    metrics_port: int | None = Field(None, ge=0, le=65535)  # then /metrics is served there only
    metrics_host: str | None = None  # the metrics listener's address; default: `host`
    # GET /status (a live HTML page) and /status.json, served where /metrics is, to whom it is
    status_page: bool = True
    # Shutdown (SIGTERM, SIGINT): /ready answers 503 at once while requests are still served, for
    # `shutdown_delay_s`, so that load balancers and Kubernetes endpoints stop sending new ones; then
    # the listener closes and the requests in flight finish, for up to `drain_timeout_s`; keep-alive
    # connections are closed after their answer (docs/configuration.md, "Restarts")
    shutdown_delay_s: float = Field(0.0, ge=0)
    drain_timeout_s: float = Field(60.0, ge=0)
    # SO_REUSEPORT: a new gateway may listen on the port of the one it replaces, both accept until
    # the old one drains: a restart on one host refuses nothing
    reuse_port: bool = False

    @model_validator(mode="after")
    def _metrics_listener_of_its_own(self) -> ServerConfig:
        if self.metrics_port is None:
            if self.metrics_host is not None:
                raise ValueError("metrics_host needs metrics_port")
        elif self.metrics_port == self.port and self.port != 0:
            raise ValueError(f"metrics_port must differ from port ({self.port})")
        return self


class HealthConfig(_Strict):
    interval_s: float = Field(2.0, gt=0)  # active GET /health period
    timeout_s: float = Field(2.0, gt=0)
    failure_threshold: int = Field(3, ge=1)  # consecutive request failures that eject a replica
    # or its share failing of its last ~16 requests exceeds the median of the pool's others by this
    failure_ratio: float = Field(0.2, gt=0, le=1)
    # ... and by this many standard errors of the pool's ratio over ~16 requests (a fleet failing
    # alike has no outlier); failures in a row must be as rare as run_chance at the pool's ratio
    ratio_confidence: float = Field(3.5, ge=0)
    run_chance: float = Field(1e-4, gt=0, le=1)
    cooldown_s: float = Field(5.0, gt=0)
    max_cooldown_s: float = Field(60.0, gt=0)
    max_ejected_fraction: float = Field(0.5, gt=0, le=1)  # of a pool's replicas (at least one)
    # with overload control: eject a replica whose engine is this many times slower than the median
    # of the pool's others (its fitted TTFT speed factor); off by default (policy/health.py says why)
    latency_factor: float | None = Field(None, gt=1)
    # retries on another replica (connection failure or 5xx before anything reached the client):
    # at most this many per request sent, plus retry_budget_min_per_s
    retry_budget_ratio: float = Field(0.2, ge=0)
    retry_budget_min_per_s: float = Field(5.0, ge=0)


class EmbeddedBackend(_Strict):
    """Local `tidegate engine` workers the gateway spawns and supervises."""

    type: Literal["embedded"] = "embedded"
    model: str
    count: int = Field(1, ge=1, le=64)
    threads: int = Field(1, ge=1, le=256)
    engine_args: tuple[str, ...] = ()  # extra `tidegate engine` flags
    slot_limit: int = Field(64, ge=1)  # requests one worker may hold at once
    startup_timeout_s: float = Field(600.0, gt=0)


class UpstreamBackend(_Strict):
    """An OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp, Ollama, a provider)."""

    type: Literal["upstream"] = "upstream"
    url: str  # base URL including the API prefix, e.g. http://10.0.0.5:8000/v1
    model: str | None = None  # the upstream's name for the model; default: the pool's name
    api_key: SecretStr | None = None  # sent as Bearer; never echoed
    health_path: str | None = "/health"  # on the URL's host; null: passive ejection only
    # on the URL's host, read with each health check: the engine's running and waiting requests and
    # KV-cache use (vLLM, SGLang, `tidegate engine` gauges) for routing and for the load from outside
    # the gateways, which leaves them fewer slots (docs/scale-out.md); null, or a page without them:
    # none known
    metrics_path: str | None = "/metrics"
    # the tokens its KV cache holds, which bound the prefixes the gateway counts it as holding
    # (prefix-aware routing); null: as its engine reports (vLLM, SGLang, `tidegate engine` gauges)
    kv_cache_tokens: int | None = Field(None, ge=1)
    slot_limit: int = Field(256, ge=1)
    # send 2 x the request's tier rank (0 = best), +1 while its tenant floods the tier, as its
    # `priority`, for engines that schedule by it (vLLM with --scheduling-policy priority,
    # `tidegate engine`): a critical prompt is then prefilled ahead of the sheddable ones already
    # queued inside the engine, a quiet tenant's ahead of a flood's. Off: other servers may refuse
    # the unknown field
    forward_priority: bool = False

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http(s) URL with a host, got {url!r}")
        return url.rstrip("/")


Backend = Annotated[Union[EmbeddedBackend, UpstreamBackend], Field(discriminator="type")]


class KubernetesTargetConfig(_Strict):
    """The workload the gateway scales itself through the Kubernetes API (needs `tidegate[kubernetes]`
    and RBAC on its scale subresource; docs/autoscaling.md)."""

    namespace: str = Field("default", min_length=1)
    kind: Literal["Deployment", "StatefulSet"] = "Deployment"
    name: str = Field(min_length=1)


class ForecastConfig(_Strict):
    """The autoscaler's predictive layer (`policy.forecast`): the arrival rate per `bucket_s` is
    forecast one `cold_start_s` ahead (set it to the replicas' measured start time) and the fleet
    is sized for it before it arrives. Holt-Winters forecasts after two seasons seen, seasonal-naive
    after one; before, the last bucket's rate (the reactive layer then leads)."""

    method: Literal["holt_winters", "seasonal_naive"] = "holt_winters"
    bucket_s: float = Field(60.0, gt=0)
    season_s: float = Field(86_400.0, gt=0)  # a day
    cold_start_s: float = Field(60.0, ge=0)
    alpha: float = Field(0.3, gt=0, lt=1)  # Holt-Winters: level, trend, season smoothing
    beta: float = Field(0.05, gt=0, lt=1)
    gamma: float = Field(0.3, gt=0, lt=1)

    @model_validator(mode="after")
    def _season(self) -> ForecastConfig:
        if self.season_s < self.bucket_s:
            raise ValueError("autoscale.forecast: season_s must be >= bucket_s")
        return self


class AutoscaleConfig(_Strict):
    """The pool's desired replica count, computed by the gateway (`policy.autoscale.Autoscaler`) and
    exported as `tidegate_desired_replicas{pool}` for an actuator to follow (the Kubernetes HPA or
    KEDA in deploy/kubernetes). List up to `max_replicas` backends: those not running are simply
    not ready (docs/autoscaling.md, "Live")."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(8, ge=1)
    slots_per_replica: int | None = Field(None, ge=1)  # default: the pool's largest slot_limit
    target_utilisation: float = Field(0.7, gt=0, le=1)
    stable_window_s: float = Field(60.0, gt=0)
    panic_window_s: float = Field(6.0, gt=0)
    scale_up_step: float = Field(0.25, gt=0)
    scale_down_window_s: float = Field(300.0, ge=0)
    queue_trigger: int = Field(100, ge=1)
    latency_trigger: float = Field(1.2, gt=0)
    tick_s: float = Field(5.0, gt=0)  # how often the gateway decides
    # tokens (prompt + output) per second one replica serves at its slot limit, measured (e.g.
    # `bench/autoscale_live.py` prints it for an embedded worker); set (and overload_control on: it
    # counts the work), the pool scales on the work arriving, not on the requests it holds
    replica_tokens_per_s: float | None = Field(None, gt=0)
    # work demand: the fleet moves only when the work's mean, give or take this many standard
    # errors, needs another count (0: the mean alone; docs/autoscaling.md)
    noise_band_sigmas: float = Field(2.0, ge=0)
    # work demand: the utilisation the pool may run at while its P99 TTFT has margin: edge_hold_s
    # after the last miss the fleet did not absorb, and while the work does not rise (null:
    # target_utilisation always; docs/autoscaling.md, "Latency feedback")
    edge_utilisation: float | None = Field(None, gt=0, le=1)
    edge_hold_s: float = Field(300.0, ge=0)
    # workers (embedded pools) or a StatefulSet's pods (`kubernetes`, its pods listed in ordinal order)
    # kept loaded and out of traffic, taken at once by a scale-out (seconds instead of a cold start)
    # and refilled in the background
    standby: int = Field(0, ge=0)
    # set: the gateway writes the desired count to this workload's scale itself (else it only exports it)
    kubernetes: KubernetesTargetConfig | None = None
    forecast: ForecastConfig | None = None  # set: the predictive layer scales ahead of the forecast rate

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscale: min_replicas must be <= max_replicas")
        if self.panic_window_s > self.stable_window_s:
            raise ValueError("autoscale: panic_window_s must be <= stable_window_s")
        if self.edge_utilisation is not None and self.edge_utilisation < self.target_utilisation:
            raise ValueError("autoscale: edge_utilisation must be >= target_utilisation")
        return self


class SemanticCacheConfig(_Strict):
    """A paraphrase of a cached chat question gets its answer (docs/caching.md): same tenant, model,
    system prompt, earlier turns and parameters; the last user turn similar above `threshold` and
    agreeing in numbers, negations, names, units and dates."""

    embedding_pool: str = "all-MiniLM-L6-v2"  # the pool that embeds questions
    # 0.3 % false hits and 69 % of paraphrases on the shipped labelled set (bench/semantic_cache.py)
    threshold: float = Field(0.86, gt=0, le=1)
    rung_threshold: float | None = Field(None, gt=0, le=1)  # looser, for the ladder's cached-answer rung
    max_entries: int = Field(10_000, ge=1)
    embed_timeout_s: float = Field(1.0, gt=0)  # a slower embedding is a miss


class PoolCacheConfig(_Strict):
    """The pool's exact response cache and single-flight coalescing (docs/caching.md). Deterministic
    requests (temperature 0, a seed, embeddings) are cached; `Cache-Control: no-store` / `no-cache`
    from the client and a tenant's `response_cache: false` opt out."""

    cache_sampled: bool = False  # also cache sampled requests: a hit then repeats one earlier sample
    coalesce: bool = True  # identical requests in flight share one upstream request
    semantic: SemanticCacheConfig | None = None  # opt-in: paraphrases of cached questions


class CacheConfig(_Strict):
    """The response cache's tiers, shared by every pool that has `response_cache`."""

    memory_bytes: int = Field(64 << 20, ge=0)  # in-process LRU bound
    redis_url: str | None = None  # redis://host:port/db: a tier shared by every gateway, with a TTL
    ttl_s: float = Field(3600.0, gt=0)
    redis_timeout_s: float = Field(0.05, gt=0)  # a slower Redis reply is a miss
    redis_retry_s: float = Field(5.0, gt=0)  # after a Redis failure the tier is skipped this long


class SharedStateConfig(_Strict):
    """Where the tenants' RPM/TPM buckets live (docs/scale-out.md). `memory`: in each gateway process,
    so N gateways admit N times a limit. `redis`: in one Redis shared by every gateway, reserved and
    settled by Lua scripts on Redis time, so the limits hold across processes exactly."""

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None  # redis://[user:password@]host:port/db or rediss://...; needed by `redis`
    # Redis unreachable, or slower than redis_timeout_s: `local` admits on in-process buckets of
    # limit / gateway_count; `fail_open` admits everything; `fail_closed` answers 503 + Retry-After
    on_redis_error: Literal["fail_open", "fail_closed", "local"] = "local"
    gateway_count: int = Field(1, ge=1)  # gateways sharing the limits: `local` gives each 1/gateway_count
    redis_timeout_s: float = Field(0.25, gt=0)  # a reply slower than this is an outage
    redis_retry_s: float = Field(1.0, gt=0)  # after an outage, Redis is tried again this often
    key_prefix: str = Field("tidegate:rl:", min_length=1)
    # with backend redis, the gateways in front of the same replicas: `split` their slots (each takes
    # a max-min fair share of every replica's slot_limit, agreed through a Redis heartbeat), or
    # `per_gateway`: each fills every replica's whole slot_limit, as if alone (docs/scale-out.md)
    dispatch: Literal["split", "per_gateway"] = "split"
    # how often a gateway publishes its demand and takes its share: a slot one gateway gives back idles
    # until another's next heartbeat. Answers shorter than it, a 6:3:1 load balancer: the engines'
    # batch 91 % in use at 0.5 s, 93 % at 0.25 s, 95 % at 0.1 s (sim.active_active); one Lua script a beat
    heartbeat_s: float = Field(0.25, gt=0)
    # a gateway not heard from this long is dead: its share returns to the others; a gateway that cannot
    # reach Redis keeps its last shares this long, then takes slot_limit // gateway_count of each replica
    member_ttl_s: float = Field(3.0, gt=0)

    @model_validator(mode="after")
    def _redis_needs_url(self) -> SharedStateConfig:
        if self.member_ttl_s <= self.heartbeat_s:
            raise ValueError("shared_state: member_ttl_s must be longer than heartbeat_s")
        if self.backend == "redis":
            scheme = urlsplit(self.redis_url).scheme if self.redis_url else ""
            if scheme not in ("redis", "rediss"):
                raise ValueError("shared_state: backend redis needs redis_url (redis://host:port/db or rediss://)")
        return self


class TracingConfig(_Strict):
    """OpenTelemetry traces of requests, exported over OTLP (docs/observability.md, "Tracing"). Off by
    default; a client's `traceparent` is passed on to upstreams either way."""

    enabled: bool = False
    # the collector's OTLP/HTTP base URL (`/v1/traces` is appended unless it is there); for
    # protocol grpc its gRPC address, e.g. http://otel-collector:4317
    endpoint: str = "http://127.0.0.1:4318"
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    # builtin: tidegate's own OTLP/HTTP encoder, no dependency, a few µs a request; sdk: the
    # OpenTelemetry SDK's exporters (`pip install 'tidegate[tracing]'`), needed for grpc
    exporter: Literal["builtin", "sdk"] = "builtin"
    sampling_ratio: float = Field(1.0, ge=0, le=1)  # of traces that start here (by trace id, as TraceIdRatioBased)
    parent_based: bool = True  # a client's traceparent decides by its sampled flag
    propagate: bool = True  # upstreams get a traceparent naming the attempt's span (vLLM, SGLang continue it)
    service_name: str = Field("tidegate", min_length=1)
    resource_attributes: dict[str, str] = {}  # e.g. deployment.environment: prod
    headers: dict[str, SecretStr] = {}  # sent with each export, e.g. a collector's authorization
    max_queue_spans: int = Field(8192, ge=1)  # spans waiting for export; past it new ones are dropped, counted
    max_batch_spans: int = Field(512, ge=1)
    export_interval_s: float = Field(1.0, gt=0)
    export_timeout_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _exporter_speaks_protocol(self) -> TracingConfig:
        if self.protocol == "grpc" and self.exporter == "builtin":
            raise ValueError("tracing: protocol grpc needs exporter: sdk (the built-in exporter speaks OTLP/HTTP)")
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"tracing.endpoint must be an http(s) URL with a host, got {self.endpoint!r}")
        return self


class BatchConfig(_Strict):
    """The OpenAI Batch API (docs/batch.md): files and batches kept in Redis (run it with AOF), their
    requests queued on a Redis Stream and run by every gateway whose `worker` is on, in `tier`, so
    that they take only the capacity interactive tiers leave idle. Off unless a Redis is configured:
    `redis_url`, or else `shared_state.redis_url`."""

    enabled: bool | None = None  # None: on exactly when a Redis URL is known
    redis_url: str | None = None  # None: shared_state.redis_url
    worker: bool = True  # this process runs queued batch requests (any number of gateways may)
    tier: str = "batch"  # the tier its requests are admitted in (a configured tier)
    # batch requests this gateway holds in its own queue and at replicas at once: enough to fill idle
    # slots, few enough that the queue is not flooded (the controller still decides when each goes)
    max_in_flight: int = Field(16, ge=1)
    max_attempts: int = Field(3, ge=1)  # runs of a request that failed (5xx, a dead gateway) before it is dead-lettered
    # an entry held this long by a consumer that stopped confirming it (a dead gateway) is taken over;
    # live workers confirm theirs every claim_idle_s / 3, so a slow request is never taken from them
    claim_idle_s: float = Field(30.0, gt=0)
    sweep_interval_s: float = Field(1.0, gt=0)  # how often finished, expired and cancelled batches are closed
    max_file_bytes: int = Field(100 << 20, ge=1024)  # an upload is also bounded by server.max_body_bytes
    max_requests_per_batch: int = Field(50_000, ge=1)  # OpenAI's limit
    key_prefix: str = Field("tidegate:batch:", min_length=1)
    # retention, so that Redis does not grow forever: a final batch, its output and error files and
    # its input file go this long after it ended; a file no batch read goes this long after its upload
    retention_s: float = Field(30 * 86400.0, gt=0)
    dead_letter_max_len: int = Field(10_000, ge=1)  # the dead-letter stream is trimmed to its newest entries
    # a stream consumer (a gateway's worker, by process) with nothing pending and idle this long is
    # removed: each restart makes a new one, and their names would pile up in the group
    consumer_idle_s: float = Field(300.0, gt=0)
    retention_sweep_interval_s: float = Field(60.0, gt=0)  # how often expired batches, files, consumers go
    # batch work takes the level slots the interactive tiers left idle on average over this window
    # (policy.background_share); 0 (the default): only batch.max_in_flight bounds it. Off by default:
    # measured (docs/batch.md), it halved the batch's rate and left the replicas 70 % busy instead
    # of 85 % for 2.4 points of interactive P99 (+35.9 % against +38.3 %): capacity idled, goal missed
    share_memory_s: float = Field(0.0, ge=0)
    # an interactive request that finds no free slot stops a running batch request to take its slot,
    # and the batch request runs again later (`policy.pool` rule 9; docs/batch.md): engines do not
    # preempt, so without it each slot batch work holds is one an interactive burst waits for
    preemptible: bool = True

    @model_validator(mode="after")
    def _url_is_redis(self) -> BatchConfig:
        if self.redis_url is not None and urlsplit(self.redis_url).scheme not in ("redis", "rediss"):
            raise ValueError("batch: redis_url must be redis://host:port/db or rediss://")
        return self


class FailoverConfig(_Strict):
    """Mid-stream failover (docs/configuration.md): a stream whose replica dies or stalls after output
    began is continued on another replica, the client's stream uninterrupted."""

    # off: such a stream ends with an error event. Turn it off for upstreams that do not take an
    # assistant prefix (`continue_final_message`, as vLLM and `tidegate engine` do) and would start over
    enabled: bool = True
    max_failovers: int = Field(1, ge=1, le=8)  # continuations of one request


class LengthClassConfig(_Strict):
    """One of a pool's length classes (`policy.length_classes`): prompts of at most
    `max_prompt_tokens` (estimated) tokens go to `replicas` while any of them is up."""

    max_prompt_tokens: int | None = Field(None, ge=1)  # None: the last class, any length
    # the pool's replicas that serve it, by position from 0 in backend order (an embedded backend's
    # `count` workers are as many positions)
    replicas: tuple[int, ...] = Field(min_length=1)


class PoolConfig(_Strict):
    name: str = Field(min_length=1)  # the `model` clients ask for
    backends: tuple[Backend, ...] = Field(min_length=1)
    failover: FailoverConfig = FailoverConfig()
    autoscale: AutoscaleConfig | None = None
    response_cache: PoolCacheConfig | None = None  # None: every request goes to a replica
    # embedded workers kept loaded and out of traffic: when a serving worker's process dies, a spare
    # takes its traffic at once and the restarted worker becomes the spare once loaded, so a crash
    # does not leave the pool a worker short while a model loads (autoscaled pools: autoscale.standby)
    spare: int = Field(0, ge=0)
    # short and long prompts on separate replica sets, ordered by bound, the last unbounded; None: one set
    length_classes: tuple[LengthClassConfig, ...] | None = None

    @property
    def replica_count(self) -> int:
        return sum(b.count if isinstance(b, EmbeddedBackend) else 1 for b in self.backends)

    @model_validator(mode="after")
    def _length_classes_name_fixed_replicas(self) -> PoolConfig:
        if self.length_classes is None:
            return self
        if self.autoscale is not None or self.spare:
            raise ValueError(f"pool {self.name!r}: length_classes needs a fixed set of replicas "
                             "(no autoscale, no spare)")
        count = self.replica_count
        for position, length_class in enumerate(self.length_classes):
            bad = [i for i in length_class.replicas if not 0 <= i < count]
            if bad:
                raise ValueError(f"pool {self.name!r}: length_classes[{position}] names replicas {bad}; "
                                 f"the pool has replicas 0 to {count - 1}")
        try:
            self.length_class_policy([str(i) for i in range(count)])
        except ValueError as error:
            raise ValueError(f"pool {self.name!r}: {error}") from None
        return self

    def length_class_policy(self, replica_ids: Sequence[str]) -> LengthClasses | None:
        """The pool's length classes over its replicas' ids (in backend order); None: none configured."""
        if self.length_classes is None:
            return None
        return LengthClasses(tuple(LengthClass(c.max_prompt_tokens, frozenset(replica_ids[i] for i in c.replicas))
                                   for c in self.length_classes))

    @model_validator(mode="after")
    def _spares_are_embedded_workers(self) -> PoolConfig:
        if not self.spare:
            return self
        if self.autoscale is not None:
            raise ValueError(f"pool {self.name!r}: an autoscaled pool keeps spares with autoscale.standby")
        if not all(isinstance(b, EmbeddedBackend) for b in self.backends):
            raise ValueError(f"pool {self.name!r}: spare needs embedded backends only")
        workers = sum(b.count for b in self.backends if isinstance(b, EmbeddedBackend))
        if self.spare >= workers:
            raise ValueError(f"pool {self.name!r}: spare ({self.spare}) leaves none of its {workers} "
                             "embedded workers to serve")
        return self


class GatewayConfig(_Strict):
    server: ServerConfig = ServerConfig()
    health: HealthConfig = HealthConfig()
    pools: tuple[PoolConfig, ...] = Field(min_length=1)
    # overload control: on unless switched off (off: FIFO queues and static slot limits, the baseline)
    overload_control: bool = True
    tenants: dict[str, TenantConfig] = {}
    tiers: TiersConfig = TiersConfig()
    limits: LimitsConfig = LimitsConfig()
    degradation: DegradationConfig = DegradationConfig()
    cache: CacheConfig = CacheConfig()
    shared_state: SharedStateConfig = SharedStateConfig()
    tracing: TracingConfig = TracingConfig()
    batch: BatchConfig = BatchConfig()

    @model_validator(mode="after")
    def _unique_pool_names(self) -> GatewayConfig:
        names = [pool.name for pool in self.pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(duplicates)}")
        for pool in self.pools:  # an embedded pool's workers are what its autoscaler can start
            if pool.autoscale is not None and all(isinstance(b, EmbeddedBackend) for b in pool.backends):
                workers = sum(b.count for b in pool.backends if isinstance(b, EmbeddedBackend))
                wanted = pool.autoscale.max_replicas + pool.autoscale.standby
                if wanted > workers:
                    raise ValueError(f"pool {pool.name!r}: autoscale.max_replicas + standby ({wanted}) "
                                     f"is more than its {workers} embedded workers")
        for pool in self.pools:  # a Kubernetes standby is a pod past those serving: the pool lists them all
            autoscale = pool.autoscale
            if autoscale is not None and autoscale.kubernetes is not None and autoscale.standby:
                listed = autoscale.max_replicas + autoscale.standby
                if autoscale.kubernetes.kind != "StatefulSet" or len(pool.backends) != listed:
                    raise ValueError(f"pool {pool.name!r}: autoscale.standby on Kubernetes needs a StatefulSet whose "
                                     f"pods the pool lists as its backends in ordinal order, max_replicas + standby "
                                     f"({listed}) of them")
        for pool in self.pools:
            if pool.length_classes is not None and not self.overload_control:
                raise ValueError(f"pool {pool.name!r}: length_classes needs overload_control (its pool controller "
                                 "routes by them)")
        for pool in self.pools:
            semantic = pool.response_cache.semantic if pool.response_cache is not None else None
            if semantic is not None and semantic.embedding_pool not in names:
                raise ValueError(f"pool {pool.name!r}: response_cache.semantic.embedding_pool "
                                 f"{semantic.embedding_pool!r} is not a pool")
        for pool, ladder in self.degradation.pools.items():
            for name in (pool, ladder.fallback_pool):
                if name is not None and name not in names:
                    raise ValueError(f"degradation.pools: unknown pool {name!r}")
        check_tenant_tiers(self.tenants, self.tiers)
        if self.batch.enabled and self.batch_redis_url is None:
            raise ValueError("batch: enabled needs batch.redis_url or shared_state.redis_url")
        wanted = self.batch.enabled or self.batch.redis_url is not None
        if wanted and self.batch.enabled is not False and self.batch.tier not in self.tiers.table():
            raise ValueError(f"batch: tier {self.batch.tier!r} is not a configured tier")
        return self

    @property
    def batch_redis_url(self) -> str | None:
        """Where the Batch API keeps its files, batches and queue; None: the Batch API is off."""
        if self.batch.enabled is False:
            return None
        if self.batch.enabled is None and self.batch.redis_url is None and self.batch.tier not in self.tiers.table():
            return None  # on by default only where its tier exists (custom tiers may have none)
        return self.batch.redis_url or self.shared_state.redis_url

    @property
    def overload(self) -> OverloadConfig:
        return OverloadConfig(tenants=self.tenants, tiers=self.tiers, limits=self.limits,
                              degradation=self.degradation)


def _substitute_env(value: Any, environ: dict[str, str], where: str) -> Any:
    """Replaces `${NAME}` / `${NAME:-default}` in the parsed config's strings (not in comments, and a
    secret's characters can never change the YAML's structure)."""
    if isinstance(value, dict):
        return {key: _substitute_env(item, environ, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [_substitute_env(item, environ, f"{where}.{index}") for index, item in enumerate(value)]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in environ:
            return environ[name]
        if default is not None:
            return default
        raise ConfigError(f"{where}: environment variable {name} is not set (referenced as ${{{name}}})")

    return _ENV_REFERENCE.sub(replace, value)


def _describe(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"  {location}: {message}")
    return "\n".join(lines)


def parse_config(text: str, source: str = "<config>", environ: dict[str, str] | None = None) -> GatewayConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    data = _substitute_env(data, dict(os.environ) if environ is None else environ, source)
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, source)) from None


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from None
    return parse_config(text, source=str(path))


def embedded_sizing(cpu_count: int) -> tuple[int, int]:
    """(generation workers, threads each) for the embedded default.

    Up to two cores: one single-threaded worker per core (the gateway is light). Beyond: one core is
    left to the gateway and the embeddings worker; the rest is cut into workers of 2 threads (4 from
    13 cores up: small models gain little past that, and more replicas give the router room), at
    most 8 workers. 1 -> 1 x 1; 2 -> 2 x 1; 4 -> 1 x 2; 8 -> 3 x 2; 16 -> 3 x 4; 64 -> 8 x 4.
    """
    cpu_count = max(1, cpu_count)
    if cpu_count <= 2:
        return cpu_count, 1
    usable = cpu_count - 1
    threads = 2 if usable < 12 else 4
    return max(1, min(8, usable // threads)), threads


def default_config(cpu_count: int | None = None, host: str = "127.0.0.1", port: int = 8000) -> GatewayConfig:
    """The embedded default: tiny-random-llama workers sized to the machine, plus one embeddings worker."""
    workers, threads = embedded_sizing(cpu_count or os.cpu_count() or 1)
    return GatewayConfig(
        server=ServerConfig(host=host, port=port),
        pools=(
            PoolConfig(name="tiny-random-llama",
                       backends=(EmbeddedBackend(model="tiny-random-llama", count=workers, threads=threads),)),
            PoolConfig(name="all-MiniLM-L6-v2",
                       backends=(EmbeddedBackend(model="all-MiniLM-L6-v2", count=1, threads=1),)),
        ),
    )
