"""The dispatcher seam: typed events in, typed decisions out (the pool controller's contract).

The harness is the only caller here; the live gateway will be the other. A dispatcher is pure:
time and measurements come in as arguments, it never reads a clock and never calls a replica.
It decides *that* a request goes to a replica; the body that drives it does the sending.

Call order the harness keeps (so a dispatcher may rely on it):
- `on_arrival` once per request, at its arrival time;
- `on_first_token`, then `on_finish`, or `on_failure`, for each request it assigned;
- `on_capacity` after every event that may free or need a slot (an arrival, a finish, a failure)
  and at the `wake_at_s` it last asked for; its assignments are sent at once, in order.
A periodic tick (DESIGN's `on_tick`) is a dispatcher asking for `wake_at_s = now_s + period`.

These records will move to `tidegate.types` when a controller in `policy/` implements the seam:
policy may not import the simulator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from tidegate.types import ReplicaLoad

__all__ = [
    "SimRequest",
    "ArrivalVerdict",
    "ArrivalDecision",
    "Assignment",
    "Refusal",
    "Dispatch",
    "Dispatcher",
    "QUEUED",
]


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: int
    arrival_s: float
    tenant: str
    tier: str
    prompt_tokens: int
    output_tokens: int  # the scenario fixes how many tokens the model generates


class ArrivalVerdict(Enum):
    QUEUED = "queued"  # held by the dispatcher until `on_capacity` assigns or refuses it
    REFUSED = "refused"  # answered at once (429/503 in the live body)


@dataclass(frozen=True, slots=True)
class ArrivalDecision:
    verdict: ArrivalVerdict
    reason: str | None = None  # why it was refused, e.g. "queue_full", "unknown_tier"


QUEUED = ArrivalDecision(ArrivalVerdict.QUEUED)


@dataclass(frozen=True, slots=True)
class Assignment:
    request_id: int
    replica_id: str
    priority: int = 0  # the engine's scheduling class (lower first), as the live body forwards it


@dataclass(frozen=True, slots=True)
class Refusal:
    request_id: int
    reason: str  # e.g. "queue_wait": waited past its tier's max_queue_wait_s


@dataclass(frozen=True, slots=True)
class Dispatch:
    assignments: tuple[Assignment, ...] = ()
    refusals: tuple[Refusal, ...] = ()  # queued requests given up now
    wake_at_s: float | None = None  # later than now_s: call `on_capacity` then even if nothing happens


class Dispatcher(Protocol):
    def on_arrival(self, now_s: float, request: SimRequest) -> ArrivalDecision: ...

    def on_capacity(self, now_s: float, loads: Mapping[str, ReplicaLoad]) -> Dispatch:
        """`loads`: each live replica's self-report as of now_s (running, waiting, KV use)."""
        ...

    def on_first_token(self, now_s: float, request_id: int) -> None: ...

    def on_finish(self, now_s: float, request_id: int) -> None: ...

    def on_failure(self, now_s: float, request_id: int, reason: str) -> None: ...
