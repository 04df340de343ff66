"""Runs an experiment: load from the project's load generator, the fault timeline, and the gateway's
replica health sampled on the same clock; then hands everything measured to the report.

Times are seconds from the start of the load. What the run changes it undoes at the end: paused
processes are resumed, partitions healed and removed, proxies it started stopped, and proxies it only
drove set back to pass. Replicas it restarted are left running: they are the deployment's again.
"""

from __future__ import annotations

import asyncio
import gc
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import numpy as np

from tidegate.chaos import process_faults as pf
from tidegate.chaos.experiment import (
    CpuPressureAction, Experiment, KillAction, KubernetesDeleteAction, MemoryPressureAction, PartitionAction,
    PauseAction, ProxyAction, ProxySpec, RestartAction, Step,
)
from tidegate.chaos.faults import PASS
from tidegate.chaos.partition import NetnsReplica, unavailable_reason
from tidegate.chaos.process_faults import FaultResult, Member, Outcome
from tidegate.chaos.proxy_admin import AdminClient, check_loopback
from tidegate.loadgen.records import RequestRecord

__all__ = ["TimelineEvent", "GatewaySample", "ChaosResult", "run_experiment", "label_matches"]

_LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_PROXY_READY_S = 20.0


@dataclass(frozen=True)
class TimelineEvent:
    t_s: float  # when it was applied
    planned_s: float | None  # the step's at_s; None for what follows from a step (resume, heal, pressure end)
    action: str
    subject: str  # target group, proxy or partition name
    outcome: Outcome
    detail: str
    addresses: tuple[str, ...] = ()  # the replicas concerned (host:port or host), matched to the gateway's labels
    lifts: bool = False  # it ends a fault: restart, resume, heal, proxy back to pass, pressure over
    measured: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GatewaySample:
    t_s: float
    metric: str  # tidegate_replica_healthy | tidegate_replica_outstanding | tidegate_stream_failovers_total
    pool: str
    replica: str
    value: float
    outcome: str = ""  # tidegate_stream_failovers_total: resumed | failed | refused


@dataclass
class ChaosResult:
    experiment: Experiment
    records: list[RequestRecord]
    record_offset_s: float  # add to a record's sent_s to put it on the run's clock
    clock_alignment_s: float  # ... which is exact within this many seconds (earlier at most)
    load_elapsed_s: float
    timeline: list[TimelineEvent]
    samples: list[GatewaySample]
    scrape_failures: int
    proxies: dict[str, dict]  # name -> counters at the end
    notes: list[str]
    restarted: list[subprocess.Popen]  # processes the run started and left running (restarted replicas)


def label_matches(replica_label: str, address: str) -> bool:
    """Whether a gateway replica label (`pool#0@127.0.0.1:9001`) names `address` (host:port, or a host)."""
    where = replica_label.rpartition("@")[2]
    return where == address or where.rpartition(":")[0] == address


