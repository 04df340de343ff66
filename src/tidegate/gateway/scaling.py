"""The autoscaler, live: every `tick_s` each pool with `autoscale` configured turns what the gateway
sees into `ScaleSignals`, asks its `policy.autoscale.Autoscaler`, and exports the answer as
`tidegate_desired_replicas{pool}` beside `tidegate_replicas_ready{pool}` (the names the simulator's
reports use), for an actuator to follow: the Kubernetes HPA or KEDA on that metric
(deploy/kubernetes/hpa.yaml). The same policy object the simulator drives (`sim.scaling`).

Signals, from the gateway alone: ready = replicas taking traffic (health and breaker); starting =
replicas the last decision asked for that are not ready yet; in flight = requests held by
replicas; queued = the pool's queue; arrivals, refusals and the work arriving (prompt tokens at
arrival, output tokens as generated: `tidegate_overload_work_tokens_total{pool,kind}`) since the
last tick from the gateway's own counters; the worst tier's P99 time to first token over the tick against its target. The pool
lists up to `max_replicas` backends: one that is not running is just not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tidegate.config import AutoscaleConfig
from tidegate.gateway.dispatch import ModelPool
from tidegate.gateway.kubernetes_actuator import KubernetesActuator
from tidegate.gateway.overload_metrics import Buckets, bucket_increase, quantile_from_buckets
from tidegate.policy.autoscale import AutoscaleSettings, Autoscaler, ScaleDecision, ScaleSignals
from tidegate.policy.fleet import FleetActions, FleetCounts, fleet_actions
from tidegate.policy.forecast import Forecaster, make_forecaster
from tidegate.policy.health import is_routable
from tidegate.types import ReplicaHealth

__all__ = ["ScaleLoop", "ScaleRecord", "LocalActuator", "KubernetesActuator", "autoscale_settings", "forecaster_for"]

log = logging.getLogger("tidegate.scaling")

HISTORY = 20  # decisions kept per pool for the status page


def autoscale_settings(config: AutoscaleConfig, pool: ModelPool, work_counted: bool = True) -> AutoscaleSettings:
    """The policy's settings; on work demand when the gateway counts the work arriving and served
    (`work_counted`: overload control on), with `replica_tokens_per_s` as set, else as measured
    while the pool is saturated (`policy.throughput`)."""
    slots = config.slots_per_replica or max(replica.slot_limit for replica in pool.replicas)
    work = config.replica_tokens_per_s if work_counted else None
    ahead = {} if config.forecast is None else {"cold_start_s": config.forecast.cold_start_s,
                                                 "forecast_bucket_s": config.forecast.bucket_s}
    return AutoscaleSettings(slots, min_replicas=config.min_replicas, max_replicas=config.max_replicas,
                             target_utilisation=config.target_utilisation, stable_window_s=config.stable_window_s,
                             panic_window_s=config.panic_window_s, scale_up_step=config.scale_up_step,
                             scale_down_window_s=config.scale_down_window_s, queue_trigger=config.queue_trigger,
                             latency_trigger=config.latency_trigger, replica_tokens_per_s=work,
                             noise_band_sigmas=config.noise_band_sigmas, measure_throughput=work_counted,
                             edge_utilisation=config.edge_utilisation, edge_hold_s=config.edge_hold_s, **ahead)


def forecaster_for(config: AutoscaleConfig) -> Forecaster | None:
    """The predictive layer's forecaster, when `autoscale.forecast` is set."""
    f = config.forecast
    if f is None:
        return None
    return make_forecaster(f.method, f.bucket_s, f.season_s, alpha=f.alpha, beta=f.beta, gamma=f.gamma)


@dataclass(frozen=True, slots=True)
class ScaleRecord:
    """A decision that changed the desired count, for the status page and the log."""

    at_s: float
    ready: int
    desired: int
    layer: str
    reason: str


