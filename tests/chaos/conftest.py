"""Real processes on loopback for the chaos tests: mock upstreams, and handles that stop them."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support import ManagedProcess, free_port, start_process, tidegate_argv


class Mock:
    def __init__(self, process: ManagedProcess, port: int) -> None:
        self.process = process
        self.port = port
        self.base = f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def processes() -> Iterator[list[ManagedProcess]]:
    started: list[ManagedProcess] = []
    yield started
    for process in reversed(started):
        process.stop()


@pytest.fixture(scope="module")
def start_mock(processes: list[ManagedProcess]) -> Callable[..., Mock]:
    def start(*extra: str, tokens: int = 8) -> Mock:
        port = free_port()
        argv = tidegate_argv("mock-upstream", "--port", str(port), "--tokens", str(tokens), "--ttft-ms", "0",
                             "--itl-ms", "0", *extra)
        process = start_process(argv, ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30)
        processes.append(process)
        return Mock(process, port)

    return start
