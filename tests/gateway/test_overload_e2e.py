"""End to end with the official `openai` client: `tidegate serve` with overload control over a mock upstream."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import free_port, start_process, tidegate_argv  # noqa: E402

_PRESET = "busy, try again later"
_MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    mock_port, slow_port, port = free_port(), free_port(), free_port()
    mock = start_process(tidegate_argv("mock-upstream", "--port", str(mock_port), "--tokens", "4", "--ttft-ms", "0",
                                       "--itl-ms", "0"), ready_url=f"http://127.0.0.1:{mock_port}/health", timeout_s=30)
    # one slot whose answer takes 3 s to start: a request behind it must queue
    slow = start_process(tidegate_argv("mock-upstream", "--port", str(slow_port), "--tokens", "1", "--ttft-ms", "3000",
                                       "--itl-ms", "0"), ready_url=f"http://127.0.0.1:{slow_port}/health", timeout_s=30)
    config = {
        "server": {"port": port, "access_log": False},
        "pools": [{"name": "m", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{mock_port}/v1",
                                              "forward_priority": True}]},
                  {"name": "slow", "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{slow_port}/v1",
                                                 "slot_limit": 1}]}],
        "tenants": {"capped": {"api_keys": ["sk-capped"], "requests_per_minute": 1},
                    "worker": {"api_keys": ["sk-worker"], "tier": "mid"},
                    "free": {"api_keys": ["sk-free"], "tier": "low"}},
        # a `low` tier that may queue nothing: served only when it can start at once, else the preset reply
        "tiers": {"default": "high", "levels": {
            "high": {"rank": 0, "max_queue_wait_s": 5, "ttft_target_s": 5},
            "mid": {"rank": 1, "max_queue_wait_s": 5, "ttft_target_s": 5},
            "low": {"rank": 2, "queue_bound": 0, "max_queue_wait_s": 5, "ttft_target_s": 10}}},
        "degradation": {"preset_reply": _PRESET},
    }
    path = tmp_path_factory.mktemp("overload") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    server = start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"http://127.0.0.1:{port}/ready",
                           timeout_s=30)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.stop()
        mock.stop()
        slow.stop()


def _client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=10)


def test_bad_key_is_401(gateway: str) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(gateway, "sk-wrong").chat.completions.create(model="m", messages=_MESSAGES)


def test_over_the_limit_is_429_with_rate_limit_headers(gateway: str) -> None:
    client = _client(gateway, "sk-capped")
    first = client.chat.completions.with_raw_response.create(model="m", messages=_MESSAGES)
    assert first.headers["x-ratelimit-limit-requests"] == "1"
    assert first.parse().choices[0].message.content
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="m", messages=_MESSAGES)
    headers = refused.value.response.headers
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert int(headers["retry-after"]) >= 1
    assert "requests per minute" in refused.value.message


def test_degraded_reply_names_its_rung(gateway: str) -> None:
    holder = threading.Thread(target=lambda: _client(gateway, "sk-worker").chat.completions.create(
        model="slow", messages=_MESSAGES, max_tokens=1))
    holder.start()  # takes the slow pool's one slot for 3 s
    time.sleep(0.5)
    with pytest.raises(openai.InternalServerError) as degraded:
        _client(gateway, "sk-free").chat.completions.create(model="slow", messages=_MESSAGES, stream=True)
    holder.join(timeout=10)
    response = degraded.value.response
    assert response.status_code == 503
    assert response.headers["x-tidegate-degradation"] == "preset_reply"
    assert int(response.headers["retry-after"]) >= 1
    assert _PRESET in degraded.value.message


def test_malformed_request_timeout_header_is_400(gateway: str) -> None:
    client = _client(gateway, "sk-capped").with_options(default_headers={"x-request-timeout": "soon"})
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=_MESSAGES)
    assert "x-request-timeout" in caught.value.message


def test_the_tier_rank_goes_upstream_as_priority_whatever_the_client_asked(gateway: str) -> None:
    # the backend has forward_priority on; the mock echoes the priority it got as system_fingerprint
    reply = _client(gateway, "sk-worker").chat.completions.create(model="m", messages=_MESSAGES,
                                                                  extra_body={"priority": -5})
    assert reply.system_fingerprint == "priority=2"  # `mid` is rank 1: 2 x rank, not flooding