class LocalActuator:
    """Makes an embedded pool's running workers follow the desired count, with `standby` more kept
    loaded and out of traffic, through the pure decision the simulator also carries out
    (`policy.fleet.fleet_actions`): a scale-out takes standbys first (routable at once: seconds
    instead of a cold start), then starts stopped workers; standbys are refilled in the background.
    A scale-in drains before it stops: the replica leaving takes no new request
    (`ReplicaHealth.DRAINING`), and once it holds none it becomes a standby when the decision kept
    it as one, else its process stops, so no request is aborted. The most recently started go
    first; the last serving replica never (tests/gateway/test_local_actuator.py)."""

    def __init__(self, pool: ModelPool, supervisor: Any, wake: Callable[[], None], *, standby: int = 0,
                 drain_timeout_s: float = 600.0) -> None:
        self._pool = pool
        self._supervisor = supervisor
        self._wake = wake  # tells the pool's dispatch (and controller) that health changed
        self._standby = standby
        self._drain_timeout_s = drain_timeout_s
        self._kept: set[str] = set()  # draining replicas that become standbys once empty
        self._tasks: set[asyncio.Task] = set()

    def starting(self) -> int:
        """Workers started to serve and not yet answering their health check."""
        return sum(1 for replica in self._pool.replicas if replica.health is ReplicaHealth.UNKNOWN)

    def _with(self, *states: ReplicaHealth) -> list[Any]:
        return [replica for replica in self._pool.replicas if replica.health in states]

    def counts(self) -> FleetCounts:
        """The fleet as `fleet_actions` sees it; a draining replica kept as a standby counts as
        warming (it will be one), so that it is not refilled twice."""
        return FleetCounts(serving=len(self._with(ReplicaHealth.HEALTHY, ReplicaHealth.UNHEALTHY)),
                           starting=self.starting(), standby=len(self._with(ReplicaHealth.STANDBY)),
                           warming=len(self._with(ReplicaHealth.WARMING)) + len(self._kept),
                           standby_target=self._standby)

    def apply(self, desired: int) -> FleetActions:
        """Carries out `fleet_actions` towards `desired` (changes state: health, processes) and
        returns them."""
        actions = fleet_actions(desired, self.counts())
        promoted = self._with(ReplicaHealth.STANDBY)[:actions.promote]
        for replica in promoted:
            replica.health = ReplicaHealth.HEALTHY  # loaded already: routable now
            self._supervisor.restore_priority(replica.replica_id)  # it loaded at a lower priority
            log.info("standby takes traffic", extra={"fields": {"replica": replica.replica_id}})
        stopped = self._with(ReplicaHealth.STOPPED)
        for replica in stopped[:actions.start]:
            replica.health = ReplicaHealth.UNKNOWN  # its health checks take it from here
            self._spawn(self._supervisor.start_worker(replica.replica_id))
        for replica in stopped[actions.start:actions.start + actions.warm]:
            replica.health = ReplicaHealth.WARMING  # its first good health check makes it a standby
            self._spawn(self._supervisor.start_worker(replica.replica_id))
        serving = self._with(ReplicaHealth.HEALTHY, ReplicaHealth.UNHEALTHY)
        drained: list[Any] = []
        for replica in list(reversed(serving))[:actions.drain]:
            if not any(r.health is ReplicaHealth.HEALTHY for r in serving if r is not replica and r not in drained):
                break  # what stays must include a replica that answers its health checks
            drained.append(replica)
        for index, replica in enumerate(drained):
            replica.health = ReplicaHealth.DRAINING
            if index < actions.keep_drained:
                self._kept.add(replica.replica_id)
            self._spawn(self._drain(replica))
        if promoted or drained:
            self._wake()
        return actions

    async def _drain(self, replica: Any) -> None:
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self._drain_timeout_s
        while replica.outstanding > 0 and loop.time() < deadline_s:
            await asyncio.sleep(0.05)
        if replica.replica_id in self._kept:
            self._kept.discard(replica.replica_id)
            replica.health = ReplicaHealth.STANDBY  # loaded: kept as a standby rather than start another
            log.info("drained to standby", extra={"fields": {"replica": replica.replica_id}})
        else:
            await self._supervisor.stop_worker(replica.replica_id)
            replica.health = ReplicaHealth.STOPPED
            log.info("replica stopped", extra={"fields": {"replica": replica.replica_id,
                                                          "still_held": replica.outstanding}})
        self._wake()

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _PoolScaling:
    def __init__(self, pool: ModelPool, config: AutoscaleConfig, work_counted: bool) -> None:
        self.pool = pool
        self.autoscaler = Autoscaler(autoscale_settings(config, pool, work_counted), forecaster_for(config))
        self.desired: int | None = None
        self.arrived = 0.0  # the gateway's counters at the previous tick
        self.refused = 0.0
        self.tokens = 0.0
        self.served = 0.0
        self.ttft: dict[str, Buckets] = {}  # tier -> cumulative buckets at the previous tick
        self.history: deque[ScaleRecord] = deque(maxlen=HISTORY)


