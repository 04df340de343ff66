"""Mid-stream failover through `tidegate serve`: a replica killed (SIGKILL) or stalled while it
streams, and the official client still gets one complete answer with correct usage."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from gateway_harness import Gateway, Upstream, upstream_pool

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "How do tide gates work?"}]
TOKENS = 16


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=20)


def _metric_lines(base: str, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)}


def _resumed(gateway: Gateway) -> float:
    return sum(v for k, v in _metric_lines(gateway.base, "tidegate_stream_failovers_total").items()
               if 'outcome="resumed"' in k)


def _busy(upstream: Upstream) -> bool:
    return _metric_lines(f"http://127.0.0.1:{upstream.port}", "mock_inflight_requests").get(
        "mock_inflight_requests", 0) > 0


def _reference(upstream: Upstream) -> openai.types.chat.ChatCompletion:
    """The uninterrupted answer: the mock's text is a function of the request."""
    return _client(upstream.url).chat.completions.create(model="m", messages=MESSAGES, max_tokens=32)


def _stream_killing_after(gateway: Gateway, upstreams: list[Upstream], tokens_before_kill: int) -> list:
    stream = _client(gateway.api).chat.completions.create(model="m", messages=MESSAGES, max_tokens=32, stream=True,
                                                          stream_options={"include_usage": True})
    chunks, killed = [], False
    for chunk in stream:
        chunks.append(chunk)
        if not killed and sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == tokens_before_kill:
            (serving,) = [u for u in upstreams if _busy(u)]
            serving.process.popen.kill()  # SIGKILL: the connection is reset mid-answer
            killed = True
    assert killed
    return chunks


def test_stream_on_a_killed_replica_is_continued_on_another(start_mock, start_gateway) -> None:
    upstreams = [start_mock("--itl-ms", "40", tokens=TOKENS) for _ in range(3)]
    gateway = start_gateway([upstream_pool("m", *upstreams, health_path=None)])
    reference = _reference(upstreams[0])
    chunks = _stream_killing_after(gateway, upstreams, 5)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference.choices[0].message.content
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.role) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (reference.usage.prompt_tokens, TOKENS, reference.usage.total_tokens)
    assert _resumed(gateway) == 1


def test_pool_that_opted_out_ends_the_stream_with_an_error_event(start_mock, start_gateway) -> None:
    upstreams = [start_mock("--itl-ms", "40", tokens=TOKENS) for _ in range(2)]
    gateway = start_gateway([{**upstream_pool("m", *upstreams, health_path=None), "failover": {"enabled": False}}])
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        _stream_killing_after(gateway, upstreams, 3)
    assert _resumed(gateway) == 0


def test_stream_on_a_stalled_replica_is_continued_after_the_silence_timeout(start_mock, start_gateway) -> None:
    stalls, good = start_mock("--stall-after", "3", tokens=TOKENS), start_mock(tokens=TOKENS)
    gateway = start_gateway([upstream_pool("m", stalls, good, health_path=None)],
                            server={"stream_idle_timeout_s": 0.5}, health={"failure_threshold": 1000,
                                                                           "failure_ratio": 1.0})
    reference = _reference(good).choices[0].message.content
    for _ in range(2):  # round robin: one of them starts on the stalling replica
        stream = _client(gateway.api).chat.completions.create(model="m", messages=MESSAGES, max_tokens=32,
                                                              stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reference
    assert _resumed(gateway) >= 1
