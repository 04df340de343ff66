"""The simulator's Python API, for scripts and notebooks; `tidegate sim run` is built on it.

    from tidegate.simulate import Simulation, poisson_requests, trace_requests

    simulation = Simulation(config="serve.yaml", profile="llama-3-8b-h100-80gb", replicas=8)
    requests = trace_requests(speedup=60, rate_scale=4, duration_s=1800,
                              mix={"critical": 0.2, "standard": 0.8})
    controlled = simulation.run(requests)
    fifo = simulation.run(requests, fifo=True)
    print(controlled.summary.tier("critical").ttft_p99_s, controlled.summary.mean_busy_fraction)
    simulation.write({"overload control": controlled, "FIFO": fifo}, "out/")  # tidegate bench's report

A run is a function of its inputs: the same requests, config, profile and replicas give the same
records, bit for bit. The controller is the one `tidegate serve` builds from the same config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tidegate.config import GatewayConfig, PoolConfig, load_config
from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.driver import RunResult as BenchResult
from tidegate.loadgen.mix import LengthDistribution
from tidegate.loadgen.trace import default_trace_path, load_azure_trace
from tidegate.policy.autoscale import AutoscaleSettings, Autoscaler, ScalePolicy
from tidegate.policy.forecast import Forecaster
from tidegate.policy.pool import PoolController, PoolSettings
from tidegate.policy.tiers import TierTable
from tidegate.sim.fifo import FifoDispatcher
from tidegate.sim.harness import Harness, RunResult, ScenarioEvent, TrafficClass, make_requests, requests_from_trace
from tidegate.sim.profile import ReplicaProfile, load_profile
from tidegate.sim.report import RunSummary, summarize
from tidegate.sim.scaling import ScaleEvent, ScalingLoop
from tidegate.sim.seam import SimRequest
from tidegate.sim_report import probe_times, sim_report

__all__ = ["Simulation", "SimulatedRun", "poisson_requests", "trace_requests", "pool_controller", "DEFAULT_PROFILE"]

DEFAULT_PROFILE = "tiny-random-llama-cpu"
Mix = Mapping[str, float]  # tier -> share of the requests


@dataclass(frozen=True)
class SimulatedRun:
    result: RunResult  # every request's record, each replica's counters, the probes
    summary: RunSummary  # per tier TTFT percentiles, goodput, refusals; per replica utilisation
    scaling: tuple[ScaleEvent, ...] = ()  # with an autoscaler: each tick's fleet and decision
    replica_hours: float | None = None  # with an autoscaler: replicas paid for (starting to stopped)


def _mix_pairs(mix: Mix | None) -> list[tuple[str, float]]:
    pairs = list((mix or {}).items())
    if any(share <= 0 for _, share in pairs):
        raise ValueError(f"mix shares must be positive, got {dict(pairs)}")
    return pairs


def poisson_requests(rate_rps: float, duration_s: float, *, mix: Mix | None = None, tier: str = "standard",
                     prompt_tokens: tuple[int, int] = (64, 1024), output_tokens: tuple[int, int] = (32, 256),
                     seed: int = 0) -> tuple[SimRequest, ...]:
    """Poisson arrivals over [0, duration_s), lengths uniform in the given ranges, tiers drawn by
    `mix` (all `tier` without one)."""
    prompt, output = (LengthDistribution("uniform", low, high) for low, high in (prompt_tokens, output_tokens))
    classes = [TrafficClass("sim", name, share, prompt, output) for name, share in _mix_pairs(mix) or [(tier, 1.0)]]
    return make_requests(Poisson(rate_rps), duration_s, classes, seed)


def trace_requests(path: str | Path | None = None, *, speedup: float = 1.0, rate_scale: float = 1.0,
                   duration_s: float | None = None, mix: Mix | None = None, tier: str = "standard",
                   seed: int = 0) -> tuple[SimRequest, ...]:
    """An Azure-format trace (default: the conversation trace shipped in the package; credit in
    `tidegate.loadgen.trace.AZURE_TRACE_CREDIT`), compressed by `speedup`, thinned or duplicated by
    `rate_scale`, cut at `duration_s`; tiers drawn by `mix` (all `tier` without one)."""
    trace = load_azure_trace(Path(path) if path else default_trace_path()).scaled(
        np.random.default_rng(seed), speedup=speedup, rate_scale=rate_scale)
    requests = requests_from_trace(trace, tenant="trace", tier=tier)
    if duration_s is not None:
        requests = tuple(r for r in requests if r.arrival_s < duration_s)
    pairs = _mix_pairs(mix)
    if pairs:
        rng = np.random.default_rng(seed + 1)
        shares = np.asarray([share for _, share in pairs])
        which = rng.choice(len(pairs), size=len(requests), p=shares / shares.sum())
        requests = tuple(SimRequest(r.request_id, r.arrival_s, r.tenant, pairs[k][0], r.prompt_tokens,
                                    r.output_tokens) for r, k in zip(requests, which))
    return requests


def _pool(config: GatewayConfig, pool_name: str | None) -> PoolConfig:
    """The named pool of the config, its first by default."""
    pool = next((p for p in config.pools if p.name == pool_name), None) if pool_name else config.pools[0]
    if pool is None:
        raise ValueError(f"no pool {pool_name!r} in the config")
    return pool


def pool_controller(config: GatewayConfig, pool_name: str | None, replica_ids: list[str]) -> tuple[PoolController, int]:
    """The controller `tidegate serve` builds for the pool (its first by default), over these
    replicas, and the pool's slot limit (what FIFO holds per replica)."""
    pool = _pool(config, pool_name)
    backend = pool.backends[0]
    orders_by_priority = getattr(backend, "forward_priority", True)  # embedded engines order by it
    overload = config.overload
    limits = overload.limits
    isolation = limits.isolation if overload.auth_enabled else None
    controller = PoolController([limits.pool_replica(i, backend.slot_limit, orders_by_priority) for i in replica_ids],
                                overload.tiers.table(),
                                PoolSettings(engine_share=limits.engine_share, max_queued=limits.max_queued,
                                             # 0: no prefix affinity, as `tidegate serve` reads it
                                             **({} if limits.prefix_cache_tokens is None
                                                else {"prefix_cache_tokens": limits.prefix_cache_tokens})),
                                shares=isolation.shares(None) if isolation is not None else None,
                                length_classes=pool.length_class_policy(replica_ids))
    return controller, backend.slot_limit


