"""One model pool's whole dispatch decision: queue, protection, work budget, routing, engine priority.

Typed events in (`on_arrival`, `on_capacity`, `on_first_token`, `on_finish`, `on_failure`,
`on_cancel`, `on_replica_health`), typed decisions out (`ArrivalDecision`, `Dispatch` of
`Assignment`s and `Refusal`s); time comes in as an argument. Queries change nothing. The live
gateway and the simulator are its two bodies.

The mechanism, rule by rule (each names the scenario of `tidegate.sim.scenarios` that fails
without it; a rule no scenario needs does not belong here):

1. Late binding, strict priority between tiers, fair share within a tier (`FairPriorityQueue`): a
   request leaves the queue only when a replica can take it. One that finds nothing waiting and a
   replica that can take it is assigned at arrival (`ArrivalVerdict.ASSIGNED`), with the accounts
   a queued-and-dispatched request leaves. (`critical_burst`, `noisy_tenant`;
   `test_a_request_that_finds_nobody_waiting_is_assigned_at_arrival`)
2. Engine levels. A request is sent with `priority = 2 * tier rank + demoted`, where demoted means
   its tenant floods its tier (`TenantShares`). Engines that order by priority serve a level's
   prompts before a worse level's, so "protected" is one idea for the best tier and for a tenant
   within its share during a flood: nothing of a worse level is ahead of it in the engine.
   (`noisy_tenant`, `critical_burst`)
3. Work budget, in the unit that sets TTFT. Each replica's prefill tokens sent and not yet
   answered by a first token are counted by level; its engine time to first token is the pool's
   line over those tokens at the replica's own speed (`ttft_model.pool_line`). A request may go to
   a replica only if the work its engine will prefill before it (its level and better on an engine
   ordering by priority; all of it otherwise), plus its own, is predicted to start within
   `engine_share` of its tier's TTFT target, and within what its wait so far has left of that
   target. On an engine that ignores priority a request also delays every tier that arrives after
   it, so the target is the tightest among tiers active lately. (`burst_after_idle`, `goodput`;
   `test_a_request_predicted_past_its_engine_budget_waits`,
   `test_a_request_is_not_sent_where_it_would_start_past_what_is_left_of_its_target`.) A slowed
   replica's budget follows its speed: `slowed_replica` reads 2x within +-25 % from 3 s after
   the slowdown and stays there (1.8x-2.0x); a line fitted per replica took 16 s and then
   wandered 1.3x-2.5x, each replica's few TTFTs carrying decode work as noise.
   (`test_a_replica_that_turns_twice_as_slow_shows_it_within_its_memory`)
4. Work conservation: a replica with nothing of that level (or, on an engine ignoring priority,
   nothing at all) waiting for prefill always takes the next request, whatever the budget. The
   budget only shortens the engine's queue; it never idles the engine. A replica whose first token
   is not yet measured has no budget, only its slots (rule 5). (`cold_start`, `retry_storm`)
5. Slots by level: a replica holds at most `max_requests` requests of a level and better, and at
   most `max_requests + headroom` in all (its engine's batch). Engines do not preempt a running
   request for a better one, so without the headroom a critical request waits for a sheddable one
   to finish; with it, it starts at once, and nothing is kept idle for it. (`critical_burst`,
   `noisy_tenant`) The headroom is kept only while a better level may want it: a demoted level's
   tier has its regular tenants, and a tier keeps it for a better tier seen within
   `headroom_memory_s`. Kept for a better tier that never comes, it idled a third of every
   engine: `small_engines` (two sequences per engine, one tier at 80 % load) refused 134 of 374
   requests, FIFO 7; live, `bench/chaos.py` with overload control refused 36 % at 80 % load.
   A flood's verdict comes seconds after its first requests, which took the
   regular level's slots meanwhile; once its tenant is judged over its share they count as
   demoted (`_demote_slots_of_new_floods`). Without it the tier's other tenants queued for seconds
   until those requests finished: others' P99 1.14x/1.25x/1.21x/1.23x/7.47x alone's over the five
   `noisy_tenant` seeds, 1.11x/1.26x/1.19x/1.22x/1.21x with it (within target 1881 and 1900; FIFO
   1893, 1886 since decode stretches changed the order of ties)
   (`test_a_flooding_tenants_requests_sent_before_its_verdict_leave_the_others_room`).
   The headroom is sized to the better levels' demand, each tick, per replica and level
   (`_Replica.size_headroom`): HEADROOM_ARRIVALS x the better requests sent to the replica per
   request it ended (how many arrive while one of its slots frees), plus a floor of
   HEADROOM_FLOOR_SHARE of the configured headroom, which stays the most it may be. The whole
   configured headroom (16 of 48) left `noisy_tenant` 102 requests within target short of FIFO's
   (noise +-37): the quiet tenants hold some twenty slots a replica inside the flood's cap, and
   the sixteen over it stayed idle; sized, +58 (+-35), and `critical_burst` +388 (+-44) where it
   was -44, goodput at 2x and 4x +491 and +451 where it was -20 and +135. Sized to the arrivals
   alone, `noisy_tenant`'s others' P99 went to 1.46x (worst of five seeds, mean 1.36x; 1.36x and
   1.25x with the floor) and `critical_burst`'s mean to 1.40x (1.37x); the floor alone (6 of 48)
   let a burst of the quiet tenants' requests past it queue for slots: 1.85x, mean 1.42x
   (`test_noisy_tenant_is_held_off_the_others_with_the_replicas_busy`,
   `test_the_headroom_follows_the_better_levels_arrivals`; bench/headroom_demand.py).
6. Deadlines: a queued request waits at most its tier's `max_queue_wait_s`, its client's timeout,
   or until its TTFT target less the replicas' fitted engine time for it; one the predicted
   service rate (corrected by the waits past predictions turned out to be, `policy.prediction`)
   cannot start by then is refused at once, on arrival. (Deadlines:
   `test_queued_requests_are_refused_at_their_deadline_and_the_controller_asks_to_wake_then`;
   the early refusal: `critical_burst` refuses 67 % of what it refuses at arrival, FIFO none, all
   at their deadline, 8 s later, with as many requests within target.) Searching
   the queue for such requests while they wait (`FairPriorityQueue.shed_hopeless`) refused ones
   that a burst's end let through: 20 fewer served in time than FIFO in `critical_burst`; removed.
7. Routing among replicas that fit: the least predicted engine TTFT; routable (health, breaker);
   a retried request never returns to the replica that failed it, and keeps first claim on every
   other replica while it waits, the queue taking only what no waiting retry may use. A replica
   that probably holds the request's prompt prefix in its engine's cache (`policy.prefix`) is
   charged only the rest of the prompt, so affinity and load are weighed in one unit; the
   tenants of `bench/prefix_cache.py` keep to their replicas. The prediction counts prefill
   only, so decodes could pile onto the replica that looks fastest (its last prompts were
   cached) or holds a hot prefix: for a request with a prompt prefix, a replica holding over
   `LOAD_IMBALANCE` x the least busy one's requests (+1), and over `PILE_UP_SLOT_SHARE` of its
   slots, is chosen only when no other can take it
   (`test_requests_sharing_a_prefix_go_where_it_is_cached`,
   `test_a_hot_prefix_spreads_once_its_replica_is_busier_than_the_prefill_it_saves`,
   `test_a_replica_with_few_requests_keeps_the_prefixes_it_holds`; `sim.scenarios.prefix_clients`).
   Affinity fixes the split of load between replicas at the split of prefixes, so over time a
   busier replica hands a whole prefix to the least loaded one when `policy.prefix.AffinityLoad`
   says that evens their recent loads out by more than noise; the replica it left forgets it
   (`test_a_busier_replica_hands_a_prefix_whole_to_a_quieter_one`; `prefix_clients`' Zipf mix);
   the assignment names the replica it left, for the body to count. Each replica's index holds
   what its engine's KV cache does: `PoolReplica.kv_cache_tokens`, else the engine's report in
   `on_capacity`'s loads, at the characters a token `on_prompt_usage` measures; an index larger
   than the cache sends tenants where their prompts were evicted
   (`test_the_index_is_bounded_by_the_kv_capacity_its_engine_reports`; `prefix_index_sizing`).
   (`test_a_retry_goes_first_and_never_to_the_replica_that_failed_it`,
   `test_a_waiting_retry_leaves_the_replica_that_failed_it_to_the_queue`,
   `test_every_replica_down_refuses_every_waiting_request`; `replica_killed`: its breaker opens on
   the failures of the requests it held, and only a probe each cool-down goes to it after)
8. Shared replicas: with several gateways in front of the same replicas, rule 5's batch is this
   gateway's grant of it (`on_slot_grant`; the split is `policy.slot_split`'s), so that N gateways
   do not send N batches. (`tidegate.sim.active_active`: unsplit, three gateways at 2x capacity
   left the engines' queues deep and served fewer requests within target than one gateway;
   `test_a_gateway_holds_no_more_than_its_grant_of_a_replica`). The same grant carries the load
   from outside the gateways that the engines' gauges show (`policy.slot_split.OutsideLoad`): the
   slots it leaves are what is split, or, for a gateway alone, what it may hold
   (`sim.active_active.outside_load`, `test_load_sent_past_the_gateways_is_subtracted_from_the_slots_they_split`,
   `test_requests_sent_straight_to_the_engine_leave_the_gateway_fewer_slots`)
9. Preemption of background work: a request sent `preemptible` (re-runnable: a Batch API request,
   whose result is kept only when it ends) of a tier worse than a waiting request's is stopped
   when that request finds no slot it may take and would find one on the replica the stopped
   request frees; the youngest such request goes (it has done the least work), and the waiting
   request takes its slot in the same `Dispatch` (`Preemption`; the body cancels the call and
   runs it again later). Engines do not preempt, so without it every slot a batch request holds
   is one an interactive burst waits for until the batch request ends: `bench/batch_api.py`
   measured interactive P99 TTFT +24.8 % and +36.8 % beside a batch without it (rule 5's headroom
   and a share of the mean demand did not help), +5.4 % and -4.9 % with it, a quarter of the batch
   requests preempted once (docs/batch.md)
   (`test_a_waiting_request_preempts_the_youngest_background_request_on_a_full_replica`,
   `test_interactive_requests_take_the_slots_of_a_running_batch_at_once`).
10. Early resends (`policy.resends`): a request refused at arrival (rule 6) is remembered by its
    fingerprint until its Retry-After; sent again before then, it is not refused again at once but
    held below the queue until its deadline, and held requests go to replicas with room when
    nothing of the queue can, best tier first and newest first. A client that resends the moment it
    is refused then makes one round trip a deadline instead of hundreds a second, and what is served
    of the held requests is what has most of its target left. (`retry_storm` on shared cores:
    `test_an_early_resend_is_held_to_its_deadline_not_refused_at_once`,
    `test_held_resends_are_served_newest_first_when_a_replica_has_room`)
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from tidegate.policy.health import Breaker, BreakerPolicy, BreakerState, is_routable, median
from tidegate.policy.length_classes import LengthClasses
from tidegate.policy.prediction import WaitPredictor, WorkUnit
from tidegate.policy.prefix import CHARS_PER_TOKEN, AffinityLoad, CharsPerToken, PrefixIndex, index_blocks
from tidegate.policy.queueing import FairPriorityQueue, QueuedRequest, ShedReason
from tidegate.policy.resends import EarlyResends, HeldResends
from tidegate.policy.shares import TenantShares
from tidegate.policy.tiers import TierSpec, TierTable
from tidegate.policy.ttft_model import ReplicaSpeed, TtftFit, pool_line
from tidegate.types import (ArrivalDecision, ArrivalVerdict, Assignment, Dispatch, PoolRequest, Preemption, Refusal,
                            ReplicaHealth, ReplicaLoad)

# the prompt size at which replicas' fitted engine times are compared by the latency rule: their
# fits are one line scaled by each one's speed factor, so any size gives the same ratio but at 0
_LATENCY_REFERENCE_TOKENS = 256

__all__ = ["ServiceClass", "PoolReplica", "PoolSettings", "ReplicaSnapshot", "PoolSnapshot", "PoolController",
           "REFUSED_UNKNOWN_TIER", "REFUSED_NO_REPLICA", "REFUSED_PREDICTED_MISS", "REFUSED_EARLY_RESEND"]

REFUSED_UNKNOWN_TIER = "unknown_tier"
# read on every request's way as a module name, not through its class: on Python 3.10 and 3.11
# that read goes through `EnumType.__getattr__`'s slot hook (some 850 instructions)
_CLOSED = BreakerState.CLOSED
_NO_REPLICAS: frozenset[str] = frozenset()  # none excluded
# A request with a prompt prefix prefers a replica only while it holds at most this many times the
# requests of the least busy one (+1), or `PILE_UP_SLOT_SHARE` of its slots if that is more. The
# predicted time to first token counts prefill work, not the decodes a replica already runs: with
# engines caching prefixes, a replica whose fitted speed looks best (its last prompts were cached)
# or that holds a hot prefix took every request while its prefill queue was empty: 40 of a
# 40-request burst, 3x imbalance live
# (`test_decodes_do_not_pile_onto_the_replica_that_looks_fastest`,
# `test_a_hot_prefix_spreads_once_its_replica_is_busier_than_the_prefill_it_saves`). Requests
# without a prefix (short prompts, and the scenarios' modelled ones) route as before: on every
# request, the cap moved critical_burst's P99 ratio from 1.29x to 1.35x (10 seeds).
LOAD_IMBALANCE = 1.5
# A few decodes more cost an engine's step little; a prefill it does not need costs a whole prompt
# and evicts another prefix. So a replica holding at most a quarter of its slots is not capped: with
# the cap at the least busy one's count + 1, 4 closed-loop clients on 2 replicas met it whenever three
# requests sat where their prefixes were cached, and the fourth was sent away to miss: the
# simulated bench/prefix_cache.py (`sim.scenarios.prefix_clients`) hit 67 % of prompt tokens and
# served 408-423 requests in 120 s; with this floor, 90-92 % and 557-602
PILE_UP_SLOT_SHARE = 0.25
# the memory of `AffinityLoad`: how long ago a request still counts half in a replica's recent load
AFFINITY_HALF_LIFE_S = 30.0
# Rule 5's headroom, sized to the better levels' demand (`_Replica.size_headroom`): HEADROOM_ARRIVALS x
# the better requests a replica was sent per request it ended (the better arrivals while one of its
# slots frees), plus HEADROOM_FLOOR_SHARE of its configured headroom, at most that headroom; counted
# with a half-life of HEADROOM_HALF_LIFE_S, sized every HEADROOM_PERIOD_S (a tick, not a request).
# bench/headroom_demand.py, ten `critical_burst` and five `noisy_tenant` seeds, P99 ratio worst/mean
# and within target against FIFO: x6 and 3/8 (6 of 16): 1.49x/1.37x +388, 1.36x/1.25x +58; x8:
# 1.47x/1.35x +364, 1.24x/1.21x +31 (but 6.15x on one of fifteen more seeds, a verdict that flapped:
# docs/overload-knobs.md); x4: 1.57x/1.39x +423, 1.36x/1.25x +115; a floor of 1/2: 1.43x/1.33x +269,
# 1.34x/1.21x +1 (noise +-50)
HEADROOM_ARRIVALS = 6.0
HEADROOM_FLOOR_SHARE = 0.375
HEADROOM_HALF_LIFE_S = 5.0  # the half-life of `TenantShares`' rates: floods are judged on the same memory
HEADROOM_PERIOD_S = 0.05
REFUSED_NO_REPLICA = "no_replica"
REFUSED_PREDICTED_MISS = "predicted_miss"
REFUSED_EARLY_RESEND = "early_resend"  # resent before its Retry-After, held to its deadline, not served


class ServiceClass(Enum):
    REGULAR = "regular"  # its tier's level
    DEMOTED = "demoted"  # its tenant floods its tier: one level below the tier's other tenants


@dataclass(frozen=True, slots=True)
class PoolReplica:
    """A replica as the controller is configured with it."""

    replica_id: str
    max_requests: int = 64  # requests of one engine level and better it holds at once (the backend's slot_limit)
    # more requests its engine can run at once: only a level's requests past `max_requests` of worse
    # levels may take them (rule 5), so a better request never waits for a worse one to finish
    headroom: int = 0
    orders_by_priority: bool = True  # its engine schedules by the `priority` it is sent
    # the tokens its engine's KV cache holds, as configured: sizes its prefix index (rule 7) over
    # what the engine reports (`ReplicaLoad.kv_cache_tokens`); None: the engine's report
    kv_cache_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.headroom < 0 \
                or (self.kv_cache_tokens is not None and self.kv_cache_tokens < 1):
            raise ValueError("max_requests >= 1, headroom >= 0 and kv_cache_tokens >= 1 or None needed")


@dataclass(frozen=True, slots=True)
class PoolSettings:
    # the share of a tier's TTFT target the engine's own queue may take; the rest is the gateway
    # queue's, where priority, fairness and early refusal still apply (docs/overload-knobs.md)
    engine_share: float = 0.5
    max_queued: int = 10_000
    min_wait_share: float = 0.25  # a request may always wait this share of its tier's max_queue_wait_s
    ttft_memory_samples: float = 16.0  # first tokens the fitted TTFT line remembers
    # prompt tokens whose prefix blocks are remembered per replica for prefix affinity (`policy.prefix`)
    # where neither its configuration nor its engine says what its KV cache holds; 0: no affinity
    prefix_cache_tokens: int = 32768
    # how long after a better tier's last arrival a worse level still leaves a replica's headroom to
    # it (rule 5): a pool that has seen no better tier that long uses its whole engine. A critical
    # request every 10 s (Poisson) beside standard at 1.5x capacity: its P99 TTFT 188 ms with 60 s,
    # 269 ms with 20 s, 447 ms with 5 s (docs/overload-knobs.md)
    headroom_memory_s: float = 60.0
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)

    def __post_init__(self) -> None:
        if not 0 < self.engine_share <= 1 or self.max_queued < 1 or not 0 <= self.min_wait_share <= 1 \
                or self.prefix_cache_tokens < 0 or self.headroom_memory_s < 0:
            raise ValueError("engine_share in (0, 1], max_queued >= 1, min_wait_share in [0, 1], "
                             "prefix_cache_tokens >= 0, headroom_memory_s >= 0")


@dataclass(frozen=True, slots=True)
class ReplicaSnapshot:
    replica_id: str
    routable: bool
    breaker: BreakerState
    requests: int  # held now
    prefill_tokens: tuple[int, ...]  # by engine level: sent and not yet answered by a first token
    fit: TtftFit | None


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    queued: int
    retries_waiting: int
    replicas: tuple[ReplicaSnapshot, ...]
    held_resends: int = 0  # rule 10


# `_pick`'s answer, built for every request sent: a plain tuple, no record class to call.
# (the replica,
#  its prefill tokens there: its prompt's, less the prefix the replica probably holds,
#  the last block of the prefix it probably holds there (`AffinityLoad`), or None,
#  the replica its prefix was held at and moved from (rule 7), or None,
#  how many of its prefix blocks that replica held,
#  the prefill tokens its engine does before it there, its own not included)
_Pick = tuple["_Replica", int, "int | None", "_Replica | None", int, int]


@dataclass(slots=True)
class _Sent:
    request: QueuedRequest | PoolRequest  # the queue's record, or, sent at once, the one it arrived with
    replica_id: str
    level: int
    sent_s: float
    tokens_ahead: int  # prefill tokens its engine had to do before its first token, own included
    prefill_tokens: int = 0  # its own prompt's, less the prefix its replica probably holds
    prefilling: bool = True  # no first token yet
    slot_level: int = 0  # the level its slot counts at (rule 5): `level`, or one below once its tenant floods


@dataclass(slots=True)
class _Replica:
    config: PoolReplica
    levels: int
    speed: ReplicaSpeed
    health: ReplicaHealth = ReplicaHealth.HEALTHY
    breaker: Breaker = field(default_factory=Breaker)
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    requests: int = 0
    prefill: list[int] = field(default_factory=list)  # by level
    prefill_total: int = 0  # `prefill` summed: an engine with nothing to prefill is told without a sum
    held: list[int] = field(default_factory=list)  # requests by level
    fit: TtftFit | None = None  # the pool's TTFT line at this replica's speed; None before its first token
    prefixes: PrefixIndex | None = None  # prefix blocks recently routed here; None: no affinity
    # rule 8: this gateway's share of the replica's slots (max_requests + headroom) while gateways
    # split them (`policy.slot_split`); None: all of them
    granted: int | None = None
    level_cap: int = 0  # `max_requests` scaled to the grant: the cap under the whole configured headroom
    # the requests it may hold (`slots()`), kept as the grant changes: every pick reads it
    slot_total: int = 0
    # rule 5 by level: the cap of that level and better, under the headroom sized to the better
    # levels' demand (`size_headroom`), never under `level_cap`
    caps: list[int] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)  # requests sent here by level, decaying
    finished: float = 0.0  # requests ended here, decaying

    def __post_init__(self) -> None:
        self.prefill = [0] * self.levels
        self.held = [0] * self.levels
        self.level_cap = self.config.max_requests
        self.slot_total = self.config.max_requests + self.config.headroom
        self.caps = [self.level_cap] * self.levels
        self.sent = [0.0] * self.levels

    def slots(self) -> int:
        """The requests it may hold: the engine's batch, or this gateway's grant of it (rule 8)."""
        return self.slot_total

    def has_slot(self, level: int, better_active: bool) -> bool:
        """Rule 5: under the engine's batch (or this gateway's grant of it, rule 8), and, while a
        better level is active, under `max_requests` at this level and better."""
        return (self.requests < self.slot_total
                and (not better_active or sum(self.held[: level + 1]) < self.caps[level]))

    def grant(self, slots: int | None) -> None:
        """Rule 8: hold at most `slots` requests (None: the configured ones), the headroom kept in
        the same proportion as the configured slots' (at least one slot a level may take)."""
        config = self.config
        self.granted = slots
        if slots is None:
            self.level_cap = config.max_requests
            self.slot_total = config.max_requests + config.headroom
        else:
            self.slot_total = slots
            headroom = round(slots * config.headroom / (config.max_requests + config.headroom))
            self.level_cap = slots - min(headroom, max(slots - 1, 0))
        self.caps = [self.level_cap] * self.levels  # sized again at the next tick

    def size_headroom(self, decay: float) -> None:
        """Rule 5's headroom for each level: the better levels' requests sent here per request
        ended here (how many arrive while one of its slots frees) times HEADROOM_ARRIVALS, plus a
        floor, at most the configured headroom (scaled to the grant); the whole of it until a
        request has ended here. Then the counts decay by `decay`."""
        most = self.slots() - self.level_cap
        finished = self.finished
        if finished <= 0:
            self.caps = [self.level_cap] * self.levels
            return
        floor = math.ceil(HEADROOM_FLOOR_SHARE * most)
        better = 0.0
        caps, sent = self.caps, self.sent
        for level in range(self.levels):
            caps[level] = self.level_cap + most - min(most, math.ceil(HEADROOM_ARRIVALS * better / finished) + floor)
            better += sent[level]
            sent[level] *= decay
        self.finished = finished * decay

    def ahead(self, level: int) -> int:
        """Prefill tokens the engine does before a newcomer of `level` (its level's included)."""
        if not self.prefill_total:  # nothing to prefill (every whole answer, a stream's idle engine)
            return 0
        return sum(self.prefill[: level + 1]) if self.config.orders_by_priority else self.prefill_total

    def add_prefill(self, level: int, tokens: int) -> None:
        """Prefill tokens sent to it at `level` (negative: prefilled), kept with their total."""
        self.prefill[level] += tokens
        self.prefill_total += tokens


