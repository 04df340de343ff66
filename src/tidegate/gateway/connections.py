"""Client connection limits: head, body and keep-alive timeouts, and a cap on open connections.

Without them a client that opens connections and sends nothing, half a head or half a body holds a
file descriptor forever; enough of them exhaust the process's descriptors, and then every request
fails, `/health` included.

Timers cost the request path two attribute stores per phase change and no clock read: a connection
notes which phase it waits in (`phase`) and zeroes `phase_since`. One sweep per `interval_s` walks
the open connections, stamps a zeroed `phase_since` with its own clock reading, and closes the
connections whose phase has lasted longer than its limit. A limit therefore bites between `limit`
and `limit + 2 * interval_s` after the phase began, never early. Connections whose request is being
handled are never swept: a long stream is normal (slow clients are the write side's business).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidegate.gateway.http import HttpConnection
    from tidegate.telemetry.metrics import GatewayMetrics

__all__ = ["IDLE", "READING_HEAD", "READING_BODY", "CLOSE_REASONS", "DRAIN_IDLE_S", "ConnectionLimits", "ConnectionRegistry",
           "raise_open_file_limit", "connection_cap"]

log = logging.getLogger("tidegate.gateway")

# What a connection waits for while no request of it is being handled. IDLE: the first byte of a
# request, on a new connection or between keep-alive requests.
IDLE, READING_HEAD, READING_BODY = 0, 1, 2
_TIMEOUT_REASONS = ("idle_timeout", "head_timeout", "body_timeout")
# idle_evicted: an idle keep-alive connection closed to make room under the cap; over_capacity: a
# new connection refused with 503 because the cap was reached and no idle one could make room
# write_timeout: a client that read none of its answer for `client_write_timeout_s` (HttpConnection)
CLOSE_REASONS = (*_TIMEOUT_REASONS, "idle_evicted", "over_capacity", "write_timeout")

_LOG_EVERY_S = 10.0  # one log line per reason per this long, with the count
# A connection answered 408 or 503 is half-closed and read until the client closes, or this long, so
# that input still arriving does not turn the answer into a reset. At most this many (an eighth of
# the cap when that is less) linger; past that an answer is followed by a plain close.
_LINGER_S = 2.0
MAX_LINGERING = 256
_RESCAN_IDLE_S = 0.1
# Draining, a keep-alive connection idle this long is closed: past a client's own gap between two
# requests, short beside a drain
DRAIN_IDLE_S = 0.5
# Descriptors kept out of the client cap besides one per upstream slot: listening sockets, log and
# worker pipes, health checks, lingering refusals, library files.
BASE_FD_RESERVE = 256 + MAX_LINGERING


@dataclass(frozen=True)
class ConnectionLimits:
    keepalive_timeout_s: float
    head_timeout_s: float
    body_timeout_s: float
    max_connections: int

    @property
    def sweep_interval_s(self) -> float:
        # a second is precise enough for limits of many seconds; tests configure sub-second ones
        shortest = min(self.keepalive_timeout_s, self.head_timeout_s, self.body_timeout_s)
        return max(0.02, min(1.0, shortest / 4))


class ConnectionRegistry:
    """The open client connections, in opening order; enforces the limits with one periodic sweep."""

    def __init__(self, limits: ConnectionLimits, metrics: GatewayMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._limit_by_phase = (limits.keepalive_timeout_s, limits.head_timeout_s, limits.body_timeout_s)
        self._clock = clock
        self._open: dict[HttpConnection, None] = {}
        self._lingering: dict[HttpConnection, float] = {}  # after their 408 or 503, with since when
        self._max_lingering = min(MAX_LINGERING, 1 + limits.max_connections // 8)
        # idle connections, longest idle last; built when the cap bites
        self._idle_candidates: list[HttpConnection] = []
        self._scanned_at = float("-inf")
        self._closed_counters = None
        if metrics is not None:
            self._closed_counters = {reason: metrics.client_connections_closed.labels(reason)
                                     for reason in CLOSE_REASONS}
            metrics.client_connections_open.set_function(lambda: len(self._open))
        self._unlogged = dict.fromkeys(CLOSE_REASONS, 0)
        self._logged_at = dict.fromkeys(CLOSE_REASONS, float("-inf"))
        self._timer: asyncio.TimerHandle | None = None
        self.draining = False  # shutting down: connections close after their answer

    def __len__(self) -> int:
        return len(self._open)

    # -- connection lifecycle (called by HttpConnection)
    def admit(self, conn: HttpConnection) -> bool:
        """A new connection: True to serve it; False when it was refused with 503."""
        if len(self._open) >= self.limits.max_connections and not self._evict_idle():
            self.record_close("over_capacity")
            conn.refuse(self._may_linger(conn))
            return False
        self._open[conn] = None
        return True

    def forget(self, conn: HttpConnection) -> None:
        self._open.pop(conn, None)
        if self._lingering:
            self._lingering.pop(conn, None)

    def _may_linger(self, conn: HttpConnection) -> bool:
        if len(self._lingering) >= self._max_lingering:
            return False
        self._lingering[conn] = self._clock()
        return True

    def _evict_idle(self) -> bool:
        """Closes the longest-idle keep-alive connection, if any, so that idle clients cannot lock out
        active ones."""
        candidates = self._idle_candidates
        while True:
            while candidates:
                conn = candidates.pop()
                if conn in self._open and conn.phase == IDLE and not conn.handling:
                    del self._open[conn]
                    if conn.time_out(answer=False, linger=False):
                        self.record_close("idle_evicted")
                    return True
            # at most one scan per _RESCAN_IDLE_S: under a flood of new connections with none idle,
            # a refusal costs O(1), not a walk over every open connection
            now = self._clock()
            if now - self._scanned_at < _RESCAN_IDLE_S:
                return False
            self._scanned_at = now
            unstamped = float("inf")  # went idle since the last sweep: the most recently idle
            candidates = [conn for conn in self._open if conn.phase == IDLE and not conn.handling]
            if not candidates:
                return False
            candidates.sort(key=lambda conn: conn.phase_since or unstamped, reverse=True)  # longest idle last
            self._idle_candidates = candidates

    # -- shutdown
    def drain(self) -> None:
        """From now on every connection closes after its answer. An idle keep-alive connection is
        left open for `DRAIN_IDLE_S` more: a client may have sent its next request already, not yet
        read here, and closing with it unread resets the connection, which the client sees as an
        error (`test_a_request_sent_as_the_drain_begins_is_answered`); its answer says
        `connection: close`, and the client reconnects (to the gateway that replaces this one). One
        idle that long is closed by the sweep."""
        self.draining = True
        self._limit_by_phase = (min(self.limits.keepalive_timeout_s, DRAIN_IDLE_S), *self._limit_by_phase[1:])
        now = self._clock()
        for conn in self._open:
            conn.close_after_answer()
            if conn.phase == IDLE and not conn.handling:
                conn.phase_since = now  # the grace is counted from the drain

    # -- the sweep
    def start(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.limits.sweep_interval_s, self._tick)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._log_closes(float("inf"))  # what the rate limit still held back

    def _tick(self) -> None:
        try:
            self.sweep()
        except Exception:  # a bug here must not stop the limits for good
            log.exception("connection sweep failed")
        self._timer = asyncio.get_running_loop().call_later(self.limits.sweep_interval_s, self._tick)

    def sweep(self) -> None:
        now = self._clock()
        limit_by_phase = self._limit_by_phase
        expired: list[HttpConnection] = []
        for conn in self._open:
            if conn.handling:
                continue
            since = conn.phase_since
            if not since:
                conn.phase_since = now  # entered its phase since the last sweep: its clock starts now
            elif now - since > limit_by_phase[conn.phase]:
                expired.append(conn)
        for conn in expired:
            phase = conn.phase
            del self._open[conn]
            answer = phase != IDLE  # a request was begun: 408
            if conn.time_out(answer, linger=answer and self._may_linger(conn)):
                self.record_close(_TIMEOUT_REASONS[phase])
        if self._lingering:
            linger_since = now - _LINGER_S
            done = [conn for conn, since in self._lingering.items() if since < linger_since]
            for conn in done:
                del self._lingering[conn]
                conn.abort()
        self._idle_candidates = []  # idle times changed: the next bite scans afresh
        self._log_closes(now)

    # -- accounting
    def record_close(self, reason: str) -> None:
        """Counts a connection closed or refused by a limit (one of CLOSE_REASONS); logged by the sweep."""
        self._unlogged[reason] += 1
        if self._closed_counters is not None:
            self._closed_counters[reason].inc()

    def _log_closes(self, now: float) -> None:
        """One line per reason per _LOG_EVERY_S, with how many: a flood must not flood the log too."""
        for reason, count in self._unlogged.items():
            if count and now - self._logged_at[reason] >= _LOG_EVERY_S:
                self._unlogged[reason] = 0
                self._logged_at[reason] = now
                log.warning("client connections closed", extra={"fields": {
                    "reason": reason, "count": count, "open": len(self._open),
                    "max_connections": self.limits.max_connections}})


def raise_open_file_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit; returns the soft limit in force (0: unknown).

    Many systems start processes at a soft limit of 1,024 descriptors while allowing far more."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft if soft != resource.RLIM_INFINITY else wanted
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):  # e.g. macOS refuses more than its OPEN_MAX
        return soft
    return wanted


def connection_cap(configured: int, upstream_slots: int, open_file_limit: int) -> int:
    """`max_connections`, lowered so that clients cannot take the descriptors that upstream
    connections (one per request in flight) and the process itself need."""
    if open_file_limit <= 0:
        return configured
    fits = open_file_limit - BASE_FD_RESERVE - upstream_slots
    cap = min(configured, max(fits, 16))
    if cap < configured:
        log.warning("max_connections lowered to fit the open file limit", extra={"fields": {
            "max_connections": configured, "lowered_to": cap, "open_file_limit": open_file_limit,
            "reserved": BASE_FD_RESERVE + upstream_slots}})
    return cap