class _Run:
    def __init__(self, experiment: Experiment, log_dir: str, on_event: Callable[[TimelineEvent], None] | None):
        self.experiment = experiment
        self.log_dir = log_dir
        self.on_event = on_event
        self.rng = random.Random(experiment.load.seed)
        self.members = {name: [Member(pid=m.pid, port=m.port, restart_command=m.restart,
                                      address=m.address or (f"127.0.0.1:{m.port}" if m.port else None))
                               for m in specs] for name, specs in experiment.targets.items()}
        self.timeline: list[TimelineEvent] = []
        self.samples: list[GatewaySample] = []
        self.scrape_failures = 0
        self.notes: list[str] = []
        self.admins: dict[str, AdminClient] = {}
        self.proxy_addresses: dict[str, str] = {}
        self.proxy_processes: dict[str, subprocess.Popen] = {}
        self.partitions: dict[str, NetnsReplica] = {}
        self.partition_unavailable: str | None = None
        self.paused: set[int] = set()
        self.background: set[asyncio.Task] = set()
        self.t0 = 0.0
        self.issued_s = 0.0  # when the step being applied was issued

    def now_s(self) -> float:
        return time.perf_counter() - self.t0

    def record(self, step: Step | None, action: str, subject: str, result: FaultResult,
               addresses: tuple[str, ...] = (), lifts: bool = False) -> None:
        """A step's events are placed when the step was issued, with how long applying took (a proxy
        switch is an HTTP call); events that follow from a step, when they happen."""
        now_s = self.now_s()
        measured = dict(result.measured)
        t_s = now_s
        if step is not None:
            t_s, measured["apply_s"] = self.issued_s, now_s - self.issued_s
        event = TimelineEvent(t_s, step.at_s if step else None, action, subject, result.outcome, result.detail,
                              addresses, lifts, measured)
        self.timeline.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # -- before the load
    async def prepare(self) -> None:
        for name, spec in self.experiment.proxies.items():
            if spec.admin is None:
                await self._start_proxy(name, spec)
            else:
                self.admins[name] = AdminClient(spec.admin)
            try:
                document = await self.admins[name].faults()
                self.proxy_addresses[name] = str(document["listen"])
                if not spec.faults.is_pass() or spec.admin is not None:
                    await self.admins[name].set_faults(spec.faults)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
                raise RuntimeError(f"proxy {name}: its admin endpoint {self.admins[name].base_url} did not "
                                   f"answer ({type(error).__name__}: {error})") from None
        if self.experiment.partitions:
            self.partition_unavailable = await asyncio.to_thread(unavailable_reason)
            if self.partition_unavailable is not None:
                self.notes.append(f"partitions skipped: {self.partition_unavailable}")
        for name, spec in self.experiment.partitions.items():
            if self.partition_unavailable is not None:
                break
            replica = NetnsReplica(name, spec.command, spec.subnet)
            result = await asyncio.to_thread(replica.setup, f"{self.log_dir}/partition-{name}.log")
            if result.outcome is Outcome.APPLIED:
                self.partitions[name] = replica
            self.notes.append(f"partition {result.detail}")

    async def _start_proxy(self, name: str, spec: ProxySpec) -> None:
        from tidegate.ports import free_port

        admin_port = free_port()  # a loopback port for its admin endpoint
        argv = [sys.executable, "-m", "tidegate", "chaos", "proxy", "--listen", spec.listen, "--target", spec.target,
                "--admin", f"127.0.0.1:{admin_port}", "--seed", str(self.experiment.load.seed)]
        if spec.raw_tcp:
            argv.append("--raw-tcp")
        with open(f"{self.log_dir}/proxy-{name}.log", "ab") as log:
            self.proxy_processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                          stdin=subprocess.DEVNULL)
        admin = self.admins[name] = AdminClient(f"http://127.0.0.1:{admin_port}")
        deadline = time.monotonic() + _PROXY_READY_S
        while True:
            try:
                await admin.faults()
                return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                if self.proxy_processes[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"proxy {name} did not start; see {self.log_dir}/proxy-{name}.log") from None
                await asyncio.sleep(0.1)

    # -- the timeline
    async def run_steps(self) -> None:
        for step in sorted(self.experiment.steps, key=lambda s: s.at_s):
            wait_s = step.at_s - self.now_s()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            self.issued_s = self.now_s()
            try:
                await self.apply(step)
            except Exception as error:  # one fault that cannot be done must not end the experiment
                self.record(step, step.action_name, "", FaultResult(Outcome.FAILED, f"{type(error).__name__}: {error}"))

    def _live(self, group: str) -> list[tuple[Member, int]]:
        return [(member, pid) for member in self.members[group] if (pid := member.current_pid()) is not None]

    async def apply(self, step: Step) -> None:
        action = step.action
        if isinstance(action, KillAction):
            chosen = pf.choose_fraction(self._live(action.target), action.fraction, self.rng)
            result = pf.kill([pid for _, pid in chosen]) if chosen else FaultResult(Outcome.SKIPPED, "none running")
            for member, pid in chosen:
                member.killed = pid in result.pids
            self.record(step, "kill", action.target, result, self._addresses(m for m, p in chosen if p in result.pids))
        elif isinstance(action, PauseAction):
            chosen = pf.choose_fraction(self._live(action.target), action.fraction, self.rng)
            result = pf.pause([pid for _, pid in chosen]) if chosen else FaultResult(Outcome.SKIPPED, "none running")
            self.paused.update(result.pids)
            addresses = self._addresses(m for m, p in chosen if p in result.pids)
            self.record(step, "pause", action.target, result, addresses)
            if result.pids:
                self.spawn(self._resume_later(action.duration_s, result.pids, action.target, addresses))
        elif isinstance(action, RestartAction):
            killed = [member for member in self.members[action.target] if member.killed]
            if not killed:
                self.record(step, "restart", action.target,
                            FaultResult(Outcome.SKIPPED, "this run killed none of them"))
            for member in killed:
                result = pf.restart(member, f"{self.log_dir}/restart-{action.target}.log")
                self.record(step, "restart", action.target, result, self._addresses([member]), lifts=True)
        elif isinstance(action, ProxyAction):
            summary = await self.admins[action.name].set_faults(action.faults)
            self.record(step, "proxy", action.name, FaultResult(Outcome.APPLIED, summary),
                        (self.proxy_addresses[action.name],), lifts=action.faults.is_pass())
        elif isinstance(action, CpuPressureAction):
            near = self._live(action.near)[:1] if action.near else []
            near_pid = near[0][1] if near else None
            self.record(step, "cpu_pressure", action.near or "", FaultResult(
                Outcome.APPLIED, f"{action.workers} worker(s) for {action.duration_s:g} s"
                + (f" near pid {near_pid}" if near_pid else "")))
            self.spawn(self._pressure_end("cpu_pressure", action.near or "",
                                          pf.cpu_pressure(action.workers, action.duration_s, near_pid)))
        elif isinstance(action, MemoryPressureAction):
            self.record(step, "memory_pressure", "", FaultResult(
                Outcome.APPLIED, f"{action.mb} MB for {action.duration_s:g} s"))
            self.spawn(self._pressure_end("memory_pressure", "", pf.memory_pressure(action.mb, action.duration_s)))
        elif isinstance(action, PartitionAction):
            await self._partition(step, action)
        elif isinstance(action, KubernetesDeleteAction):
            result = await asyncio.to_thread(pf.delete_pods, action.namespace, action.selector, action.fraction,
                                             self.rng)
            self.record(step, "kubernetes_delete", action.selector, result)

    @staticmethod
    def _addresses(members) -> tuple[str, ...]:
        return tuple(m.address for m in members if m.address)

    async def _resume_later(self, delay_s: float, pids: tuple[int, ...], group: str,
                            addresses: tuple[str, ...]) -> None:
        await asyncio.sleep(delay_s)
        result = pf.resume(pids)
        self.paused.difference_update(pids)
        self.record(None, "resume", group, result, addresses, lifts=True)

    async def _pressure_end(self, action: str, subject: str, pressure) -> None:
        result = await pressure
        self.record(None, f"{action} end", subject, result, lifts=True)

    async def _partition(self, step: Step, action: PartitionAction) -> None:
        replica = self.partitions.get(action.name)
        if replica is None:
            reason = self.partition_unavailable or "its namespace could not be set up (see the notes)"
            self.record(step, "partition", action.name, FaultResult(Outcome.SKIPPED, reason))
            return
        result = await asyncio.to_thread(replica.cut)
        self.record(step, "partition", action.name, result, (replica.replica_ip,))
        if result.outcome is Outcome.APPLIED:
            self.spawn(self._heal_later(action.duration_s, action.name, replica))

    async def _heal_later(self, delay_s: float, name: str, replica: NetnsReplica) -> None:
        await asyncio.sleep(delay_s)
        healed = await asyncio.to_thread(replica.heal)
        self.record(None, "heal", name, healed, (replica.replica_ip,), lifts=True)

    # -- the gateway, sampled on the run's clock
    async def sample_gateway(self, stop: asyncio.Event) -> None:
        spec = self.experiment.gateway
        assert spec is not None
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            while not stop.is_set():
                tick = time.perf_counter()
                try:
                    async with session.get(spec.metrics_url, headers=headers) as response:
                        text = (await response.read()).decode("utf-8", "replace") if response.status == 200 else None
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    text = None
                if text is None:
                    self.scrape_failures += 1
                else:
                    self._parse_samples(tick - self.t0, text, spec.pool)
                try:
                    await asyncio.wait_for(stop.wait(), max(0.0, spec.interval_s - (time.perf_counter() - tick)))
                except asyncio.TimeoutError:
                    pass

    def _parse_samples(self, t_s: float, text: str, pool_filter: str | None) -> None:
        for line in text.splitlines():
            if not line.startswith(("tidegate_replica_healthy{", "tidegate_replica_outstanding{",
                                    "tidegate_stream_failovers_total{")):
                continue
            series, _, value = line.rpartition(" ")
            labels = dict(_LABELS.findall(series))
            pool = labels.get("pool", "")
            if pool_filter is not None and pool != pool_filter:
                continue
            self.samples.append(GatewaySample(t_s, series.split("{", 1)[0], pool, labels.get("replica", ""),
                                              float(value), labels.get("outcome", "")))

    # -- after the load
    async def cleanup(self) -> dict[str, dict]:
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.paused:
            self.record(None, "resume", "", pf.resume(sorted(self.paused)), lifts=True)
            self.paused.clear()
        for name, replica in self.partitions.items():
            await asyncio.to_thread(replica.teardown)
        counters: dict[str, dict] = {}
        for name, admin in self.admins.items():
            try:
                counters[name] = await admin.counters()
                if name not in self.proxy_processes:
                    await admin.set_faults(PASS)  # a proxy we only drove is left forwarding, as we found it
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as error:
                self.notes.append(f"proxy {name}: could not read its counters: {error}")
        for admin in self.admins.values():
            await admin.close()
        for process in self.proxy_processes.values():
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        return counters


