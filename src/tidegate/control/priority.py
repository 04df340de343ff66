"""The CPU priority of a worker that loads its model out of traffic (a warm spare, or an autoscaled
pool's standby, being loaded), so that the load takes only the CPU the serving workers leave.

Measured (`bench/chaos.py --only embedded`, docs/chaos.md "A refill at a lower CPU priority"): at
full priority the dead worker's replacement loaded its model for 11-26 s at 0.3-0.65 of a core, and
meanwhile the two serving workers fell from 0.66 to 0.47 (and 0.43 to 0.30) of a core each, so the
pool served below its offered load while a spare that need not hurry was loading.

Why a nice value and not SCHED_IDLE or SCHED_BATCH: SCHED_BATCH keeps the full CFS weight (it only
gives up wakeup preemption), so the load would still take its share. Nice 19 weighs 15 against 1024
for a nice-0 worker: under contention the load gets ~1.5 % of a core, without contention all that is
idle, which is what is wanted; SCHED_IDLE (weight 3) is only a little stricter, and both need the
same right to be undone, so the plainer, visible (`ps`, `top` NI) and portable-to-read one is used.

A load the serving workers starve must still end: a worker still loading out of traffic
`LOADING_DEADLINE_S` after its start gets the gateway's priority back (the supervisor's deadline),
so the pool's next spare is at most that late plus a load at full priority.

A priority lowered must be raised again when the worker is promoted to serve, and raising it needs
CAP_SYS_NICE or an RLIMIT_NICE that allows the gateway's own nice value. `LoadingPriority.detect`
checks that once at start and lowers nothing where it could not be undone (logged): a serving
worker is never left niced. On Linux a nice value belongs to each thread and a new thread takes its
creator's, so the child lowers itself between fork and exec (every thread it makes is lowered), and
the restore sets every thread of the process (`/proc/<pid>/task`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOADING_DEADLINE_S", "LOADING_NICE", "LoadingPriority", "may_restore_nice"]

log = logging.getLogger("tidegate.priority")

LOADING_NICE = 19  # added to the gateway's own nice value (capped at 19) for a worker loading out of traffic
# a worker still loading out of traffic this long after its start gets the gateway's priority back:
# at nice 19 it gets only the CPU the serving workers leave, and under a load that keeps them busy
# that is almost none (bench/spare_refill.py: 0.05 of a core; a refill that loads in 14 s at nice 0
# beside 95 % load still waited at nice 19 when the load ended 105 s later), so the pool would have
# no spare while busy; with the deadline it loaded 39.6 s after the kill
LOADING_DEADLINE_S = 30.0
_CAP_SYS_NICE = 23  # bit of the capability in /proc/self/status CapEff
_MAX_NICE = 19


def _has_cap_sys_nice() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError):
        pass
    return False


def may_restore_nice(base_nice: int) -> bool:
    """Whether this process may set a worker's nice value back down to `base_nice` (its own): with
    CAP_SYS_NICE, or an RLIMIT_NICE soft limit whose ceiling (20 - limit) reaches it. Linux only."""
    if not sys.platform.startswith("linux"):
        return False
    if _has_cap_sys_nice():
        return True
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= base_nice


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:  # exited
        return []


@dataclass(frozen=True, slots=True)
class LoadingPriority:
    """How a worker that loads out of traffic starts (`lower_in_child`), and how it gets the
    gateway's priority back when it is promoted (`restore`). `lowers` False: nothing is changed."""

    base_nice: int  # the gateway's own nice value, which serving workers keep
    lowers: bool
    # a worker still loading this long after its start is restored (the supervisor's deadline); None: never
    deadline_s: float | None = LOADING_DEADLINE_S

    @classmethod
    def detect(cls, may_restore: Callable[[int], bool] = may_restore_nice,
               deadline_s: float | None = LOADING_DEADLINE_S) -> LoadingPriority:
        """Lowers only where the priority can be restored (`may_restore`, injectable for tests)."""
        base = os.getpriority(os.PRIO_PROCESS, 0)
        lowers = base < _MAX_NICE and may_restore(base)
        if lowers:
            log.info("workers loading out of traffic start at a lower CPU priority",
                     extra={"fields": {"nice": min(base + LOADING_NICE, _MAX_NICE), "serving_nice": base}})
        else:
            log.warning("workers loading out of traffic keep the normal CPU priority: it could not be "
                        "restored on promotion (needs CAP_SYS_NICE or RLIMIT_NICE)",
                        extra={"fields": {"serving_nice": base}})
        return cls(base, lowers, deadline_s)

    @property
    def loading_nice(self) -> int:
        return min(self.base_nice + LOADING_NICE, _MAX_NICE) if self.lowers else self.base_nice

    def lower_in_child(self) -> None:
        """Runs in the child between fork and exec: the worker and every thread it starts run at
        `loading_nice`."""
        os.setpriority(os.PRIO_PROCESS, 0, self.loading_nice)

    def restore(self, pid: int) -> None:
        """Sets every thread of `pid` back to `base_nice`. A thread started meanwhile by a thread not
        yet restored took the lowered value: passes repeat until one finds every thread restored."""
        for _ in range(10):
            lowered = 0
            for tid in _threads(pid):
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) != self.base_nice:
                        os.setpriority(os.PRIO_PROCESS, tid, self.base_nice)
                        lowered += 1
                except ProcessLookupError:  # that thread (or the process) ended
                    continue
                except PermissionError:  # the right was lost since `detect`: say so, serve anyway
                    log.error("cannot restore a promoted worker's CPU priority",
                              extra={"fields": {"pid": pid, "thread": tid, "nice": self.base_nice}})
                    return
            if lowered == 0:
                return
        log.warning("worker threads kept appearing at the lowered priority", extra={"fields": {"pid": pid}})
