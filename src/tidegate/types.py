"""Records that cross boundaries between policies, runtime and simulator. Frozen, units in names.

Those built for every request (`PoolRequest`, `ArrivalDecision`, `Assignment`) are NamedTuples: as
immutable as a frozen dataclass, and about three times cheaper to build (0.3 µs against 0.9 µs for
eight fields), which `bench/gateway_overhead.py` counts.

Add records here when two packages must agree on them; keep records private to a package
inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from operator import itemgetter
from typing import NamedTuple

__all__ = ["ReplicaHealth", "ReplicaLoad", "ArrivalVerdict", "PoolRequest", "Refusal", "ArrivalDecision", "QUEUED",
           "Assignment", "Preemption", "Dispatch"]


class ReplicaHealth(Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    # set by an autoscaling actuator, never by health checks: finishing what it holds before it stops
    DRAINING = "draining"
    STOPPED = "stopped"  # not running (scaled in, or not started yet): not a failure
    WARMING = "warming"  # started as a warm standby, loading: its first good health check makes it STANDBY
    STANDBY = "standby"  # loaded and answering, held out of traffic until a scale-out takes it


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a replica reports about itself (engine /metrics, vLLM metrics), read by routing."""

    running_sequences: int = 0
    waiting_sequences: int = 0
    kv_cache_usage: float = 0.0  # fraction 0-1 of KV-cache capacity in use
    # the tokens its KV cache holds in all (blocks x block size), which bounds what it keeps of
    # prompts' prefixes; 0: not reported
    kv_cache_tokens: int = 0


# ---- the pool controller's contract (policy.pool): typed events in, typed decisions out ----------


class ArrivalVerdict(Enum):
    QUEUED = "queued"  # held by the controller until `on_capacity` assigns or refuses it
    ASSIGNED = "assigned"  # nothing waited and a replica could take it: `ArrivalDecision.assignment`
    REFUSED = "refused"  # answered at once (429/503 in the live body)


class PoolRequest(NamedTuple):
    """What a pool's controller knows of one request."""

    request_id: int | str
    arrival_s: float
    tenant: str
    tier: str
    prompt_tokens: int
    max_output_tokens: int  # the client's max_tokens (or the default): a budget, not a prediction
    timeout_s: float | None = None  # the client's own deadline, if shorter than its tier's wait
    # the body will report its first token (a stream); a whole answer reports only its end
    streamed: bool = True
    # chained hashes of the prompt's leading blocks (`policy.prefix`): routes it where its prefix is
    # probably cached; empty: no affinity
    prefix: tuple[int, ...] = ()
    # the same request sent again by the same tenant has the same fingerprint (`policy.resends`): a
    # resend before its Retry-After is held, not refused again at once; 0: none
    fingerprint: int = 0
    # re-runnable background work (a Batch API request, whose result is kept only when it ends): the
    # controller may stop it to give its slot to a better tier's waiting request (`Preemption`)
    preemptible: bool = False

    # read as `policy.queueing.QueuedRequest` reads, so that a request sent at once, never queued, is
    # its own record in the fair-share accounts (`FairPriorityQueue.settle_service`): `max_output_tokens`
    # (field 5) by a C getter, read at every request's end; a Python getter costs a frame more
    expected_output_tokens = property(itemgetter(5))

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


@dataclass(frozen=True, slots=True)
class Refusal:
    request_id: int | str
    reason: str  # e.g. "queue_wait", "queue_full", "predicted_miss", "displaced", "no_replica"
    retry_after_s: float | None = None


class ArrivalDecision(NamedTuple):
    """What `on_arrival` answers when it does not assign the request at once. A request assigned at
    arrival is answered with its `Assignment` alone, which reads as the ASSIGNED decision: the common
    case below capacity builds no decision record around it."""

    verdict: ArrivalVerdict
    reason: str | None = None  # why it was refused
    retry_after_s: float | None = None
    displaced: tuple[Refusal, ...] = ()  # queued requests of worse tiers it pushed out: answer them
    # predicted wait / the wait its deadline allows (>= 1 refused); the degradation ladder reads it
    pressure: float = 0.0
    predicted_wait_s: float | None = None
    assignment: Assignment | None = None  # with ASSIGNED: carry it out as one of `on_capacity`'s


QUEUED = ArrivalDecision(ArrivalVerdict.QUEUED)


class Assignment(NamedTuple):
    request_id: int | str
    replica_id: str
    priority: int = 0  # the engine's scheduling level (lower first), for engines that order by it
    # the replica its prompt's prefix was held at and moved from, to even the load out (the pool
    # controller's rule 7); None: no move
    prefix_moved_from: str | None = None

    # returned by `on_arrival`, an assignment is the decision "assigned at arrival" (`ArrivalDecision`'s
    # fields, as that decision has them): class attributes, not fields, so building one costs nothing more
    verdict = ArrivalVerdict.ASSIGNED
    reason = None
    retry_after_s = None
    displaced = ()
    pressure = 0.0
    predicted_wait_s = 0.0

    @property
    def assignment(self) -> Assignment:
        return self


class Preemption(NamedTuple):
    """A preemptible request stopped so that a better tier's waiting request takes its slot: the
    controller has ended it already (its slot is free); the body cancels its upstream call and runs
    it again later."""

    request_id: int | str
    replica_id: str
    for_request_id: int | str  # the waiting request that takes its slot in the same `Dispatch`
    held_s: float  # how long it had been at the replica: the work thrown away


@dataclass(frozen=True, slots=True)
class Dispatch:
    assignments: tuple[Assignment, ...] = ()
    refusals: tuple[Refusal, ...] = ()  # queued requests given up now
    wake_at_s: float | None = None  # later than now_s: call `on_capacity` then even if nothing happens
    preemptions: tuple[Preemption, ...] = ()  # sent requests stopped to free slots that `assignments` use
