"""Several gateways in front of the same replicas, simulated with the policy the live ones run.

`GatewayFleet` is one `Dispatcher` made of N pool controllers (`policy.pool`), one per gateway; a
load balancer gives each arrival to one of them by weight. With `split=True` the gateways share each
replica's slots as `gateway.shared_dispatch` does live: every `heartbeat_s` (each gateway at its own
phase) a gateway publishes what it holds and wants, is granted what it wants up to what the others
do not claim (as the Lua script does, atomically), and works out its next want from everyone's
demand with `policy.slot_split.fair_shares`. With `split=False` each gateway fills every replica's
whole `slot_limit`, as if alone.

`active_active` is the scenario: 2 replicas whose engines run a batch of `slot_limit` sequences (the
rest wait in the engine), traffic at 2x capacity, one gateway against three, unsplit and split, and
split with a 6:3:1 load balancer, in two shapes: chat (answers of 32-256 tokens, seconds long) and
short answers (16 tokens, shorter than a heartbeat: every grant is used and given back many times
between two heartbeats). It prints goodput beside the batch's use and the engines' queues, and is
`tests/sim/test_active_active.py`'s bar.

`outside_load` is the scenario for load from outside the gateways: besides the three split gateways,
clients send `OUTSIDE_SHARE` of the requests straight to the engines (round-robin, no gateway sees
them). Each gateway reads each engine's running + waiting every `SCRAPE_S` (its health checks) and
subtracts what the gateways hold there (`policy.slot_split.OutsideLoad`); the gateways split only
the slots that leaves. Without the subtraction the engines queue what the outside clients take.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tidegate.engine.scheduler import SchedulerConfig
from tidegate.policy.pool import PoolController, PoolReplica
from tidegate.policy.shares import TenantShares
from tidegate.policy.slot_split import OutsideLoad, fair_shares, grant
from tidegate.policy.tiers import TierTable, default_tiers
from tidegate.sim.capacity import saturated_rps
from tidegate.loadgen.arrivals import Poisson
from tidegate.loadgen.mix import LengthDistribution
from tidegate.sim.harness import Harness, TrafficClass, make_requests
from tidegate.sim.scenarios import CHAT_OUTPUT, CHAT_PROMPT, DURATION_S, ScenarioRun, Verdict, replica_spec
from tidegate.types import (ArrivalDecision, Assignment, Dispatch, PoolRequest, ReplicaHealth,
                            ReplicaLoad)

__all__ = ["GatewayFleet", "FleetRun", "run_fleet", "active_active", "outside_load"]

OUTSIDE_TENANT = "direct"  # requests of this tenant go straight to an engine, past every gateway


@dataclass(slots=True)
class _Entry:
    """One gateway's published entry at one replica (the Lua script's numbers)."""

    held: int = 0
    demand: int = 0
    wanted: int = 0
    granted: int = 0
    outside: int = 0  # its estimate of the replica's load from outside the gateways


class GatewayFleet:
    """N gateways' controllers as one dispatcher; arrivals spread by `weights`."""

    def __init__(self, replica_ids: Sequence[str], tiers: TierTable, slot_limit: int, weights: Sequence[float],
                 *, split: bool, heartbeat_s: float = 0.25, seed: int = 0, subtract_outside: bool = True,
                 scrape_s: float = 2.0) -> None:
        self._ids = list(replica_ids)
        self._slot_limit = slot_limit
        self.gateways = [PoolController([PoolReplica(r, slot_limit) for r in replica_ids], tiers,
                                        shares=TenantShares()) for _ in weights]
        total = float(sum(weights))
        self._cumulative = np.cumsum([w / total for w in weights])
        self._rng = np.random.default_rng(seed)
        self._owner: dict[int | str, int] = {}  # request id -> its gateway
        self.split = split
        self.heartbeat_s = heartbeat_s
        count = len(self.gateways)
        # each gateway beats at its own phase, as processes started at different times do
        self._beats = [(index * heartbeat_s / count, index) for index in range(count)]
        heapq.heapify(self._beats)
        self._entries = [{r: _Entry(wanted=slot_limit) for r in replica_ids} for _ in self.gateways]
        self._granted_once = [False] * count
        # the engines' gauges, read by each gateway's health checks at its own phase (`gateway.shared_dispatch`)
        self.subtract_outside = subtract_outside
        self.scrape_s = scrape_s
        self._outside = [{r: OutsideLoad() for r in replica_ids} for _ in self.gateways]
        self._next_scrape_s = [index * scrape_s / count for index in range(count)]
        self._direct = 0  # round-robin over the replicas for requests sent past the gateways
        self.sent_beyond: list[int] = []  # at each beat: requests held at a replica past its slot_limit, all gateways

    # -- the heartbeat, as gateway/shared_dispatch.py and its Lua script do it
    def _beat(self, now_s: float, index: int) -> None:
        controller, entries = self.gateways[index], self._entries[index]
        for rid in self._ids:
            entry = entries[rid]
            entry.held = controller.held(rid)
            entry.demand = entry.held + controller.queued
            entry.outside = self._outside[index][rid].sequences if self.subtract_outside else 0
            others = [k for k in range(len(self.gateways)) if k != index and self._granted_once[k]]
            outside = max([entry.outside] + [self._entries[k][rid].outside for k in others])
            entry.granted = grant(entry.wanted, self._slot_limit,
                                  [(self._entries[k][rid].held, self._entries[k][rid].granted) for k in others],
                                  outside)
            controller.on_slot_grant(now_s, rid, entry.granted)
        self._granted_once[index] = True
        live = [k for k in range(len(self.gateways)) if self._granted_once[k]]
        for rid in self._ids:
            outside = max(self._entries[k][rid].outside for k in live)
            shares = fair_shares(max(0, self._slot_limit - outside),
                                 {str(k): self._entries[k][rid].demand for k in live})
            entries[rid].wanted = shares[str(index)]
        self.sent_beyond.append(sum(max(0, sum(g.held(rid) for g in self.gateways) - self._slot_limit)
                                    for rid in self._ids))

    def _catch_up(self, now_s: float) -> None:
        if not self.split:
            return
        if not self._granted_once[-1]:  # each gateway beats once as it starts, before it serves
            for index in range(len(self.gateways)):
                self._beat(now_s, index)
        beats = self._beats
        # idle stretches skip to their last three rounds: nothing changed meanwhile but the time
        skip_to = now_s - 3 * self.heartbeat_s
        while beats and beats[0][0] <= now_s:
            at_s, index = heapq.heappop(beats)
            if at_s >= skip_to:
                self._beat(at_s, index)
            step = self.heartbeat_s
            next_s = at_s + step if at_s + step > skip_to else at_s + step * max(1, int((skip_to - at_s) / step))
            heapq.heappush(beats, (next_s, index))

    def _scrape(self, now_s: float, loads: Mapping[str, ReplicaLoad]) -> None:
        """The gateways whose health checks are due read the engines' gauges (as `shared_dispatch`
        does at each scrape: its own held requests now, the others' as their last heartbeat said)."""
        if not self.split or not loads:
            return
        for index, controller in enumerate(self.gateways):
            if now_s < self._next_scrape_s[index]:
                continue
            # the next reading after now, at this gateway's phase
            missed = int((now_s - self._next_scrape_s[index]) / self.scrape_s)
            self._next_scrape_s[index] += self.scrape_s * (missed + 1)
            for rid, load in loads.items():
                others = sum(self._entries[k][rid].held for k in range(len(self.gateways))
                             if k != index and self._granted_once[k])
                self._outside[index][rid].observe(load.running_sequences + load.waiting_sequences,
                                                  controller.held(rid) + others)

    # -- the dispatcher seam
    def on_arrival(self, now_s: float, request: PoolRequest) -> ArrivalDecision | Assignment:
        self._catch_up(now_s)
        if request.tenant == OUTSIDE_TENANT:  # a client of the engines themselves: no gateway sees it
            replica_id = self._ids[self._direct % len(self._ids)]
            self._direct += 1
            self._owner[request.request_id] = -1
            return Assignment(request.request_id, replica_id)
        index = int(np.searchsorted(self._cumulative, self._rng.random(), side="right"))
        index = min(index, len(self.gateways) - 1)
        self._owner[request.request_id] = index
        return self.gateways[index].on_arrival(now_s, request)

    def on_capacity(self, now_s: float, loads: Mapping[str, ReplicaLoad] = {}) -> Dispatch:
        self._scrape(now_s, loads)
        self._catch_up(now_s)
        assignments, refusals, wakes = [], [], []
        for controller in self.gateways:
            dispatch = controller.on_capacity(now_s, loads)
            assignments += dispatch.assignments
            refusals += dispatch.refusals
            if dispatch.wake_at_s is not None:
                wakes.append(dispatch.wake_at_s)
        busy = any(c.queued or any(c.held(r) for r in self._ids) for c in self.gateways)
        if self.split and busy and self._beats:
            wakes.append(self._beats[0][0])
        later = [w for w in wakes if w > now_s]
        return Dispatch(tuple(assignments), tuple(refusals), min(later) if later else None)

    def on_first_token(self, now_s: float, request_id: int) -> None:
        index = self._owner[request_id]
        if index >= 0:
            self.gateways[index].on_first_token(now_s, request_id)

    def on_finish(self, now_s: float, request_id: int) -> None:
        index = self._owner.pop(request_id)
        if index >= 0:
            self.gateways[index].on_finish(now_s, request_id)

    def on_failure(self, now_s: float, request_id: int, reason: str) -> None:
        index = self._owner.pop(request_id)
        if index >= 0:
            self.gateways[index].on_failure(now_s, request_id, reason)

    def on_replica_health(self, now_s: float, replica_id: str, health: ReplicaHealth) -> None:
        for controller in self.gateways:
            controller.on_replica_health(now_s, replica_id, health)


