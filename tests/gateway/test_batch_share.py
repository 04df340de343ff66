"""The batch worker takes the background share live (`policy.background_share`): over one replica of
`slot_limit` 4 (3 level slots, 1 of headroom), batch work never holds more than the level slots,
while without the share it takes the whole engine when no better tier is active."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batch_fixtures import KEY_A, client, jsonl, mock_upstream, redis_url, started, wait_final  # noqa: E402,F401
from support import free_port, start_process, tidegate_argv  # noqa: E402


def _peak_at_engine(tmp_path: Path, started, redis_url: str, prefix: str, share_memory_s: float) -> int:
    upstream = mock_upstream(started, "--ttft-ms", "150")
    port = free_port()
    config = {"server": {"port": port, "access_log": False},
              "pools": [{"name": "slow", "backends": [{"type": "upstream", "url": upstream, "slot_limit": 4}]}],
              "tenants": {"a": {"api_keys": [KEY_A]}},
              "batch": {"redis_url": redis_url, "key_prefix": prefix, "max_in_flight": 16, "sweep_interval_s": 0.2,
                        "share_memory_s": share_memory_s}}
    path = tmp_path / f"{prefix.strip(':')}.yaml"
    path.write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{port}"
    started.append(start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"{base}/ready",
                                 timeout_s=30))
    api = client(base)
    uploaded = api.files.create(file=("in.jsonl", jsonl(24, model="slow")), purpose="batch")
    batch = wait_final(api, api.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert batch.request_counts.completed == 24
    with urllib.request.urlopen(upstream.removesuffix("/v1") + "/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("mock_inflight_peak"):
                return int(float(line.split()[1]))
    raise AssertionError("no mock_inflight_peak")


def test_batch_holds_no_more_than_the_level_slots_with_the_share(tmp_path: Path, started, redis_url: str) -> None:
    assert _peak_at_engine(tmp_path, started, redis_url, "share:", share_memory_s=10.0) == 3
    # the same without the share: the controller alone lets batch take the headroom too
    assert _peak_at_engine(tmp_path, started, redis_url, "noshare:", share_memory_s=0.0) == 4
