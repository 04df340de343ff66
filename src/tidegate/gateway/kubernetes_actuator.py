"""The Kubernetes actuator: the scale loop's desired count written to a workload's scale subresource
through the official client (`control.kubernetes_scaler`), and, for a StatefulSet whose pods the
pool lists in ordinal order, a scale-in drained first and warm standbys kept (docs/autoscaling.md,
"The Kubernetes actuator")."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

from tidegate.types import ReplicaHealth

__all__ = ["KubernetesActuator", "DRAIN_RETRY_S"]

log = logging.getLogger("tidegate.scaling")

# after the API refused a drained scale-in, the next waits this long: each try takes pods out of
# traffic until they are empty, and under a lasting refusal (RBAC) they would leave it every tick
DRAIN_RETRY_S = 60.0


class KubernetesActuator:
    """Writes the desired count to a workload's scale (`control.kubernetes_scaler`, the official
    client, in a thread: its calls block) and reads its ready replicas back. One call at a time; a
    count decided meanwhile is written by the next. The API's refusals are logged once each, with
    what to fix, and the gateway keeps serving.

    When the pool lists a StatefulSet's pods in ordinal order (`ordinals`: backend i is pod i), the
    gateway knows which pods a count keeps, since Kubernetes removes the highest ordinals first:
    - the first `serving` pods take traffic; the next `standby` are kept loaded and out of traffic
      (`WARMING` until their health checks answer, then `STANDBY`), and a scale-out promotes them
      at once (seconds instead of a pod's cold start) while the count written grows to refill them;
    - a scale-in drains first: the pods leaving traffic take no new request (`DRAINING`) and the
      lower count is written only once they hold none (or the drain timeout), so no request is cut
      by a pod's end; drained pods within the new count become the standbys, the rest `STOPPED` (not
      health-checked: a terminating pod that still answers must not get traffic again).
    Without `ordinals` (a Deployment: which pod goes is its controller's choice) the count is written
    as decided (tests/gateway/test_kubernetes_actuator.py)."""

    def __init__(self, scaler: Any, ordinals: list[Any] | None = None, wake: Callable[[], None] | None = None,
                 *, standby: int = 0, drain_timeout_s: float = 600.0) -> None:
        self._scaler = scaler
        self._ordinals = ordinals
        self._standby = standby if ordinals is not None else 0
        self._wake = wake or (lambda: None)  # tells the pool's dispatch that health changed
        self._drain_timeout_s = drain_timeout_s
        self._written: int | None = None  # the count last written, or read before the first write
        self._serving: int | None = None  # ordinals: the pods in traffic (the first ones)
        self._state: Any | None = None  # the last ScaleState read
        self._busy = False
        self._last_error: str | None = None
        self._drain_refused_s = -math.inf  # when the API last refused a drained scale-in (loop time)
        self._draining: list[Any] | None = None  # pods a scale-in drains, until its count is written
        self._drain_target = 0  # the serving count that scale-in goes to

    def starting(self) -> int:
        """Replicas asked to serve and not ready yet."""
        if self._ordinals is not None and self._serving is not None:
            return sum(1 for replica in self._ordinals[:self._serving] if replica.health is ReplicaHealth.UNKNOWN)
        return 0 if self._state is None else max(0, self._state.wanted - self._state.ready)

    def apply(self, desired: int) -> None:
        """Starts one write-and-read (on ordinals: the standbys promoted, or a drain first) unless one
        is under way (changes state: replicas' health)."""
        loop = asyncio.get_running_loop()
        serving = self._serving
        scale_in = self._ordinals is not None and serving is not None and desired < serving
        if self._busy:
            if self._draining is not None and desired > self._drain_target:
                self._call_off_drain()
            return
        if scale_in and loop.time() - self._drain_refused_s < DRAIN_RETRY_S:
            return
        self._busy = True
        if self._ordinals is None:
            work = asyncio.to_thread(self._sync, desired)
        elif serving is None:  # the count the workload has, before any is written: nothing is drained blind
            work = self._first_read()
        elif scale_in:
            work = self._drain_then_scale(desired, self._take_out_of_traffic(desired))
        else:
            self._scale_out(desired)
            work = asyncio.to_thread(self._sync, self._count(desired))
        loop.create_task(work).add_done_callback(self._done)

    def _sync(self, count: int) -> tuple[int | None, Any]:
        written = self._scaler.scale_to(count) if count != self._written else self._written
        return written, self._scaler.state()

    def _count(self, serving: int) -> int:
        assert self._ordinals is not None
        return min(len(self._ordinals), serving + self._standby)

    async def _first_read(self) -> tuple[int | None, Any]:
        """The workload's count as it is: its pods serve, the listed ones past it are stopped
        (changes state)."""
        assert self._ordinals is not None
        state = await asyncio.to_thread(self._scaler.state)
        for replica in self._ordinals[state.wanted:]:
            replica.health = ReplicaHealth.STOPPED
        self._serving = min(state.wanted, len(self._ordinals))
        self._wake()
        return state.wanted, state

    def _scale_out(self, desired: int) -> None:
        """Standbys up to `desired` promoted at once, stopped pods asked for, and the pods past them
        to load as standbys, before the count that covers them is written (changes state)."""
        assert self._ordinals is not None and self._serving is not None
        changed = False
        for index in range(self._serving, self._count(desired)):
            replica = self._ordinals[index]
            was = replica.health
            if index < desired:
                if was is ReplicaHealth.STANDBY:
                    replica.health = ReplicaHealth.HEALTHY  # loaded already: routable now
                    log.info("standby takes traffic", extra={"fields": {"replica": replica.replica_id}})
                elif was in (ReplicaHealth.STOPPED, ReplicaHealth.WARMING):
                    replica.health = ReplicaHealth.UNKNOWN  # its health checks take it in once its pod answers
            elif was is ReplicaHealth.STOPPED:
                replica.health = ReplicaHealth.WARMING  # a standby once its pod answers
            changed = changed or replica.health is not was
        self._serving = desired
        if changed:
            self._wake()

    def _take_out_of_traffic(self, desired: int) -> list[Any]:
        """The serving pods past `desired`, now draining (changes state)."""
        assert self._ordinals is not None and self._serving is not None
        leaving = self._ordinals[desired:self._serving]
        for replica in leaving:
            replica.health = ReplicaHealth.DRAINING
        self._draining, self._drain_target = leaving, desired
        self._wake()
        return leaving

    def _call_off_drain(self) -> None:
        """A scale-out decided while a scale-in still drains, its count not written: the draining
        pods go back in traffic at once (their pods still run) and nothing is written; the next tick
        scales out from the count as it stands (changes state). Else a surge would wait for the
        drain's longest request, up to the drain timeout."""
        assert self._draining is not None
        for replica in self._draining:
            if replica.health is ReplicaHealth.DRAINING:
                replica.health = ReplicaHealth.HEALTHY
        log.info("scale-in called off", extra={"fields": {"replicas": [r.replica_id for r in self._draining]}})
        self._draining = None
        self._wake()

    async def _drain_then_scale(self, desired: int, leaving: list[Any]) -> tuple[int | None, Any]:
        """Once `leaving` hold no request, the count without them is written; they become the
        standbys it keeps, the pods past it stop (changes state)."""
        assert self._ordinals is not None
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + self._drain_timeout_s
        while (self._draining is leaving and any(replica.outstanding > 0 for replica in leaving)
               and loop.time() < deadline_s):
            await asyncio.sleep(0.05)
        if self._draining is not leaving:  # called off by a scale-out: nothing written
            return self._written, self._state
        self._draining = None  # the write goes out: past calling off
        count = self._count(desired)
        try:
            result = await asyncio.to_thread(self._sync, count)
        except Exception:
            for replica in leaving:  # the count stands: back in traffic once they answer their checks
                replica.health = ReplicaHealth.UNKNOWN
            self._drain_refused_s = loop.time()
            self._wake()
            raise
        for index in range(desired, len(self._ordinals)):
            replica = self._ordinals[index]
            if index >= count:
                replica.health = ReplicaHealth.STOPPED  # its pod ends
            elif replica.health is ReplicaHealth.DRAINING:
                replica.health = ReplicaHealth.STANDBY  # loaded and answering: kept rather than refilled
        self._serving = desired
        log.info("replicas drained and scaled in", extra={"fields": {
            "replicas": [replica.replica_id for replica in leaving], "count": count,
            "still_held": sum(replica.outstanding for replica in leaving)}})
        return result

    def _done(self, task: asyncio.Task) -> None:
        self._busy = False
        error = task.exception()
        if error is None:
            self._written, self._state = task.result()
            self._last_error = None
        elif str(error) != self._last_error:
            self._last_error = str(error)
            log.error("cannot scale", extra={"fields": {"error": str(error)}})
