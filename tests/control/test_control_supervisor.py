"""Worker supervision with real (tiny) child processes: restart on crash, SIGTERM then SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tidegate.control.supervisor import WorkerSpec, WorkerSupervisor


async def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_crashing_worker_is_restarted() -> None:
    crash = WorkerSpec("crash", (sys.executable, "-c", "import sys; sys.exit(3)"))
    supervisor = WorkerSupervisor([crash], first_backoff_s=0.01, max_backoff_s=0.02)
    await supervisor.start()
    try:
        await _wait_for(lambda: supervisor.restarts["crash"] >= 2)
    finally:
        await supervisor.stop()


async def test_stop_kills_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    code = ("import signal, time, pathlib; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(marker)!r}).write_text('up'); time.sleep(60)")
    supervisor = WorkerSupervisor([WorkerSpec("stubborn", (sys.executable, "-c", code))], stop_timeout_s=0.3)
    await supervisor.start()
    await _wait_for(marker.exists)
    process = supervisor._processes["stubborn"]
    await asyncio.wait_for(supervisor.stop(), 10)
    assert process.returncode == -9


async def test_stop_ends_a_well_behaved_worker_with_sigterm(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    code = f"import time, pathlib; pathlib.Path({str(marker)!r}).write_text('up'); time.sleep(60)"
    supervisor = WorkerSupervisor([WorkerSpec("polite", (sys.executable, "-c", code))], stop_timeout_s=5)
    await supervisor.start()
    await _wait_for(marker.exists)
    process = supervisor._processes["polite"]
    await supervisor.stop()
    assert process.returncode == -15
    assert supervisor.restarts["polite"] == 0


async def test_an_unexpected_exit_is_reported_before_the_restart() -> None:
    crash = WorkerSpec("crash", (sys.executable, "-c", "import sys; sys.exit(3)"))
    supervisor = WorkerSupervisor([crash], first_backoff_s=0.01, max_backoff_s=0.02)
    exits: list[tuple[str, int]] = []
    supervisor.on_exit = lambda name: exits.append((name, supervisor.restarts[name]))
    await supervisor.start()
    try:
        await _wait_for(lambda: len(exits) >= 2)
    finally:
        await supervisor.stop()
    assert exits[:2] == [("crash", 0), ("crash", 1)]  # each exit told before its restart was counted


async def test_a_stop_is_not_reported_as_an_exit(tmp_path: Path) -> None:
    code = "import time; time.sleep(60)"
    supervisor = WorkerSupervisor([WorkerSpec("sleeper", (sys.executable, "-c", code))], stop_timeout_s=5)
    exits: list[str] = []
    supervisor.on_exit = exits.append
    await supervisor.start()
    await _wait_for(lambda: supervisor.pid("sleeper") is not None)
    await supervisor.stop_worker("sleeper")
    await supervisor.stop()
    assert exits == []


async def test_an_exit_is_seen_before_it_is_reported_and_the_child_is_still_reaped() -> None:
    supervisor = WorkerSupervisor([WorkerSpec("w", (sys.executable, "-c", "import time; time.sleep(60)"))],
                                  stop_timeout_s=5, first_backoff_s=30)
    await supervisor.start()
    try:
        await _wait_for(lambda: supervisor.pid("w") is not None)
        assert not supervisor.exited("w")
        pid = supervisor.pid("w")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _wait_for(lambda: supervisor.exited("w"))
        await _wait_for(lambda: supervisor.pid("w") is None)  # reaped by asyncio all the same
    finally:
        await supervisor.stop()
