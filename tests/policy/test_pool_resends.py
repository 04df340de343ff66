"""Rule 10 of `policy.pool`: a request resent before its Retry-After is held, not refused at once."""

from __future__ import annotations

import heapq

from tidegate.policy.pool import REFUSED_EARLY_RESEND, REFUSED_PREDICTED_MISS, PoolController, PoolReplica
from tidegate.policy.resends import EarlyResends
from tidegate.policy.tiers import default_tiers
from tidegate.types import ArrivalVerdict, PoolRequest

SERVICE_S = 0.5  # each request holds the pool's one slot this long


class Saturated:
    """One replica of one slot, each request taking `SERVICE_S`, offered twice what it serves until
    arrivals are refused early (rule 6)."""

    def __init__(self) -> None:
        self.ctl = PoolController([PoolReplica("r0", max_requests=1)], default_tiers())
        self.now_s = 0.0
        self._ends: list[tuple[float, int | str]] = []
        self._next_id = 0
        self.sent: list[int | str] = []  # assigned, in order
        self.refused: list[tuple[int | str, str]] = []  # refused after arrival, with the reason
        self.refused_at_s: dict[int | str, float] = {}
        refused_at_arrival = None
        while refused_at_arrival is None:
            self.advance(0.1)
            decision = self.arrive(fingerprint=0)
            if decision.verdict is ArrivalVerdict.REFUSED:
                refused_at_arrival = decision
        assert refused_at_arrival.reason == REFUSED_PREDICTED_MISS

    def arrive(self, fingerprint: int, request_id: int | None = None):
        if request_id is None:
            self._next_id += 1
            request_id = self._next_id
        decision = self.ctl.on_arrival(self.now_s, PoolRequest(request_id, self.now_s, "t", "standard", 100, 50,
                                                              fingerprint=fingerprint))
        if decision.assignment is not None:
            self._sent(request_id)
        return decision

    def advance(self, seconds: float, arrivals: bool = True) -> None:
        """Time passes by steps of 50 ms: ends, then (with `arrivals`) a new request each 100 ms, then
        the controller's dispatch."""
        stop_s = self.now_s + seconds
        while self.now_s < stop_s - 1e-9:
            self.now_s = round(self.now_s + 0.05, 6)
            while self._ends and self._ends[0][0] <= self.now_s:
                end_s, request_id = heapq.heappop(self._ends)
                self.ctl.on_first_token(end_s - SERVICE_S + 0.1, request_id)
                self.ctl.on_finish(end_s, request_id)
            if arrivals and round(self.now_s * 20) % 2 == 0:
                self.arrive(fingerprint=0)
            self.dispatch()

    def cancel_queued(self) -> None:
        """Every request of the regular queue goes away (their clients gave up)."""
        settled = set(self.sent) | set(self.refused_at_s)
        for request_id in range(1, self._next_id + 1):
            if request_id not in settled:
                self.ctl.on_cancel(self.now_s, request_id)

    def dispatch(self) -> None:
        result = self.ctl.on_capacity(self.now_s)
        self.refused += [(r.request_id, r.reason) for r in result.refusals]
        self.refused_at_s.update((r.request_id, self.now_s) for r in result.refusals)
        for assignment in result.assignments:
            self._sent(assignment.request_id)

    def _sent(self, request_id: int | str) -> None:
        self.sent.append(request_id)
        heapq.heappush(self._ends, (self.now_s + SERVICE_S, request_id))


def refused_early(pool: Saturated, fingerprint: int, request_id: int) -> float:
    decision = pool.arrive(fingerprint, request_id)
    assert decision.verdict is ArrivalVerdict.REFUSED and decision.reason == REFUSED_PREDICTED_MISS
    assert decision.retry_after_s is not None
    return decision.retry_after_s


