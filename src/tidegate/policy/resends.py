"""Requests sent again before their `Retry-After` ran out: held to their deadline, newest first.

Early refusal exists to make a client back off. A client that resends the same request the moment
it is refused (a retry storm: benchmark tools, naive SDK loops) turns every early refusal into a
round trip that brings the same request straight back, and on a machine where the gateway, the
clients and the engines share the cores, those round trips take the engines' CPU (the
`retry_storm` scenario with `refusal_cpu_s`; `bench/retry_storm.py` live: 1,770 refusals a second
slowed the engines by 17 %). Refusing such a resend early again buys nothing: the client did not
wait the first time. So the pool controller remembers the requests it refused early
(`EarlyResends`, by the fingerprint the body gives a request: the same request from the same
tenant has the same one), and holds a resend that comes back before its `Retry-After` (`HeldResends`)
instead of refusing it: it waits, below every request admitted the regular way, until a replica
has room for it or its deadline passes. That bounds the round trips to one per client per
deadline, and the held requests are served newest first (adaptive LIFO, as in "Fail at Scale"):
while they wait past what was predicted, the newest one has the most of its target left, so
what is served is served in time and what is refused is the stalest. A request sent once, or
again after its `Retry-After`, is refused early as before (`test_a_resend_after_its_retry_after_is_refused_early_again`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tidegate.policy.queueing import QueuedRequest

__all__ = ["EarlyResends", "HeldResends"]


class EarlyResends:
    """Fingerprints of requests refused early, each until its `Retry-After` runs out; at most
    `capacity` of them (the oldest remembered is forgotten first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity >= 1 needed")
        self.capacity = capacity
        self._retry_at_s: dict[int, float] = {}  # in the order remembered

    def __len__(self) -> int:
        return len(self._retry_at_s)

    def is_early(self, now_s: float, fingerprint: int) -> bool:
        """Whether a request with this fingerprint comes back before the `Retry-After` it was given."""
        return now_s < self._retry_at_s.get(fingerprint, -1.0)

    def remember(self, now_s: float, fingerprint: int, retry_after_s: float) -> None:
        """The request was refused with `retry_after_s`: a resend before then is early (changes state)."""
        remembered = self._retry_at_s
        remembered.pop(fingerprint, None)  # to the end of the order
        remembered[fingerprint] = now_s + retry_after_s
        while len(remembered) > self.capacity:
            del remembered[next(iter(remembered))]
        # the oldest remembered have mostly run out: forget those at the front (bounded work)
        for _ in range(2):
            oldest = next(iter(remembered), None)
            if oldest is None or remembered[oldest] > now_s:
                break
            del remembered[oldest]


class HeldResends:
    """Early resends waiting for a replica, by tier: taken newest first, expired oldest first."""

    def __init__(self) -> None:
        self._by_tier: dict[str, deque[tuple[QueuedRequest, int]]] = {}  # (request, fingerprint), arrival order
        self.count = 0  # held now (an attribute, not __len__: the pool controller reads it on every dispatch)

    def tiers(self) -> Iterator[str]:
        """Tiers with a held request."""
        return (tier for tier, held in self._by_tier.items() if held)

    def newest(self, tier: str) -> QueuedRequest | None:
        held = self._by_tier.get(tier)
        return held[-1][0] if held else None

    def next_deadline_s(self) -> float | None:
        deadlines = [held[0][0].deadline_s for held in self._by_tier.values() if held]
        return min(deadlines) if deadlines else None

    def hold(self, request: QueuedRequest, fingerprint: int) -> None:
        """Changes state: the request waits until taken, expired or cancelled."""
        self._by_tier.setdefault(request.tier, deque()).append((request, fingerprint))
        self.count += 1

    def take_newest(self, tier: str) -> QueuedRequest:
        """Changes state: the newest held request of `tier` leaves (it was just assigned)."""
        self.count -= 1
        return self._by_tier[tier].pop()[0]

    def expire(self, now_s: float) -> list[tuple[QueuedRequest, int]]:
        """Changes state: the requests at or past their deadline leave, oldest first. A request with
        a client's deadline shorter than its tier's waits until those held before it expire."""
        expired = []
        for held in self._by_tier.values():
            while held and held[0][0].deadline_s <= now_s:
                expired.append(held.popleft())
        self.count -= len(expired)
        return expired

    def cancel(self, request_id: int | str) -> bool:
        """Changes state: the request leaves if held (its client went away)."""
        for held in self._by_tier.values():
            for index, (request, _) in enumerate(held):
                if request.request_id == request_id:
                    del held[index]
                    self.count -= 1
                    return True
        return False

    def take_all(self) -> list[tuple[QueuedRequest, int]]:
        """Changes state: every held request leaves (no replica is left to serve them)."""
        everything = [item for held in self._by_tier.values() for item in held]
        self._by_tier.clear()
        self.count = 0
        return everything
