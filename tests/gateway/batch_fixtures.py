"""What the Batch API's files and retention tests share: a real redis-server, mock upstreams and a
factory of `tidegate serve` processes with the Batch API on, each under its own key prefix."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import openai
import pytest
import yaml

from support import ManagedProcess, free_port, start_process, start_redis, tidegate_argv

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
GatewayFactory = Callable[..., str]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, url = start_redis(append_only=True, data_dir=str(tmp_path_factory.mktemp("redis")))
    try:
        yield url
    finally:
        process.stop()


@pytest.fixture(scope="module")
def started() -> Iterator[list[ManagedProcess]]:
    processes: list[ManagedProcess] = []
    yield processes
    for process in reversed(processes):
        process.stop()


def mock_upstream(started: list[ManagedProcess], *extra: str) -> str:
    port = free_port()
    started.append(start_process(tidegate_argv("mock-upstream", "--port", str(port), "--tokens", "4", *extra),
                                 ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30))
    return f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def mocks(started: list[ManagedProcess]) -> dict[str, str]:
    return {"fast": mock_upstream(started), "slow": mock_upstream(started, "--ttft-ms", "300"),
            "broken": mock_upstream(started, "--error-rate", "1")}


@pytest.fixture(scope="module")
def gateway_factory(started: list[ManagedProcess], mocks: dict[str, str], redis_url: str,
                    tmp_path_factory: pytest.TempPathFactory) -> GatewayFactory:
    def start(**batch: object) -> str:
        port = free_port()
        config = {
            "server": {"port": port, "access_log": False},
            "health": {"failure_threshold": 1000, "failure_ratio": 1.0},
            "pools": [{"name": name, "backends": [{"type": "upstream", "url": url, "slot_limit": 4}]}
                      for name, url in mocks.items()],
            "tenants": {"a": {"api_keys": [KEY_A]}, "b": {"api_keys": [KEY_B]}},
            "batch": {"redis_url": redis_url, "claim_idle_s": 1.0, "sweep_interval_s": 0.2, **batch},
        }
        path = tmp_path_factory.mktemp("gateway") / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        started.append(start_process(tidegate_argv("serve", "--config", str(path)),
                                     ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30))
        return f"http://127.0.0.1:{port}"

    return start


def client(base: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=10)


def jsonl(count: int, model: str = "fast") -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": 4,
                                        "messages": [{"role": "user", "content": f"question {i}"}]}}) + "\n"
                   for i in range(count)).encode()


def wait_final(api: openai.OpenAI, batch_id: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = api.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} not final after {timeout_s}s")