REPLICAS = 2
BATCH = 16  # sequences an engine runs at once; every gateway's slot_limit
# (prompt, output, their means) shapes: chat's, and answers shorter than a heartbeat (bench/active_active.py's)
SHAPES = {"chat": (CHAT_PROMPT, CHAT_OUTPUT, 544, 144),
          "short": (LengthDistribution("const", 16), LengthDistribution("const", 16), 16, 16)}
LOAD = 2.0
SEEDS = (191, 192, 193)
WINDOW = (5.0, 55.0)
PROBE_EVERY_S = 0.25
ARMS: tuple[tuple[str, tuple[float, ...], bool], ...] = (
    ("1 gateway", (1.0,), False), ("3 unsplit", (1.0, 1.0, 1.0), False), ("3 split", (1.0, 1.0, 1.0), True),
    ("3 split 6:3:1", (6.0, 3.0, 1.0), True))


@dataclass(frozen=True, slots=True)
class FleetRun:
    arm: str
    run: ScenarioRun
    waiting_mean: float  # sequences waiting in the engines (beyond their batch), time-mean, summed over replicas
    waiting_peak: int
    batch_use: float  # running sequences / the engines' batch, time-mean

    def goodput(self, tenant: str | None = None) -> float:
        window = self.run.records(start_s=WINDOW[0], end_s=WINDOW[1], tenant=tenant)
        return self.run.good(window) / (WINDOW[1] - WINDOW[0])


