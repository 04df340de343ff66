"""Time to first token is taken at the first event with output, not at the role-only event that
OpenAI-style chat streams open with (vLLM and the embedded engine send it at once): the adaptive
slot limits learn from this sample, and would see every replica as instant otherwise."""

from __future__ import annotations

import re
import urllib.request

import openai
import pytest

from gateway_harness import Gateway, upstream_pool
from tidegate.gateway.proxy import _FIRST_TOKEN

TTFT_S = 0.3


@pytest.fixture(scope="module")
def gateway(start_mock, start_gateway) -> Gateway:
    return start_gateway([upstream_pool("slow", start_mock("--ttft-ms", str(TTFT_S * 1000), tokens=4))])


def _ttft_histogram(gateway: Gateway) -> tuple[float, float]:
    with urllib.request.urlopen(f"{gateway.base}/metrics", timeout=5) as response:
        text = response.read().decode()
    total = float(re.search(r'^tidegate_time_to_first_token_seconds_sum{[^}]*pool="slow"[^}]*} (\S+)', text, re.M)[1])
    count = float(re.search(r'^tidegate_time_to_first_token_seconds_count{[^}]*pool="slow"[^}]*} (\S+)', text, re.M)[1])
    return total, count


def test_stream_ttft_waits_for_the_first_token_not_the_role_event(gateway: Gateway) -> None:
    client = openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=10)
    chunks = list(client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    total, count = _ttft_histogram(gateway)
    assert count == 1 and total >= TTFT_S * 0.9


@pytest.mark.parametrize(("event", "has_output"), [
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}', False),
    (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}', True),
    (b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}', False),
    (b'data: {"choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":null}]}', True),
    (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c"}]}}]}', True),
    (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}', True),
    (b'data: {"choices":[{"index":0,"delta":{"reasoning_content":"so"}}]}', True),
])
def test_first_token_pattern(event: bytes, has_output: bool) -> None:
    assert bool(_FIRST_TOKEN.search(event)) is has_output