class ScaleLoop:
    def __init__(self, pools: Mapping[str, ModelPool], configs: Mapping[str, AutoscaleConfig],
                 registry: CollectorRegistry, overload: Any | None, clock: Callable[[], float] = time.monotonic,
                 actuators: Mapping[str, LocalActuator | KubernetesActuator] | None = None) -> None:
        self._actuators = dict(actuators or {})  # pools whose workers the gateway starts and stops itself
        self._registry = registry
        self._overload = overload
        self._clock = clock
        for name, config in configs.items():
            if config.replica_tokens_per_s is not None and overload is None:
                log.warning("autoscale: replica_tokens_per_s needs overload_control (it counts the work "
                            "arriving); the pool scales on the requests it holds", extra={"fields": {"pool": name}})
        self._pools = {name: _PoolScaling(pools[name], config, overload is not None)
                       for name, config in configs.items()}
        self._tick_s = min((config.tick_s for config in configs.values()), default=5.0)
        self.desired = Gauge("tidegate_desired_replicas", "Replicas the pool's autoscaler wants (for the HPA or "
                             "KEDA to follow)", ["pool"], registry=registry)
        self.ready = Gauge("tidegate_replicas_ready", "Replicas taking traffic", ["pool"], registry=registry)
        self.throughput = Gauge("tidegate_autoscale_replica_tokens_per_s", "One replica's token throughput at its "
                                "slot limit the autoscaler divides the work by: as set, else as measured while "
                                "the pool is saturated (absent until known)", ["pool"], registry=registry)
        self.decisions = Counter("tidegate_autoscale_decisions", "Changes of the desired replicas, by the layer "
                                 "that decided (reactive, trigger, panic, predictive, bounds)", ["pool", "layer"],
                                 registry=registry)
        self._task: asyncio.Task | None = None

    def history(self, pool: str) -> tuple[ScaleRecord, ...]:
        scaling = self._pools.get(pool)
        return tuple(scaling.history) if scaling is not None else ()

    async def start(self) -> None:
        now_s = self._clock()
        arrivals, refusals, tokens, served = self._totals()
        for name, scaling in self._pools.items():  # counters from now: what came before is not this tick's
            scaling.arrived, scaling.refused = arrivals.get(name, 0.0), refusals.get(name, 0.0)
            scaling.tokens, scaling.served = tokens.get(name, 0.0), served.get(name, 0.0)
            self.ready.labels(name).set(self._ready(scaling.pool, now_s))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                self.tick(self._clock())
            except Exception:  # a failed decision must not stop the next ones
                log.exception("autoscaling tick failed")

    def tick(self, now_s: float) -> None:
        """Decides every pool's size once (changes the autoscalers' state and the gauges)."""
        arrivals, refusals, tokens, served = self._totals()
        for name, scaling in self._pools.items():
            pool = scaling.pool
            ready = self._ready(pool, now_s)
            arrived, refused = arrivals.get(name, 0.0), refusals.get(name, 0.0)
            actuator = self._actuators.get(name)
            starting = actuator.starting() if actuator is not None else max(0, (scaling.desired or ready) - ready)
            signals = ScaleSignals(now_s, ready=ready, starting=starting,
                                   in_flight=sum(replica.outstanding for replica in pool.replicas),
                                   queued=self._queued(name, pool), arrivals=int(arrived - scaling.arrived),
                                   refused=int(refused - scaling.refused), ttft_ratio=self._take_ttft_ratio(name, scaling),
                                   arrived_tokens=int(tokens.get(name, 0.0) - scaling.tokens),
                                   served_tokens=int(served.get(name, 0.0) - scaling.served))
            scaling.arrived, scaling.refused, scaling.tokens = arrived, refused, tokens.get(name, 0.0)
            scaling.served = served.get(name, 0.0)
            decision = scaling.autoscaler.on_tick(signals)
            tokens_per_s = scaling.autoscaler.replica_tokens_per_s
            if tokens_per_s is not None:
                self.throughput.labels(name).set(tokens_per_s)
            self.ready.labels(name).set(ready)
            self.desired.labels(name).set(decision.desired)
            if decision.desired != scaling.desired:
                self._record(name, scaling, now_s, ready, decision)
            scaling.desired = decision.desired
            if actuator is not None:
                actuator.apply(decision.desired)

    def _record(self, name: str, scaling: _PoolScaling, now_s: float, ready: int, decision: ScaleDecision) -> None:
        scaling.history.append(ScaleRecord(now_s, ready, decision.desired, decision.layer.value, decision.reason))
        self.decisions.labels(name, decision.layer.value).inc()
        log.info("desired replicas", extra={"fields": {"pool": name, "ready": ready, "desired": decision.desired,
                                                       "was": scaling.desired, "layer": decision.layer.value,
                                                       "reason": decision.reason}})

    @staticmethod
    def _ready(pool: ModelPool, now_s: float) -> int:
        return sum(1 for replica in pool.replicas if is_routable(replica.health, replica.breaker, now_s))

    def _queued(self, name: str, pool: ModelPool) -> int:
        if self._overload is not None:
            return self._overload.bodies[name].controller.queued
        return len(pool.queue)

    def _totals(self) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
        """Arrivals, refusals, work tokens arrived (prompt + output) and served so far by pool,
        from the gateway's counters (FIFO's refusals: its 429 and 503 answers; FIFO counts no work)."""
        if self._overload is not None:
            work = self._overload.metrics.work_tokens  # plain numbers: no collection
            return (self._sample_sums("tidegate_overload_admissions_total"),
                    self._sample_sums("tidegate_overload_rejections_total"), work.totals(), work.served_totals())
        return (self._sample_sums("tidegate_requests_total"),
                self._sample_sums("tidegate_requests_total", refused_only=True), {}, {})

    def _sample_sums(self, sample_name: str, refused_only: bool = False) -> dict[str, float]:
        """A counter's value summed by pool."""
        sums: dict[str, float] = {}
        family_name = sample_name.removesuffix("_total")
        for family in self._registry.collect():
            if family.name != family_name:
                continue
            for sample in family.samples:
                if sample.name != sample_name:
                    continue
                if refused_only and sample.labels.get("status") not in ("429", "503"):
                    continue
                pool = sample.labels.get("pool", "")
                sums[pool] = sums.get(pool, 0.0) + sample.value
        return sums

    def _take_ttft_ratio(self, name: str, scaling: _PoolScaling) -> float | None:
        """The worst tier's P99 time to first token since the last tick over its target (None: no first
        token); keeps this tick's counts for the next (changes state)."""
        if self._overload is None:
            return None
        targets = {tier.name: tier.ttft_target_s for tier in self._overload.control.tiers}
        current = {tier: buckets for (pool, tier), buckets in self._overload.metrics.first_tokens.cumulative().items()
                   if pool == name}
        worst: float | None = None
        for tier, buckets in current.items():
            p99 = quantile_from_buckets(0.99, bucket_increase(buckets, scaling.ttft.get(tier, [])))
            if not math.isnan(p99) and tier in targets:
                ratio = p99 / targets[tier]
                worst = ratio if worst is None else max(worst, ratio)
        scaling.ttft = current
        return worst
