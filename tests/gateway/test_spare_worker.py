"""A warm spare: an embedded pool of two workers, one serving and one loaded out of traffic
(`spare: 1`). When the serving worker's process is killed, the spare takes the traffic while the
killed worker is still restarting (no model load waited for), the restarted worker becomes the new
spare, and the requests sent after the kill are all served."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_harness import StreamingLoad, wait_for  # noqa: E402
from support import free_port, start_process, tidegate_argv  # noqa: E402

from tidegate.control.priority import LoadingPriority  # noqa: E402

MODEL = "tiny-random-llama"

pytestmark = pytest.mark.slow


def _replicas(base: str) -> list[dict]:
    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as response:
        return json.loads(response.read())["pools"][0]["replicas"]


def _health(base: str) -> list[str]:
    return [replica["health"] for replica in _replicas(base)]


def _worker_pid(gateway_pid: int, replica_id: str) -> int:
    """The engine process serving `replica_id` (its port is in the id and on its command line)."""
    port = replica_id.rsplit(":", 1)[1]
    children = Path(f"/proc/{gateway_pid}/task/{gateway_pid}/children").read_text().split()
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1].decode() == port:
            return int(pid)
    raise LookupError(f"no worker process for {replica_id}")


def _thread_nices(pid: int) -> set[int]:
    """The nice values of the process's threads (a nice value is per thread on Linux)."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the worker's process in /proc")
def test_a_spare_takes_the_traffic_of_a_killed_worker_before_it_restarts(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = {"server": {"port": port, "access_log": False}, "health": {"interval_s": 0.5},
              "pools": [{"name": MODEL, "spare": 1,
                         "backends": [{"type": "embedded", "model": MODEL, "count": 2, "threads": 1,
                                       "slot_limit": 2}]}]}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"{base}/ready", timeout_s=240)
    try:
        assert wait_for(lambda: _health(base) == ["healthy", "standby"], 120), _replicas(base)
        serving, spare = (replica["replica"] for replica in _replicas(base))
        # the spare loaded at a lower CPU priority where the gateway may restore it (control/priority.py)
        priority = LoadingPriority.detect()  # the gateway inherits this process's nice value and rights
        assert _thread_nices(_worker_pid(gateway.pid, serving)) == {priority.base_nice}
        assert _thread_nices(_worker_pid(gateway.pid, spare)) == {priority.loading_nice}
        with StreamingLoad(base, MODEL, clients=2, max_tokens=8, ignore_eos=True) as load:
            assert wait_for(lambda: len(load.answered) >= 4, 60), load.failed[:3]
            os.kill(_worker_pid(gateway.pid, serving), signal.SIGKILL)
            killed_s = time.monotonic()
            # the spare serves while the killed worker is still loading again out of traffic
            taken: list[list[str]] = []
            assert wait_for(lambda: taken.append(_health(base)) or taken[-1] == ["warming", "healthy"], 30,
                            every_s=0.05), taken[-5:]
            taken_s = time.monotonic() - killed_s
            assert _thread_nices(_worker_pid(gateway.pid, spare)) == {priority.base_nice}  # promoted: full priority
            answered_at_takeover = len(load.answered)
            assert wait_for(lambda: len(load.answered) >= answered_at_takeover + 4, 60), load.failed[-3:]
            # the restarted worker becomes the new spare
            assert wait_for(lambda: _health(base) == ["standby", "healthy"], 120), _replicas(base)
            assert _thread_nices(_worker_pid(gateway.pid, serving)) == {priority.loading_nice}  # the refill
            served_since_takeover = len(load.answered) - answered_at_takeover
        assert served_since_takeover >= 4
        # only the requests the killed worker held may fail (two clients: two at most)
        assert len(load.failed) <= 2, load.failed[:3]
        print(f"spare serving {taken_s:.1f} s after the kill; failed {len(load.failed)}, "
              f"answered {len(load.answered)}")
    finally:
        gateway.stop(timeout_s=40)
