"""The gateway's request queue: strict priority between tiers with aging, fair share within a tier.

Designs followed:
- between tiers, strict priority (Triton priority levels, Google SRE criticality) with *aging*: a
  request of a tier with `aging_offset_s` competes as if it had arrived that much later, so a
  higher tier wins unless the lower tier's oldest request has waited `aging_offset_s` longer than
  the higher tier's oldest; `batch` therefore waits a bounded time, never forever; a tier without
  an offset never overtakes;
- within a tier, the Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language
  Models" (OSDI 2024): the backlogged tenant with the least weighted service (input tokens x 1 +
  output tokens x 2 by default, divided by the tenant's weight) goes next, and a tenant that becomes
  backlogged is lifted to the least counter of those waiting, so idling banks no credit, less the
  cost of its own request (FQ-CoDel's sparse-flow priority, RFC 8290): a tenant with one request at
  a time goes before a flooding tenant's next, instead of alternating with it. While tenants stay
  backlogged, the service gap between them stays within one request's cost, whatever the flood;
- deadlines: the tier's maximum queue wait, or the client's shorter timeout; an expired request is
  handed back to the caller, never dispatched;
- bounds per tier and in total; when full, the lowest tier's newest request is shed first (the
  newcomer itself when it is in the lowest tier present), as in Gateway API Inference Extension
  flow control.

Every method that depends on time takes `now_s`; nothing here reads a clock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from tidegate.policy.tiers import TierSpec, TierTable

__all__ = [
    "QueuedRequest",
    "EnqueueOutcome",
    "ShedReason",
    "ShedRequest",
    "EnqueueDecision",
    "DequeueResult",
    "QueueAhead",
    "FairPriorityQueue",
]


class QueuedRequest(NamedTuple):  # built per request: a NamedTuple is cheap (tidegate.types)
    request_id: str
    tenant: str
    tier: str
    prompt_tokens: int
    expected_output_tokens: int  # charged to the tenant's fair share at dispatch; corrected later
    enqueued_at_s: float
    deadline_s: float  # dispatching at or after this is pointless: the request is shed instead
    predicted_wait_s: float = 0.0  # the wait predictor's uncorrected figure at arrival (0: none)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.expected_output_tokens


class EnqueueOutcome(Enum):
    QUEUED = "queued"
    REJECTED_TIER_FULL = "tier_full"  # the tier's own bound is reached
    REJECTED_QUEUE_FULL = "queue_full"  # the total bound is reached and no lower tier can give way
    REJECTED_PAST_DEADLINE = "past_deadline"  # the client's timeout had already passed


class ShedReason(Enum):
    DISPLACED = "displaced"  # a request of a better tier took its place
    DEADLINE = "deadline"  # it waited until its deadline
    HOPELESS = "hopeless"  # the work certainly ahead of it cannot drain before its deadline


@dataclass(frozen=True, slots=True)
class ShedRequest:
    request: QueuedRequest
    reason: ShedReason


@dataclass(frozen=True, slots=True)
class EnqueueDecision:
    outcome: EnqueueOutcome
    request: QueuedRequest  # the newcomer, queued or not
    shed: tuple[ShedRequest, ...]  # requests removed to make room or because they expired: answer them

    @property
    def queued(self) -> bool:
        return self.outcome is EnqueueOutcome.QUEUED


@dataclass(frozen=True, slots=True)
class DequeueResult:
    request: QueuedRequest | None  # None: nothing waits
    expired: tuple[ShedRequest, ...]  # requests found past their deadline: answer them
    charged_service: float  # what the request's tenant was charged in its fair-share counter


@dataclass(frozen=True, slots=True)
class QueueAhead:
    """Work queued at the same or a better tier than a given tier."""

    requests: int
    tokens: int


class _TierQueue:
    """One tier: arrival order, per-tenant FIFOs and the VTC counters of its tenants."""

    __slots__ = ("spec", "arrivals", "by_tenant", "tenant_tokens", "counters", "heap", "heap_token", "idle_floor",
                 "tokens")

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.arrivals: OrderedDict[int, QueuedRequest] = OrderedDict()  # seq -> request, oldest first
        self.by_tenant: dict[str, OrderedDict[int, QueuedRequest]] = {}  # backlogged tenants only
        self.tenant_tokens: dict[str, int] = {}  # backlogged tenant -> tokens it has queued
        self.counters: dict[str, float] = {}  # tenant -> weighted service received
        # min-heap of (counter, token, tenant); an item is current only if heap_token[tenant] == token
        self.heap: list[tuple[float, int, str]] = []
        self.heap_token: dict[str, int] = {}
        self.idle_floor = 0.0  # counter of the last tenant served: the lift when no one is backlogged
        self.tokens = 0


class _TenantTotals:
    """The work each backlogged tenant of a tier has queued, sorted, to sum min(total, cap) over
    tenants in O(log tenants)."""

    __slots__ = ("_sorted", "_prefix")

    def __init__(self, queue: _TierQueue, in_tokens: bool) -> None:
        self._sorted = sorted(float(queue.tenant_tokens[tenant]) if in_tokens else float(len(waiting))
                              for tenant, waiting in queue.by_tenant.items())
        self._prefix = list(itertools.accumulate(self._sorted, initial=0.0))

    def capped_sum(self, cap: float) -> float:
        """Sum over tenants of min(their queued work, cap)."""
        below = bisect.bisect_right(self._sorted, cap)
        return self._prefix[below] + cap * (len(self._sorted) - below)


class FairPriorityQueue:
    """A bounded queue of requests for one model pool. See the module docstring for the rules."""

    def __init__(
        self,
        tiers: TierTable,
        *,
        max_queued: int,
        tenant_weights: Mapping[str, float] | None = None,
        input_token_weight: float = 1.0,
        output_token_weight: float = 2.0,
    ) -> None:
        if max_queued < 0:
            raise ValueError("max_queued must be >= 0")
        self._tiers = tiers
        self._max_queued = max_queued
        self._weights = dict(tenant_weights or {})
        if any(weight <= 0 for weight in self._weights.values()):
            raise ValueError("tenant weights must be > 0")
        # floats whatever is passed: a charge is then a float with or without a tenant's weight (`_charge`)
        self._input_weight = float(input_token_weight)
        self._output_weight = float(output_token_weight)
        self._queues = {spec.name: _TierQueue(spec) for spec in tiers}  # best rank first
        self._by_id: dict[str, tuple[int, QueuedRequest]] = {}
        # the same dict, read-only outside: `not queue.queued_ids` asks "is it empty?" without a call
        # (`len(queue)` runs `__len__` through the type's slot, on every arrival of the pool controller)
        self.queued_ids: Mapping[str, object] = self._by_id
        self._deadlines: list[tuple[float, int, str]] = []  # lazy: stale items are skipped
        self._seq = itertools.count()

    # ---- questions ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def depth(self, tier: str) -> int:
        return len(self._queues[tier].arrivals)

    def work_ahead(self, tier: str, tenant: str | None = None, tokens: int = 0) -> QueueAhead:
        """What a new request of `tier` (from `tenant`, of `tokens`) would wait behind.

        All work of better tiers counts. Within its own tier, fair sharing serves the newcomer
        after its tenant's own queued work and, from every other tenant, about as much again
        (round-robin equivalence of VTC), so another tenant's flood does not count in full; without
        a tenant, all of the tier counts. Aging and later arrivals are ignored.
        """
        rank = self._tiers[tier].rank
        requests = total_tokens = 0
        for queue in self._queues.values():  # best rank first
            if queue.spec.rank > rank:
                break
            if queue.spec.rank < rank or tenant is None:
                requests += len(queue.arrivals)
                total_tokens += queue.tokens
            else:
                own = queue.by_tenant.get(tenant)
                own_requests, own_tokens = (len(own), queue.tenant_tokens[tenant]) if own else (0, 0)
                requests += own_requests
                total_tokens += own_tokens
                for other, waiting in queue.by_tenant.items():
                    if other != tenant:
                        requests += min(len(waiting), own_requests + 1)
                        total_tokens += min(queue.tenant_tokens[other], own_tokens + tokens)
        return QueueAhead(requests, total_tokens)

    def oldest_wait_s(self, now_s: float, tier: str) -> float:
        """How long the oldest request of `tier` has waited; 0 when none waits."""
        arrivals = self._queues[tier].arrivals
        return now_s - next(iter(arrivals.values())).enqueued_at_s if arrivals else 0.0

    def next_deadline_s(self) -> float | None:
        """The earliest deadline of a waiting request: when the runtime should next call `expire`."""
        while self._deadlines and not self._is_current(self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def peek(self, skip_tenants: frozenset[str] = frozenset()) -> QueuedRequest | None:
        """The request `dequeue` would hand out next (expiry aside), left in place.

        For a dispatcher that must first find a replica this request may use (retry exclusions).
        `skip_tenants`: tenants of the tier whose turn it is that may not be served now (the next
        least-served tenant of that tier goes instead; None when only they wait there).
        """
        queue = self._pick_tier()
        if queue is None:
            return None
        tenant = self._next_tenant(queue, skip_tenants)
        return None if tenant is None else next(iter(queue.by_tenant[tenant].values()))

    def service_counter(self, tier: str, tenant: str) -> float:
        return self._queues[tier].counters.get(tenant, 0.0)

    # ---- changes ------------------------------------------------------------------------------

    def enqueue(
        self,
        now_s: float,
        *,
        request_id: str,
        tenant: str,
        tier: str,
        prompt_tokens: int,
        expected_output_tokens: int,
        timeout_s: float | None = None,
        predicted_wait_s: float = 0.0,
    ) -> EnqueueDecision:
        """Queues a request, or refuses it; returns whatever had to be shed (newcomer excluded)."""
        if request_id in self._by_id:
            raise ValueError(f"request {request_id} is already queued")
        if prompt_tokens < 0 or expected_output_tokens < 0:
            raise ValueError("token counts must be >= 0")
        queue = self._queues.get(tier)
        if queue is None:
            raise ValueError(f"unknown tier {tier!r}")
        wait_s = queue.spec.max_queue_wait_s if timeout_s is None else min(queue.spec.max_queue_wait_s, timeout_s)
        request = QueuedRequest(request_id, tenant, tier, prompt_tokens, expected_output_tokens, now_s, now_s + wait_s,
                                predicted_wait_s)
        shed = list(self.expire(now_s))
        if wait_s <= 0:
            return EnqueueDecision(EnqueueOutcome.REJECTED_PAST_DEADLINE, request, tuple(shed))
        if len(queue.arrivals) >= queue.spec.queue_bound:
            # the newcomer is its tier's newest request, so it is the one to shed
            return EnqueueDecision(EnqueueOutcome.REJECTED_TIER_FULL, request, tuple(shed))
        if len(self._by_id) >= self._max_queued:
            lowest = next((q for q in reversed(self._queues.values()) if q.arrivals), None)
            if lowest is None or lowest.spec.rank <= queue.spec.rank:
                return EnqueueDecision(EnqueueOutcome.REJECTED_QUEUE_FULL, request, tuple(shed))
            newest_seq = next(reversed(lowest.arrivals))
            shed.append(ShedRequest(self._remove(lowest, newest_seq), ShedReason.DISPLACED))
        self._add(queue, request)
        return EnqueueDecision(EnqueueOutcome.QUEUED, request, tuple(shed))

    def dequeue(self, now_s: float, skip_tenants: frozenset[str] = frozenset()) -> DequeueResult:
        """The next request to dispatch: call when a replica has a free slot (late binding).
        `skip_tenants` as for `peek`."""
        expired = self.expire(now_s)
        queue = self._pick_tier()
        tenant = None if queue is None else self._next_tenant(queue, skip_tenants)
        if queue is None or tenant is None:
            return DequeueResult(None, expired, 0.0)
        seq = next(iter(queue.by_tenant[tenant]))
        request = self._remove(queue, seq)
        charged = self._charge(request.prompt_tokens, request.expected_output_tokens, tenant)
        queue.counters[tenant] += charged
        queue.idle_floor = queue.counters[tenant]
        if tenant in queue.by_tenant:
            self._push_tenant(queue, tenant)
        return DequeueResult(request, expired, charged)

    def charge_unqueued(self, tier: str, tenant: str, prompt_tokens: int, expected_output_tokens: int) -> float:
        """A request of a tier with nobody waiting is served without queueing: its tenant's counter
        moves as `enqueue` then `dequeue` would move it (the idle lift, then the charge). Its fields
        come one by one: the caller (every request sent at once) holds them already."""
        queue = self._queues[tier]
        if queue.by_tenant:
            raise ValueError(f"tier {tier!r} has requests waiting: queue this one")
        # `_charge`, inline: this runs for every request sent at once
        charged = self._input_weight * prompt_tokens + self._output_weight * expected_output_tokens
        if self._weights:
            charged /= self._weights.get(tenant, 1.0)
        counters = queue.counters
        counter = counters.get(tenant, 0.0)
        lifted = queue.idle_floor - charged
        # `max(counter, lifted)` as an expression: no builtin call (the first of equals, as max keeps)
        counter = (lifted if lifted > counter else counter) + charged
        counters[tenant] = counter
        queue.idle_floor = counter
        return charged

    def settle_service(self, request: QueuedRequest, actual_output_tokens: int) -> None:
        """Corrects the tenant's fair-share counter once the real output length is known."""
        tenant = request.tenant
        queue = self._queues[request.tier]
        counters = queue.counters
        if tenant not in counters:
            return
        delta = self._output_weight * (actual_output_tokens - request.expected_output_tokens)
        weights = self._weights
        # a tenant without a weight has 1.0, and dividing by 1.0 changes nothing: not done
        counters[tenant] += delta / weights.get(tenant, 1.0) if weights else delta
        if tenant in queue.by_tenant:
            self._push_tenant(queue, tenant)

    def cancel(self, request_id: str) -> QueuedRequest | None:
        """Removes a request whose client went away; None if it is not queued."""
        held = self._by_id.get(request_id)
        if held is None:
            return None
        seq, request = held
        return self._remove(self._queues[request.tier], seq)

    def expire(self, now_s: float) -> tuple[ShedRequest, ...]:
        """Removes and returns every request whose deadline is at or before `now_s`."""
        expired: list[ShedRequest] = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            item = heapq.heappop(self._deadlines)
            if self._is_current(item):
                request = self._remove(self._queues[self._by_id[item[2]][1].tier], item[1])
                expired.append(ShedRequest(request, ShedReason.DEADLINE))
        return tuple(expired)

    def shed_hopeless(self, now_s: float, rate_left_per_s: Callable[[int], float],
                      in_tokens: bool) -> tuple[ShedRequest, ...]:
        """Removes and returns the requests predicted to start only after their deadline, each tier's
        queue drained at `rate_left_per_s(rank)` (tokens, or requests when not `in_tokens`, per
        second: the service rate the better tiers leave it; see `prediction`).

        The work predicted ahead of a queued request is what VTC would serve first if every tenant's
        service counter started level: its own tenant's earlier requests of its tier; from every
        other tenant as much as that (so another tenant's flood does not count in full), and, of
        their requests at its own turn, those that arrived before it; and the better tiers' queued
        work, unless aging lets it overtake some of it. Future arrivals are not counted. A request
        displaced behind a burst of better traffic, or behind its tier's backlog once a service
        rate is known, is answered when that becomes known, not after waiting out its deadline
        (`test_request_displaced_behind_better_work_is_refused_at_once`,
        `test_request_behind_its_tiers_backlog_is_refused_before_its_deadline`).
        """
        shed: list[ShedRequest] = []
        better_work = 0.0
        better_offset_s = 0.0  # the largest aging offset among better tiers with queued work
        for queue in self._queues.values():  # best rank first
            offset_s = queue.spec.aging_offset_s
            rate_per_s = rate_left_per_s(queue.spec.rank) if queue.arrivals else 0.0
            totals = _TenantTotals(queue, in_tokens)
            own_before: dict[str, tuple[int, float]] = {}  # tenant -> (its requests, their work) so far
            turn_work: list[float] = []  # turn k -> work of the k-th requests of tenants seen so far
            for seq, request in list(queue.arrivals.items()):
                work = float(request.tokens) if in_tokens else 1.0
                turn, before = own_before.get(request.tenant, (0, 0.0))
                # every tenant's work up to `before` (its own included, all of it earlier), and the
                # requests of its own turn that came first
                same_turn = turn_work[turn] if turn < len(turn_work) else 0.0
                ahead = totals.capped_sum(before) + same_turn
                overtakes = offset_s is not None and request.enqueued_at_s + offset_s < now_s + better_offset_s
                ahead += 0.0 if overtakes else better_work
                ahead_s = 0.0 if ahead <= 0 else (ahead / rate_per_s if rate_per_s > 0 else math.inf)
                if ahead_s > request.deadline_s - now_s:
                    shed.append(ShedRequest(self._remove(queue, seq), ShedReason.HOPELESS))
                    totals = _TenantTotals(queue, in_tokens)  # rare: recount without it
                    continue
                own_before[request.tenant] = (turn + 1, before + work)
                if turn == len(turn_work):
                    turn_work.append(0.0)
                turn_work[turn] += work
            if queue.arrivals:
                better_work += float(queue.tokens) if in_tokens else float(len(queue.arrivals))
                better_offset_s = max(better_offset_s, offset_s or 0.0)
        return tuple(shed)

    # ---- internals ----------------------------------------------------------------------------

    def _charge(self, prompt_tokens: int, output_tokens: int, tenant: str) -> float:
        """What serving such a request adds to the tenant's counter."""
        charged = self._input_weight * prompt_tokens + self._output_weight * output_tokens
        # a tenant without a weight has 1.0, and dividing by 1.0 changes nothing: not done
        return charged / self._weights.get(tenant, 1.0) if self._weights else charged

    def _is_current(self, item: tuple[float, int, str]) -> bool:
        held = self._by_id.get(item[2])
        return held is not None and held[0] == item[1]

    def _pick_tier(self) -> _TierQueue | None:
        best: _TierQueue | None = None
        best_key = math.inf
        for queue in self._queues.values():  # best rank first; a tie keeps the better rank
            if queue.arrivals:
                offset_s = queue.spec.aging_offset_s
                oldest_s = next(iter(queue.arrivals.values())).enqueued_at_s
                if best is None:
                    # the best tier waiting competes from its own arrival; without an offset it
                    # cannot overtake anything, but it can still be overtaken by an aged lower tier
                    best, best_key = queue, oldest_s + (offset_s or 0.0)
                elif offset_s is not None and oldest_s + offset_s < best_key:
                    best, best_key = queue, oldest_s + offset_s
        return best

    def _next_tenant(self, queue: _TierQueue, skip_tenants: frozenset[str]) -> str | None:
        tenant = self._least_served_tenant(queue)
        if tenant not in skip_tenants:
            return tenant
        # passed over: the least served of the rest (a scan, taken only when some tenant is skipped)
        rest = [(queue.counters[other], other) for other in queue.by_tenant if other not in skip_tenants]
        return min(rest)[1] if rest else None

    def _least_served_tenant(self, queue: _TierQueue) -> str:
        while True:
            counter, token, tenant = queue.heap[0]
            if queue.heap_token.get(tenant) == token:
                return tenant
            heapq.heappop(queue.heap)

    def _push_tenant(self, queue: _TierQueue, tenant: str) -> None:
        token = next(self._seq)
        queue.heap_token[tenant] = token
        heapq.heappush(queue.heap, (queue.counters[tenant], token, tenant))

    def _add(self, queue: _TierQueue, request: QueuedRequest) -> None:
        seq = next(self._seq)
        tenant = request.tenant
        if tenant not in queue.by_tenant:
            # VTC counter lift: a tenant (re)joining the backlog starts no lower than those waiting,
            # or than the last tenant served when no one waits, so idle time earns no credit, bar
            # one request: it is lifted to just below them, by its own request's cost, so that a
            # sparse tenant's request goes before a backlogged tenant's next one (FQ-CoDel's new
            # flows, RFC 8290). Its service still never runs more than that one request ahead.
            floor = queue.counters[self._least_served_tenant(queue)] if queue.by_tenant else queue.idle_floor
            credit = self._charge(request.prompt_tokens, request.expected_output_tokens, tenant)
            queue.counters[tenant] = max(queue.counters.get(tenant, 0.0), floor - credit)
            queue.by_tenant[tenant] = OrderedDict()
            self._push_tenant(queue, tenant)
        queue.by_tenant[tenant][seq] = request
        queue.arrivals[seq] = request
        queue.tokens += request.tokens
        queue.tenant_tokens[tenant] = queue.tenant_tokens.get(tenant, 0) + request.tokens
        self._by_id[request.request_id] = (seq, request)
        heapq.heappush(self._deadlines, (request.deadline_s, seq, request.request_id))
        if len(self._deadlines) > 2 * len(self._by_id) + 1024:
            # dispatched and cancelled requests leave stale items behind; drop them now and then
            self._deadlines = [item for item in self._deadlines if self._is_current(item)]
            heapq.heapify(self._deadlines)

    def _remove(self, queue: _TierQueue, seq: int) -> QueuedRequest:
        request = queue.arrivals.pop(seq)
        tenant_queue = queue.by_tenant[request.tenant]
        del tenant_queue[seq]
        queue.tenant_tokens[request.tenant] -= request.tokens
        if not tenant_queue:
            del queue.by_tenant[request.tenant]
            del queue.tenant_tokens[request.tenant]
            del queue.heap_token[request.tenant]  # its heap items go stale
        queue.tokens -= request.tokens
        del self._by_id[request.request_id]
        return request
