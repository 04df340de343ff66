"""Length classes through `tidegate serve`: short prompts on one replica set, long on another
(`policy.length_classes`), and the whole pool when a class's replicas are down."""

from __future__ import annotations

import openai

from gateway_harness import Gateway, Upstream, upstream_pool, wait_for
from support import free_port
from test_gateway_resilience import _metrics

SHORT = [{"role": "user", "content": "hello"}]
LONG = [{"role": "user", "content": "tell me about the weather " * 300}]  # ~7,800 characters


def _served(upstream: Upstream) -> float:
    """Completions the mock upstream answered (health checks and scrapes not counted)."""
    return _metrics(f"http://127.0.0.1:{upstream.port}")["mock_api_requests_total"]


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=20)


def _split_pool(short: Upstream | str, long: Upstream | str) -> dict:
    pool = upstream_pool("m", short, long)
    pool["length_classes"] = [{"max_prompt_tokens": 200, "replicas": [0]}, {"replicas": [1]}]
    return pool


def test_short_prompts_go_to_one_replica_set_and_long_ones_to_the_other(start_mock, start_gateway) -> None:
    short, long = start_mock(), start_mock()
    client = _client(start_gateway([_split_pool(short, long)]))
    for _ in range(6):
        client.chat.completions.create(model="m", messages=SHORT)
    assert (_served(short), _served(long)) == (6, 0)
    for _ in range(4):
        client.chat.completions.create(model="m", messages=LONG)
    assert (_served(short), _served(long)) == (6, 4)


def test_a_long_prompt_whose_replicas_are_down_goes_to_the_rest_of_the_pool(start_mock, start_gateway) -> None:
    short = start_mock()
    gateway = start_gateway([_split_pool(short, f"http://127.0.0.1:{free_port()}/v1")],
                            health={"interval_s": 0.2})
    client = _client(gateway)
    assert wait_for(lambda: _answers(client), 15)
    assert _served(short) >= 1
    assert _metrics(gateway.base)['tidegate_length_class_fallbacks_total{pool="m"}'] >= 1


def _answers(client: openai.OpenAI) -> bool:
    try:
        return bool(client.chat.completions.create(model="m", messages=LONG).choices[0].message.content)
    except openai.APIError:
        return False
