"""Late-binding dispatch: a request leaves the gateway's wait queue only when a replica has a free slot.

`ModelPool.acquire` takes a slot on the replica the routing policy picks, or waits in the pool's
`FifoWaitQueue` until `release` (or a replica turning healthy) frees one. That is the body with overload
control off (FIFO, static slot limits). With it on, the pool's controller (`policy/pool.py`) decides
who waits and where each request goes; `ModelPool.controlled` hands it every capacity change.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from tidegate.errors import OverloadedError
from tidegate.gateway.failover import FailoverPolicy
from tidegate.gateway.scrub import SecretScrubber
from tidegate.gateway.upstream import ConnectionPool
from tidegate.policy.health import CLOSED_BREAKER, Breaker, BreakerPolicy, BreakerState, median
from tidegate.policy.retry import RetryBudget, RetryBudgetPolicy
from tidegate.policy.routing import any_routable, pick_replica
from tidegate.types import ReplicaHealth, ReplicaLoad

__all__ = ["Replica", "Waiter", "FifoWaitQueue", "ModelPool"]

log = logging.getLogger("tidegate.dispatch")


class Replica:
    """One backend replica as the runtime sees it; satisfies policy.routing.RoutableReplica."""

    __slots__ = ("replica_id", "pool_name", "health", "breaker", "outstanding", "slot_limit", "load",
                 "connections", "upstream_model", "auth_header", "scrubber", "health_url", "scrape_url",
                 "request_heads", "forward_priority", "extra_headers")

    def __init__(
        self,
        replica_id: str,
        pool_name: str,
        connections: ConnectionPool,
        slot_limit: int,
        upstream_model: str,
        api_key: str | None,
        health_url: str | None,
        scrape_url: str | None = None,
        forward_priority: bool = False,
        extra_headers: bytes = b"",
    ) -> None:
        self.replica_id = replica_id
        self.pool_name = pool_name
        # a replica without an active check is trusted until requests to it fail
        self.health = ReplicaHealth.UNKNOWN if health_url else ReplicaHealth.HEALTHY
        self.breaker: Breaker = CLOSED_BREAKER
        self.outstanding = 0
        self.slot_limit = slot_limit
        self.load = ReplicaLoad()
        self.connections = connections
        self.upstream_model = upstream_model
        self.auth_header = f"authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        # the key's forms, found once here, to keep it out of what the upstream's answers carry back
        self.scrubber = SecretScrubber(api_key) if api_key else None
        self.health_url = health_url
        self.scrape_url = scrape_url  # engine /metrics with running/waiting/KV gauges, if any
        self.request_heads: dict[str, bytes] = {}  # API path -> request line and fixed headers
        self.forward_priority = forward_priority  # the engine schedules by the body's `priority` field
        self.extra_headers = extra_headers  # b"name: value\r\n" lines sent with every request

    def request_head(self, api_path: str) -> bytes:
        head = self.request_heads.get(api_path)
        if head is None:
            endpoint = self.connections.endpoint
            head = self.request_heads[api_path] = (
                b"POST " + endpoint.base_path + api_path.encode() + b" HTTP/1.1\r\nhost: " + endpoint.host_header
                + b"\r\ncontent-type: application/json\r\n" + self.auth_header + self.extra_headers
            )
        return head


class Waiter:
    __slots__ = ("future", "exclude")

    def __init__(self, future: asyncio.Future[Replica], exclude: Collection[str]) -> None:
        self.future = future
        self.exclude = exclude


class FifoWaitQueue:
    """The FIFO body's queue (overload control off); with it on, the pool's controller queues."""

    def __init__(self) -> None:
        self._waiters: deque[Waiter] = deque()

    def push(self, waiter: Waiter) -> None:
        self._waiters.append(waiter)

    def peek(self) -> Waiter | None:
        return self._waiters[0] if self._waiters else None

    def pop(self) -> Waiter:
        return self._waiters.popleft()

    def remove(self, waiter: Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def drain(self) -> list[Waiter]:
        """Removes and returns every waiter (none will be served)."""
        waiters = list(self._waiters)
        self._waiters.clear()
        return waiters

    def __len__(self) -> int:
        return len(self._waiters)


class ModelPool:
    def __init__(
        self,
        name: str,
        replicas: list[Replica],
        breaker_policy: BreakerPolicy,
        max_queued: int,
        queue_timeout_s: float,
        retry_after_s: int,
        retry_budget: RetryBudgetPolicy = RetryBudgetPolicy(),
        created_s: float = 0.0,
    ) -> None:
        self.name = name
        self.replicas = replicas
        self.breaker_policy = breaker_policy
        self.queue = FifoWaitQueue()
        self._max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self._retry_after_s = retry_after_s
        self._cursor = 0
        self.retry_budget = RetryBudget(retry_budget)  # retries on another replica, per pool
        self._released_s = created_s  # when a slot was last given back: a queue with no release is stuck
        self.ejections: Any = None  # the gateway's ejection counter (pool, replica, reason), once it has one
        self.failover = FailoverPolicy()  # mid-stream failover (gateway/failover.py); the config sets it
        # overload control's body of this pool's controller (`overload._PoolBody.wake`): it owns the
        # queue and the slots then, and a health change wakes it instead of the FIFO queue
        self.controlled: Callable[[float], None] | None = None

    def ready(self, now_s: float) -> bool:
        """Can take work: some replica is routable, and waiting requests are not stuck behind slots
        that nobody has given back for a whole queue timeout."""
        if not any_routable(self.replicas, now_s):
            return False
        return not len(self.queue) or now_s - self._released_s < self._queue_timeout_s

    def try_acquire(self, now_s: float, exclude: Collection[str] = ()) -> Replica | None:
        if len(self.queue):
            return None  # those already waiting go first
        return self._take(now_s, exclude)

    def _take(self, now_s: float, exclude: Collection[str]) -> Replica | None:
        choice = pick_replica(self.replicas, now_s, self._cursor, exclude)
        self._cursor = choice.next_cursor
        if choice.index is None:
            return None
        replica = self.replicas[choice.index]
        replica.outstanding += 1
        if replica.breaker.state is not BreakerState.CLOSED:
            replica.breaker = replica.breaker.on_dispatch(now_s)  # the probe of an ejected replica
        return replica

    async def acquire(self, now_s: float, exclude: Collection[str] = ()) -> Replica:
        replica = self.try_acquire(now_s, exclude)
        if replica is not None:
            return replica
        if not any_routable(self.replicas, now_s, exclude):
            raise self.no_replica_error()
        if len(self.queue) >= self._max_queued:
            raise OverloadedError(f"model {self.name!r} is overloaded: queue full",
                                  code="queue_full", retry_after_s=self._retry_after_s)
        loop = asyncio.get_running_loop()
        waiter = Waiter(loop.create_future(), exclude)
        self.queue.push(waiter)
        timer = loop.call_later(self._queue_timeout_s, self._expire, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self.queue.remove(waiter)
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(waiter.future.result(), now_s)  # handed a slot just as the client left
            raise
        finally:
            timer.cancel()

    def _expire(self, waiter: Waiter) -> None:
        self.queue.remove(waiter)
        if not waiter.future.done():
            waiter.future.set_exception(OverloadedError(
                f"model {self.name!r} is overloaded: no replica slot freed in time",
                code="queue_timeout", retry_after_s=self._retry_after_s))

    def release(self, replica: Replica, now_s: float) -> None:
        replica.outstanding -= 1
        self._released_s = now_s
        if len(self.queue):
            self.dispatch_waiting(now_s)

    def dispatch_waiting(self, now_s: float) -> None:
        """Hand free slots to waiters in queue order; called on release and on health changes.

        With no routable replica left, every waiter is refused at once: waiting out its deadline
        for a replica that is down or ejected only makes the refusal late."""
        if self.controlled is not None:
            self.controlled(now_s)
            return
        queue = self.queue
        if len(queue) and not any_routable(self.replicas, now_s):
            self._refuse_all()
            return
        while len(queue):
            waiter = queue.peek()
            if waiter is None:
                return
            if waiter.future.done():
                queue.pop()
                continue
            replica = self._take(now_s, waiter.exclude)
            if replica is None:
                if not any_routable(self.replicas, now_s, waiter.exclude):
                    queue.pop()
                    waiter.future.set_exception(self.no_replica_error())
                    continue
                return
            queue.pop()
            waiter.future.set_result(replica)

    def _refuse_all(self) -> None:
        for waiter in self.queue.drain():
            if not waiter.future.done():
                waiter.future.set_exception(self.no_replica_error())

    def no_replica_error(self) -> OverloadedError:
        return OverloadedError(f"no replica of model {self.name!r} is available: every replica is down or "
                               "ejected; retry later", code="no_replica", retry_after_s=self._retry_after_s)

    def record_success(self, replica: Replica, now_s: float, sent_s: float) -> None:
        """A request sent to `replica` at `sent_s` succeeded."""
        replica.breaker = replica.breaker.on_success(now_s, sent_s, self.breaker_policy)

    def record_failure(self, replica: Replica, now_s: float, sent_s: float) -> None:
        """A request sent to `replica` at `sent_s` failed (no answer, or a 5xx): may eject it."""
        policy = self.breaker_policy
        ejected = sum(1 for other in self.replicas if not other.breaker.admits(now_s))
        may_eject = ejected < max(1, int(len(self.replicas) * policy.max_ejected_fraction))
        pool_ratio = median([other.breaker.failure_ratio for other in self.replicas if other is not replica])
        self.adopt_breaker(replica, replica.breaker.on_failure(now_s, sent_s, policy, may_eject, pool_ratio))

    def adopt_breaker(self, replica: Replica, breaker: Breaker) -> None:
        """Sets the replica's breaker (this pool's, or its controller's); a new ejection is logged and
        counted with its reason (`tidegate_replica_ejections_total`)."""
        before = replica.breaker
        replica.breaker = breaker
        if breaker.ejected_s > before.ejected_s and breaker.reason is not None:
            reason = breaker.reason.value
            log.warning("replica ejected", extra={"fields": {
                "pool": self.name, "replica": replica.replica_id, "reason": reason,
                "consecutive_failures": breaker.consecutive_failures,
                "failure_ratio": round(breaker.failure_ratio, 3), "cooldown_s": breaker.cooldown_s}})
            if self.ejections is not None:
                self.ejections.labels(self.name, replica.replica_id, reason).inc()