def _plan(experiment: Experiment):
    from tidegate.loadgen.arrivals import Constant, Poisson
    from tidegate.loadgen.mix import Tenant, parse_length
    from tidegate.loadgen.plan import TrafficStream, build_plan

    load = experiment.load
    tenant = Tenant(name="chaos", api_key=load.api_key, tier="standard")
    closed = load.concurrency is not None
    # a closed loop sends when a slot frees: its plan only needs to be long enough
    arrivals = Constant(1.0) if closed else (Constant(load.rate) if load.arrival == "constant" else Poisson(load.rate))
    stream = TrafficStream(arrivals, (tenant,), parse_length(load.prompt_tokens), parse_length(load.max_tokens))
    rng = np.random.default_rng(load.seed)
    if closed:
        return build_plan([stream], rng, None, 100_000)
    return build_plan([stream], rng, experiment.duration_s)


async def run_experiment(experiment: Experiment, *, log_dir: str | None = None,
                         on_event: Callable[[TimelineEvent], None] | None = None) -> ChaosResult:
    """Runs the load and the timeline together; everything the report shows comes from here."""
    from tidegate.loadgen.cli import check_target_allowed, first_listed_model
    from tidegate.loadgen.driver import Driver, RunConfig
    from tidegate.loadgen.http_client import parse_url
    from tidegate.loadgen.records import ApiKind

    load = experiment.load
    endpoint = parse_url(load.url)
    if not load.allow_remote_host:
        check_target_allowed(endpoint, [])
    if experiment.gateway is not None and not load.allow_remote_host:
        from urllib.parse import urlsplit

        check_loopback(urlsplit(experiment.gateway.metrics_url).hostname or "", "gateway.metrics_url")
    plan = _plan(experiment)
    model = load.model or await asyncio.to_thread(first_listed_model, endpoint, plan)
    config = RunConfig(targets=(endpoint,), model=model, kind=ApiKind(load.endpoint), stream=load.stream,
                       ignore_eos=load.ignore_eos, timeout_s=load.timeout_s, concurrency=load.concurrency,
                       duration_s=experiment.duration_s if load.concurrency else None)
    run = _Run(experiment, log_dir or tempfile.mkdtemp(prefix="tidegate-chaos-"), on_event)
    stop_sampling = asyncio.Event()
    helpers: list[asyncio.Task] = []
    try:
        await run.prepare()
        driver = Driver(config, plan)
        # The driver collects garbage and freezes the heap before it starts its clock; frozen now,
        # its collection is short, so its clock starts right after ours.
        gc.collect()
        gc.freeze()
        run.t0 = time.perf_counter()
        load_task = asyncio.ensure_future(driver.run())
        # The driver's first step (up to its first wait) runs before we resume: its clock started
        # between t0 and now, so a record's time on ours is known within this bound.
        await asyncio.sleep(0)
        alignment_s = run.now_s()
        helpers.append(asyncio.ensure_future(run.run_steps()))
        if experiment.gateway is not None:
            helpers.append(asyncio.ensure_future(run.sample_gateway(stop_sampling)))
        result = await load_task
        steps_task = helpers[0]
        if not steps_task.done():  # the load ended early (every request failed fast): the steps still run
            await steps_task
        await asyncio.sleep(experiment.tail_s)
    finally:
        stop_sampling.set()
        for task in helpers:
            if not task.done():
                task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        counters = await run.cleanup()
    return ChaosResult(
        experiment=experiment, records=result.records, record_offset_s=alignment_s, clock_alignment_s=alignment_s,
        load_elapsed_s=result.elapsed_s, timeline=sorted(run.timeline, key=lambda e: e.t_s), samples=run.samples,
        scrape_failures=run.scrape_failures, proxies=counters, notes=run.notes,
        restarted=[m.started for ms in run.members.values() for m in ms if m.started is not None],
    )
