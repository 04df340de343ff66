"""Active-active, live: 3 `tidegate serve` processes over the same 2 mock replicas and a real
redis-server split each replica's slots (`shared_state.dispatch: split`), so the replicas never hold
more than their `slot_limit` whichever gateway sent what; with `per_gateway` they do. Requests go
through the official `openai` client, spread over the gateways."""

from __future__ import annotations

import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ManagedProcess, free_port, start_process, start_redis, tidegate_argv  # noqa: E402

pytestmark = pytest.mark.slow

SLOTS = 3  # each replica's slot_limit
GATEWAYS = 3
REQUESTS = 36
KEY = "sk-active"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    process, url = start_redis()
    try:
        yield url
    finally:
        process.stop()


def _mocks() -> list[tuple[ManagedProcess, int]]:
    started = []
    for _ in range(2):
        port = free_port()
        started.append((start_process(tidegate_argv("mock-upstream", "--port", str(port), "--tokens", "8",
                                                    "--ttft-ms", "150", "--itl-ms", "20"),
                                      ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30), port))
    return started


def _gateways(tmp: Path, mock_ports: list[int], redis_url: str, dispatch: str, prefix: str) -> list[tuple[ManagedProcess, str]]:
    started = []
    for _ in range(GATEWAYS):
        port = free_port()
        config = {"server": {"port": port, "access_log": False}, "health": {"interval_s": 0.5},
                  "pools": [{"name": "m", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{p}/v1",
                                                        "slot_limit": SLOTS} for p in mock_ports]}],
                  "tenants": {"app": {"api_keys": [KEY], "tier": "standard"}},
                  "shared_state": {"backend": "redis", "redis_url": redis_url, "dispatch": dispatch,
                                   "gateway_count": GATEWAYS, "key_prefix": prefix},
                  "batch": {"enabled": False}}
        path = tmp / f"gateway-{port}.yaml"
        path.write_text(yaml.safe_dump(config))
        started.append((start_process(tidegate_argv("serve", "--config", str(path)),
                                      ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=30),
                        f"http://127.0.0.1:{port}"))
    return started


def _metric(url: str, name: str, key: str | None = None) -> float:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    text = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _stream(base: str) -> bool:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=30)
    chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                            stream=True)
    return sum(1 for chunk in chunks if chunk.choices and chunk.choices[0].delta.content) > 0


def _burst(bases: list[str]) -> list[bool]:
    with ThreadPoolExecutor(REQUESTS) as pool:
        return list(pool.map(_stream, [bases[i % len(bases)] for i in range(REQUESTS)]))


def _run(tmp_path: Path, redis_url: str, dispatch: str) -> tuple[list[bool], list[float], list[float]]:
    mocks = _mocks()
    gateways = _gateways(tmp_path, [port for _, port in mocks], redis_url, dispatch, f"t-{dispatch}:")
    try:
        bases = [base for _, base in gateways]
        if dispatch == "split":  # every gateway has heard of the others (two heartbeats)
            deadline = time.monotonic() + 10
            while any(_metric(f"{b}/metrics", "tidegate_dispatch_gateways", KEY) < GATEWAYS for b in bases):
                assert time.monotonic() < deadline, "the gateways never saw each other"
                time.sleep(0.2)
            time.sleep(1.0)  # and given back what each took before the others came
        answered = _burst(bases)
        peaks = [_metric(f"http://127.0.0.1:{port}/metrics", "mock_inflight_peak") for _, port in mocks]
        # a health check in the burst can read another gateway's requests sent since its heartbeat as
        # load from outside (`policy.slot_split.OutsideLoad`); two quiet checks later it is gone
        deadline = time.monotonic() + 5
        while True:
            grants = [_metric(f"{b}/metrics", "tidegate_dispatch_slot_limit", KEY) for b in bases]
            if dispatch != "split" or sum(grants) >= 2 * SLOTS or time.monotonic() > deadline:
                return answered, peaks, grants
            time.sleep(0.25)
    finally:
        for process, _ in gateways:
            process.stop()
        for process, _ in mocks:
            process.stop()


def test_split_gateways_never_send_a_replica_more_than_its_slots(tmp_path: Path, redis_url: str) -> None:
    answered, peaks, grants = _run(tmp_path, redis_url, "split")
    assert all(answered), f"{answered.count(False)} of {REQUESTS} not answered"
    assert max(peaks) <= SLOTS, f"replicas held at most {peaks} requests at once, slot_limit {SLOTS}"
    assert max(peaks) == SLOTS  # and their slots were used
    assert sum(grants) == 2 * SLOTS  # the gateways' shares add up to the replicas' slots


def test_per_gateway_dispatch_sends_each_replica_up_to_a_batch_from_every_gateway(tmp_path: Path,
                                                                                  redis_url: str) -> None:
    answered, peaks, _ = _run(tmp_path, redis_url, "per_gateway")
    assert all(answered)
    assert max(peaks) > SLOTS
