"""Overload control at the gateway: the I/O edge of the pure policies in `policy/`.

Per request (see `policy.overload` for the decisions themselves):
`authenticate` (API key -> tenant, tier; 401) -> `admit` (rate limits, predicted wait, degradation
ladder; refusals raise at once with `x-ratelimit-*`, `Retry-After` and `x-tidegate-degradation`)
-> `acquire` (waits in the pool's `FairWaitQueue` until a replica's adaptive slot frees: late
binding) -> `first_token` / `ended` (latency samples for the replica's slot limit) -> `settle`
(refund the unused token reservation, correct the tenant's fair share).

The clock is read here and passed in; every decision stays in the policies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from tidegate.errors import AuthenticationError, OverloadedError, RateLimitError
from tidegate.gateway.dispatch import ModelPool, Replica, Waiter
from tidegate.gateway.overload_config import OverloadPolicies
from tidegate.gateway.overload_metrics import OverloadMetrics
from tidegate.policy.admission import LimitKind
from tidegate.policy.concurrency import PriorityReserve, ReplicaSlots
from tidegate.policy.degradation import DEGRADATION_HEADER, Rung
from tidegate.policy.health import is_routable
from tidegate.policy.identity import Identity
from tidegate.policy.overload import ArrivalOutcome, OverloadControl, RequestFacts, ShedNotice

__all__ = [
    "TenantRateLimitError",
    "DegradedReplyError",
    "Ticket",
    "FairWaitQueue",
    "OverloadRuntime",
    "estimate_prompt_tokens",
    "extra_headers",
]

log = logging.getLogger("tidegate.overload")


class TenantRateLimitError(RateLimitError):
    """429 with the tenant's `x-ratelimit-*` headers."""

    def __init__(self, message: str, *, retry_after_s: float | None, headers: bytes) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.headers = headers


class DegradedReplyError(OverloadedError):
    """503 + Retry-After carrying the preset reply text, named as such by `x-tidegate-degradation`."""

    def __init__(self, message: str, *, retry_after_s: float | None, headers: bytes) -> None:
        super().__init__(message, code="overloaded", retry_after_s=retry_after_s)
        self.headers = headers


def extra_headers(error: BaseException) -> bytes:
    """Header lines an error adds to its response (rate-limit, degradation); b"" for most errors."""
    return getattr(error, "headers", b"")


