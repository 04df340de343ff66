"""Scenario runner: seeded arrivals -> a dispatcher (the seam) -> modelled replicas, on virtual time.

A run is a function of its inputs: the same requests, replicas, dispatcher and events give the
same records, bit for bit. Requests come from the load generator's pure arrival processes and
length distributions (`make_requests`) or from a trace (`requests_from_trace`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tidegate.loadgen.arrivals import ArrivalProcess, sample_arrivals
from tidegate.loadgen.mix import LengthDistribution
from tidegate.loadgen.trace import Trace
from tidegate.sim.loop import EventHandle, EventLoop
from tidegate.sim.replica import ModelledReplica, ReplicaSpec
from tidegate.sim.seam import ArrivalVerdict, Assignment, Dispatch, Dispatcher, SimRequest
from tidegate.sim.step_noise import SharedDrift
from tidegate.types import ReplicaHealth

__all__ = ["TrafficClass", "ClosedLoopClients", "KillReplica", "SlowReplica", "StartReplica", "ScenarioEvent",
           "RequestRecord", "ReplicaStats", "Probe", "RunResult", "Harness", "make_requests", "requests_from_trace"]


@dataclass(frozen=True, slots=True)
class TrafficClass:
    tenant: str
    tier: str
    share: float  # relative weight among the classes of a scenario
    prompt_tokens: LengthDistribution
    output_tokens: LengthDistribution
    # every request of the class starts with the same this many tokens (a system prompt; a load
    # test that sends one prompt again and again shares all of it), which a replica's prefix cache
    # computes once: bench/storm_fidelity.py's storm sends one prompt, and an engine with prefix
    # caching computes 13 of its 269 tokens. 0: each request's prompt is its own
    shared_prefix_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ClosedLoopClients:
    """`clients` clients that each keep one request in flight from `start_s` until `stop_s`: a new
    one `think_s` after an answer, or the same one again `resend_s` after a refusal or failure (a
    retry storm: clients that resend at once, as naive SDK loops and benchmark tools do, whatever
    Retry-After says). Each client draws its requests' lengths from its own stream: its k-th
    request is the same whatever the dispatcher did, so two arms of a scenario serve the same
    work, compared request for request (common random numbers)."""

    clients: int
    traffic: TrafficClass
    start_s: float
    stop_s: float
    resend_s: float = 0.02  # a refusal's round trip: the resend cannot come sooner
    think_s: float = 0.0
    seed: int = 0
    # each request opens with one of `prefixes` shared prompts of `prefix_tokens` (a tenant's system
    # prompt, drawn uniformly), before its own `traffic.prompt_tokens`; 0: nothing shared
    prefixes: int = 0
    prefix_tokens: int = 0
    # how often each prefix is drawn, relative (`prefixes` of them); empty: uniformly
    prefix_weights: tuple[float, ...] = ()
    # the prefix of each request the clients send, in the order they send them, instead of drawing
    # it: a fixed work list the clients share, as bench/prefix_cache.py's do; they stop at its end
    prefix_order: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class KillReplica:
    at_s: float
    replica_id: str


@dataclass(frozen=True, slots=True)
class SlowReplica:
    at_s: float
    replica_id: str
    factor: float  # step durations x factor from then on


@dataclass(frozen=True, slots=True)
class StartReplica:
    """The replica is requested at `at_s` and serves from `at_s + ` its spec's `cold_start_s`. A
    replica whose first event is this one is down from the run's start (a scale-out); one killed
    before it comes back (a respawn)."""

    at_s: float
    replica_id: str


ScenarioEvent = KillReplica | SlowReplica | StartReplica


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: int
    tenant: str
    tier: str
    prompt_tokens: int
    output_tokens: int
    arrival_s: float
    dispatch_s: float | None = None
    replica_id: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    refused_s: float | None = None
    refused_reason: str | None = None  # refused by the dispatcher: never reached a replica
    failed_s: float | None = None
    failure_reason: str | None = None  # reached a replica and failed there

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def served(self) -> bool:
        return self.finish_s is not None


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    replica_id: str
    busy_s: float  # time with at least one sequence running or waiting
    steps: int
    generated_tokens: int
    preemptions: int
    alive: bool


@dataclass(frozen=True, slots=True)
class Probe:
    """The run's state at one instant: what a scrape of the live gateway would show."""

    t_s: float
    busy_s: tuple[float, ...]  # each replica's busy time so far, in the order given
    sequences: tuple[int, ...]  # each replica's running + waiting sequences
    queued: int  # requests the dispatcher holds (arrived, neither sent to a replica nor refused)


