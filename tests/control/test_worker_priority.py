"""A worker that loads out of traffic starts at a lower CPU priority and gets the gateway's back when
promoted (`control/priority.py`), with real child processes; whether the priority could be restored
is the injectable `may_restore`, the OS calls are real."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tidegate.control.priority import LOADING_NICE, LoadingPriority
from tidegate.control.supervisor import WorkerSpec, WorkerSupervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values via /proc")

BASE_NICE = os.getpriority(os.PRIO_PROCESS, 0)
LOWERED_NICE = min(BASE_NICE + LOADING_NICE, 19)
CAN_RESTORE = LoadingPriority.detect().lowers  # this test process may set a nice value back down


def _worker(marker: Path, threads: int) -> WorkerSpec:
    """A child that starts `threads` threads (they take its nice value), says so, and waits."""
    code = ("import pathlib, threading, time\n"
            f"for _ in range({threads}): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            f"pathlib.Path({str(marker)!r}).write_text('up')\n"
            "time.sleep(60)\n")
    return WorkerSpec("w", (sys.executable, "-c", code))


def _thread_nices(pid: int) -> list[int]:
    return [os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


async def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _started(supervisor: WorkerSupervisor, marker: Path) -> int:
    await supervisor.start()
    await _wait_for(marker.exists)
    pid = supervisor.pid("w")
    assert pid is not None
    return pid


@pytest.mark.skipif(not CAN_RESTORE, reason="needs CAP_SYS_NICE or RLIMIT_NICE to restore the priority")
async def test_a_promoted_spare_has_every_thread_back_at_the_gateways_priority(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    supervisor = WorkerSupervisor([_worker(marker, threads=3)],
                                  loading_priority=LoadingPriority.detect(may_restore=lambda _base: True))
    supervisor.loads_out_of_traffic = lambda name: True
    try:
        pid = await _started(supervisor, marker)
        assert _thread_nices(pid) == [LOWERED_NICE] * 4 and supervisor.priority_lowered("w")
        supervisor.restore_priority("w")
        assert _thread_nices(pid) == [BASE_NICE] * 4  # the threads too, not only the main one
        assert not supervisor.priority_lowered("w")
    finally:
        await supervisor.stop()


async def test_nothing_is_lowered_where_it_could_not_be_restored(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    loading = LoadingPriority.detect(may_restore=lambda _base: False)
    supervisor = WorkerSupervisor([_worker(marker, threads=1)], loading_priority=loading)
    supervisor.loads_out_of_traffic = lambda name: True
    try:
        pid = await _started(supervisor, marker)
        assert not loading.lowers
        assert _thread_nices(pid) == [BASE_NICE] * 2 and not supervisor.priority_lowered("w")
    finally:
        await supervisor.stop()


async def test_a_worker_restarted_to_serve_starts_at_the_gateways_priority(tmp_path: Path) -> None:
    """The restart without a spare (`gateway/spares.py`: no spare loaded, the dead worker comes back
    to serve) is not slowed: only a worker that loads out of traffic is lowered."""
    marker = tmp_path / "up"
    supervisor = WorkerSupervisor([_worker(marker, threads=1)], first_backoff_s=0.01,
                                  loading_priority=LoadingPriority.detect(may_restore=lambda _base: True))
    out_of_traffic = [True]
    supervisor.loads_out_of_traffic = lambda name: out_of_traffic[0]
    try:
        first = await _started(supervisor, marker)
        assert supervisor.priority_lowered("w") and _thread_nices(first) == [LOWERED_NICE] * 2
        marker.unlink()
        out_of_traffic[0] = False  # it died with no spare to take over: it restarts to serve
        os.kill(first, 9)
        await _wait_for(lambda: marker.exists() and supervisor.pid("w") not in (None, first))
        second = supervisor.pid("w")
        assert second is not None
        assert _thread_nices(second) == [BASE_NICE] * 2 and not supervisor.priority_lowered("w")
    finally:
        await supervisor.stop()


@pytest.mark.skipif(not CAN_RESTORE, reason="needs CAP_SYS_NICE or RLIMIT_NICE to restore the priority")
async def test_a_worker_still_loading_at_the_deadline_gets_the_gateways_priority_back(tmp_path: Path) -> None:
    """Serving workers that keep the cores busy starve a nice-19 load: past the deadline it loads at
    the gateway's priority, so that the pool gets its spare back while busy."""
    marker = tmp_path / "up"
    supervisor = WorkerSupervisor([_worker(marker, threads=2)], loading_priority=LoadingPriority.detect(
        may_restore=lambda _base: True, deadline_s=0.3))
    supervisor.loads_out_of_traffic = lambda name: True  # still WARMING: never answered a health check
    try:
        pid = await _started(supervisor, marker)
        assert _thread_nices(pid) == [LOWERED_NICE] * 3 and supervisor.priority_lowered("w")
        await _wait_for(lambda: _thread_nices(pid) == [BASE_NICE] * 3)
        assert not supervisor.priority_lowered("w")
    finally:
        await supervisor.stop()


async def test_a_loaded_standby_keeps_the_lower_priority_past_the_deadline(tmp_path: Path) -> None:
    """The deadline is for a load that does not end: a standby that has loaded (no longer WARMING)
    waits idle at the lower priority until it is promoted."""
    marker = tmp_path / "up"
    supervisor = WorkerSupervisor([_worker(marker, threads=1)], loading_priority=LoadingPriority.detect(
        may_restore=lambda _base: True, deadline_s=0.1))
    asked = []
    # asked at its start: it will load out of traffic; asked again at the deadline: it has loaded
    # (its first good health check made it a STANDBY)
    supervisor.loads_out_of_traffic = lambda name: asked.append(name) or len(asked) == 1
    try:
        pid = await _started(supervisor, marker)
        await _wait_for(lambda: len(asked) >= 2)  # the deadline came
        assert _thread_nices(pid) == [LOWERED_NICE] * 2 and supervisor.priority_lowered("w")
    finally:
        await supervisor.stop()
