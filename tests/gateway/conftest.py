"""Real processes on loopback: mock upstreams and `tidegate serve` in front of them."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gateway_harness import Gateway, Upstream  # noqa: E402
from support import ManagedProcess, free_port, start_process, tidegate_argv  # noqa: E402


@pytest.fixture(scope="module")
def processes() -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for process in reversed(started):
        process.stop()


@pytest.fixture(scope="module")
def start_mock(processes: list[ManagedProcess]) -> Callable[..., Upstream]:
    def start(*extra: str, tokens: int = 8) -> Upstream:
        port = free_port()
        argv = tidegate_argv("mock-upstream", "--port", str(port), "--tokens", str(tokens), "--ttft-ms", "0",
                             "--itl-ms", "0", *extra)
        process = start_process(argv, ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30)
        processes.append(process)
        return Upstream(process, port)

    return start


@pytest.fixture(scope="module")
def start_gateway(processes: list[ManagedProcess], tmp_path_factory: pytest.TempPathFactory
                  ) -> Callable[..., Gateway]:
    def start(pools: list[dict], server: dict | None = None, health: dict | None = None,
              wait_ready: bool = True, overload_control: bool | None = None) -> Gateway:
        port = free_port()
        config = {"server": {"port": port, **(server or {})}, "pools": pools}
        if health:
            config["health"] = health
        if overload_control is not None:
            config["overload_control"] = overload_control
        path = tmp_path_factory.mktemp("gateway") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        ready = "/ready" if wait_ready else "/health"
        process = start_process(tidegate_argv("serve", "--config", str(path)),
                                ready_url=f"http://127.0.0.1:{port}{ready}", timeout_s=30)
        processes.append(process)
        return Gateway(process, port)

    return start