@dataclass(frozen=True, slots=True)
class RunResult:
    records: tuple[RequestRecord, ...]  # by request id
    replicas: tuple[ReplicaStats, ...]  # in the order given
    end_s: float  # virtual time when the run stopped
    probes: tuple[Probe, ...] = ()  # at the times asked for, in time order
    prefix_moves: int = 0  # assignments whose prompt prefix the dispatcher moved to another replica

    def busy_fraction(self, start_s: float, end_s: float) -> float:
        """Mean busy fraction of the replicas between two probe times (of those alive at `end_s`)."""
        busy = {probe.t_s: probe.busy_s for probe in self.probes}
        alive = [i for i, stats in enumerate(self.replicas) if stats.alive]
        if not alive or end_s <= start_s:
            return 0.0
        return sum(busy[end_s][i] - busy[start_s][i] for i in alive) / (len(alive) * (end_s - start_s))


def make_requests(arrivals: ArrivalProcess, duration_s: float, classes: Sequence[TrafficClass],
                  seed: int) -> tuple[SimRequest, ...]:
    """Arrivals over [0, duration_s), each drawn into a class by share; lengths from its class."""
    rng = np.random.default_rng(seed)
    offsets_s = sample_arrivals(arrivals, rng, duration_s=duration_s)
    shares = np.asarray([c.share for c in classes], dtype=np.float64)
    which = rng.choice(len(classes), size=len(offsets_s), p=shares / shares.sum())
    prompts = np.zeros(len(offsets_s), dtype=np.int64)
    outputs = np.zeros(len(offsets_s), dtype=np.int64)
    for index, traffic in enumerate(classes):  # class by class, so a class's draws do not depend on others'
        mask = which == index
        prompts[mask] = traffic.prompt_tokens.sample(rng, int(mask.sum()))
        outputs[mask] = traffic.output_tokens.sample(rng, int(mask.sum()))
    return tuple(
        SimRequest(i, float(offsets_s[i]), classes[which[i]].tenant, classes[which[i]].tier, int(prompts[i]),
                   int(outputs[i]), **_shared_prefix(classes[which[i]], int(which[i])))
        for i in range(len(offsets_s))
    )


def _shared_prefix(traffic: TrafficClass, index: int) -> dict[str, int]:
    """A request's shared-prefix fields: the class's prefix, named by the class's index."""
    if not traffic.shared_prefix_tokens:
        return {}
    return {"shared_prefix": index, "shared_prefix_tokens": traffic.shared_prefix_tokens}


def _drawn_prefix(clients: ClosedLoopClients, rng: np.random.Generator) -> int | None:
    """Which of the clients' shared prefixes a request opens with (None: the clients share none)."""
    if clients.prefix_weights:
        weights = np.asarray(clients.prefix_weights, dtype=float)
        return int(rng.choice(len(weights), p=weights / weights.sum()))
    return int(rng.integers(clients.prefixes)) if clients.prefixes else None


def requests_from_trace(trace: Trace, tenant: str = "trace", tier: str = "standard") -> tuple[SimRequest, ...]:
    """One request per trace row (scale the trace first with `Trace.scaled` for another rate)."""
    return tuple(
        SimRequest(i, float(trace.offsets_s[i]), tenant, tier, max(int(trace.context_tokens[i]), 1),
                   max(int(trace.generated_tokens[i]), 1))
        for i in range(len(trace))
    )


# how often the refusals' CPU is taken from the replicas' cores (`Harness.refusal_cpu_s`): short
# beside a 5 s TTFT target, long beside one engine step
CONTENTION_TICK_S = 0.1
# the most of a core other processes take from an engine: with a gateway and clients runnable beside
# the engines on as many cores, the scheduler shares each core at least in half
MAX_CORE_SHARE_TAKEN = 0.5


