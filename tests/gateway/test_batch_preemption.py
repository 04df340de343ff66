"""Batch requests yield their slots to interactive ones live (`policy.pool` rule 9): with a replica's
slots all held by a batch, interactive requests start at once instead of waiting for batch requests
to end, and every preempted batch request is run again, its result written once, without being
counted as a failed attempt (max_attempts 1 would dead-letter it)."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_fixtures import KEY_A, client, jsonl, mock_upstream, redis_url, started, wait_final  # noqa: E402,F401
from support import free_port, start_process, tidegate_argv  # noqa: E402

BATCH = 8


def _gauge(url: str, name: str, key: str | None = None, **labels: str) -> float:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        total = 0.0
        for line in response.read().decode().splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.split()[-1])
        return total


def _ttft_s(api, model: str) -> float:
    started_s = time.perf_counter()
    stream = api.chat.completions.create(model=model, max_tokens=4, stream=True,
                                         messages=[{"role": "user", "content": "now"}])
    ttft_s = None
    for chunk in stream:  # read to its end: the request holds its slot as long as an interactive one does
        if ttft_s is None and chunk.choices and chunk.choices[0].delta.content:
            ttft_s = time.perf_counter() - started_s
    assert ttft_s is not None, "no token"
    return ttft_s


def _serve(tmp_path: Path, started, upstream: str, redis_url: str, preemptible: bool) -> str:
    port = free_port()
    config = {"server": {"port": port, "access_log": False},
              "pools": [{"name": "slow", "backends": [{"type": "upstream", "url": upstream, "slot_limit": 4}]}],
              "tenants": {"a": {"api_keys": [KEY_A]}},
              "batch": {"redis_url": redis_url, "key_prefix": f"preempt{int(preemptible)}:", "max_in_flight": BATCH,
                        "max_attempts": 1, "sweep_interval_s": 0.2, "preemptible": preemptible}}
    path = tmp_path / f"gateway{int(preemptible)}.yaml"
    path.write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"
    started.append(start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"{base}/ready",
                                 timeout_s=30))
    return base


def test_interactive_requests_take_the_slots_of_a_running_batch_at_once(tmp_path: Path, started,
                                                                         redis_url: str) -> None:
    # whole answers take ~50 ms + 4 x 300 ms; a stream's first token comes after ~50 ms
    upstream = mock_upstream(started, "--ttft-ms", "50", "--itl-ms", "300")
    base = _serve(tmp_path, started, upstream, redis_url, preemptible=True)
    api = client(base)
    alone_s = min(_ttft_s(api, "slow") for _ in range(3))
    whole_started = time.perf_counter()
    api.chat.completions.create(model="slow", max_tokens=4, messages=[{"role": "user", "content": "whole"}])
    whole_s = time.perf_counter() - whole_started  # how long a batch request holds its slot
    uploaded = api.files.create(file=("in.jsonl", jsonl(BATCH, model="slow")), purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    engine = upstream.removesuffix("/v1") + "/metrics"
    deadline = time.monotonic() + 10
    # the standard tier arrived within the headroom memory: batch holds the 3 level slots, not the 4th
    while _gauge(engine, "mock_inflight_requests") < 3:
        assert time.monotonic() < deadline, "the batch never filled the replica's level slots"
        time.sleep(0.01)
    # three at once: one takes the headroom slot, two must preempt batch requests
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        beside = list(pool.map(lambda _: _ttft_s(client(base), "slow"), range(3)))
    assert max(beside) < alone_s + 0.5 * whole_s, (beside, alone_s, whole_s)
    done = wait_final(api, batch.id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", BATCH, 0)
    lines = [json.loads(line) for line in api.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == sorted(f"req-{i}" for i in range(BATCH))
    assert _gauge(f"{base}/metrics", "tidegate_overload_preemptions_total", KEY_A, pool="slow", tier="batch") >= 2
    assert _gauge(f"{base}/metrics", "tidegate_overload_preempted_seconds_total", KEY_A, pool="slow") > 0
