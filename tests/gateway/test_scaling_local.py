"""The local actuator: an embedded pool of two workers that autoscales between one and two. Under
load the gateway starts the second worker (a real engine process) and routes to it once ready;
after the load it drains it and stops its process. Every request is answered: no scale-in aborts
one."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_harness import StreamingLoad, wait_for  # noqa: E402
from support import ManagedProcess, free_port, start_process, tidegate_argv  # noqa: E402

MODEL = "tiny-random-llama"

pytestmark = pytest.mark.slow


def _status(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as response:
        return json.loads(response.read())["pools"][0]


def _health(base: str) -> list[str]:
    return [replica["health"] for replica in _status(base)["replicas"]]


def _engine_pids(gateway_pid: int) -> set[int]:
    """The gateway's child engine processes, from /proc (Linux)."""
    children = Path(f"/proc/{gateway_pid}/task/{gateway_pid}/children")
    return {int(pid) for pid in children.read_text().split()} if children.exists() else set()


def _serve(tmp_path: Path, workers: int, standby: int) -> tuple[str, ManagedProcess]:
    port = free_port()
    config = {"server": {"port": port, "access_log": False},
              "health": {"interval_s": 0.5},
              "overload_control": False,  # FIFO: every request waits for its turn, none is refused
              "pools": [{"name": MODEL,
                         "backends": [{"type": "embedded", "model": MODEL, "count": workers,
                                       "threads": 1, "slot_limit": 2}],
                         "autoscale": {"min_replicas": 1, "max_replicas": 2, "tick_s": 0.5, "stable_window_s": 2,
                                       "panic_window_s": 1, "scale_down_window_s": 2, "standby": standby}}]}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"http://127.0.0.1:{port}/ready",
                            timeout_s=240)
    return f"http://127.0.0.1:{port}", process


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ManagedProcess]]:
    base, process = _serve(tmp_path_factory.mktemp("local-scaling"), workers=2, standby=0)
    try:
        yield base, process
    finally:
        process.stop(timeout_s=40)


def test_a_warm_standby_takes_traffic_at_once_and_is_refilled(tmp_path: Path) -> None:
    """Three workers, one serving and one standby: a scale-out makes the standby serve within a
    tick or two (no cold start), the third starts as the new standby (loaded once the cores are
    free); the scale-in drains the second and stops it (the standby is full), and no request fails."""
    base, process = _serve(tmp_path, workers=3, standby=1)
    try:
        assert wait_for(lambda: _health(base) == ["healthy", "standby", "stopped"], 120), _status(base)
        with StreamingLoad(base, MODEL, clients=6, max_tokens=16, ignore_eos=True) as load:
            assert wait_for(lambda: _gauge(base, "tidegate_desired_replicas") == 2.0, 30)
            asked_s = time.monotonic()
            assert wait_for(lambda: _health(base)[:2] == ["healthy", "healthy"], 10), _status(base)
            taken_s = time.monotonic() - asked_s
            assert taken_s <= 3.0, taken_s  # a cold start here takes ~8 s
            # the third starts as the new standby; it loads at nice 19 (control/priority.py), so while
            # the two serving workers keep both cores busy it may not finish before the loading
            # deadline (30 s) gives it the gateway's priority back
            assert wait_for(lambda: _health(base)[2] in ("warming", "standby"), 10), _status(base)
        assert wait_for(lambda: sorted(_health(base)) == ["healthy", "standby", "stopped"], 120), _status(base)
        assert not load.failed, load.failed[:3]
        assert load.answered and all(tokens >= 1 for tokens in load.answered)
    finally:
        process.stop(timeout_s=40)


def _gauge(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def test_the_gateway_starts_a_worker_under_load_and_drains_it_after(gateway: tuple[str, ManagedProcess]) -> None:
    base, process = gateway
    assert sorted(_health(base)) == ["healthy", "stopped"]  # min_replicas: one worker running
    if sys.platform.startswith("linux"):
        assert len(_engine_pids(process.pid)) == 1
    with StreamingLoad(base, MODEL, clients=6, max_tokens=16, ignore_eos=True) as load:
        assert wait_for(lambda: _health(base) == ["healthy", "healthy"], 120), _status(base)
        served_before = len(load.answered)
        time.sleep(3.0)  # both take traffic
        assert len(load.answered) > served_before
    assert wait_for(lambda: sorted(_health(base)) == ["healthy", "stopped"], 60), _status(base)
    assert not load.failed, load.failed[:3]
    assert load.answered and all(tokens >= 1 for tokens in load.answered)
    layers = {decision["layer"] for decision in _status(base)["scaling"]}
    assert layers & {"reactive", "panic", "trigger"}, layers
    if sys.platform.startswith("linux"):
        assert wait_for(lambda: len(_engine_pids(process.pid)) == 1, 30)
    assert os.path.exists(f"/proc/{process.pid}") or not sys.platform.startswith("linux")