def test_an_early_resend_is_held_to_its_deadline_not_refused_at_once() -> None:
    pool = Saturated()
    refused_early(pool, fingerprint=77, request_id=9001)
    resent = pool.arrive(fingerprint=77, request_id=9002)  # at once, as a retry storm's client does
    assert resent.verdict is ArrivalVerdict.QUEUED
    assert pool.ctl.snapshot(pool.now_s).held_resends == 1
    held_at_s = pool.now_s
    pool.advance(3.0)  # the queue ahead of it keeps the slot busy: it waits
    assert 9002 not in pool.sent and (9002, REFUSED_EARLY_RESEND) not in pool.refused
    pool.advance(2.0)  # past the standard tier's wait budget (4 s)
    assert (9002, REFUSED_EARLY_RESEND) in pool.refused and 9002 not in pool.sent
    assert pool.ctl.snapshot(pool.now_s).held_resends == 0
    assert pool.refused_at_s[9002] - held_at_s <= default_tiers()["standard"].max_queue_wait_s + 0.05
    # refused at its deadline, it is remembered again: sent again at once, it is held again
    assert pool.arrive(fingerprint=77, request_id=9003).verdict is ArrivalVerdict.QUEUED


def test_the_controller_asks_to_wake_at_a_held_resends_deadline() -> None:
    pool = Saturated()
    refused_early(pool, fingerprint=5, request_id=9001)
    pool.arrive(fingerprint=5, request_id=9002)
    held_at_s = pool.now_s
    pool.cancel_queued()  # only the held resend is left waiting: its deadline is the one to wake for
    wake_s = pool.ctl.on_capacity(pool.now_s).wake_at_s
    assert wake_s is not None and held_at_s < wake_s <= held_at_s + default_tiers()["standard"].max_queue_wait_s


def test_a_resend_after_its_retry_after_is_refused_early_again() -> None:
    pool = Saturated()
    retry_after_s = refused_early(pool, fingerprint=77, request_id=9001)
    pool.advance(retry_after_s + 0.1)  # the client waited as it was told; the pool is still full
    assert pool.arrive(fingerprint=77, request_id=9002).reason == REFUSED_PREDICTED_MISS


def test_a_request_without_a_fingerprint_is_refused_at_once_every_time() -> None:
    pool = Saturated()
    for request_id in (9001, 9002, 9003):
        refused_early(pool, fingerprint=0, request_id=request_id)
    assert pool.ctl.snapshot(pool.now_s).held_resends == 0


def test_held_resends_are_served_newest_first_when_a_replica_has_room() -> None:
    pool = Saturated()
    for fingerprint, first, again in ((1, 9001, 9011), (2, 9002, 9012), (3, 9003, 9013)):
        refused_early(pool, fingerprint, first)
    for fingerprint, again in ((1, 9011), (2, 9012), (3, 9013)):
        assert pool.arrive(fingerprint, again).verdict is ArrivalVerdict.QUEUED
    # the queue empties: the held resends take the slot as it frees, newest first
    pool.cancel_queued()
    pool.advance(2.0, arrivals=False)
    served = [r for r in pool.sent if r in (9011, 9012, 9013)]
    assert served[:2] == [9013, 9012]


def test_a_cancelled_held_resend_is_forgotten() -> None:
    pool = Saturated()
    refused_early(pool, fingerprint=8, request_id=9001)
    pool.arrive(fingerprint=8, request_id=9002)
    pool.ctl.on_cancel(pool.now_s, 9002)
    assert pool.ctl.snapshot(pool.now_s).held_resends == 0
    pool.advance(5.0)
    assert 9002 not in pool.sent and all(r != 9002 for r, _ in pool.refused)


def test_early_resends_remember_at_most_their_capacity_and_until_the_retry_after() -> None:
    early = EarlyResends(capacity=2)
    early.remember(0.0, 1, 1.0)
    early.remember(0.0, 2, 5.0)
    early.remember(0.0, 3, 5.0)  # the oldest remembered is forgotten
    assert not early.is_early(0.5, 1) and early.is_early(0.5, 2) and early.is_early(0.5, 3)
    assert not early.is_early(5.0, 2)
    assert len(early) <= 2


def test_a_refusal_with_no_wait_is_remembered_without_error() -> None:
    early = EarlyResends(capacity=4)
    early.remember(1.0, 1, 0.0)  # runs out at once: forgotten, and nothing else is left
    early.remember(1.0, 2, 0.0)
    assert not early.is_early(1.0, 2) and len(early) == 0
