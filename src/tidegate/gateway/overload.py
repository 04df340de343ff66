"""Overload control at the gateway: the live body of `policy.overload` and the pools' controllers.

Per request: `authenticate` (API key -> tenant, tier; 401) -> `admit` (rate limits, the pool's
controller, degradation ladder; refusals raise at once with `x-ratelimit-*`, `Retry-After` and
`x-tidegate-degradation`) -> `acquire` (waits until the controller assigns it a replica: late
binding) -> `first_token` / `ended` (what happened at the replica) -> `settle` (tells the controller
how it ended, refunds the unused token reservation). Futures, timers, metrics and error mapping
live here; every decision is the controller's (`policy.pool`). The clock is read here and passed in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from tidegate.errors import AuthenticationError, OverloadedError, RateLimitError
from tidegate.gateway.dispatch import ModelPool, Replica
from tidegate.overload_config import OverloadPolicies
from tidegate.gateway.overload_metrics import OverloadMetrics
from tidegate.policy.admission import LimitKind
from tidegate.policy.degradation import DEGRADATION_HEADER, DegradationDecision, Rung
from tidegate.policy.identity import Identity
from tidegate.policy.overload import Arrival, ArrivalOutcome, OverloadControl, ShedNotice
from tidegate.policy.pool import REFUSED_NO_REPLICA, PoolController
from tidegate.policy.prefix import BLOCK_CHARS, BLOCK_TOKENS, MAX_BLOCKS, prefix_blocks
from tidegate.policy.slot_split import OutsideLoad
from tidegate.types import Assignment, PoolRequest, Preemption, Refusal

__all__ = [
    "TenantRateLimitError",
    "DegradedReplyError",
    "CachedAnswerRung",
    "Ticket",
    "OverloadRuntime",
    "estimate_prompt_tokens",
    "extra_headers",
]

log = logging.getLogger("tidegate.overload")
# read on every admission as a module name: through its class, on Python 3.10 and 3.11, the read goes
# through `EnumType.__getattr__`'s slot hook (some 850 instructions)
_ASSIGNED = ArrivalOutcome.ASSIGNED
_PRIMARY = Rung.PRIMARY  # the rung of every request served by its own pool (with rate limits: an `Arrival`)


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


class CachedAnswerRung(Exception):
    """The ladder answers with the cache's answer to the same question (`x-tidegate-degradation:
    cached_answer`): raised instead of the preset reply when the caller offered one."""

    def __init__(self, headers: bytes) -> None:
        super().__init__("cached answer")
        self.headers = headers


def extra_headers(error: BaseException) -> bytes:
    """Header lines an error adds to its response (rate-limit, degradation); b"" for most errors."""
    return getattr(error, "headers", b"")


def _header_lines(headers: Mapping[str, str]) -> bytes:
    return b"".join(f"{name}: {value}\r\n".encode() for name, value in headers.items())


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Prompt tokens from the request body without a tokenizer: ~4 characters a token (OpenAI's rule of
    thumb), plus a few per chat message for its role and separators. Only for reservations, fair
    share and the work budget: settlement corrects the reservation with the upstream's usage."""
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


def prompt_prefix(body: Mapping[str, Any]) -> tuple[int, ...]:
    """The prompt's prefix blocks (`policy.prefix`): a chat's roles and texts in order, or the prompt."""
    messages = body.get("messages")
    parts: list[str] = []
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            parts.append(str(message.get("role", "")))
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [part["text"] for part in content
                          if isinstance(part, dict) and isinstance(part.get("text"), str)]
    elif isinstance(body.get("prompt"), str):
        parts.append(body["prompt"])
    return prefix_blocks(parts)


class Ticket:
    """What the body knows of one admitted request, from `admit` to `settle`."""

    __slots__ = ("request_id", "pool", "tier", "prompt_tokens", "arrived_s", "predicted_wait_s", "response_headers",
                 "future", "replica", "priority", "dispatched_s", "failure", "completed", "settled", "shared",
                 "prompt_chars")

    def __init__(self, request_id: str, pool: str, tier: str, prompt_tokens: int, arrived_s: float,
                 predicted_wait_s: float | None, response_headers: bytes) -> None:
        self.request_id = request_id
        self.pool = pool  # the pool it waits in: the fallback pool when degraded to it
        self.tier = tier
        self.prompt_tokens = prompt_tokens
        self.arrived_s = arrived_s
        self.predicted_wait_s = predicted_wait_s
        self.response_headers = response_headers  # rate-limit (+ degradation) lines for the answer
        # while it waits in a controller's queue: resolved with the replica it assigns, or the refusal
        self.future: asyncio.Future[Replica] | None = None
        self.replica: Replica | None = None  # assigned and not yet ended there
        self.priority = 0  # the engine level the controller assigned (`priority` for engines using it)
        self.dispatched_s: float | None = None
        self.failure: str | None = None  # how its attempt failed at the replica, if it did
        self.completed = False  # the replica answered it whole
        self.settled = False
        self.shared: Any = None  # its reservation in the shared limits (`gateway.shared_limits`), if they took it
        # its prompt's characters as its prefix blocks count them, for the engines' tokens a character
        # (`PoolController.on_prompt_usage`); 0: not known
        self.prompt_chars = 0


class _PoolBody:
    """One pool's controller driven live: assignments resolve waiting futures, refusals answer them,
    and a timer asks again at the time the controller names."""

    def __init__(self, runtime: OverloadRuntime, pool: ModelPool, controller: PoolController) -> None:
        self._runtime = runtime
        self.pool = pool
        self.controller = controller
        self._replicas = {replica.replica_id: replica for replica in pool.replicas}
        self.waiting: dict[str, Ticket] = {}  # queued in the controller, future pending
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s: float | None = None
        self._outside: dict[str, OutsideLoad] = {}  # replica -> load from outside this gateway, from its gauges
        pool.controlled = self.wake
        self.sync_health(runtime.clock())

    def sync_health(self, now_s: float) -> None:
        """The health checker's verdicts into the controller; its breakers back onto the replicas
        (read by readiness and metrics)."""
        for replica in self.pool.replicas:
            self.controller.on_replica_health(now_s, replica.replica_id, replica.health)
            self.pool.adopt_breaker(replica, self.controller.breaker(now_s, replica.replica_id))

    def wake(self, now_s: float) -> None:
        """A replica's health or load changed: hand out what may go now, with fresh loads."""
        self.sync_health(now_s)
        self.pump(now_s, {replica.replica_id: replica.load for replica in self.pool.replicas})

    def observe_engine(self, now_s: float, replica: Replica) -> None:
        """A gateway alone in front of the replica read its engine's gauges: what the engine runs and
        queues past this gateway's requests is outside load, and rule 8's slots are the configured
        less it (at least one, so that an estimate gone wrong never leaves a replica unused)."""
        rid = replica.replica_id
        estimate = self._outside.get(rid)
        if estimate is None:
            estimate = self._outside[rid] = OutsideLoad()
        load = replica.load
        estimate.observe(load.running_sequences + load.waiting_sequences, self.controller.held(rid))
        outside = estimate.sequences
        before = self.controller.slot_grant(rid)
        self.controller.on_slot_grant(now_s, rid, None if outside == 0 else max(1, replica.slot_limit - outside))
        if self.controller.slot_grant(rid) > before:  # more room: what waits may go now
            self.wake(now_s)

    def pump(self, now_s: float, loads: Mapping[str, Any] = {}) -> None:
        """Asks the controller for what can go now and carries it out."""
        dispatch = self.controller.on_capacity(now_s, loads)  # loads carry the engines' KV capacity (rule 7)
        if dispatch.preemptions:
            self._runtime.preempt(dispatch.preemptions, self.pool.name)
        waiting = self.waiting
        for assignment in dispatch.assignments:
            ticket = waiting.pop(str(assignment.request_id))
            self.carry_out(now_s, ticket, assignment)
            assert ticket.future is not None
            ticket.future.set_result(ticket.replica)  # type: ignore[arg-type]
        for refusal in dispatch.refusals:
            ticket = waiting.pop(str(refusal.request_id), None)
            if ticket is not None:
                self._runtime.answer_refusal(ticket, refusal)
        self._arm_timer(now_s, dispatch.wake_at_s)

    def wait(self, ticket: Ticket) -> None:
        """The controller queued it: it waits for an assignment or a refusal."""
        ticket.future = asyncio.get_running_loop().create_future()
        self.waiting[ticket.request_id] = ticket

    def carry_out(self, now_s: float, ticket: Ticket, assignment: Assignment) -> None:
        """The controller assigned it a replica (at arrival, or while it waited)."""
        replica = self._replicas[assignment.replica_id]
        replica.outstanding += 1
        if assignment.prefix_moved_from is not None:  # rule 7 moved its prefix here to even the load out
            metrics = self._runtime.metrics
            metrics.of(metrics.prefix_moves, self.pool.name).inc()
        ticket.replica = replica
        ticket.priority = assignment.priority
        if ticket.dispatched_s is None:
            ticket.dispatched_s = now_s
            self._runtime.on_dispatch(ticket, now_s)

    def _arm_timer(self, now_s: float, wake_at_s: float | None) -> None:
        if wake_at_s is None or (self._timer_at_s is not None and self._timer_at_s <= wake_at_s):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(max(0.0, wake_at_s - now_s), self._on_timer)
        self._timer_at_s = wake_at_s

    def _on_timer(self) -> None:
        self._timer = self._timer_at_s = None
        self.pump(self._runtime.clock())


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
        self.bodies: dict[str, _PoolBody] = {}
        # preemptible requests admitted and not yet settled: the task running each, cancelled when the
        # controller preempts it (rule 9 of `policy.pool`), and its tier
        self._preemptible: dict[str, tuple[asyncio.Task[Any], str]] = {}
        # `gateway.shared_limits.SharedLimits` when the rate limits live in Redis (`shared_state`):
        # the proxy awaits its decision and hands it to `admit`; None: the in-process limiter decides
        self.shared_limits: Any = None
        self._ttft_targets_s = {tier.name: tier.ttft_target_s for tier in self.control.tiers}
        self._default_tier = self.control.tiers.default.name  # an identity's tier when it names none
        # without API keys every request is the anonymous tenant's: resolved once, not per request
        self.auth_enabled = self.identity.auth_enabled
        self.anonymous: Identity | None = None if self.auth_enabled else self.authenticate(None)
        self._prefix_affinity = self.config.limits.prefix_cache_tokens != 0
        for tier_name, target_s in self._ttft_targets_s.items():
            metrics.ttft_target.labels(tier_name).set(target_s)
        self._body_of: dict[str, _PoolBody] = {}  # replica id -> its pool's body
        for name, pool in pools.items():
            controller = self.control.pools[name].controller
            self.bodies[name] = _PoolBody(self, pool, controller)
            self._body_of.update((replica.replica_id, self.bodies[name]) for replica in pool.replicas)
            for tier in self.control.tiers:
                metrics.watch_queue(name, tier.name, lambda c=controller, t=tier.name: c.queue_depth(t),
                                    lambda c=controller, t=tier.name: c.oldest_wait_s(self.clock(), t),
                                    lambda c=controller, t=tier.name: len(c.over_share(self.clock(), t)))
            for replica in pool.replicas:
                rid = replica.replica_id
                metrics.watch_replica(name, rid, lambda c=controller, r=rid: c.budget_tokens(self.clock(), r),
                                      lambda c=controller, r=rid: c.ttft_fit(r),
                                      lambda c=controller, r=rid: c.slot_grant(r),
                                      lambda c=controller, r=rid: c.prefix_index_blocks(r) * BLOCK_CHARS)

    def observe_engine(self, replica: Replica) -> None:
        """The health checks read the replica's engine gauges (a gateway alone in front of it)."""
        body = self._body_of.get(replica.replica_id)
        if body is not None:
            body.observe_engine(self.clock(), replica)

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

    # -- 1. admission
    def request_cost(self, body: Mapping[str, Any]) -> tuple[int, int]:
        """(prompt tokens, max tokens) the rate limits reserve for a request."""
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            max_tokens = 0 if "input" in body else self.config.limits.default_max_tokens
        return estimate_prompt_tokens(body), max_tokens

    def admit(self, now_s: float, request_id: str, identity: Identity, model: str, body: Mapping[str, Any],
              timeout_s: float | None = None, streamed: bool = True, cached_answer_available: bool = False,
              shared: Any = None, fingerprint: int = 0) -> Ticket:
        """Admits a request into its pool's controller, or raises the answer to send at once
        (CachedAnswerRung when `cached_answer_available` and the ladder takes that rung).
        `shared`: the shared limits' admission (`SharedAdmission`), which then replaces the
        in-process limiter's decision and is settled with the ticket. `fingerprint`: the same for
        the same request sent again (`policy.resends`), 0 for none."""
        if shared is None:
            prompt_tokens, max_tokens = self.request_cost(body)
        else:
            prompt_tokens, max_tokens = shared.prompt_tokens, shared.max_tokens
        # a prompt shorter than one block has no prefix to route by: not hashed
        prefix = prompt_prefix(body) if self._prefix_affinity and prompt_tokens > BLOCK_TOKENS else ()
        preemptible = identity.preemptible
        tier = self._default_tier if identity.tier is None else identity.tier
        # the one record of the request the controllers keep, from its arrival to its end; `_make`, every
        # field in order: the NamedTuple's own constructor goes through the type's slot into a Python
        # `__new__` (some 350 instructions more a request)
        request = PoolRequest._make((request_id, now_s, identity.tenant, tier, prompt_tokens, max_tokens, timeout_s,
                                     streamed, prefix, fingerprint, preemptible))
        arrival = self.control.arrive(now_s, model, request, cached_answer_available=cached_answer_available,
                                      admission=None if shared is None else shared.decision)
        metrics = self.metrics
        if type(arrival) is Assignment:  # assigned at once, no rate limit to report
            assignment, headers, outcome = arrival, b"", _ASSIGNED
        else:
            limits = arrival.admission.headers
            headers = _header_lines(limits.as_http_headers()) if limits is not None else b""
            outcome = arrival.outcome
            assignment = arrival.assignment if arrival.rung is _PRIMARY else None
        if assignment is not None:
            # the common case below capacity: its prompt's work, its admission and its wait (none)
            # counted in one call, and nothing predicted, shed or degraded to answer
            metrics.sent_at_arrival(model, tier, prompt_tokens)
            ticket = Ticket(request_id, model, tier, prompt_tokens, now_s, None, headers)
            ticket.dispatched_s = now_s  # its wait is counted: `carry_out` observes none
            self.bodies[model].carry_out(now_s, ticket, assignment)
        elif outcome is ArrivalOutcome.QUEUED or outcome is ArrivalOutcome.ASSIGNED:
            assert type(arrival) is Arrival and arrival.pool is not None
            metrics.work_tokens.add(model, prompt_tokens, 0)
            if arrival.rung is not Rung.PRIMARY:
                headers += _header_lines({DEGRADATION_HEADER: arrival.rung.value})
                metrics.of(metrics.degraded, model, arrival.rung.value).inc()
            metrics.of(metrics.admissions, model, tier, "queued" if arrival.rung is Rung.PRIMARY
                       else arrival.rung.value).inc()
            body = self.bodies[arrival.pool]
            if arrival.assignment is not None:  # sent at arrival to the fallback pool: nothing was predicted
                ticket = Ticket(request_id, arrival.pool, tier, prompt_tokens, now_s, None, headers)
                body.carry_out(now_s, ticket, arrival.assignment)
            else:
                ticket = Ticket(request_id, arrival.pool, tier, prompt_tokens, now_s, arrival.predicted_wait_s, headers)
                body.wait(ticket)
            if arrival.shed:
                self._answer_shed(now_s, arrival.shed)
        else:
            assert type(arrival) is Arrival
            self._refuse(now_s, model, tier, prompt_tokens, arrival, headers, shared)
        ticket.shared = shared
        if 0 < len(prefix) < MAX_BLOCKS:  # its last, partial block half full on average
            ticket.prompt_chars = len(prefix) * BLOCK_CHARS + BLOCK_CHARS // 2
        if preemptible:
            task = asyncio.current_task()
            assert task is not None
            self._preemptible[request_id] = (task, tier)
        return ticket

    def _refuse(self, now_s: float, model: str, tier: str, prompt_tokens: int, arrival: Arrival, headers: bytes,
                shared: Any) -> NoReturn:
        """Raises the answer to a request refused at arrival (rate limits, the ladder)."""
        metrics = self.metrics
        metrics.work_tokens.add(model, prompt_tokens, 0)  # refused work is demand too
        if shared is not None:
            shared.settle(0)  # admitted by the limits, answered without a model: nothing used
        self._answer_shed(now_s, arrival.shed)
        outcome = arrival.outcome
        metrics.of(metrics.admissions, model, tier, outcome.value).inc()
        if outcome in (ArrivalOutcome.RATE_LIMITED, ArrivalOutcome.TOO_LARGE):
            kind = arrival.admission.limit_hit or LimitKind.REQUESTS
            reason = "too_large" if outcome is ArrivalOutcome.TOO_LARGE else f"rate_limited_{kind.value}"
            metrics.of(metrics.rejections, model, tier, reason).inc()
            metrics.of(metrics.rejection_latency, model).observe(self.clock() - now_s)
            raise TenantRateLimitError(arrival.admission.message, retry_after_s=arrival.admission.retry_after_s,
                                       headers=headers)
        metrics.of(metrics.rejections, model, tier, arrival.reason or "degraded").inc()
        metrics.of(metrics.rejection_latency, model).observe(self.clock() - now_s)
        reply = arrival.reply
        if outcome is ArrivalOutcome.CACHED_ANSWER:
            assert reply is not None
            metrics.of(metrics.degraded, model, Rung.CACHED_ANSWER.value).inc()
            raise CachedAnswerRung(headers + _header_lines(reply.headers()))
        if outcome is ArrivalOutcome.NO_REPLICA:
            raise self.pools[model].no_replica_error()
        assert reply is not None
        metrics.of(metrics.degraded, model, Rung.PRESET_REPLY.value).inc()
        raise self._preset_reply(reply, headers)

    # -- 2. late-binding dispatch
    async def acquire(self, ticket: Ticket) -> Replica:
        """Waits until the controller assigns the request a replica, or refuses it (raised).

        Await it right after `admit`, with `settle` in a `finally`: the request is already queued.
        """
        if ticket.future is None:  # assigned at arrival
            assert ticket.replica is not None
            return ticket.replica
        self.bodies[ticket.pool].pump(self.clock())
        return await ticket.future

    async def retry(self, ticket: Ticket, reason: str) -> Replica:
        """Its replica failed it before any byte reached the client: the controller sends it again,
        first and to another replica. Raises OverloadedError when none takes it within its wait."""
        body = self.bodies[ticket.pool]
        replica = ticket.replica
        assert replica is not None
        now_s = self.clock()
        ticket.replica = None
        replica.outstanding -= 1
        body.controller.on_failure(now_s, ticket.request_id, reason, retry=True)
        body.pool.adopt_breaker(replica, body.controller.breaker(now_s, replica.replica_id))
        ticket.failure = None
        body.wait(ticket)
        body.pump(now_s)
        try:
            return await asyncio.wait_for(ticket.future, self.control.tiers[ticket.tier].max_queue_wait_s)
        except asyncio.TimeoutError:
            raise OverloadedError("no other replica took the retry in time", code="queue_timeout") from None

    def on_dispatch(self, ticket: Ticket, now_s: float) -> None:
        metrics = self.metrics
        metrics.of(metrics.queue_wait, ticket.pool, ticket.tier).observe(now_s - ticket.arrived_s)
        if ticket.predicted_wait_s is not None:
            metrics.of(metrics.predicted_wait, ticket.pool, ticket.tier).observe(ticket.predicted_wait_s)

    # -- 3. what happened at the replica
    def first_token(self, ticket: Ticket) -> None:
        """Its first token (streams only): the engine's prefill of it is done."""
        body = self.bodies[ticket.pool]
        now_s = self.clock()
        body.controller.on_first_token(now_s, ticket.request_id)
        ttft_s = now_s - ticket.arrived_s
        self.metrics.first_tokens.observe(ticket.pool, ticket.tier, ttft_s, ttft_s <= self._ttft_targets_s[ticket.tier])
        if body.waiting:
            body.pump(now_s)  # a finished prefill frees work budget

    def ended(self, ticket: Ticket, failure: str | None) -> None:
        """The replica answered (`failure` None) or failed it; the controller hears it at `settle`
        (or `retry`), once the gateway is done with the replica."""
        ticket.failure = failure
        ticket.completed = failure is None

    # -- 4. settle
    def settle(self, ticket: Ticket, completion_tokens: int, prompt_tokens: int | None = None) -> None:
        """Ends the request's accounts, however it ended. Call exactly once, in a `finally`.
        `prompt_tokens`: its prompt's, as the engine's usage said (None: it said none)."""
        if ticket.settled:
            return
        ticket.settled = True
        if self._preemptible:
            self._preemptible.pop(ticket.request_id, None)
        now_s = self.clock()
        body = self.bodies[ticket.pool]
        if ticket.future is not None and body.waiting.pop(ticket.request_id, None) is not None:
            body.controller.on_cancel(now_s, ticket.request_id)  # the client left while it waited
        elif ticket.replica is not None:  # also when assigned just as the client left
            # done with its replica however it ended: the controller hears how, the slot is free
            replica = ticket.replica
            ticket.replica = None
            replica.outstanding -= 1
            controller = body.controller
            if ticket.failure is not None:
                controller.on_failure(now_s, ticket.request_id, ticket.failure)
            elif ticket.completed:
                controller.on_finish(now_s, ticket.request_id, completion_tokens)
            else:  # the client left, or the gateway failed, while it was at the replica
                controller.on_cancel(now_s, ticket.request_id)
            breaker = controller.breaker(now_s, replica.replica_id)
            if breaker is not replica.breaker:  # the common case, a closed breaker left as it was, costs no call
                body.pool.adopt_breaker(replica, breaker)
        if prompt_tokens and ticket.prompt_chars:
            body.controller.on_prompt_usage(ticket.prompt_chars, prompt_tokens)
        used_tokens = ticket.prompt_tokens + completion_tokens
        if completion_tokens > 0:
            self.metrics.work_tokens.add_served(ticket.pool, ticket.prompt_tokens, completion_tokens)
        self.control.finish(now_s, ticket.request_id, used_tokens=used_tokens)
        if ticket.shared is not None:
            ticket.shared.settle(used_tokens)
        if body.waiting:
            body.pump(now_s)

    def preempt(self, preemptions: tuple[Preemption, ...], pool: str) -> None:
        """The controller stopped these preemptible requests (their slots are taken already): cancel the
        tasks running them, which closes their upstream calls; their caller (the batch worker) sees the
        cancellation and runs them again."""
        metrics = self.metrics
        for preemption in preemptions:
            running = self._preemptible.pop(str(preemption.request_id), None)
            if running is None:
                continue
            task, tier = running
            metrics.of(metrics.preemptions, pool, tier).inc()
            metrics.of(metrics.preempted_seconds, pool).inc(preemption.held_s)
            task.cancel()

    # -- refusals of waiting requests
    def answer_refusal(self, ticket: Ticket, refusal: Refusal) -> None:
        """The controller gave up a queued request (deadline, no replica left)."""
        self.metrics.of(self.metrics.rejections, ticket.pool, ticket.tier, f"shed_{refusal.reason}").inc()
        if ticket.future is None or ticket.future.done():
            return
        reply = self.control.refusal_reply(ticket.pool, refusal)
        if refusal.reason == REFUSED_NO_REPLICA and reply.rung is not Rung.CACHED_ANSWER:
            ticket.future.set_exception(self.pools[ticket.pool].no_replica_error())
            return
        self.metrics.of(self.metrics.degraded, ticket.pool, reply.rung.value).inc()
        ticket.future.set_exception(self._reply(reply, ticket.response_headers))

    def _answer_shed(self, now_s: float, notices: tuple[ShedNotice, ...]) -> None:
        """Requests a newcomer pushed out of a queue: answered, or moved to the fallback pool."""
        for notice in notices:
            body = self.bodies[notice.pool]
            ticket = body.waiting.pop(notice.request_id, None)
            if ticket is None:
                continue
            if notice.moved_to is None:
                self.metrics.of(self.metrics.rejections, notice.pool, notice.tier, f"shed_{notice.reason}").inc()
                self.metrics.of(self.metrics.degraded, notice.pool, notice.reply.rung.value).inc()
                if ticket.future is not None and not ticket.future.done():
                    ticket.future.set_exception(self._reply(notice.reply, ticket.response_headers))
                continue
            self.metrics.of(self.metrics.degraded, notice.pool, Rung.FALLBACK_POOL.value).inc()
            ticket.pool = notice.moved_to
            ticket.response_headers += _header_lines(notice.reply.headers())
            target = self.bodies[notice.moved_to]
            if notice.assignment is not None:  # the fallback pool took it at once
                target.carry_out(now_s, ticket, notice.assignment)
                assert ticket.future is not None
                ticket.future.set_result(ticket.replica)  # type: ignore[arg-type]
            else:
                target.waiting[ticket.request_id] = ticket  # its future still pending
                target.pump(now_s)

    @classmethod
    def _reply(cls, reply: DegradationDecision, headers: bytes) -> Exception:
        """A refused request's answer: the cached answer, or the preset reply."""
        if reply.rung is Rung.CACHED_ANSWER:
            return CachedAnswerRung(headers + _header_lines(reply.headers()))
        return cls._preset_reply(reply, headers)

    @staticmethod
    def _preset_reply(reply: DegradationDecision, headers: bytes) -> DegradedReplyError:
        return DegradedReplyError(reply.message or "overloaded", retry_after_s=reply.retry_after_s,
                                  headers=headers + _header_lines(reply.headers()))
