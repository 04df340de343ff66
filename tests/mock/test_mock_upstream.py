"""The mock upstream speaks enough OpenAI for the official client, and its latency models hold."""

from __future__ import annotations

import random
import time

import openai
import pytest

from tests.support import free_port, start_process, tidegate_argv
from tidegate.mock.latency import Distribution, LatencyModel


@pytest.fixture(scope="module")
def mock_url():
    port = free_port()
    process = start_process(
        tidegate_argv("mock-upstream", "--port", str(port), "--tokens", "8", "--ttft-ms", "30", "--itl-ms", "5", "--seed", "1"),
        ready_url=f"http://127.0.0.1:{port}/health",
    )
    yield f"http://127.0.0.1:{port}"
    process.stop()


@pytest.fixture()
def client(mock_url):
    return openai.OpenAI(base_url=mock_url + "/v1", api_key="unused", max_retries=0)


def test_chat_completion_returns_configured_token_count(client):
    reply = client.chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.completion_tokens == 8
    assert reply.choices[0].message.content.strip()


def test_max_tokens_caps_tokens_and_finishes_by_length(client):
    reply = client.completions.create(model="mock-model", prompt="hi", max_tokens=3)
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].finish_reason == "length"


def test_stream_sends_one_chunk_per_token_then_usage(client):
    def stream():
        return client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True},
        )

    # the client's first stream pays its lazy imports while tokens queue up: warm it first
    for _event in stream():
        pass
    arrivals, usage = [], None
    for event in stream():
        if event.choices and event.choices[0].delta.content:
            arrivals.append(time.monotonic())
        if event.usage:
            usage = event.usage
    assert len(arrivals) == 8
    assert usage is not None and usage.completion_tokens == 8
    # 7 gaps of 5 ms: the stream is paced, not sent in one burst
    assert arrivals[-1] - arrivals[0] >= 0.7 * 7 * 0.005


def test_embeddings_have_configured_dimension(client):
    result = client.embeddings.create(model="mock-model", input=["a", "b"])
    assert [len(item.embedding) for item in result.data] == [384, 384]


def test_forced_status_header_gives_openai_error(client):
    with pytest.raises(openai.InternalServerError) as caught:
        client.with_options(default_headers={"x-mock-status": "503"}).chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == 503


def test_invalid_json_is_400_and_server_keeps_serving(mock_url, client):
    import urllib.error
    import urllib.request

    request = urllib.request.Request(mock_url + "/v1/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400
    assert client.models.list().data[0].id == "mock-model"


@pytest.mark.parametrize("distribution", list(Distribution))
def test_sampled_quantiles_match_analytic_quantiles(distribution):
    model = LatencyModel(0.02, distribution, sigma=0.5)
    rng = random.Random(7)
    samples = sorted(model.sample_s(rng) for _ in range(40_000))
    for q in (0.5, 0.9, 0.99):
        empirical = samples[int(q * len(samples))]
        assert empirical == pytest.approx(model.quantile_s(q), rel=0.05, abs=1e-9)


async def test_precise_timer_never_wakes_early_and_keeps_deadline_order():
    import asyncio

    from tidegate.mock.server import PreciseTimer

    timer, woke = PreciseTimer(), []
    start_s = time.perf_counter()
    deadlines_s = [start_s + 0.001 * ((i * 7) % 20) for i in range(40)]

    async def sleeper(deadline_s: float) -> None:
        await timer.sleep_until(deadline_s)
        woke.append((time.perf_counter(), deadline_s))

    await asyncio.wait_for(asyncio.gather(*(sleeper(d) for d in deadlines_s)), timeout=10)
    assert all(woke_s >= deadline_s for woke_s, deadline_s in woke)
    assert [deadline_s for _, deadline_s in woke] == sorted(deadlines_s)
