"""The local actuator: an embedded pool of two workers that autoscales between one and two. Under
load the gateway starts the second worker (a real engine process) and routes to it once ready;
after the load it drains it and stops its process. Every request is answered: no scale-in aborts
one."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ManagedProcess, free_port, start_process, tidegate_argv  # noqa: E402

pytestmark = pytest.mark.slow


def _status(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/status.json", timeout=10) as response:
        return json.loads(response.read())["pools"][0]


def _health(base: str) -> list[str]:
    return [replica["health"] for replica in _status(base)["replicas"]]


def _wait_for(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.25)
    return False


def _engine_pids(gateway_pid: int) -> set[int]:
    """The gateway's child engine processes, from /proc (Linux)."""
    children = Path(f"/proc/{gateway_pid}/task/{gateway_pid}/children")
    return {int(pid) for pid in children.read_text().split()} if children.exists() else set()


def _serve(tmp_path: Path, workers: int, standby: int) -> tuple[str, ManagedProcess]:
    port = free_port()
    config = {"server": {"port": port, "access_log": False},
              "health": {"interval_s": 0.5},
              "overload_control": False,  # FIFO: every request waits for its turn, none is refused
              "pools": [{"name": "tiny-random-llama",
                         "backends": [{"type": "embedded", "model": "tiny-random-llama", "count": workers,
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


class _Load:
    """Streaming clients until stopped (bounded in count): what was answered and what failed."""

    def __init__(self, base: str, clients: int) -> None:
        self.base, self.stop = base, threading.Event()
        self.answered: list[int] = []
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run) for _ in range(clients)]

    def __enter__(self) -> _Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self) -> None:
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(500):
            if self.stop.is_set():
                return
            try:
                chunks = list(client.chat.completions.create(
                    model="tiny-random-llama", max_tokens=16, stream=True, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "tell me a story"}]))
                self.answered.append(sum(1 for c in chunks if c.choices and c.choices[0].delta.content))
            except openai.APIError as error:
                self.failed.append(repr(error))


def test_a_warm_standby_takes_traffic_at_once_and_is_refilled(tmp_path: Path) -> None:
    """Three workers, one serving and one standby: a scale-out makes the standby serve within a
    tick or two (no cold start), the third starts as the new standby; the scale-in drains the
    second and stops it (the standby is full), and no request fails."""
    base, process = _serve(tmp_path, workers=3, standby=1)
    try:
        assert _wait_for(lambda: _health(base) == ["healthy", "standby", "stopped"], 120), _status(base)
        with _Load(base, clients=6) as load:
            assert _wait_for(lambda: _gauge(base, "tidegate_desired_replicas") == 2.0, 30)
            asked_s = time.monotonic()
            assert _wait_for(lambda: _health(base)[:2] == ["healthy", "healthy"], 10), _status(base)
            taken_s = time.monotonic() - asked_s
            assert taken_s <= 3.0, taken_s  # a cold start here takes ~8 s
            assert _wait_for(lambda: _health(base) == ["healthy", "healthy", "standby"], 120), _status(base)
        assert _wait_for(lambda: sorted(_health(base)) == ["healthy", "standby", "stopped"], 60), _status(base)
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
    stop = threading.Event()
    answered, failed = [], []

    def load() -> None:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(500):  # bounded in count, and by the event
            if stop.is_set():
                return
            try:
                chunks = list(client.chat.completions.create(
                    model="tiny-random-llama", max_tokens=16, stream=True, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "tell me a story"}]))
                answered.append(sum(1 for c in chunks if c.choices and c.choices[0].delta.content))
            except openai.APIError as error:
                failed.append(repr(error))

    threads = [threading.Thread(target=load) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        assert _wait_for(lambda: _health(base) == ["healthy", "healthy"], 120), _status(base)
        served_before = len(answered)
        time.sleep(3.0)  # both take traffic
        assert len(answered) > served_before
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert _wait_for(lambda: sorted(_health(base)) == ["healthy", "stopped"], 60), _status(base)
    assert not failed, failed[:3]
    assert answered and all(tokens >= 1 for tokens in answered)
    layers = {decision["layer"] for decision in _status(base)["scaling"]}
    assert layers & {"reactive", "panic", "trigger"}, layers
    if sys.platform.startswith("linux"):
        assert _wait_for(lambda: len(_engine_pids(process.pid)) == 1, 30)
    assert os.path.exists(f"/proc/{process.pid}") or not sys.platform.startswith("linux")