def _header_lines(headers: Mapping[str, str]) -> bytes:
    return b"".join(f"{name}: {value}\r\n".encode() for name, value in headers.items())


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Prompt tokens from the request body without a tokenizer: ~4 characters a token (OpenAI's rule of
    thumb), plus a few per chat message for its role and separators. Only for reservations and
    fair share: settlement corrects it with the usage the upstream reports."""
    chars = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(part.get("text", "")) for part in content if isinstance(part, dict))
        return chars // 4 + 4 * len(messages) + 1
    prompt = body.get("prompt", body.get("input"))
    if isinstance(prompt, str):
        return len(prompt) // 4 + 1
    if isinstance(prompt, list):
        return sum(len(p) // 4 + 1 if isinstance(p, str) else len(p) if isinstance(p, list) else 1 for p in prompt)
    return 1


class Ticket:
    """What overload control knows of one admitted request; rides on `Waiter.ticket`."""

    __slots__ = ("request_id", "pool", "tier", "tenant", "prompt_tokens", "arrived_s", "predicted_wait_s",
                 "response_headers", "dispatched_s", "waiter", "replica", "protected", "holds_protected_slot",
                 "demoted_on")

    def __init__(self, request_id: str, pool: str, tier: str, tenant: str, prompt_tokens: int, arrived_s: float,
                 predicted_wait_s: float | None, response_headers: bytes) -> None:
        self.request_id = request_id
        self.pool = pool  # the pool it waits in: the fallback pool when degraded to it
        self.tier = tier
        self.tenant = tenant
        self.prompt_tokens = prompt_tokens
        self.arrived_s = arrived_s
        self.predicted_wait_s = predicted_wait_s
        self.response_headers = response_headers  # rate-limit (+ degradation) lines for the answer
        self.dispatched_s: float | None = None
        self.waiter: Waiter | None = None
        self.replica: Replica | None = None  # set at admission by the uncontended fast path
        # served like the best tier (decided when it leaves the queue: `OverloadControl.protected`)
        self.protected = False
        self.holds_protected_slot: Replica | None = None  # the replica whose slot it holds, when protected
        # the replica that was told to serve it a priority step below its tier, its tenant flooding
        self.demoted_on: Replica | None = None


class FairWaitQueue:
    """`dispatch.WaitQueue` over a pool's `FairPriorityQueue` (inside `OverloadControl`).

    A waiter's ticket is already queued in the policy when it is pushed (`OverloadControl.arrive`
    enqueues); this maps request ids to waiters, keeps the deadline timer armed and answers
    requests the policy sheds. Waiters without a ticket (a retry on another replica after a
    connection failure: already dispatched once) go first, in FIFO order.
    """

    def __init__(self, runtime: OverloadRuntime, pool: str) -> None:
        self._runtime = runtime
        self._control = runtime.control
        self._pool = pool
        self._policies = runtime.control.pools[pool]
        self._waiting: dict[str, Waiter] = {}
        self._retries: deque[Waiter] = deque()
        self._peeked_at_s = 0.0
        self._skipped: frozenset[str] = frozenset()  # flooding tenants `peek` passed over
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s: float | None = None

    def push(self, waiter: Waiter) -> None:
        ticket = waiter.ticket
        if ticket is None:
            self._retries.append(waiter)
            return
        self._waiting[ticket.request_id] = waiter
        self._arm_timer()

    def peek(self) -> Waiter | None:
        if self._retries:
            return self._retries[0]
        now_s = self._peeked_at_s = self._runtime.clock()
        self._runtime.answer_shed(now_s, self._control.expire(now_s, self._pool))
        self._skipped = frozenset()
        while True:
            head = self._control.peek(self._pool, self._skipped)
            if head is None:
                return None
            waiter = self._waiting.get(head.request_id)
            if waiter is not None:
                protected = waiter.ticket.protected = self._control.protected(now_s, self._pool, head)
                if not protected:
                    # the rest fill only the slots neither headroom nor the protected reserve keeps
                    excluded = self._runtime.unprotected_exclusions(self._pool, now_s)
                    if excluded is None:
                        # no such slot free: hold the head back; but a flooding tenant's turn must
                        # not hold back its tier's tenants within their share, who may go now
                        flooding = self._control.flooding(now_s, self._pool, head.tier)
                        if head.tenant not in flooding or self._skipped:
                            return None
                        self._skipped = flooding
                        continue
                    waiter.exclude = excluded
                return waiter
            # queued in the policy but nobody waits for it (its handler failed before waiting)
            self._control.cancel(now_s, head.request_id)

    def pop(self) -> Waiter:
        if self._retries:
            return self._retries.popleft()
        now_s = self._peeked_at_s  # the instant `peek` looked: the same request comes out
        dispatch = self._control.dispatch(now_s, self._pool, self._skipped)
        self._runtime.answer_shed(now_s, dispatch.shed)
        request = dispatch.request
        if request is None:
            raise IndexError("pop from an empty FairWaitQueue")
        waiter = self._waiting.pop(request.request_id)
        ticket: Ticket = waiter.ticket
        ticket.dispatched_s = now_s
        self._runtime.on_dispatch(ticket, now_s - request.enqueued_at_s)
        self._arm_timer()
        return waiter

    def remove(self, waiter: Waiter) -> None:
        ticket = waiter.ticket
        if ticket is None:
            try:
                self._retries.remove(waiter)
            except ValueError:
                pass
            return
        if self._waiting.pop(ticket.request_id, None) is not None:
            self._control.cancel(self._runtime.clock(), ticket.request_id)

    def drain(self) -> list[Waiter]:
        """Every waiter, each request cancelled in the policy (its reservation refunded)."""
        now_s = self._runtime.clock()
        waiters = list(self._retries)
        self._retries.clear()
        for request_id, waiter in self._waiting.items():
            self._control.cancel(now_s, request_id)
            waiters.append(waiter)
        self._waiting.clear()
        return waiters

    def take_shed(self, request_id: str) -> Waiter | None:
        """The waiter of a request the policy dropped, no longer queued."""
        return self._waiting.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._policies.queue) + len(self._retries)

    # -- deadlines: answer a request at its deadline, not when the next slot happens to free
    def _arm_timer(self) -> None:
        deadline_s = self._policies.queue.next_deadline_s()
        if deadline_s is None or (self._timer_at_s is not None and self._timer_at_s <= deadline_s):
            return
        if self._timer is not None:
            self._timer.cancel()
        delay_s = max(0.0, deadline_s - self._runtime.clock())
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._on_deadline)
        self._timer_at_s = deadline_s

    def _on_deadline(self) -> None:
        self._timer = self._timer_at_s = None
        now_s = self._runtime.clock()
        self._runtime.answer_shed(now_s, self._control.expire(now_s, self._pool))
        if len(self._policies.queue):
            self._arm_timer()


class OverloadRuntime:
    """Owns the overload policies of a running gateway and drives them from the request path."""

    def __init__(self, policies: OverloadPolicies, pools: Mapping[str, ModelPool], metrics: OverloadMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.identity = policies.identity
        self.control: OverloadControl = policies.control
        self.config = policies.config
        self.pools = pools
        self.metrics = metrics
        self.clock = clock
        self.queues: dict[str, FairWaitQueue] = {}
        self.slots: dict[str, ReplicaSlots] = {}  # replica id -> its adaptive slots
        self._tickets: dict[str, Ticket] = {}  # queued, by request id: to find a shed request's waiter
        slots_config = self.config.limits.slots
        isolation = self.config.limits.isolation
        isolation_tolerance = isolation.latency_tolerance if isolation is not None else None
        self._headroom = slots_config.priority_headroom
        half_life_s = slots_config.priority_reserve_half_life_s
        # Protected requests: the best tier's, and (isolation) those of tenants within their share
        # while another tenant floods their tier. Per pool, for each of the two: their recent
        # concurrency, reserved inside the limits (None: no reserve). Only the best tier's presence
        # aims the limits at its tighter target: tenants within their share are most of the load
        # in a flood, and a target near the unloaded latency would hold them to the fewest slots.
        self._best_tier = self.control.tiers.best.name
        self._reserves: dict[str, PriorityReserve | None] = {
            name: PriorityReserve(half_life_s) if half_life_s is not None else None for name in pools}
        self._share_reserves: dict[str, PriorityReserve | None] = {
            name: PriorityReserve(half_life_s) if half_life_s is not None else None for name in pools}
        self._protected_held: dict[str, int] = {}  # replica id -> protected requests holding its slots
        self._demoted_held: dict[str, int] = {}  # replica id -> demoted requests (`engine_priority`) it holds
        self._best_held: dict[str, int] = {}  # replica id -> best-tier requests holding its slots
        # One anonymous tenant, no rate limit: a request that finds the queue empty and a slot free
        # would be admitted, queued and dispatched at once, so it skips the policy round trip.
        default_tier = self.control.tiers.default
        self._fast_path = (not self.config.tenants and self.config.limits.default is None
                           and default_tier.queue_bound > 0 and self.config.limits.max_queued > 0)
        for name, pool in pools.items():
            queue = self.queues[name] = FairWaitQueue(self, name)
            pool.queue = queue
            tier_queue, shares = self.control.pools[name].queue, self.control.pools[name].shares
            for tier in self.control.tiers:
                metrics.watch_queue(name, tier.name, lambda q=tier_queue, t=tier.name: q.depth(t),
                                    lambda q=tier_queue, t=tier.name: q.oldest_wait_s(self.clock(), t),
                                    None if shares is None else
                                    lambda s=shares, t=tier.name: len(s.over_share(self.clock(), t)))
            for replica in pool.replicas:
                # the backend's configured slot_limit stays a ceiling the adaptive limit never passes
                slots = self.slots[replica.replica_id] = slots_config.new_slots(
                    ceiling=replica.slot_limit,
                    # a smaller limit squeezes the flood, not the protected tenants, only where the
                    # flood is demoted (`engine_priority`); elsewhere it measured worse than none
                    isolation_tolerance=isolation_tolerance if replica.forward_priority else None)
                self._protected_held[replica.replica_id] = self._best_held[replica.replica_id] = 0
                # routing's cap: the adaptive limit plus the protected requests' headroom
                replica.slot_limit = slots.slot_limit + self._headroom
                metrics.watch_slot_limit(name, replica.replica_id, lambda s=slots: s.slot_limit,
                                         lambda s=slots: s.aimed_latency_s(self.clock()))

    # -- 0. identity
    def authenticate(self, authorization: bytes | None) -> Identity:
        key = None
        if authorization is not None:
            scheme, _, value = authorization.decode("latin-1").partition(" ")
            key = value.strip() if scheme.lower() == "bearer" else None
        decision = self.identity.resolve(key)
        if decision.identity is None:
            raise AuthenticationError("missing or invalid API key (send 'Authorization: Bearer <key>')")
        return decision.identity

    def check_tier(self, identity: Identity) -> None:
        if identity.tier is not None and identity.tier not in self.control.tiers:
            raise AuthenticationError(f"the key's tier {identity.tier!r} is not configured")

    # -- 1. admission
    def admit(self, now_s: float, request_id: str, identity: Identity, model: str, body: Mapping[str, Any],
              timeout_s: float | None = None) -> Ticket:
        """Admits a request into its pool's queue, or raises the answer to send at once."""
        prompt_tokens = estimate_prompt_tokens(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            max_tokens = 0 if "input" in body else self.config.limits.default_max_tokens
        if self._fast_path and identity.tier is None and timeout_s is None:
            pool = self.pools[model]
            replica = pool.try_acquire(now_s) if not len(pool.queue) else None
            if replica is not None and replica.outstanding > self.slots[replica.replica_id].slot_limit:
                pool.release(replica, now_s)  # it took the protected headroom: queue instead
                replica = None
            if replica is not None:
                try:
                    return self._dispatched_at_once(now_s, request_id, identity, model, replica,
                                                    prompt_tokens, prompt_tokens + max_tokens)
                except BaseException:
                    pool.release(replica, now_s)  # the slot is the caller's only once the ticket is
                    raise
        facts = RequestFacts(request_id, identity.tenant, identity.tier, model, prompt_tokens, max_tokens,
                             timeout_s=timeout_s)
        arrival = self.control.arrive(now_s, facts)
        tier = arrival.tier.name
        self.answer_shed(now_s, arrival.shed)
        limits = arrival.admission.headers
        headers = _header_lines(limits.as_http_headers()) if limits is not None else b""
        outcome = arrival.outcome
        metrics = self.metrics
        if outcome is ArrivalOutcome.QUEUED:
            assert arrival.pool is not None
            if arrival.rung is not Rung.PRIMARY:
                headers += _header_lines({DEGRADATION_HEADER: arrival.rung.value})
                metrics.of(metrics.degraded, model, arrival.rung.value).inc()
            metrics.of(metrics.admissions, model, tier, "queued" if arrival.rung is Rung.PRIMARY
                                      else arrival.rung.value).inc()
            prediction = arrival.prediction
            ticket = Ticket(request_id, arrival.pool, tier, identity.tenant, prompt_tokens, now_s,
                            prediction.predicted_wait_s if prediction is not None else None, headers)
            self._tickets[request_id] = ticket
            # the waiter joins at once, so that the policy's queue and the waiters never disagree
            ticket.waiter = Waiter(asyncio.get_running_loop().create_future(), (), ticket)
            self.pools[arrival.pool].queue.push(ticket.waiter)
            return ticket
        metrics.of(metrics.admissions, model, tier, outcome.value).inc()
        if outcome in (ArrivalOutcome.RATE_LIMITED, ArrivalOutcome.TOO_LARGE):
            kind = arrival.admission.limit_hit or LimitKind.REQUESTS
            reason = "too_large" if outcome is ArrivalOutcome.TOO_LARGE else f"rate_limited_{kind.value}"
            metrics.of(metrics.rejections, model, tier, reason).inc()
            metrics.of(metrics.rejection_latency, model).observe(self.clock() - now_s)
            raise TenantRateLimitError(arrival.admission.message, retry_after_s=arrival.admission.retry_after_s,
                                       headers=headers)
        # PRESET_REPLY (CACHED_ANSWER cannot happen: no cache is offered to the policy yet)
        reply = arrival.reply
        assert reply is not None
        reason = ("predicted_miss" if arrival.prediction is not None and arrival.prediction.misses_deadline
                  else "degraded")
        metrics.of(metrics.rejections, model, tier, reason).inc()
        metrics.of(metrics.degraded, model, Rung.PRESET_REPLY.value).inc()
        metrics.of(metrics.rejection_latency, model).observe(self.clock() - now_s)
        raise DegradedReplyError(reply.message or "overloaded", retry_after_s=reply.retry_after_s,
                                 headers=headers + _header_lines(reply.headers()))

    def _dispatched_at_once(self, now_s: float, request_id: str, identity: Identity, model: str, replica: Replica,
                            prompt_tokens: int, tokens: int) -> Ticket:
        tier = self.control.tiers.default.name
        # the predictor still learns of the dispatch, so its next backlogged interval starts here
        self.control.pools[model].predictor.on_dispatch(now_s, tokens, queued_after=0)
        metrics = self.metrics
        metrics.of(metrics.admissions, model, tier, "queued").inc()
        metrics.of(metrics.queue_wait, model, tier).observe(0.0)
        ticket = Ticket(request_id, model, tier, identity.tenant, prompt_tokens, now_s, 0.0, b"")
        ticket.dispatched_s = now_s
        ticket.replica = replica
        ticket.protected = tier == self._best_tier
        self._took_slot(ticket, replica, now_s)
        return ticket

    # -- 2./3. queue and late-binding dispatch
    async def acquire(self, ticket: Ticket) -> Replica:
        """Waits until a replica of the ticket's pool has a free slot and this request is next.

        Await it right after `admit`, with `settle` in a `finally`: the request is already queued.
        """
        if ticket.replica is not None:
            return ticket.replica  # the fast path took a slot at admission
        waiter = ticket.waiter
        assert waiter is not None
        self.pools[ticket.pool].dispatch_waiting(self.clock())
        try:
            replica = await waiter.future
        except asyncio.CancelledError:
            pool = self.pools[ticket.pool]  # the fallback pool if the request was moved meanwhile
            pool.queue.remove(waiter)
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                pool.release(future.result(), self.clock())  # handed a slot just as the client left
            raise
        try:
            self._took_slot(ticket, replica, self.clock())
        except BaseException:
            self.pools[replica.pool_name].release(replica, self.clock())  # the caller never got the slot
            raise
        return replica

    def _took_slot(self, ticket: Ticket, replica: Replica, now_s: float) -> None:
        if not ticket.protected:
            if replica.forward_priority and self.control.floods(now_s, ticket.pool, ticket.tier, ticket.tenant):
                # demoted (see `engine_priority`): the engine serves it after the tier's others, so
                # it takes no slot from them; the limit still bounds the flood (unprotected_exclusions)
                ticket.demoted_on = replica
                rid = replica.replica_id
                self._demoted_held[rid] = self._demoted_held.get(rid, 0) + 1
                replica.slot_limit += 1
            return
        reserve = self._reserve_of(ticket)
        if reserve is not None:
            reserve.on_change(now_s, +1)
        ticket.holds_protected_slot = replica
        rid = replica.replica_id
        self._protected_held[rid] = self._protected_held.get(rid, 0) + 1
        if ticket.tier == self._best_tier:
            self._best_held[rid] = self._best_held.get(rid, 0) + 1

    def _gave_back_slot(self, ticket: Ticket, now_s: float) -> None:
        demoted_on = ticket.demoted_on
        if demoted_on is not None:
            ticket.demoted_on = None
            self._demoted_held[demoted_on.replica_id] -= 1
            demoted_on.slot_limit -= 1
        replica = ticket.holds_protected_slot
        if replica is None:
            return
        ticket.holds_protected_slot = None
        reserve = self._reserve_of(ticket)
        if reserve is not None:
            reserve.on_change(now_s, -1)
        self._protected_held[replica.replica_id] -= 1
        if ticket.tier == self._best_tier:
            self._best_held[replica.replica_id] -= 1
        pool = self.pools[ticket.pool]
        if len(pool.queue):
            pool.dispatch_waiting(now_s)  # an unprotected request may now fit where this one was

    def _reserve_of(self, ticket: Ticket) -> PriorityReserve | None:
        reserves = self._reserves if ticket.tier == self._best_tier else self._share_reserves
        return reserves.get(ticket.pool)

    def on_dispatch(self, ticket: Ticket, waited_s: float) -> None:
        self._tickets.pop(ticket.request_id, None)
        self.metrics.of(self.metrics.queue_wait, ticket.pool, ticket.tier).observe(waited_s)
        if ticket.predicted_wait_s is not None:
            predicted = self.metrics.of(self.metrics.predicted_wait, ticket.pool, ticket.tier)
            predicted.observe(ticket.predicted_wait_s)

    def answer_shed(self, now_s: float, notices: tuple[ShedNotice, ...]) -> None:
        """Answers requests the policy dropped from a queue (deadline passed, or displaced)."""
        for notice in notices:
            request = notice.request
            if notice.moved_to is not None:
                self._move_waiter(now_s, notice)
                continue
            ticket = self._tickets.pop(request.request_id, None)
            self.metrics.of(self.metrics.rejections, ticket.pool if ticket else "", request.tier,
                                           f"shed_{notice.reason.value}").inc()
            if ticket is None:
                continue
            self.metrics.of(self.metrics.degraded, ticket.pool, Rung.PRESET_REPLY.value).inc()
            waiter = self.queues[ticket.pool].take_shed(request.request_id)
            if waiter is None or waiter.future.done():
                continue
            reply = notice.reply
            waiter.future.set_exception(DegradedReplyError(
                reply.message or "overloaded", retry_after_s=reply.retry_after_s,
                headers=ticket.response_headers + _header_lines(reply.headers())))

    def _move_waiter(self, now_s: float, notice: ShedNotice) -> None:
        """A displaced request the policy moved to the fallback pool: its waiter follows it there."""
        ticket = self._tickets.get(notice.request.request_id)
        if ticket is None:
            return
        waiter = self.queues[ticket.pool].take_shed(ticket.request_id)
        target = notice.moved_to
        assert target is not None
        self.metrics.of(self.metrics.degraded, ticket.pool, Rung.FALLBACK_POOL.value).inc()
        ticket.pool = target
        ticket.response_headers += _header_lines(notice.reply.headers())
        if waiter is None or waiter.future.done():
            return
        pool = self.pools[target]
        pool.queue.push(waiter)
        pool.dispatch_waiting(now_s)

    # -- 4./5. adaptive slots
    def first_token(self, replica: Replica, latency_s: float, ticket: Ticket | None = None) -> None:
        """Time from dispatch to the first token (or to the whole answer when not streamed).

        Not of a request the engine was told to serve after its tier's others (`demoted`): its
        wait inside the engine is the flood's own queue, which neither the slot limit (that keeps
        the others' batch at the target) nor the others' wait budget should answer for.
        """
        if ticket is not None and ticket.demoted_on is not None:
            return
        if ticket is not None:  # the wait budget of later requests of its tier counts it
            self.control.observe_first_token(ticket.pool, ticket.tier, latency_s)
        self._sample(replica, latency_s, dropped=False)

    def ended_badly(self, replica: Replica, elapsed_s: float) -> None:
        """An error or timeout at the replica: the limit backs off."""
        self._sample(replica, elapsed_s, dropped=True)

    def _sample(self, replica: Replica, latency_s: float, dropped: bool) -> None:
        slots = self.slots.get(replica.replica_id)
        if slots is None:
            return
        now_s = self.clock()
        slots.inflight = replica.outstanding  # the pool counts held slots; the policy reads them
        slots.observe_load(now_s, replica.load)
        isolating = self.control.isolating(now_s, replica.pool_name)
        slots.set_protection(self._best_tier_present(replica, now_s), isolating)
        before = replica.slot_limit
        pool = self.pools[replica.pool_name]
        # a flooding tenant's backlog stretches no target: the bigger batch would slow the very
        # tenants isolation protects, to drain a queue that is the flood's own
        slots.observe(now_s, latency_s, dropped, queued=len(pool.queue) > 0 and not isolating)
        replica.slot_limit = (self._protected_cap(replica, slots, now_s) + self._headroom
                              + self._demoted_held.get(replica.replica_id, 0))
        kind = "drop" if dropped else "ok"
        self.metrics.of(self.metrics.slot_samples, replica.pool_name, replica.replica_id, kind).inc()
        if replica.slot_limit > before:
            if len(pool.queue):
                pool.dispatch_waiting(now_s)

    def engine_priority(self, ticket: Ticket) -> int:
        """The `priority` sent to engines that schedule by it (lower first): twice the tier's rank,
        plus one if the ticket is demoted: its tenant flooded its tier when it took its slot.

        The gateway's slots bound how many requests a replica holds, but the engine orders them
        itself: its prompts and decodes go best priority first, then oldest, and preemption takes
        the worst. With one priority per tier a flood's requests, dispatched while nothing else
        waited, sit ahead of a protected tenant's in the engine's queue and fill its steps; one
        step lower for the flooding tenant lets the others' prompts in first, and never below a
        lower tier. A demoted request holds no slot against protected ones (`_took_slot`), and its
        time to first token teaches nothing (`first_token`).
        """
        return 2 * self.control.tiers[ticket.tier].rank + (ticket.demoted_on is not None)

    def _protected_cap(self, replica: Replica, slots: ReplicaSlots, now_s: float) -> int:
        """Slots of the replica protected requests may hold, before the headroom (`best_tier_slots`)."""
        reserve = self._reserves.get(replica.pool_name)
        if reserve is None:
            return slots.slot_limit
        return slots.best_tier_slots(reserve.peak_per_replica(now_s, len(self.pools[replica.pool_name].replicas)))

    def _best_tier_present(self, replica: Replica, now_s: float) -> bool:
        reserve = self._reserves.get(replica.pool_name)
        if reserve is None:
            return self._best_held.get(replica.replica_id, 0) > 0
        return reserve.reserved_per_replica(now_s, len(self.pools[replica.pool_name].replicas)) > 0

    def unprotected_exclusions(self, pool: str, now_s: float) -> tuple[str, ...] | None:
        """Replicas of `pool` where an unprotected request may not go now; None when it fits nowhere.

        Unprotected requests may hold at most `limit - reserved` slots of a replica: the headroom
        above the adaptive limit and the protected requests' expected concurrency inside it stay
        free for them.
        """
        replicas = self.pools[pool].replicas
        reserved = sum(reserve.reserved_per_replica(now_s, len(replicas))
                       for reserve in (self._reserves.get(pool), self._share_reserves.get(pool)) if reserve is not None)
        slots, protected_held = self.slots, self._protected_held
        excluded: list[str] = []
        fits = False
        for replica in replicas:
            rid = replica.replica_id
            lower_held = replica.outstanding - protected_held.get(rid, 0)
            if (lower_held < slots[rid].slot_limit - reserved and replica.outstanding < slots[rid].slot_limit
                    and is_routable(replica.health, replica.breaker, now_s)):
                fits = True
            else:
                excluded.append(rid)
        return tuple(excluded) if fits else None

    # -- 6. settle
    def settle(self, ticket: Ticket, prompt_tokens: int | None, completion_tokens: int) -> None:
        """Ends the request's accounts: refund unused tokens, correct fair share. Call exactly once."""
        if ticket.holds_protected_slot is not None or ticket.demoted_on is not None:
            self._gave_back_slot(ticket, self.clock())
        if ticket.replica is not None:
            return  # the fast path: nothing reserved, nothing queued
        now_s = self.clock()
        self._tickets.pop(ticket.request_id, None)
        if ticket.dispatched_s is None and self.control.cancel(now_s, ticket.request_id):
            return
        prompt = ticket.prompt_tokens if prompt_tokens is None else prompt_tokens
        self.control.finish(now_s, ticket.request_id, prompt_tokens=prompt, completion_tokens=completion_tokens)