class Harness:
    """Drives one dispatcher and its replicas through one run; implements `ReplicaListener`."""

    def __init__(self, replicas: Sequence[ReplicaSpec], dispatcher: Dispatcher, *, refusal_cpu_s: float = 0.0) -> None:
        """`refusal_cpu_s`: the CPU a refusal's round trip (the gateway answering it, the client
        reading it and sending again) takes from the replicas' cores, one core a replica: on the
        embedded default they share one machine; 0: the gateway and clients have their own cores."""
        if refusal_cpu_s < 0:
            raise ValueError("refusal_cpu_s >= 0 needed")
        self.loop = EventLoop()
        self.refusal_cpu_s = refusal_cpu_s
        self._cpu_owed_s = 0.0  # refusals' CPU not yet taken from the replicas
        self._contention_tick: EventHandle | None = None
        self.dispatcher = dispatcher
        # the replicas of one profile and seed share their step noise's drift, as engines on one machine do
        drifts = {(spec.noise, spec.noise_seed): SharedDrift(spec.noise, spec.noise_seed)
                  for spec in replicas if spec.noise is not None and spec.noise.shared_share}
        self.replicas = {spec.replica_id: ModelledReplica(spec, self.loop, self,
                                                          drifts.get((spec.noise, spec.noise_seed)))
                         for spec in replicas}
        if len(self.replicas) != len(replicas):
            raise ValueError("replica ids must be unique")
        self._records: dict[int, RequestRecord] = {}
        self._requests: dict[int, SimRequest] = {}
        self._capacity_pending = False
        self._wake: EventHandle | None = None
        self._clients: ClosedLoopClients | None = None
        self._client_rngs: list[np.random.Generator] = []
        self._client_of: dict[int, int] = {}  # a client's request in flight -> the client's index
        self._listed = 0  # requests sent so far from the clients' `prefix_order`
        self._next_id = 0
        self._probes: list[Probe] = []
        self._queued = 0  # arrived - sent to a replica - refused: the dispatcher's queue
        self._prefix_moves = 0  # assignments that moved a prompt prefix to another replica (rule 7)
        self.arrived = 0  # requests arrived so far
        self.arrived_tokens = 0  # their prompt + output tokens: the work asked for (`policy.autoscale`)
        self.refused = 0  # requests refused by the dispatcher so far
        self.served_tokens = 0  # prompt + output tokens of the requests answered so far (`policy.throughput`)
        self.first_tokens: list[tuple[str, float]] = []  # (tier, TTFT s) of each first token, in order
        self.starting: set[str] = set()  # replicas requested and not ready yet
        self.draining: set[str] = set()  # replicas taking no new request, stopped once empty
        self.warming: set[str] = set()  # replicas loading to be standbys
        self.standby: set[str] = set()  # loaded, out of traffic: promotable in seconds
        self._keep: set[str] = set()  # draining replicas to keep as standbys once empty

    def run(self, requests: Iterable[SimRequest], events: Iterable[ScenarioEvent] = (),
            until_s: float | None = None, clients: ClosedLoopClients | None = None,
            probes_s: Iterable[float] = ()) -> RunResult:
        """Until every request is settled (or until `until_s`, leaving the rest unsettled).
        `probes_s`: times at which a `Probe` of the replicas and the queue is recorded."""
        for request in requests:
            self._schedule(request)
        events = sorted(events, key=lambda e: e.at_s)
        self.hold_down(self._not_started(events))
        for event in events:
            self.loop.call_at(event.at_s, self._apply, event)
        for probe_s in probes_s:
            self.loop.call_at(probe_s, self._probe)
        if clients is not None:
            self._clients = clients
            self._listed = 0
            self._client_rngs = [np.random.default_rng([clients.seed, index]) for index in range(clients.clients)]
            self._next_id = max(self._requests, default=-1) + 1
            for index in range(clients.clients):
                self.loop.call_at(clients.start_s, self._client_send, index)
        if until_s is None:
            self.loop.run()
        else:
            self.loop.run_until(until_s)
        end_s = self.loop.now_s
        stats = tuple(ReplicaStats(r.replica_id, r.busy_s_at(end_s), r.steps, r.generated_tokens, r.preemptions,
                                   r.alive) for r in self.replicas.values())
        return RunResult(tuple(self._records[i] for i in sorted(self._records)), stats, end_s, tuple(self._probes),
                         self._prefix_moves)

    # closed-loop clients: each settled request of theirs sends the next
    def _schedule(self, request: SimRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self._requests[request.request_id] = request
        self.loop.call_at(request.arrival_s, self._arrive, request)

    def _client_send(self, client: int, again: SimRequest | None = None) -> None:
        """Client `client` sends its next request, or `again` once more after a refusal."""
        clients, now_s = self._clients, self.loop.now_s
        if clients is None or now_s >= clients.stop_s:
            return
        traffic = clients.traffic
        if again is None:
            if clients.prefix_order and self._listed >= len(clients.prefix_order):
                return  # the shared work list is used up
            rng = self._client_rngs[client]
            prompt, output = int(traffic.prompt_tokens.sample(rng, 1)[0]), int(traffic.output_tokens.sample(rng, 1)[0])
            if clients.prefix_order:
                shared: int | None = clients.prefix_order[self._listed]
                self._listed += 1
            else:
                shared = _drawn_prefix(clients, rng)
            if shared is None:
                fields = _shared_prefix(traffic, 0)
            else:  # one of the clients' prefixes, before the class's own prompt
                fields = {"shared_prefix": shared, "shared_prefix_tokens": clients.prefix_tokens}
                prompt += clients.prefix_tokens
            fingerprint = self._next_id + 1  # its resends keep it
        else:
            prompt, output, fingerprint = again.prompt_tokens, again.output_tokens, again.fingerprint
            fields = {"shared_prefix": again.shared_prefix, "shared_prefix_tokens": again.shared_prefix_tokens}
        request = SimRequest(self._next_id, now_s, traffic.tenant, traffic.tier, prompt, output, fingerprint=fingerprint,
                             **fields)  # type: ignore[arg-type]
        self._next_id += 1
        self._client_of[request.request_id] = client
        self._schedule(request)

    def _settled(self, request_id: int, answered: bool) -> None:
        client = self._client_of.pop(request_id, None)
        if client is not None:
            assert self._clients is not None
            if answered:
                self.loop.call_later(self._clients.think_s, self._client_send, client)
            else:
                self.loop.call_later(self._clients.resend_s, self._client_send, client, self._requests[request_id])

    def _probe(self) -> None:
        now_s = self.loop.now_s
        replicas = self.replicas.values()
        loads = [r.load if r.alive else None for r in replicas]
        self._probes.append(Probe(now_s, tuple(r.busy_s_at(now_s) for r in replicas),
                                  tuple(0 if load is None else load.running_sequences + load.waiting_sequences
                                        for load in loads), self._queued))

    # ReplicaListener: a replica reports; the dispatcher hears it, then may fill the freed slot
    def on_first_token(self, now_s: float, replica_id: str, request_id: int) -> None:
        self._update(request_id, first_token_s=now_s)
        self.first_tokens.append((self._records[request_id].tier, now_s - self._records[request_id].arrival_s))
        self.dispatcher.on_first_token(now_s, request_id)
        self._need_capacity()  # a prefill done frees work budget (`policy.pool`, rule 3)

    def on_finish(self, now_s: float, replica_id: str, request_id: int) -> None:
        self._update(request_id, finish_s=now_s)
        request = self._requests[request_id]
        self.served_tokens += request.prompt_tokens + request.output_tokens
        if replica_id in self.draining:  # after the replica's step is done with its callbacks
            self.loop.call_later(0.0, self._stop_if_drained, replica_id)
        self.dispatcher.on_finish(now_s, request_id)
        self._settled(request_id, answered=True)
        self._need_capacity()

    def on_failure(self, now_s: float, replica_id: str, request_id: int, reason: str) -> None:
        self._update(request_id, failed_s=now_s, failure_reason=reason)
        if replica_id in self.draining:
            self.loop.call_later(0.0, self._stop_if_drained, replica_id)
        self.dispatcher.on_failure(now_s, request_id, reason)
        self._settled(request_id, answered=False)
        self._need_capacity()

    # internals
    def _arrive(self, request: SimRequest) -> None:
        now_s = self.loop.now_s
        self._records[request.request_id] = RequestRecord(
            request.request_id, request.tenant, request.tier, request.prompt_tokens, request.output_tokens, now_s)
        self._queued += 1
        self.arrived += 1
        self.arrived_tokens += request.prompt_tokens + request.output_tokens
        decision = self.dispatcher.on_arrival(now_s, request.as_pool_request())
        for refusal in decision.displaced:
            self._refuse(now_s, int(refusal.request_id), refusal.reason)
        if decision.verdict is ArrivalVerdict.REFUSED:
            self._refuse(now_s, request.request_id, decision.reason)
            return
        if decision.assignment is not None:
            self._submit(now_s, decision.assignment)
        self._need_capacity()

    @staticmethod
    def _not_started(events: Sequence[ScenarioEvent]) -> list[str]:
        """Replicas whose first event is a start: down until then."""
        first: dict[str, ScenarioEvent] = {}
        for event in events:
            first.setdefault(event.replica_id, event)
        return [replica_id for replica_id, event in first.items() if isinstance(event, StartReplica)]

    def _apply(self, event: ScenarioEvent) -> None:
        replica = self.replicas[event.replica_id]
        if isinstance(event, KillReplica):
            replica.kill()
        elif isinstance(event, SlowReplica):
            replica.slow_down(event.factor)
        else:
            self.start_replica(event.replica_id)

    # the fleet: what an actuator does (`sim.scaling`); scenario events use them too
    def start_replica(self, replica_id: str) -> None:
        """Requests a replica that is down: it serves after its spec's cold start (changes state)."""
        replica = self.replicas[replica_id]
        if replica.alive or replica_id in self.starting:
            raise ValueError(f"StartReplica at {self.loop.now_s}: {replica_id} is already serving or starting")
        self.starting.add(replica_id)
        self.dispatcher.on_replica_health(self.loop.now_s, replica_id, ReplicaHealth.UNHEALTHY)
        self.loop.call_later(replica.spec.cold_start_s, self._ready, replica_id)

    def warm_replica(self, replica_id: str) -> None:
        """Loads a replica that is down as a standby: after its cold start it is up and out of
        traffic (changes state)."""
        replica = self.replicas[replica_id]
        if replica.alive or replica_id in self.starting or replica_id in self.warming:
            raise ValueError(f"cannot warm {replica_id}: it is already up or starting")
        self.warming.add(replica_id)
        self.dispatcher.on_replica_health(self.loop.now_s, replica_id, ReplicaHealth.UNHEALTHY)
        self.loop.call_later(replica.spec.cold_start_s, self._warmed, replica_id)

    def promote_replica(self, replica_id: str, after_s: float = 0.0) -> None:
        """A standby takes traffic `after_s` from now (the time to route to it), without a cold
        start (changes state)."""
        if replica_id not in self.standby:
            raise ValueError(f"cannot promote {replica_id}: it is not a standby")
        self.standby.discard(replica_id)
        self.starting.add(replica_id)
        self.loop.call_later(after_s, self._ready, replica_id)

    def keep_drained(self, replica_id: str) -> None:
        """The draining replica becomes a standby once empty instead of stopping (changes state)."""
        if replica_id not in self.draining:
            raise ValueError(f"{replica_id} is not draining")
        self._keep.add(replica_id)

    def _warmed(self, replica_id: str) -> None:
        self.warming.discard(replica_id)
        self.replicas[replica_id].start()
        self.standby.add(replica_id)

    def hold_down(self, replica_ids: Iterable[str]) -> None:
        """Before the run: these replicas are down until started (a fleet that may grow)."""
        for replica_id in replica_ids:
            self.replicas[replica_id].kill()  # holds nothing yet: nothing fails
            self.dispatcher.on_replica_health(self.loop.now_s, replica_id, ReplicaHealth.UNHEALTHY)

    def drain_replica(self, replica_id: str) -> None:
        """The replica takes no new request and stops once it holds none: nothing it holds is
        aborted (changes state)."""
        if not self.replicas[replica_id].alive:
            raise ValueError(f"cannot drain {replica_id}: it is not serving")
        self.draining.add(replica_id)
        self.dispatcher.on_replica_health(self.loop.now_s, replica_id, ReplicaHealth.UNHEALTHY)
        self._stop_if_drained(replica_id)

    @property
    def kept_draining(self) -> int:
        """Draining replicas that become standbys once empty."""
        return len(self._keep)

    @property
    def queued(self) -> int:
        """Requests arrived and neither sent to a replica nor refused: the dispatcher's queue."""
        return self._queued

    def _stop_if_drained(self, replica_id: str) -> None:
        replica = self.replicas[replica_id]
        if not replica.alive:  # died while draining
            self.draining.discard(replica_id)
        elif replica_id in self.draining and not replica.scheduler.has_work:
            self.draining.discard(replica_id)
            if replica_id in self._keep:  # loaded: kept out of traffic as a standby
                self._keep.discard(replica_id)
                self.standby.add(replica_id)
            else:
                replica.kill()  # holds nothing: nothing fails

    def _ready(self, replica_id: str) -> None:
        self.starting.discard(replica_id)
        if not self.replicas[replica_id].alive:  # a promoted standby is up already
            self.replicas[replica_id].start()
        self.dispatcher.on_replica_health(self.loop.now_s, replica_id, ReplicaHealth.HEALTHY)
        self._need_capacity()

    def _need_capacity(self) -> None:
        # several events at one instant (a step's finishes, a burst) make one call, after them all
        if not self._capacity_pending:
            self._capacity_pending = True
            self.loop.call_later(0.0, self._capacity)

    def _capacity(self) -> None:
        self._capacity_pending = False
        now_s = self.loop.now_s
        loads = {r.replica_id: r.load for r in self.replicas.values() if r.alive}
        self._carry_out(now_s, self.dispatcher.on_capacity(now_s, loads))

    def _carry_out(self, now_s: float, dispatch: Dispatch) -> None:
        for refusal in dispatch.refusals:
            self._refuse(now_s, int(refusal.request_id), refusal.reason)
        for assignment in dispatch.assignments:
            self._submit(now_s, assignment)
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if dispatch.wake_at_s is not None:
            if dispatch.wake_at_s <= now_s:
                raise ValueError(f"wake_at_s {dispatch.wake_at_s} is not after now ({now_s}): it would spin")
            self._wake = self.loop.call_at(dispatch.wake_at_s, self._need_capacity)

    def _refuse(self, now_s: float, request_id: int, reason: str | None) -> None:
        self._queued -= 1
        self.refused += 1
        if self.refusal_cpu_s:
            self._cpu_owed_s += self.refusal_cpu_s
            if self._contention_tick is None:
                self._contention_tick = self.loop.call_later(CONTENTION_TICK_S, self._share_cores)
        self._update(request_id, refused_s=now_s, refused_reason=reason)
        self._settled(request_id, answered=False)

    def _share_cores(self) -> None:
        """Each tick, the refusals' CPU owed is taken from the replicas' cores: their steps stretch
        by 1 / (1 - share). The operating system gives every runnable process its turn, so an engine
        keeps at least half its core (`MAX_CORE_SHARE_TAKEN`); what it cannot take is not owed on:
        the refusals' own round trips were as slow then."""
        alive = [r for r in self.replicas.values() if r.alive]
        capacity_s = CONTENTION_TICK_S * max(len(alive), 1)
        share = min(MAX_CORE_SHARE_TAKEN, self._cpu_owed_s / capacity_s)
        self._cpu_owed_s = 0.0
        for replica in alive:
            replica.share_cores(1.0 / (1.0 - share))
        self._contention_tick = (self.loop.call_later(CONTENTION_TICK_S, self._share_cores) if share > 0 else None)

    def _submit(self, now_s: float, assignment: Assignment) -> None:
        self._queued -= 1
        if assignment.prefix_moved_from is not None:
            self._prefix_moves += 1
        request = self._requests[int(assignment.request_id)]
        self._update(request.request_id, dispatch_s=now_s, replica_id=assignment.replica_id)
        self.replicas[assignment.replica_id].submit(request.request_id, request.prompt_tokens,
                                                    request.output_tokens, assignment.priority,
                                                    prompt_token_ids=request.prompt_token_ids())

    def _update(self, request_id: int, **changes: object) -> None:
        self._records[request_id] = replace(self._records[request_id], **changes)
