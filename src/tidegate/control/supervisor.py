"""Keeps local worker processes running: start, restart on crash with backoff, stop with the gateway;
and starts or stops one on request (`start_worker`, `stop_worker`: the local autoscaling actuator).
`on_exit`, when set, learns of a worker's unexpected exit at once, before its restart's backoff, so
that the gateway can stop routing to it and promote a warm spare (`gateway/spares.py`). `exited`
asks the kernel directly (waitid with WNOWAIT: the child is not reaped, asyncio still collects it),
for a caller that saw the worker's connections break a moment before the exit is reported.

Stopping sends SIGTERM, then SIGKILL after a timeout. On Linux each child also asks the kernel for
SIGTERM when the gateway dies, so a killed gateway leaves no orphan workers.

A worker that `loads_out_of_traffic` says will load out of traffic (a spare) starts at a lower CPU
priority where `loading_priority` allows it (`control/priority.py`); `restore_priority` gives it the
gateway's priority back when it is promoted to serve, and so does the loading priority's deadline
when it is still loading then (a load the serving workers starve must still end).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

from tidegate.control.priority import LoadingPriority

__all__ = ["WorkerSpec", "WorkerSupervisor"]

log = logging.getLogger("tidegate.supervisor")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _child_setup(loading: LoadingPriority | None) -> Callable[[], None] | None:
    """What the child runs between fork and exec: die with the gateway (Linux), and start at the
    loading priority when `loading` is given."""
    if not sys.platform.startswith("linux"):
        return None
    if loading is None:
        return _die_with_parent

    def setup() -> None:
        _die_with_parent()
        loading.lower_in_child()

    return setup


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    name: str
    argv: tuple[str, ...]


class WorkerSupervisor:
    def __init__(self, specs: list[WorkerSpec], stop_timeout_s: float = 10.0, first_backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, stable_after_s: float = 30.0, held: frozenset[str] = frozenset(),
                 loading_priority: LoadingPriority | None = None) -> None:
        self.specs = specs
        self._held = held  # workers `start` leaves stopped, for `start_worker` to start later
        self._stop_timeout_s = stop_timeout_s
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._stable_after_s = stable_after_s  # a run this long resets the backoff
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self.restarts: dict[str, int] = {spec.name: 0 for spec in specs}
        self.on_exit: Callable[[str], None] | None = None  # a worker exited unexpectedly (its name)
        # asked at each (re)start: will this worker load out of traffic (a spare)? Then it starts at
        # `loading_priority`'s lower priority, until `restore_priority`
        self.loads_out_of_traffic: Callable[[str], bool] | None = None
        self._loading_priority = loading_priority
        self._lowered: set[str] = set()  # workers whose current process runs at the lowered priority

    def pid(self, name: str) -> int | None:
        process = self._processes.get(name)
        return process.pid if process is not None and process.returncode is None else None

    def priority_lowered(self, name: str) -> bool:
        """Whether the worker's current process was started at the lower loading priority and not
        yet restored (changes nothing)."""
        return name in self._lowered

    def restore_priority(self, name: str) -> None:
        """The worker is promoted to serve: its process, every thread, back to the gateway's CPU
        priority (nothing if it was not lowered)."""
        pid = self.pid(name)
        if name not in self._lowered or self._loading_priority is None:
            return
        self._lowered.discard(name)
        if pid is not None:
            self._loading_priority.restore(pid)
            log.info("worker priority restored", extra={"fields": {"worker": name, "pid": pid,
                                                                   "nice": self._loading_priority.base_nice}})

    def _restore_if_still_loading_at_deadline(self, name: str, pid: int) -> asyncio.TimerHandle | None:
        """At the loading priority's deadline, a worker still loading out of traffic (its process
        unchanged, still lowered, `loads_out_of_traffic` still true: not yet a loaded standby) gets
        the gateway's priority back, so that a load the serving workers starve of CPU still ends."""
        deadline_s = self._loading_priority.deadline_s if self._loading_priority is not None else None
        if deadline_s is None:
            return None

        def overdue() -> None:
            if (name in self._lowered and self.pid(name) == pid and self.loads_out_of_traffic is not None
                    and self.loads_out_of_traffic(name)):
                log.warning("worker still loading out of traffic at the deadline: CPU priority restored",
                            extra={"fields": {"worker": name, "pid": pid, "deadline_s": deadline_s}})
                self.restore_priority(name)

        return asyncio.get_running_loop().call_later(deadline_s, overdue)

    def _starts_lowered(self, name: str) -> bool:
        return (self._loading_priority is not None and self._loading_priority.lowers
                and self.loads_out_of_traffic is not None and self.loads_out_of_traffic(name))

    def exited(self, name: str) -> bool:
        """Whether the worker's current process has exited, reported or not (changes nothing)."""
        process = self._processes.get(name)
        if process is None:
            return False
        if process.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped already, its exit not yet delivered to us
            return True
        except (OSError, AttributeError):  # no waitid (not Linux/Unix): the exit will be reported
            return False

    async def start(self) -> None:
        for spec in self.specs:
            if spec.name not in self._held:
                self._launch(spec)

    def _launch(self, spec: WorkerSpec) -> None:
        self._tasks[spec.name] = asyncio.get_running_loop().create_task(self._keep_running(spec))

    def running(self, name: str) -> bool:
        """Kept running (started, or restarting after a crash), not stopped."""
        task = self._tasks.get(name)
        return task is not None and not task.done()

    async def start_worker(self, name: str) -> None:
        """Starts a stopped worker and keeps it running (nothing if it runs)."""
        if not self.running(name) and not self._stopping:
            self._launch(next(spec for spec in self.specs if spec.name == name))

    async def stop_worker(self, name: str) -> None:
        """Stops one worker for good (until `start_worker`): SIGTERM, SIGKILL after the timeout."""
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        process = self._processes.pop(name, None)
        if process is not None and process.returncode is None:
            await self._terminate([process])
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def _keep_running(self, spec: WorkerSpec) -> None:
        loop = asyncio.get_running_loop()
        backoff_s = self._first_backoff_s
        while not self._stopping:
            lowered = self._starts_lowered(spec.name)
            preexec = _child_setup(self._loading_priority if lowered else None)
            try:
                process = await asyncio.create_subprocess_exec(*spec.argv, preexec_fn=preexec)
            except OSError as error:
                log.error("cannot start worker", extra={"fields": {"worker": spec.name, "error": str(error)}})
                process = None
            started_s = loop.time()
            if process is not None:
                self._processes[spec.name] = process
                overdue = None
                if lowered:
                    self._lowered.add(spec.name)
                    overdue = self._restore_if_still_loading_at_deadline(spec.name, process.pid)
                else:  # a process stopped by `stop_worker` while lowered is not seen to exit here
                    self._lowered.discard(spec.name)
                log.info("worker started", extra={"fields": {"worker": spec.name, "pid": process.pid,
                                                             "priority_lowered": lowered}})
                try:
                    returncode = await process.wait()
                finally:
                    if overdue is not None:
                        overdue.cancel()
                self._lowered.discard(spec.name)  # the next process decides anew
                if self._stopping:
                    return
                if self.on_exit is not None:
                    try:
                        self.on_exit(spec.name)
                    except Exception:  # a bug there must not stop the restarts
                        log.exception("worker exit handler failed")
                log.warning("worker exited; restarting",
                            extra={"fields": {"worker": spec.name, "returncode": returncode, "backoff_s": backoff_s}})
            if loop.time() - started_s >= self._stable_after_s:
                backoff_s = self._first_backoff_s
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2.0, self._max_backoff_s)
            self.restarts[spec.name] += 1

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks.values():
            task.cancel()
        await self._terminate([p for p in self._processes.values() if p.returncode is None])
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _terminate(self, running: list[asyncio.subprocess.Process]) -> None:
        for process in running:
            try:
                process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        for process in running:
            try:
                await asyncio.wait_for(process.wait(), self._stop_timeout_s)
            except asyncio.TimeoutError:
                log.warning("worker ignored SIGTERM; killing", extra={"fields": {"pid": process.pid}})
                try:
                    process.kill()
                except ProcessLookupError:
                    pass
                await process.wait()