class PoolController:
    def __init__(self, replicas: Sequence[PoolReplica], tiers: TierTable, settings: PoolSettings = PoolSettings(),
                 *, shares: TenantShares | None = None, tenant_weights: Mapping[str, float] | None = None,
                 length_classes: LengthClasses | None = None) -> None:
        if len({r.replica_id for r in replicas}) != len(replicas):
            raise ValueError("replica ids must be unique")
        if length_classes is not None:
            unknown = {r for c in length_classes.classes for r in c.replicas} - {r.replica_id for r in replicas}
            if unknown:
                raise ValueError(f"length classes name replicas not in the pool: {sorted(unknown)}")
        self._length_classes = length_classes
        # requests sent outside their length class because none of its replicas was routable
        self.length_class_fallbacks = 0
        self.tiers = tiers
        self._tier_specs = {tier.name: tier for tier in tiers}  # a dict's lookup: no call on the hot path
        self.settings = settings
        self._levels = 2 * (max(t.rank for t in tiers) + 1)
        affinity = settings.prefix_cache_tokens > 0
        self._replicas = {r.replica_id: _Replica(r, self._levels, ReplicaSpeed(settings.ttft_memory_samples),
                                                 prefixes=PrefixIndex(index_blocks(
                                                     r.kv_cache_tokens or settings.prefix_cache_tokens,
                                                     CHARS_PER_TOKEN)) if affinity else None)
                          for r in replicas}
        self._prefixes: dict[int | str, tuple[int, ...]] = {}  # queued requests' prefix blocks
        self._affinity_load = AffinityLoad(AFFINITY_HALF_LIFE_S) if affinity else None
        # prompt characters a token at the engines: the prefix indexes count characters (rule 7)
        self._chars_per_token = CharsPerToken()
        self._indexes_chars_per_token = CHARS_PER_TOKEN  # the ratio the indexes were last sized at
        self._order = list(self._replicas.values())
        self._queue = FairPriorityQueue(tiers, max_queued=settings.max_queued, tenant_weights=tenant_weights)
        self._predictor = WaitPredictor(WorkUnit.TOKENS)
        self._shares = shares
        self._sent: dict[int | str, _Sent] = {}
        self._retries: deque[tuple[QueuedRequest, frozenset[str]]] = deque()  # go first, in order
        self._early = EarlyResends(settings.max_queued)  # rule 10: refused early, until their Retry-After
        self._held = HeldResends()  # rule 10: resent before it, served last, newest first
        self._whole: set[int | str] = set()  # queued or sent requests that report no first token
        self._preemptible: set[int | str] = set()  # queued or sent requests that may be stopped (rule 9)
        # (when its replica's fit says its prefill is done, request id) for those that report none
        self._assumed_prefills: list[tuple[float, int | str]] = []
        self._refusals: list[Refusal] = []  # decided by an event, handed out by the next `on_capacity`
        self._last_arrival_s: dict[str, float] = {}
        # the latest arrival of the tier of each rank, by rank (rule 5's headroom memory reads the
        # latest of the better ranks': one store an arrival, where keeping that latest by rank took a loop)
        self._last_arrival_by_rank = [-math.inf] * (self._levels // 2)
        self._floods_counted: dict[str, frozenset[str]] = {}  # tier -> tenants whose slots count demoted
        self._speed_factors: tuple[float, ...] | None = None  # the last `pool_line` answer's, by replica
        self._line: TtftFit | None = None  # the pool's TTFT line at speed 1, as last fitted
        self._mean_factor = 1.0  # the replicas' raw factors' mean against it (their factors' divisor)
        self._samples_since_fit = 0
        self._cursor = 0
        self._headroom_sized_s = -math.inf

    # ---- queries: they change nothing ---------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue) + len(self._retries) + self._held.count

    def snapshot(self, now_s: float) -> PoolSnapshot:
        return PoolSnapshot(len(self._queue), len(self._retries), tuple(
            ReplicaSnapshot(r.config.replica_id, self._routable(r, now_s), r.breaker.current(now_s).state, r.requests,
                            tuple(r.prefill), r.fit) for r in self._order), self._held.count)

    def queue_depth(self, tier: str) -> int:
        return self._queue.depth(tier)

    def oldest_wait_s(self, now_s: float, tier: str) -> float:
        return self._queue.oldest_wait_s(now_s, tier)

    def over_share(self, now_s: float, tier: str) -> frozenset[str]:
        """Tenants flooding `tier`: their requests go one engine level down."""
        return self._shares.over_share(now_s, tier) if self._shares is not None else frozenset()

    def breaker(self, now_s: float, replica_id: str) -> Breaker:
        breaker = self._replicas[replica_id].breaker
        # a closed breaker is current as it is: no call (the gateway asks at every request's end)
        return breaker if breaker.state is _CLOSED else breaker.current(now_s)

    def ttft_fit(self, replica_id: str) -> TtftFit | None:
        """The replica's fitted engine TTFT line (rule 3); None before its first token."""
        return self._replicas[replica_id].fit

    def budget_tokens(self, now_s: float, replica_id: str) -> float | None:
        """Prefill tokens the replica's engine may hold ahead of a best-tier request (rule 3);
        None before its first token is measured."""
        replica = self._replicas[replica_id]
        fit = replica.fit
        if fit is None:
            return None
        return fit.tokens_within(self.engine_budget_s(now_s, self.tiers.best, replica.config))

    def _better_level_active(self, now_s: float, level: int) -> bool:
        """Whether a level better than `level` may want the headroom (rule 5): a demoted level's tier
        has its regular tenants; a tier, any better tier that arrived within `headroom_memory_s`."""
        if level % 2:
            return True
        rank = level // 2
        return rank > 0 and now_s - max(self._last_arrival_by_rank[:rank]) <= self.settings.headroom_memory_s

    def engine_level(self, tier: str, service: ServiceClass) -> int:
        return 2 * self.tiers[tier].rank + (service is ServiceClass.DEMOTED)

    def service_class(self, now_s: float, tier: str, tenant: str) -> ServiceClass:
        if self._shares is not None and tenant in self._shares.over_share(now_s, tier):
            return ServiceClass.DEMOTED
        return ServiceClass.REGULAR

    def engine_budget_s(self, now_s: float, tier: TierSpec, replica: PoolReplica) -> float:
        """The engine time a newcomer of `tier` may be predicted to take on `replica` (rule 3)."""
        if replica.orders_by_priority:
            return self.settings.engine_share * tier.ttft_target_s
        active = [t.ttft_target_s for t in self.tiers
                  if now_s - self._last_arrival_s.get(t.name, -math.inf) <= t.ttft_target_s]
        return self.settings.engine_share * min(active + [tier.ttft_target_s])

    # ---- events -------------------------------------------------------------------------------

    def on_arrival(self, now_s: float, request: PoolRequest) -> ArrivalDecision | Assignment:
        """The request's `Assignment` when it goes at once (rule 1), else the decision to queue or
        refuse it."""
        tier = self._tier_specs.get(request.tier)
        if tier is None:
            return ArrivalDecision(ArrivalVerdict.REFUSED, REFUSED_UNKNOWN_TIER)
        self._last_arrival_s[tier.name] = now_s
        last = self._last_arrival_by_rank
        if now_s > last[tier.rank]:
            last[tier.rank] = now_s
        if self._shares is not None:  # demand counts whether or not it is served
            self._shares.on_arrival(now_s, tier.name, request.tenant, request.prompt_tokens + request.max_output_tokens)
        # nothing waits and a replica takes it: the common case, first (a replica that takes it is routable)
        if not self._queue.queued_ids and not self._retries and (request.timeout_s is None or request.timeout_s > 0):
            assignment = self._assign_at_once(now_s, tier, request)
            if assignment is not None:
                return assignment
        if not any(self._routable(r, now_s) for r in self._order):
            return ArrivalDecision(ArrivalVerdict.REFUSED, REFUSED_NO_REPLICA)
        tokens = request.prompt_tokens + request.max_output_tokens
        wait_s = self._wait_budget_s(tier, request)
        self._expire(now_s)
        ahead = self._queue.work_ahead(tier.name, request.tenant, tokens)
        prediction = self._predictor.predict(now_s, ahead, now_s + wait_s, tier.rank)
        if prediction.misses_deadline:
            if request.fingerprint and self.queued < self.settings.max_queued:
                if self._early.is_early(now_s, request.fingerprint):  # rule 10
                    self._hold(now_s, request, wait_s)
                    return ArrivalDecision(ArrivalVerdict.QUEUED, pressure=prediction.pressure, predicted_wait_s=wait_s)
                self._early.remember(now_s, request.fingerprint, prediction.retry_after_s)
            return ArrivalDecision(ArrivalVerdict.REFUSED, REFUSED_PREDICTED_MISS, prediction.retry_after_s)
        decision = self._queue.enqueue(now_s, request_id=request.request_id, tenant=request.tenant,  # type: ignore[arg-type]
                                       tier=tier.name, prompt_tokens=request.prompt_tokens,
                                       expected_output_tokens=request.max_output_tokens, timeout_s=wait_s,
                                       predicted_wait_s=prediction.uncorrected_wait_s)
        displaced = tuple(self._refusal(now_s, item.request, item.reason.value) for item in decision.shed
                          if item.reason is ShedReason.DISPLACED)
        self._refusals += [self._refusal(now_s, item.request, item.reason.value) for item in decision.shed
                           if item.reason is not ShedReason.DISPLACED]
        if not decision.queued:
            return ArrivalDecision(ArrivalVerdict.REFUSED, decision.outcome.value, self._retry_after_s(now_s, tier),
                                   displaced)
        self._predictor.on_queued(now_s, tier.rank, tokens)
        if not request.streamed:
            self._whole.add(request.request_id)
        if request.preemptible:
            self._preemptible.add(request.request_id)
        if request.prefix:
            self._prefixes[request.request_id] = request.prefix
        return ArrivalDecision(ArrivalVerdict.QUEUED, displaced=displaced, pressure=prediction.pressure,
                               predicted_wait_s=prediction.predicted_wait_s)

    def on_capacity(self, now_s: float, loads: Mapping[str, ReplicaLoad] = {}) -> Dispatch:
        """Hand what can go to the replicas that can take it; refuse what can no longer be served."""
        for replica in self._order:  # a closed breaker stays closed by time alone
            if replica.breaker.state is not BreakerState.CLOSED:
                replica.breaker = replica.breaker.current(now_s)
        for replica_id, load in loads.items():
            replica = self._replicas[replica_id]
            resized = load.kv_cache_tokens != replica.load.kv_cache_tokens
            replica.load = load
            if resized:  # its engine reported its KV capacity (a restart may change it)
                self._size_prefix_index(replica)
        self._expire(now_s)
        self._assume_prefills_done(now_s)
        self._demote_slots_of_new_floods(now_s)
        if now_s - self._headroom_sized_s >= HEADROOM_PERIOD_S:
            last_s, self._headroom_sized_s = self._headroom_sized_s, now_s
            decay = 0.5 ** ((now_s - last_s) / HEADROOM_HALF_LIFE_S) if last_s > -math.inf else 1.0
            for replica in self._order:
                replica.size_headroom(decay)
        if self.queued and not any(self._routable(r, now_s) for r in self._order):
            self._refuse_all(now_s)
        assignments: list[Assignment] = []
        preemptions: list[Preemption] | None = None  # rarely any: not built unless needed
        queue_exclude: frozenset[str] = frozenset()
        if self._retries:
            queue_exclude = self._dispatch_retries(now_s, assignments)
            if len(queue_exclude) == len(self._order):
                return self._dispatch(now_s, assignments, preemptions)
        skip: frozenset[str] = frozenset()
        while (head := self._queue.peek(skip)) is not None:
            assignment = self._try_assign(now_s, head, queue_exclude, dequeue_skip=skip)
            if assignment is not None:
                assignments.append(assignment)
                continue
            if self._preemptible and (preemption := self._preempt_for(now_s, head)) is not None:  # rule 9
                preemptions = [*(preemptions or ()), preemption]
                assignment = self._try_assign(now_s, head, frozenset(), dequeue_skip=skip)
                if assignment is None:  # `_preempt_for` checks what `_pick` does: not expected
                    break
                assignments.append(assignment)
                continue
            # a flooding tenant's turn must not hold back its tier's tenants within their share:
            # they are a level better in the engine, so they may fit where it does not
            flooding = self._shares.over_share(now_s, head.tier) if self._shares is not None else frozenset()
            if skip or head.tenant not in flooding:
                break
            skip = flooding
        if self._held.count and not self._queue and not self._retries:
            assignments += self._assign_held(now_s)
        return self._dispatch(now_s, assignments, preemptions)

    def _dispatch(self, now_s: float, assignments: list[Assignment],
                  preemptions: list[Preemption] | None) -> Dispatch:
        refusals, self._refusals = tuple(self._refusals), []
        return Dispatch(tuple(assignments), refusals, self._wake_at_s(now_s),
                        tuple(preemptions) if preemptions else ())

    def _dispatch_retries(self, now_s: float, assignments: list[Assignment]) -> frozenset[str]:
        """Rule 7's retries, first and in order; one that no replica takes now stays first in line
        without holding back a later one that can go. Returns the replicas the queue may not take:
        every one a waiting retry may still be sent to, so the queue takes only slots that no
        waiting retry can use, the replicas that failed them (before, a retry that only the replica
        that failed it had room for held the whole queue until another replica freed a slot:
        `test_a_waiting_retry_leaves_the_replica_that_failed_it_to_the_queue`,
        `test_a_waiting_retry_does_not_hold_back_a_later_one_that_can_go`)."""
        waiting: deque[tuple[QueuedRequest, frozenset[str]]] = deque()
        claimed: set[str] = set()
        for request, exclude in self._retries:
            assignment = self._try_assign(now_s, request, exclude)
            if assignment is None:
                waiting.append((request, exclude))
                claimed.update(r.config.replica_id for r in self._order if r.config.replica_id not in exclude)
            else:
                assignments.append(assignment)
        self._retries = waiting
        return frozenset(claimed)

    def on_first_token(self, now_s: float, request_id: int | str) -> None:
        sent = self._sent.get(request_id)
        if sent is None or not sent.prefilling:
            return
        replica = self._replicas[sent.replica_id]
        self._prefilled(replica, sent)
        self._learn_speed(replica, sent.tokens_ahead, max(0.0, now_s - sent.sent_s))
        if self.settings.breaker.latency_factor is not None:
            self._eject_latency_outlier(now_s, replica)

    def on_finish(self, now_s: float, request_id: int | str, output_tokens: int | None = None) -> None:
        """A sent request ended well; `output_tokens`: what it really generated, if known."""
        sent = self._end(request_id)
        if sent is None:
            return
        replica = self._replicas[sent.replica_id]
        replica.breaker = replica.breaker.on_success(now_s, sent.sent_s, self.settings.breaker)
        self._settle(now_s, sent, output_tokens)

    def on_failure(self, now_s: float, request_id: int | str, reason: str, retry: bool = False) -> None:
        """A sent request failed at its replica. `retry`: the body will resend it if the controller
        assigns it again (before any byte reached the client); it then goes first, to another replica."""
        preemptible = retry and request_id in self._preemptible
        sent = self._end(request_id)
        if sent is None:
            return
        replica = self._replicas[sent.replica_id]
        pool_ratio = median([r.breaker.failure_ratio for r in self._order if r is not replica])
        replica.breaker = replica.breaker.on_failure(now_s, sent.sent_s, self.settings.breaker,
                                                     may_eject=self._may_eject(now_s), pool_failure_ratio=pool_ratio)
        if retry:
            request = sent.request
            if type(request) is PoolRequest:  # sent at once: it waits as the queue record it never had
                request = QueuedRequest(request.request_id, request.tenant, request.tier,  # type: ignore[arg-type]
                                        request.prompt_tokens, request.max_output_tokens, sent.sent_s, math.inf)
            self._retries.append((request, frozenset({sent.replica_id})))
            if preemptible:
                self._preemptible.add(request_id)
        else:
            self._settle(now_s, sent, 0)

    def on_cancel(self, now_s: float, request_id: int | str) -> None:
        """The client went away: forget a queued request, or end a sent one (its slot is free)."""
        if self._queue.cancel(request_id) is not None:  # type: ignore[arg-type]
            self._whole.discard(request_id)
            self._preemptible.discard(request_id)
            self._prefixes.pop(request_id, None)
            if not len(self._queue):
                self._predictor.on_queue_emptied()
            return
        for index, (request, _) in enumerate(self._retries):
            if request.request_id == request_id:
                del self._retries[index]
                self._whole.discard(request_id)
                self._preemptible.discard(request_id)
                return
        if self._held.count and self._held.cancel(request_id):
            self._whole.discard(request_id)
            self._prefixes.pop(request_id, None)
            return
        sent = self._end(request_id)
        if sent is not None:
            self._settle(now_s, sent, 0)

    def on_replica_health(self, now_s: float, replica_id: str, health: ReplicaHealth) -> None:
        self._replicas[replica_id].health = health

    def on_slot_grant(self, now_s: float, replica_id: str, slots: int | None) -> None:
        """Rule 8: this gateway's share of the replica's slots, from the split among the gateways
        in front of it (`policy.slot_split`); None: all its configured slots. A smaller grant sends
        nothing more until the requests held past it end; a larger one is used by the next
        `on_capacity`."""
        self._replicas[replica_id].grant(slots)

    def on_prompt_usage(self, prompt_chars: int, prompt_tokens: int) -> None:
        """An engine's usage said a prompt of about `prompt_chars` characters (as `policy.prefix`
        joins its parts) was `prompt_tokens` tokens. The prefix indexes count characters and the
        engines' caches tokens: once the ratio moves by over a tenth, every index is sized again
        (`test_the_index_counts_the_engines_tokens_in_the_characters_their_usage_reports`; the sizing
        itself: `sim.scenarios.prefix_index_sizing`, which an index sized by its default fails)."""
        ratio = self._chars_per_token
        ratio.observe(prompt_chars, prompt_tokens)
        if abs(ratio.value() - self._indexes_chars_per_token) > 0.1 * self._indexes_chars_per_token:
            self._indexes_chars_per_token = ratio.value()
            for replica in self._order:
                self._size_prefix_index(replica)

    def prefix_index_blocks(self, replica_id: str) -> int:
        """The prefix blocks the replica's index holds at most (0: no affinity) (a query)."""
        index = self._replicas[replica_id].prefixes
        return 0 if index is None else index.capacity_blocks

    def _size_prefix_index(self, replica: _Replica) -> None:
        """Rule 7's index bounded like the replica's KV cache: as configured, else as its engine
        reports, else `PoolSettings.prefix_cache_tokens`; in characters at the measured ratio."""
        if replica.prefixes is not None:
            tokens = replica.config.kv_cache_tokens or replica.load.kv_cache_tokens or self.settings.prefix_cache_tokens
            replica.prefixes.resize(index_blocks(tokens, self._indexes_chars_per_token))

    def slot_grant(self, replica_id: str) -> int:
        """The requests this gateway may hold at the replica now (rule 5's batch, or rule 8's grant)."""
        replica = self._replicas[replica_id]
        config = replica.config
        return config.max_requests + config.headroom if replica.granted is None else replica.granted

    def held(self, replica_id: str) -> int:
        """Requests sent to the replica and not yet ended."""
        return self._replicas[replica_id].requests

    def level_slots(self, now_s: float) -> int:
        """Rule 5's requests of one level and better over the routable replicas (rule 8's grant of
        each): what background work may share, the headroom left to better levels
        (`policy.background_share`)."""
        return sum(r.level_cap for r in self._order if self._routable(r, now_s))

    def demand_above(self, tier: str) -> int:
        """Requests of tiers ranked better than `tier`, held at replicas or waiting in the queue: the
        interactive demand `policy.background_share` leaves room for."""
        rank = self.tiers[tier].rank
        held = sum(sum(r.held[: 2 * rank]) for r in self._order)
        return held + sum(self._queue.depth(t.name) for t in self.tiers if t.rank < rank)

    # ---- internals ----------------------------------------------------------------------------

    def _assign_at_once(self, now_s: float, tier: TierSpec, request: PoolRequest) -> Assignment | None:
        """Rule 1 when nothing waits: the request goes now if a replica can take it, with the same
        accounts as a request queued and dispatched at once (fair-share counter, dispatch rate,
        tier service rate); queueing it only to take it out again cost most of the gateway's
        CPU per request (`bench/gateway_overhead.py`). Its deadline no longer matters once sent."""
        # as `on_capacity` would first: whole answers' prefills past their time
        # (`test_a_whole_answers_predicted_prefill_ends_before_the_next_arrival_is_assigned_at_once`)
        if self._assumed_prefills:
            self._assume_prefills_done(now_s)
        shares = self._shares
        if shares is not None:
            self._demote_slots_of_new_floods(now_s)
        streamed = request.streamed
        # the request is its own account: no queue record is built for it (`_Sent.request`); its
        # arguments by position (a call by keyword costs more, on every request)
        assignment = self._try_assign(now_s, request, _NO_REPLICAS, None, not streamed, request.prefix, now_s, tier)
        if assignment is None:
            return None
        if not streamed:
            self._whole.add(request.request_id)
        if request.preemptible:
            self._preemptible.add(request.request_id)
        prompt_tokens, output_tokens = request.prompt_tokens, request.max_output_tokens
        self._queue.charge_unqueued(tier.name, request.tenant, prompt_tokens, output_tokens)
        self._predictor.on_sent_at_once(now_s, tier.rank, prompt_tokens + output_tokens)
        if shares is not None:
            shares.on_dispatch(now_s, tier.name, prompt_tokens + output_tokens)
        return assignment

    def _try_assign(self, now_s: float, request: QueuedRequest | PoolRequest, exclude: frozenset[str],
                    dequeue_skip: frozenset[str] | None = None, whole: bool | None = None,
                    prefix: tuple[int, ...] | None = None, enqueued_at_s: float | None = None,
                    tier: TierSpec | None = None) -> Assignment | None:
        """`whole`: the request reports no first token (None: look it up in `_whole`); `prefix`:
        its prefix blocks (None: look them up in `_prefixes`); `enqueued_at_s`: when its wait began,
        given for a request sent at once (a `PoolRequest`), else the queued request's own; `tier`:
        its tier's spec, when the caller holds it."""
        request_id = request.request_id
        if prefix is None:
            prefix = self._prefixes.get(request_id, ())
        if tier is None:
            tier = self._tier_specs[request.tier]
        shares = self._shares
        # `engine_level(service_class(...))` inline: this runs for every request
        level = 2 * tier.rank + (shares is not None and request.tenant in shares.over_share(now_s, tier.name))
        # what is left of its TTFT target after its wait so far (rule 3): an engine that would
        # start it later has no use for it now
        if enqueued_at_s is None:
            enqueued_at_s = request.enqueued_at_s  # type: ignore[union-attr]
        left_s = enqueued_at_s + tier.ttft_target_s - now_s
        # without length classes no call on the hot path
        classes = self._length_classes
        outside = None if classes is None else self._outside_length_class(now_s, request.prompt_tokens)
        picked = self._pick(now_s, tier, level, request.prompt_tokens,
                            exclude if not outside else exclude | outside, left_s, prefix)
        if picked is None:
            return None
        if outside is None and classes is not None:
            self.length_class_fallbacks += 1
        replica, prefill_tokens, prefix_key, moved_from, moved_blocks, ahead = picked
        if prefix:
            self._prefixes.pop(request_id, None)
            balance = self._affinity_load
            if balance is not None:
                if moved_from is not None and moved_from.prefixes is not None and prefix_key is not None:
                    moved_from.prefixes.forget(prefix[:moved_blocks])  # its next requests follow it
                    balance.move(now_s, prefix_key, moved_from.config.replica_id, replica.config.replica_id)
                balance.record(now_s, replica.config.replica_id, prefix_key)
            if replica.prefixes is not None:
                replica.prefixes.record(prefix)
        if dequeue_skip is not None:
            taken = self._queue.dequeue(now_s, dequeue_skip).request
            assert taken is not None and taken.request_id == request.request_id
            self._predictor.on_dispatch(now_s, request.tokens, queued_after=len(self._queue))
            self._predictor.on_waited(request.predicted_wait_s, now_s - request.enqueued_at_s)
            if self._shares is not None:
                self._shares.on_dispatch(now_s, request.tier, request.tokens)
        rid = replica.config.replica_id
        ahead += prefill_tokens  # its engine's prefill before its first token, its own included
        replica.requests += 1
        replica.held[level] += 1
        replica.sent[level] += 1
        breaker = replica.breaker
        if breaker.state is not _CLOSED:  # a closed breaker stays as it is: no call
            replica.breaker = breaker.on_dispatch(now_s)
        fit = replica.fit
        if whole is None:
            whole = request_id in self._whole
        # a whole answer reports no first token: its prefill is taken as done when the replica's
        # fit predicts, so that it neither blocks the budget until its answer nor is forgotten at
        # once (`test_a_whole_answer_holds_the_budget_for_its_predicted_prefill`); before the
        # replica has a fit nothing tells when its prefill ends, nor predicts it: not counted
        prefilling = not whole or fit is not None
        if prefilling:
            replica.add_prefill(level, prefill_tokens)
            if whole:
                done_s = now_s + fit.predict_s(ahead)  # type: ignore[union-attr]  # a whole answer prefilling has a fit
                heapq.heappush(self._assumed_prefills, (done_s, request_id))
        self._sent[request_id] = _Sent(request, rid, level, now_s, ahead, prefill_tokens, prefilling, level)
        # `_make`: built by `tuple.__new__` from a plain call; the NamedTuple's own constructor goes through
        # the type's slot into a Python `__new__` (some 350 instructions more, on every request)
        return Assignment._make((request_id, rid, level, None if moved_from is None else moved_from.config.replica_id))

    def _pick(self, now_s: float, tier: TierSpec, level: int, tokens: int, exclude: frozenset[str],
              left_s: float, prefix: tuple[int, ...] = ()) -> _Pick | None:
        """The replica to send it to, and the prefill tokens it would cost there (its prompt's,
        less the prefix that replica probably holds: `policy.prefix`); None: none may take it now."""
        better_active: bool | None = None  # rule 5's question, asked of a replica at its `max_requests`
        best: _Replica | None = None
        best_key: tuple[bool, float, int, int, float] | None = None
        best_tokens = tokens
        order, cursor = self._order, self._cursor
        count = len(order)
        best_index = best_matched = best_ahead = 0
        # (replica, its prefill tokens there): all that may take a request with a prefix (rule 7's moves)
        eligible: list[tuple[_Replica, int]] | None = [] if prefix and self._affinity_load is not None else None
        # rule 7: the prediction counts prefill, not the decodes a replica already runs
        load_cap = math.inf
        if prefix:
            least = min((r.requests for r in order if is_routable(r.health, r.breaker, now_s)), default=0)
            load_cap = LOAD_IMBALANCE * least + 1
        for offset in range(count):
            index = (cursor + offset) % count
            replica = order[index]
            if (exclude and replica.config.replica_id in exclude) \
                    or not is_routable(replica.health, replica.breaker, now_s):
                continue
            # rule 5: a replica holding fewer than its `level_cap` (<= its slots) has a slot for any
            # level, so only one holding that many asks whether a better level is active (the same
            # answer, asked less: a call and a max over ranks on every pick)
            if replica.requests >= replica.level_cap:
                if better_active is None:
                    better_active = self._better_level_active(now_s, level)
                if not replica.has_slot(level, better_active):
                    continue
            own, matched = tokens, 0
            if prefix and replica.prefixes is not None:
                # rule 7: a cached prefix is prefill the engine skips; at least the last token is computed
                matched = replica.prefixes.matched(prefix)
                own = max(1, tokens - tokens * matched // len(prefix)) if tokens else 0
            ahead = replica.ahead(level) if replica.prefill_total else 0  # nothing to prefill: no call
            fit = replica.fit
            # rule 4: an empty prefill queue takes anything. Before its first token is measured a
            # replica has no budget, only its slots (rule 5): holding it to one prefill at a time
            # then left `retry_storm` (8 seeds) 6 and 27 requests in time behind FIFO with 64 and 512
            # clients, 2 and 31 without it: no gain; a long-prompt burst on a cold pool kept critical
            # within target either way (P99 2.5 s and 2.2 s; FIFO 6.9 s)
            if ahead > 0 and fit is not None \
                    and fit.predict_s(ahead + own) > min(self.engine_budget_s(now_s, tier, replica.config), left_s):
                continue  # rule 3
            # a replica not yet measured predicts in tokens (an idle one, 0, is tried first); a
            # cached prefix also breaks ties there (its tokens as an int: compared exactly as their float)
            predicted_s = fit.predict_s(ahead + own) if fit is not None else ahead
            if eligible is not None:
                eligible.append((replica, own))
            piled_up = replica.requests > load_cap and replica.requests > PILE_UP_SLOT_SHARE * replica.slots()
            key = (piled_up, predicted_s, own, replica.requests, replica.load.kv_cache_usage)
            if best_key is None or key < best_key:  # one store each: six names at once would build a tuple
                best = replica
                best_key = key
                best_index = index
                best_tokens = own
                best_matched = matched
                best_ahead = ahead
        if best is None:
            return None
        self._cursor = (best_index + 1) % count
        pick: _Pick = (best, best_tokens, None, None, 0, best_ahead)
        return pick if eligible is None or not best_matched else self._rebalanced(now_s, prefix, pick, best_matched,
                                                                                   eligible, level)

    def _rebalanced(self, now_s: float, prefix: tuple[int, ...], pick: _Pick, matched: int,
                    eligible: list[tuple[_Replica, int]], level: int) -> _Pick:
        """Rule 7's balance over time: a request whose prefix the picked replica holds (its first `matched`
        blocks) goes instead to the least loaded replica that may take it, its prefix moved there,
        when `AffinityLoad` says the move evens their recent loads out by more than noise (a query)."""
        source, balance = pick[0], self._affinity_load
        assert balance is not None  # `eligible` is kept only with affinity on
        key = prefix[matched - 1]
        owns = {r.config.replica_id: (r, own) for r, own in eligible if r is not source}
        target = balance.move_target(now_s, key, source.config.replica_id, owns)
        if target is None:
            return source, pick[1], key, None, 0, pick[5]
        replica, own = owns[target]
        return replica, own, key, source, matched, replica.ahead(level)

    def _outside_length_class(self, now_s: float, prompt_tokens: int) -> frozenset[str] | None:
        """The replicas outside the prompt's length class (`policy.length_classes`): empty without
        classes; None when none of its class is routable, so that it may go anywhere (a query)."""
        classes = self._length_classes
        if classes is None:
            return frozenset()
        return classes.outside(prompt_tokens, self._replicas,
                               lambda replica_id: self._routable(self._replicas[replica_id], now_s))

    def _preempt_for(self, now_s: float, request: QueuedRequest) -> Preemption | None:
        """Rule 9: `request` found no slot; stop the youngest preemptible request of a worse tier whose
        replica would then take it, and end it here (its slot is free now). None: nothing to stop."""
        if request.request_id in self._preemptible:
            return None  # background work does not preempt background work
        tier = self.tiers[request.tier]
        level = self.engine_level(tier.name, self.service_class(now_s, tier.name, request.tenant))
        better_active = self._better_level_active(now_s, level)
        left_s = request.enqueued_at_s + tier.ttft_target_s - now_s
        outside = self._outside_length_class(now_s, request.prompt_tokens) or frozenset()
        victim: _Sent | None = None
        for request_id in self._preemptible:
            sent = self._sent.get(request_id)
            if sent is None or self.tiers[sent.request.tier].rank <= tier.rank or sent.replica_id in outside \
                    or (victim is not None and sent.sent_s <= victim.sent_s):
                continue
            if self._takes_in_place_of(now_s, self._replicas[sent.replica_id], sent, tier, level, better_active,
                                       request.prompt_tokens, left_s):
                victim = sent
        if victim is None:
            return None
        victim_id = victim.request.request_id
        self._end(victim_id)
        self._settle(now_s, victim, 0)
        return Preemption(victim_id, victim.replica_id, request.request_id, now_s - victim.sent_s)

    def _takes_in_place_of(self, now_s: float, replica: _Replica, victim: _Sent, tier: TierSpec, level: int,
                           better_active: bool, tokens: int, left_s: float) -> bool:
        """Whether `_pick` would send a request of `tier` at `level` to `replica` once `victim` (of a
        worse tier, so never counted in that level's slots) left it: rules 5, 8 and 3 as `_pick` checks
        them (the prompt counted whole: a cached prefix only makes it fit better)."""
        if not is_routable(replica.health, replica.breaker, now_s):
            return False
        config = replica.config
        total = config.max_requests + config.headroom if replica.granted is None else replica.granted
        if replica.requests - 1 >= total or (better_active and sum(replica.held[: level + 1]) >= replica.caps[level]):
            return False
        ahead = replica.ahead(level)
        if not config.orders_by_priority and victim.prefilling:
            ahead -= victim.prefill_tokens
        fit = replica.fit
        return not (ahead > 0 and fit is not None
                    and fit.predict_s(ahead + tokens) > min(self.engine_budget_s(now_s, tier, config), left_s))

    def _learn_speed(self, replica: _Replica, tokens_ahead: int, engine_s: float) -> None:
        """One first token: the replica's speed against the pool's line, and, after four samples a
        replica since the last time, the line and every speed again (one round of `pool_line`;
        refitting on every first token added 8 µs, 70 %, to the controller's cost of a streamed
        request on a pool of two; now 2.5 µs). A pool of one replica is its line, refitted each time."""
        replica.speed.observe(tokens_ahead, engine_s)
        self._samples_since_fit += 1
        line = self._line
        if line is not None and 1 < len(self._order) and self._samples_since_fit < 4 * len(self._order):
            factor = replica.speed.factor(line) / self._mean_factor
            replica.fit = TtftFit(line.fixed_s * factor, line.s_per_token * factor, replica.speed.samples)
            return
        fitted = pool_line([r.speed for r in self._order], self._speed_factors)
        assert fitted is not None
        self._line, self._speed_factors = line, factors = fitted
        self._samples_since_fit = 0
        if len(self._order) == 1:
            replica.fit = line
            return
        # the raw factor of a replica against the new line, over its normalised one: the same for all
        self._mean_factor = next((r.speed.factor(line) / f for r, f in zip(self._order, factors)
                                  if r.speed.samples > 0), 1.0)
        for other, factor in zip(self._order, factors):
            if other.speed.samples > 0:
                other.fit = TtftFit(line.fixed_s * factor, line.s_per_token * factor, other.speed.samples)

    def _eject_latency_outlier(self, now_s: float, replica: _Replica) -> None:
        """The latency rule of outlier detection (`BreakerPolicy.latency_factor`): a replica whose
        fitted engine time is that many times the median of the other replicas' is ejected, like one
        that fails (`test_a_replica_far_slower_than_the_pool_is_ejected_for_latency`)."""
        policy = self.settings.breaker
        assert policy.latency_factor is not None
        if replica.breaker.state is not BreakerState.CLOSED or replica.fit is None \
                or replica.speed.samples < policy.latency_min_samples:
            return
        others = [r.fit.predict_s(_LATENCY_REFERENCE_TOKENS) for r in self._order
                  if r is not replica and r.fit is not None and r.speed.samples >= policy.latency_min_samples]
        if not others:
            return
        if replica.fit.predict_s(_LATENCY_REFERENCE_TOKENS) >= policy.latency_factor * median(others) \
                and self._may_eject(now_s):
            replica.breaker = replica.breaker.on_slow(now_s, policy)

    def _demote_slots_of_new_floods(self, now_s: float) -> None:
        """Rule 5 for the requests a flood got in before its verdict: those a tenant newly judged
        over its share holds at its tier's regular level count, from now on, as demoted ones. Only
        the slot moves (the engine keeps the priority they were sent with, and they are past their
        prefill or soon will be), so the tier's other tenants find the room the rule keeps for them
        instead of waiting seconds for the flood's first requests to finish."""
        if self._shares is None:
            return
        for tier in self.tiers:
            flooding = self._shares.over_share(now_s, tier.name)
            counted = self._floods_counted.get(tier.name, frozenset())
            if flooding == counted:
                continue
            self._floods_counted[tier.name] = flooding
            newly = flooding - counted
            if not newly:
                continue
            regular = 2 * tier.rank
            for sent in self._sent.values():
                request = sent.request
                if sent.slot_level == regular and request.tier == tier.name and request.tenant in newly:
                    replica = self._replicas[sent.replica_id]
                    replica.held[regular] -= 1
                    replica.held[regular + 1] += 1
                    sent.slot_level = regular + 1

    def _routable(self, replica: _Replica, now_s: float) -> bool:
        return is_routable(replica.health, replica.breaker, now_s)

    def _may_eject(self, now_s: float) -> bool:
        """Never more than `max_ejected_fraction` of the pool ejected at once (at least one)."""
        ejected = sum(1 for r in self._order if not r.breaker.admits(now_s))
        return ejected < max(1, int(len(self._order) * self.settings.breaker.max_ejected_fraction))

    def _wait_budget_s(self, tier: TierSpec, request: PoolRequest) -> float:
        """Rule 6: a request that waits past its TTFT target less the engine's time for it is
        served too late to count, with capacity one still in time could have used."""
        wait_s = tier.max_queue_wait_s if request.timeout_s is None else min(tier.max_queue_wait_s, request.timeout_s)
        fits = [r.fit for r in self._order if r.fit is not None]
        if fits:
            engine_s = min(fit.predict_s(request.prompt_tokens) for fit in fits)
            wait_s = min(wait_s, max(tier.ttft_target_s - engine_s, self.settings.min_wait_share * tier.max_queue_wait_s))
        return wait_s

    def _expire(self, now_s: float) -> None:
        shed = self._queue.expire(now_s)
        if shed and not len(self._queue):
            self._predictor.on_queue_emptied()
        self._refusals += [self._refusal(now_s, item.request, item.reason.value) for item in shed]
        if self._held.count:
            for request, fingerprint in self._held.expire(now_s):
                refusal = self._refusal(now_s, request, REFUSED_EARLY_RESEND)
                self._early.remember(now_s, fingerprint, refusal.retry_after_s or 1.0)
                self._refusals.append(refusal)

    def _hold(self, now_s: float, request: PoolRequest, wait_s: float) -> None:
        """Rule 10: an early resend waits, below the queue, to its deadline."""
        self._held.hold(QueuedRequest(request.request_id, request.tenant, request.tier,  # type: ignore[arg-type]
                                      request.prompt_tokens, request.max_output_tokens, now_s, now_s + wait_s),
                        request.fingerprint)
        if not request.streamed:
            self._whole.add(request.request_id)
        if request.prefix:
            self._prefixes[request.request_id] = request.prefix

    def _assign_held(self, now_s: float) -> list[Assignment]:
        """Rule 10: held resends to replicas with room, best tier first, newest first, with the
        accounts of a request assigned at arrival."""
        assignments = []
        for tier in sorted(self._held.tiers(), key=lambda name: self.tiers[name].rank):
            while (request := self._held.newest(tier)) is not None:
                assignment = self._try_assign(now_s, request, frozenset())
                if assignment is None:
                    break
                self._held.take_newest(tier)
                tokens = request.tokens
                self._queue.charge_unqueued(tier, request.tenant, request.prompt_tokens, request.expected_output_tokens)
                self._predictor.on_sent_at_once(now_s, self.tiers[tier].rank, tokens)
                if self._shares is not None:
                    self._shares.on_dispatch(now_s, tier, tokens)
                assignments.append(assignment)
        return assignments

    def _refuse_all(self, now_s: float) -> None:
        while (request := self._queue.peek()) is not None:
            self._queue.cancel(request.request_id)
            self._whole.discard(request.request_id)
            self._preemptible.discard(request.request_id)
            self._refusals.append(Refusal(request.request_id, REFUSED_NO_REPLICA, self._retry_after_s(now_s, None)))
        while self._retries:
            request, _ = self._retries.popleft()
            self._whole.discard(request.request_id)
            self._preemptible.discard(request.request_id)
            self._refusals.append(Refusal(request.request_id, REFUSED_NO_REPLICA, self._retry_after_s(now_s, None)))
        for request, _ in self._held.take_all():
            self._refusals.append(self._refusal(now_s, request, REFUSED_NO_REPLICA))
        self._predictor.on_queue_emptied()

    def _refusal(self, now_s: float, request: QueuedRequest, reason: str) -> Refusal:
        self._whole.discard(request.request_id)
        self._preemptible.discard(request.request_id)
        self._prefixes.pop(request.request_id, None)
        return Refusal(request.request_id, reason, self._retry_after_s(now_s, self.tiers[request.tier]))

    def _retry_after_s(self, now_s: float, tier: TierSpec | None) -> float:
        """When retrying is worth it: once the queue ahead has drained at the measured rate."""
        rate = self._predictor.service_rate_per_s
        if not rate or tier is None:
            return 1.0
        return max(1.0, self._queue.work_ahead(tier.name).tokens / rate)

    def _assume_prefills_done(self, now_s: float) -> None:
        due = self._assumed_prefills
        while due and due[0][0] <= now_s:
            _, request_id = heapq.heappop(due)
            sent = self._sent.get(request_id)
            if sent is not None and sent.prefilling:
                self._prefilled(self._replicas[sent.replica_id], sent)

    def _prefilled(self, replica: _Replica, sent: _Sent) -> None:
        sent.prefilling = False
        replica.add_prefill(sent.level, -sent.prefill_tokens)

    def _end(self, request_id: int | str) -> _Sent | None:
        sent = self._sent.pop(request_id, None)
        self._whole.discard(request_id)
        if self._preemptible:
            self._preemptible.discard(request_id)
        if sent is None:
            return None
        replica = self._replicas[sent.replica_id]
        if sent.prefilling:
            self._prefilled(replica, sent)
        replica.requests -= 1
        replica.held[sent.slot_level] -= 1
        replica.finished += 1
        return sent

    def _settle(self, now_s: float, sent: _Sent, output_tokens: int | None) -> None:
        request = sent.request
        if output_tokens is not None:
            self._queue.settle_service(request, output_tokens)
        if self._shares is not None:
            self._shares.on_finish(now_s, request.tier, request.tokens)

    def _wake_at_s(self, now_s: float) -> float | None:
        """The next deadline, hopeless check or breaker cool-down's end while requests wait."""
        if not self.queued:
            return None
        times = [t for t in (self._queue.next_deadline_s(),) if t is not None]
        if self._held.count:
            times.append(self._held.next_deadline_s())  # type: ignore[arg-type]
        if self._assumed_prefills:
            times.append(self._assumed_prefills[0][0])
        times += [r.breaker.reopen_at_s for r in self._order
                  if r.breaker.state is not BreakerState.CLOSED and r.breaker.reopen_at_s > now_s]
        later = [t for t in times if t > now_s]
        return min(later) if later else None
