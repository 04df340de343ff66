"""The dispatcher seam: typed events in, typed decisions out (the pool controller's contract).

The harness is the only caller here; the live gateway is the other. A dispatcher is pure:
time and measurements come in as arguments, it never reads a clock and never calls a replica.
It decides *that* a request goes to a replica; the body that drives it does the sending.

Call order the harness keeps (so a dispatcher may rely on it):
- `on_arrival` once per request, at its arrival time;
- `on_first_token`, then `on_finish`, or `on_failure`, for each request it assigned;
- `on_replica_health` UNHEALTHY for a replica that is not yet started (before any arrival) or is
  being started again, HEALTHY when its cold start is over, as the live health checks would say;
- `on_capacity` after every event that may free or need a slot or work budget (an arrival, a
  first token, a finish, a failure)
  and at the `wake_at_s` it last asked for; its assignments are sent at once, in order.
A periodic tick (DESIGN's `on_tick`) is a dispatcher asking for `wake_at_s = now_s + period`.

The records the two bodies share live in `tidegate.types` (policy may not import the simulator);
`SimRequest` is the simulator's own: it also knows how many tokens the model will generate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from tidegate.policy.prefix import BLOCK_TOKENS, MAX_BLOCKS
from tidegate.types import (QUEUED, ArrivalDecision, ArrivalVerdict, Assignment, Dispatch, PoolRequest, Refusal,
                            ReplicaHealth, ReplicaLoad)

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
    # the prompt prefix it shares with other requests (a tenant's system prompt), and its length;
    # None: its prompt shares nothing
    shared_prefix: int | None = None
    shared_prefix_tokens: int = 0
    fingerprint: int = 0  # the same for a request and its resends (`policy.resends`); 0: none

    def as_pool_request(self) -> PoolRequest:
        """What a dispatcher sees: the client asks for up to the tokens the model will generate; a
        prompt with a shared prefix has its block names, as the gateway hashes them (`policy.prefix`)."""
        return PoolRequest(self.request_id, self.arrival_s, self.tenant, self.tier, self.prompt_tokens,
                           self.output_tokens, prefix=self._prefix_blocks(), fingerprint=self.fingerprint)

    def prompt_token_ids(self) -> list[int] | None:
        """Token ids for the modelled engine's prefix cache: the shared prefix's, then this request's
        own (None: nothing shared)."""
        if self.shared_prefix is None:
            return None
        shared = min(self.shared_prefix_tokens, self.prompt_tokens)
        own = self.prompt_tokens - shared
        return ([-1 - self.shared_prefix] + [0] * (shared - 1) if shared else []) + \
            ([_OWN_MARK + self.request_id] + [0] * (own - 1) if own else [])

    def _prefix_blocks(self) -> tuple[int, ...]:
        if self.shared_prefix is None:
            return ()
        count = min(self.prompt_tokens // BLOCK_TOKENS, MAX_BLOCKS)
        shared = min(self.shared_prefix_tokens, self.prompt_tokens) // BLOCK_TOKENS
        chained, blocks = 0, []
        for index in range(count):
            chained = hash((chained, (0, self.shared_prefix) if index < shared else (1, self.request_id),
                            index))
            blocks.append(chained)
        return tuple(blocks)


_OWN_MARK = 1 << 40  # first token of a request's own part: no request id or prefix id reaches it


class Dispatcher(Protocol):
    def on_arrival(self, now_s: float, request: PoolRequest) -> ArrivalDecision | Assignment: ...

    def on_capacity(self, now_s: float, loads: Mapping[str, ReplicaLoad]) -> Dispatch:
        """`loads`: each live replica's self-report as of now_s (running, waiting, KV use)."""
        ...

    def on_first_token(self, now_s: float, request_id: int) -> None: ...

    def on_finish(self, now_s: float, request_id: int) -> None: ...

    def on_failure(self, now_s: float, request_id: int, reason: str) -> None: ...

    def on_replica_health(self, now_s: float, replica_id: str, health: ReplicaHealth) -> None:
        """A replica stopped taking traffic (it is starting) or is ready (its cold start is over)."""
        ...