def run_fleet(arm: str, weights: Sequence[float], split: bool, seed: int, shape: str = "chat",
              tiers: TierTable | None = None, outside: float = 0.0, subtract_outside: bool = True) -> FleetRun:
    """One arm; `outside`: requests sent straight to the engines, as a share of their capacity."""
    tiers = tiers or default_tiers()
    ids = [f"r{i}" for i in range(REPLICAS)]
    specs = [replace(replica_spec(i), scheduler=SchedulerConfig(max_num_seqs=BATCH, max_batch_tokens=512))
             for i in ids]
    prompt, output, mean_prompt, mean_output = SHAPES[shape]
    capacity = REPLICAS * saturated_rps(specs[0], mean_prompt, mean_output, BATCH)
    classes = [TrafficClass("a", "standard", LOAD, prompt, output)]
    if outside > 0:
        classes.append(TrafficClass(OUTSIDE_TENANT, "standard", outside, prompt, output))
    requests = make_requests(Poisson((LOAD + outside) * capacity), DURATION_S, classes, seed)
    fleet = GatewayFleet(ids, tiers, BATCH, weights, split=split, seed=seed, subtract_outside=subtract_outside)
    probes = [float(t) for t in np.arange(WINDOW[0], WINDOW[1] + 1e-9, PROBE_EVERY_S)]
    result = Harness(specs, fleet).run(requests, probes_s=probes)
    waiting = [sum(max(0, s - BATCH) for s in probe.sequences) for probe in result.probes]
    running = [sum(min(s, BATCH) for s in probe.sequences) / (BATCH * REPLICAS) for probe in result.probes]
    return FleetRun(arm, ScenarioRun(result, tiers), float(np.mean(waiting)), int(max(waiting)), float(np.mean(running)))