def _default_config() -> GatewayConfig:
    """What `tidegate serve` runs without a config: one pool of two embedded workers."""
    return GatewayConfig.model_validate({"pools": [
        {"name": "sim", "backends": [{"type": "embedded", "model": "tiny-random-llama", "count": 2}]}]})


class Simulation:
    """A pool of a `tidegate serve` config on modelled replicas of a profile."""

    def __init__(self, config: GatewayConfig | str | Path | None = None, *,
                 profile: ReplicaProfile | str | Path = DEFAULT_PROFILE, replicas: int | None = None,
                 pool: str | None = None) -> None:
        self.config = config if isinstance(config, GatewayConfig) else (
            load_config(config) if config is not None else _default_config())
        self.profile = profile if isinstance(profile, ReplicaProfile) else load_profile(profile)
        self.pool = _pool(self.config, pool)
        count = replicas if replicas is not None else sum(getattr(b, "count", 1) for b in self.pool.backends)
        if count < 1:
            raise ValueError(f"replicas must be >= 1, got {count}")
        self.replica_ids = [f"r{i}" for i in range(count)]
        self.tiers: TierTable = self.config.overload.tiers.table()
        self.slot_limit = self.pool.backends[0].slot_limit

    def check_tiers(self, requests: Sequence[SimRequest]) -> None:
        """Raises ValueError naming a tier the config does not define."""
        unknown = sorted({r.tier for r in requests} - {t.name for t in self.tiers})
        if unknown:
            raise ValueError(f"unknown tier {unknown[0]!r}; the config defines {[t.name for t in self.tiers]}")

    def run(self, requests: Sequence[SimRequest], *, fifo: bool = False, events: Sequence[ScenarioEvent] = (),
            probe: bool = True, before_run: Callable[[Harness], None] | None = None,
            autoscaler: ScalePolicy | None = None, initial_replicas: int = 1, noise_seed: int = 0) -> SimulatedRun:
        """One run to the end: overload control (the pool controller), or FIFO with overload
        control off. `events`: replicas killed or slowed on the way. `probe`: sample the replicas
        and the queue for the report's series (changes nothing in the run). `before_run`: sees the
        harness first, e.g. to schedule a progress bar's ticks on its loop. `autoscaler`: sizes the
        pool every second between `initial_replicas` and all of them (`policy.autoscale`); replicas
        start after the profile's cold start and stop after draining. `noise_seed`: draws the steps'
        times where the profile has step noise (`sim.step_noise`)."""
        self.check_tiers(requests)
        dispatcher = (FifoDispatcher(self.replica_ids, self.tiers, slot_limit=self.slot_limit) if fifo
                      else pool_controller(self.config, self.pool.name, self.replica_ids)[0])
        harness = Harness([self.profile.spec(i, noise_seed) for i in self.replica_ids], dispatcher)
        last_arrival_s = max((r.arrival_s for r in requests), default=0.0)
        scaling = None
        if autoscaler is not None:
            scaling = ScalingLoop(harness, autoscaler)
            scaling.install(last_arrival_s, initial_replicas)
        if before_run is not None:
            before_run(harness)
        probes_s = probe_times(last_arrival_s) if probe else ()
        result = harness.run(requests, events=events, probes_s=probes_s)
        if scaling is None:
            return SimulatedRun(result, summarize(result, self.tiers))
        return SimulatedRun(result, summarize(result, self.tiers), tuple(scaling.events), scaling.replica_hours)

    def autoscaler(self, *, min_replicas: int = 1, forecaster: Forecaster | None = None) -> Autoscaler:
        """tidegate's autoscaler for this pool, with its defaults: the pool's slot limit per replica,
        the profile's cold start as the forecast's lead, at most the simulation's replicas."""
        settings = AutoscaleSettings(self.slot_limit, min_replicas=min_replicas, max_replicas=len(self.replica_ids),
                                     cold_start_s=self.profile.cold_start_s)
        return Autoscaler(settings, forecaster)

    def report(self, runs: Mapping[str, SimulatedRun], *, config: Mapping[str, Any] | None = None,
               credits: Sequence[str] = ()) -> tuple[dict[str, Any], BenchResult]:
        """The runs as one `tidegate bench` report (each run a target) and the records behind it;
        `credits`: the trace's, when one was replayed (`AZURE_TRACE_CREDIT`)."""
        described = {"profile": self.profile.name, "replicas": len(self.replica_ids), "pool": self.pool.name,
                     **(config or {})}
        return sim_report({label: run.result for label, run in runs.items()}, self.tiers, pool=self.pool.name,
                          scaling={label: run.scaling for label, run in runs.items() if run.scaling},
                          config=described, credits=credits)

    def write(self, runs: Mapping[str, SimulatedRun], out_dir: str | Path, *, plots: bool = True,
              config: Mapping[str, Any] | None = None, credits: Sequence[str] = ()) -> Path:
        """report.json and records.jsonl (the schema of `tidegate bench`) and, with `plots`, the
        PNG plots, into `out_dir`; returns the report's path."""
        from tidegate.loadgen.report import write_report

        report, records = self.report(runs, config=config, credits=credits)
        path = write_report(report, records, Path(out_dir))
        if plots:
            from tidegate.loadgen.plots import write_plots

            write_plots(report, Path(out_dir))
        return path
