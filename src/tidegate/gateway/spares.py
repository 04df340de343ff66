"""Warm spares: embedded workers kept loaded and out of traffic (`pools[].spare`, or an autoscaled
pool's `autoscale.standby`), so that a worker whose process dies is replaced at once rather than
after a restart and a model load (seconds to tens of seconds, the pool a worker short meanwhile).

The supervisor reports the exit as it happens (`WorkerSupervisor.on_exit`). The dead worker leaves
traffic at once (it would otherwise stay routable until its health checks failed), a loaded spare
takes its place, and the dead worker, restarting, loads out of traffic to become the next spare
(WARMING, then STANDBY on its first good health check). With no spare loaded the dead worker comes
back to serve (UNKNOWN until its first good check), as without spares.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from tidegate.types import ReplicaHealth

__all__ = ["replace_dead_worker"]

log = logging.getLogger("tidegate.spares")

_SERVING = (ReplicaHealth.HEALTHY, ReplicaHealth.UNKNOWN, ReplicaHealth.UNHEALTHY)


def replace_dead_worker(replicas: Iterable[Any], replica_id: str) -> bool:
    """The worker of `replica_id` exited: out of traffic, a loaded spare promoted in its place (changes
    replicas' health). True when traffic changed (the pool's dispatch should be woken)."""
    replicas = list(replicas)
    dead = next((r for r in replicas if r.replica_id == replica_id), None)
    if dead is None or dead.health in (ReplicaHealth.DRAINING, ReplicaHealth.STOPPED):
        return False  # an actuator is stopping it: not a crash to make up for
    if dead.health not in _SERVING:
        dead.health = ReplicaHealth.WARMING  # a spare died: it loads again before it counts as one
        return False
    spare = next((r for r in replicas if r.health is ReplicaHealth.STANDBY), None)
    if spare is None:
        dead.health = ReplicaHealth.UNKNOWN  # out of traffic until its restart answers a health check
        log.warning("worker died; no spare loaded", extra={"fields": {"replica": replica_id}})
        return True
    spare.health = ReplicaHealth.HEALTHY  # loaded already: routable now
    dead.health = ReplicaHealth.WARMING  # restarting: the next spare once loaded
    log.warning("worker died; spare takes its traffic", extra={"fields": {"replica": replica_id,
                                                                        "spare": spare.replica_id}})
    return True