def active_active(seeds: Sequence[int] = SEEDS, shapes: Sequence[str] = tuple(SHAPES)) -> Verdict:
    """Three gateways at 2x capacity, split, serve within 10 % of one gateway's goodput with the
    engines' queues near zero; unsplit, they fill the engines' queues."""
    lines: list[str] = []
    values: list[tuple[str, float]] = []
    for shape in shapes:
        runs = {name: [run_fleet(name, weights, split, seed, shape) for seed in seeds] for name, weights, split in ARMS}
        base = float(np.mean([r.goodput() for r in runs["1 gateway"]]))
        for name, _, _ in ARMS:
            arm_runs = runs[name]
            goodput = float(np.mean([r.goodput() for r in arm_runs]))
            waiting = float(np.mean([r.waiting_mean for r in arm_runs]))
            peak = max(r.waiting_peak for r in arm_runs)
            batch_use = float(np.mean([r.batch_use for r in arm_runs]))
            served = sum(r.run.served(r.run.records(start_s=WINDOW[0], end_s=WINDOW[1])) for r in arm_runs)
            lines.append(f"{shape:<6}{name:<14} goodput {goodput:6.2f}/s ({goodput / base:4.2f}x one gateway's)  "
                         f"batch in use {batch_use:6.1%}  served {served:5d}  engines' waiting mean {waiting:5.1f} "
                         f"peak {peak:3d}")
            key = f"{shape}_" + name.replace(" ", "_").replace(":", "")
            values += [(f"{key}_ratio", goodput / base), (f"{key}_waiting", waiting), (f"{key}_batch_use", batch_use)]
    figures = dict(values)
    passed = all(figures[f"{shape}_{k}_ratio"] >= 0.9 and figures[f"{shape}_{k}_waiting"] <= 1.0
                 for shape in shapes for k in ("3_split", "3_split_631"))
    return Verdict("active_active", "3 gateways over 2 replicas at 2x capacity, slots split: goodput >= 0.9x one "
                   "gateway's, engines' waiting mean <= 1", passed, tuple(lines), tuple(values))


OUTSIDE = 0.25  # requests sent past the gateways, as a share of the engines' capacity
OUTSIDE_ARMS: tuple[tuple[str, float, bool], ...] = (
    ("3 split, none outside", 0.0, True), ("3 split, outside unsubtracted", OUTSIDE, False),
    ("3 split, outside subtracted", OUTSIDE, True))


def outside_load(seeds: Sequence[int] = SEEDS, shape: str = "chat") -> Verdict:
    """Three split gateways at 2x capacity with clients sending a quarter of the engines' capacity
    straight to them: subtracting what the engines' gauges show past the gateways' requests keeps
    the engines' queues near zero, and the gateways' goodput within 10 % of theirs without it."""
    lines: list[str] = []
    values: list[tuple[str, float]] = []
    for name, outside, subtract in OUTSIDE_ARMS:
        runs = [run_fleet(name, (1.0, 1.0, 1.0), True, seed, shape, outside=outside, subtract_outside=subtract)
                for seed in seeds]
        through = float(np.mean([r.goodput("a") for r in runs]))
        direct = float(np.mean([r.goodput(OUTSIDE_TENANT) for r in runs]))
        waiting = float(np.mean([r.waiting_mean for r in runs]))
        batch_use = float(np.mean([r.batch_use for r in runs]))
        served = sum(r.run.served(r.run.records(start_s=WINDOW[0], end_s=WINDOW[1])) for r in runs)
        lines.append(f"{name:<32} goodput through the gateways {through:6.2f}/s, direct {direct:5.2f}/s  "
                     f"batch in use {batch_use:6.1%}  served {served:5d}  engines' waiting mean {waiting:5.1f} "
                     f"peak {max(r.waiting_peak for r in runs):3d}")
        key = name.split(", ")[1].replace(" ", "_")
        values += [(f"{key}_goodput", through), (f"{key}_direct_goodput", direct), (f"{key}_waiting", waiting),
                   (f"{key}_batch_use", batch_use)]
    figures = dict(values)
    passed = (figures["outside_subtracted_waiting"] <= 0.25 * figures["outside_unsubtracted_waiting"]
              and figures["outside_subtracted_batch_use"] >= 0.95
              and figures["outside_subtracted_goodput"] >= figures["outside_unsubtracted_goodput"])
    return Verdict("outside_load", "3 split gateways at 2x capacity, a quarter of the engines' capacity sent past "
                   "them: subtracted, the engines' waiting mean <= 0.25x unsubtracted's, the batch >= 95 % in use, "
                   "the gateways' goodput no lower", passed, tuple(lines), tuple(values))
