"""The exact response cache and single-flight coalescing, end to end: `tidegate serve` over mock
upstreams, the official `openai` client, a real `redis-server` shared by two gateways."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ManagedProcess, free_port, start_process, start_redis, tidegate_argv  # noqa: E402

_TIERS = {"default": "high", "levels": {
    "high": {"rank": 0, "max_queue_wait_s": 10, "ttft_target_s": 10},
    "low": {"rank": 1, "queue_bound": 0, "max_queue_wait_s": 10, "ttft_target_s": 10}}}
_TENANTS = {"alice": {"api_keys": ["sk-alice"]}, "bob": {"api_keys": ["sk-bob"]},
            "free": {"api_keys": ["sk-free"], "tier": "low"},
            "private": {"api_keys": ["sk-private"], "response_cache": False},
            "sampler": {"api_keys": ["sk-sampler"], "response_cache": "sampled"}}


def _stop(*processes) -> None:
    """Stops the processes a test started (those it got to start), gateways before what they use."""
    for process in processes:
        if process is not None:
            process.stop()

def _mock(ttft_ms: int = 0, tokens: int = 6) -> tuple[ManagedProcess, int]:
    port = free_port()
    process = start_process(tidegate_argv("mock-upstream", "--port", str(port), "--tokens", str(tokens),
                                          "--ttft-ms", str(ttft_ms), "--itl-ms", "5"),
                            ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30)
    return process, port


def _gateway(tmp: Path, pools: list[dict], **extra: object) -> tuple[ManagedProcess, str]:
    port = free_port()
    config = {"server": {"port": port, "access_log": False}, "pools": pools, "tenants": _TENANTS, "tiers": _TIERS,
              "health": {"interval_s": 0.2}, **extra}
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"http://127.0.0.1:{port}/ready",
                            timeout_s=30)
    return process, f"http://127.0.0.1:{port}"


def _pool(name: str, port: int, **cache: object) -> dict:
    return {"name": name, "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{port}/v1", "slot_limit": 1}],
            "response_cache": cache}


def _upstream_requests(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return int(re.search(r"^mock_api_requests_total (\d+)", text, re.M).group(1))


def _metric(base: str, name: str, **labels: str) -> float:
    request = urllib.request.Request(f"{base}/metrics", headers={"authorization": "Bearer sk-alice"})
    text = urllib.request.urlopen(request, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code, self.headers, self.body = status, headers, body

    def json(self) -> dict:
        return json.loads(self.body)


def _post(base: str, payload: dict, headers: dict[str, str]) -> http.client.HTTPConnection:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v1/chat/completions", body=json.dumps(payload),
                       headers={"content-type": "application/json", **headers})
    return connection


def _chat(base: str, key: str = "sk-alice", _headers: dict[str, str] | None = None, **body: object) -> Answer:
    payload = {"model": "m", "messages": [{"role": "user", "content": "what is a tide gate?"}], "max_tokens": 6,
               **body}
    connection = _post(base, payload, {"authorization": f"Bearer {key}", **(_headers or {})})
    try:
        response = connection.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    tmp = tmp_path_factory.mktemp("cache")
    mock, mock_port = _mock()
    gateway, base = _gateway(tmp, [_pool("m", mock_port)])
    try:
        yield base, mock_port
    finally:
        gateway.stop()
        mock.stop()


def test_a_deterministic_request_is_answered_once_upstream(setup: tuple[str, int]) -> None:
    base, mock_port = setup
    before = _upstream_requests(mock_port)
    first = _chat(base, temperature=0, messages=[{"role": "user", "content": "first question"}])
    second = _chat(base, temperature=0, messages=[{"role": "user", "content": "first question"}])
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.headers["x-tidegate-cache"] == "miss" and second.headers["x-tidegate-cache"] == "hit"
    assert second.json() == first.json()
    assert second.headers["x-request-id"] != first.headers["x-request-id"]
    assert _upstream_requests(mock_port) == before + 1


def test_a_stream_is_replayed_event_by_event(setup: tuple[str, int]) -> None:
    base, mock_port = setup
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-alice", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "stream me"}]

    def run() -> tuple[list[str], str]:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=messages, temperature=0,
                                                               max_tokens=6, stream=True)
        chunks = [c.choices[0].delta.content or "" for c in raw.parse() if c.choices]
        return chunks, raw.headers["x-tidegate-cache"]

    before = _upstream_requests(mock_port)
    first, first_state = run()
    second, second_state = run()
    assert (first_state, second_state) == ("miss", "hit")
    assert second == first and "".join(first)
    assert _upstream_requests(mock_port) == before + 1


def test_sampled_and_no_store_requests_bypass_and_no_cache_refreshes(setup: tuple[str, int]) -> None:
    base, mock_port = setup
    messages = [{"role": "user", "content": "sampled"}]
    before = _upstream_requests(mock_port)
    assert [_chat(base, messages=messages).headers["x-tidegate-cache"] for _ in range(2)] == ["bypass", "bypass"]
    assert _chat(base, temperature=0, messages=messages,
                 _headers={"cache-control": "no-store"}).headers["x-tidegate-cache"] == "bypass"
    assert _chat(base, seed=7, messages=messages).headers["x-tidegate-cache"] == "miss"  # a seed is deterministic
    assert _chat(base, seed=7, messages=messages,
                 _headers={"cache-control": "no-cache"}).headers["x-tidegate-cache"] == "miss"
    assert _chat(base, seed=7, messages=messages).headers["x-tidegate-cache"] == "hit"
    assert _upstream_requests(mock_port) == before + 5


def test_a_client_header_or_a_tenant_setting_opts_sampled_requests_in(setup: tuple[str, int]) -> None:
    base, mock_port = setup
    messages = [{"role": "user", "content": "sampled, opted in"}]
    use = {"x-tidegate-cache": "use"}
    before = _upstream_requests(mock_port)
    assert [_chat(base, messages=messages, _headers=use).headers["x-tidegate-cache"] for _ in range(2)] \
        == ["miss", "hit"]
    assert _chat(base, messages=messages).headers["x-tidegate-cache"] == "bypass"  # no header: not opted in
    assert [_chat(base, "sk-sampler", messages=messages).headers["x-tidegate-cache"] for _ in range(2)] \
        == ["miss", "hit"]
    # an opted-out tenant stays out, and no-store still wins
    assert _chat(base, "sk-private", messages=messages, _headers=use).headers["x-tidegate-cache"] == "bypass"
    assert _chat(base, messages=messages, _headers={**use, "cache-control": "no-store"}
                 ).headers["x-tidegate-cache"] == "bypass"
    assert _upstream_requests(mock_port) == before + 5  # the two hits took none


def test_no_answer_crosses_tenants_and_an_opted_out_tenant_is_never_cached(setup: tuple[str, int]) -> None:
    base, _ = setup
    messages = [{"role": "user", "content": "tenant scoped"}]
    assert _chat(base, "sk-alice", temperature=0, messages=messages).headers["x-tidegate-cache"] == "miss"
    assert _chat(base, "sk-bob", temperature=0, messages=messages).headers["x-tidegate-cache"] == "miss"
    assert _chat(base, "sk-bob", temperature=0, messages=messages).headers["x-tidegate-cache"] == "hit"
    states = [_chat(base, "sk-private", temperature=0, messages=messages).headers["x-tidegate-cache"]
              for _ in range(2)]
    assert states == ["bypass", "bypass"]


def test_any_sampling_parameter_is_part_of_the_key(setup: tuple[str, int]) -> None:
    base, _ = setup
    messages = [{"role": "user", "content": "keyed"}]
    assert _chat(base, temperature=0, messages=messages).headers["x-tidegate-cache"] == "miss"
    assert _chat(base, temperature=0, messages=messages, max_tokens=5).headers["x-tidegate-cache"] == "miss"
    assert _chat(base, temperature=0, messages=messages, stop=["x"]).headers["x-tidegate-cache"] == "miss"
    assert _chat(base, temperature=0, messages=messages, user="someone").headers["x-tidegate-cache"] == "hit"


async def _concurrent(base: str, count: int, content: str, stream: bool) -> list[tuple[int, str, str]]:
    connector = aiohttp.TCPConnector(limit=count)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one() -> tuple[int, str, str]:
            payload = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                       "temperature": 0, "stream": stream}
            async with session.post(f"{base}/v1/chat/completions", json=payload,
                                    headers={"authorization": "Bearer sk-alice"}) as response:
                text = await response.text()
                return response.status, response.headers.get("x-tidegate-cache", ""), text

        return await asyncio.gather(*(one() for _ in range(count)))


@pytest.mark.parametrize("stream", [False, True])
def test_a_hundred_identical_requests_make_one_upstream_request(tmp_path: Path, stream: bool) -> None:
    mock, mock_port = _mock(ttft_ms=800)
    gateway, base = _gateway(tmp_path, [_pool("m", mock_port)])
    try:
        results = asyncio.run(_concurrent(base, 100, f"all at once {stream}", stream))
        assert _upstream_requests(mock_port) == 1
        assert [status for status, _, _ in results] == [200] * 100
        states = sorted(state for _, state, _ in results)
        assert states.count("miss") == 1 and states.count("coalesced") + states.count("hit") == 99
        bodies = {text for _, _, text in results}
        assert len(bodies) == 1 and ("[DONE]" in bodies.pop()) == stream
    finally:
        gateway.stop()
        mock.stop()


async def _two_tenants_at_once(base: str, each: int) -> list[tuple[int, str, str]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2 * each),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(key: str) -> tuple[int, str, str]:
            payload = {"model": "m", "messages": [{"role": "user", "content": "same words"}], "max_tokens": 6,
                       "temperature": 0}
            async with session.post(f"{base}/v1/chat/completions", json=payload,
                                    headers={"authorization": f"Bearer {key}"}) as response:
                await response.read()
                return response.status, response.headers.get("x-tidegate-cache", ""), key

        return await asyncio.gather(*(one(key) for key in ["sk-alice", "sk-bob"] * each))


def test_identical_requests_of_two_tenants_in_flight_do_not_coalesce(tmp_path: Path) -> None:
    mock, mock_port = _mock(ttft_ms=800)
    gateway, base = _gateway(tmp_path, [_pool("m", mock_port)])
    try:
        results = asyncio.run(_two_tenants_at_once(base, 10))
        assert [status for status, _, _ in results] == [200] * 20
        assert _upstream_requests(mock_port) == 2  # one flight a tenant
        for key in ("sk-alice", "sk-bob"):
            assert [state for _, state, k in results if k == key].count("miss") == 1
    finally:
        gateway.stop()
        mock.stop()


def _stream_lines(base: str, content: str, stop_after: int | None, max_tokens: int = 40) -> list[str]:
    payload = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
               "temperature": 0,
               "stream": True}
    connection = _post(base, payload, {"authorization": "Bearer sk-alice"})
    lines: list[str] = []
    try:
        response = connection.getresponse()
        assert response.status == 200
        while stop_after is None or len(lines) < stop_after:
            line = response.readline()
            if not line:
                break
            if line.strip():
                lines.append(line.decode().strip())
    finally:
        connection.close()  # mid-stream when it stopped early: the client leaves
    return lines


def test_a_leader_or_follower_leaving_fails_no_one(tmp_path: Path) -> None:
    mock, mock_port = _mock(ttft_ms=300, tokens=40)
    gateway, base = _gateway(tmp_path, [_pool("m", mock_port)])
    try:
        async def scenario() -> list[list[str]]:
            # leaves after its first event
            leader = asyncio.create_task(asyncio.to_thread(_stream_lines, base, "leaving", 1))
            await asyncio.sleep(0.1)
            followers = [asyncio.to_thread(_stream_lines, base, "leaving", None) for _ in range(3)]
            quitter = asyncio.to_thread(_stream_lines, base, "leaving", 2)
            return await asyncio.gather(leader, *followers, quitter)

        results = asyncio.run(scenario())
        for lines in results[1:4]:
            assert lines[-1] == "data: [DONE]" and len(lines) > 40
        assert _upstream_requests(mock_port) == 1
        time.sleep(0.3)  # the complete answer was stored: the next one is a hit
        assert _stream_lines(base, "leaving", None) == results[1]
        assert _upstream_requests(mock_port) == 1
    finally:
        gateway.stop()
        mock.stop()


def test_everyone_leaving_stops_the_upstream_request(tmp_path: Path) -> None:
    mock, mock_port = _mock(ttft_ms=0, tokens=4000)
    gateway, base = _gateway(tmp_path, [_pool("m", mock_port)])
    try:
        _stream_lines(base, "abandoned", 2, max_tokens=4000)
        time.sleep(0.5)
        assert _metric(base, "tidegate_replica_outstanding") == 0  # the slot is free again
        assert _metric(base, "tidegate_response_cache_stores_total") == 0  # an incomplete answer is not kept
    finally:
        gateway.stop()
        mock.stop()


def test_the_cached_answer_rung_answers_a_request_the_pool_refuses(tmp_path: Path) -> None:
    mock, mock_port = _mock(ttft_ms=1500)
    gateway, base = _gateway(tmp_path, [_pool("m", mock_port)])
    try:
        messages = [{"role": "user", "content": "a question asked often"}]
        kept = _chat(base, "sk-free", temperature=0, messages=messages)
        assert kept.status_code == 200

        async def scenario() -> tuple[Answer, Answer, Answer]:
            busy = asyncio.create_task(asyncio.to_thread(_chat, base, "sk-alice",
                                                         messages=[{"role": "user", "content": "long"}]))
            await asyncio.sleep(0.3)  # the pool's only slot is taken; `low` may not queue
            sampled = await asyncio.to_thread(_chat, base, "sk-free", messages=messages, temperature=0.8)
            other = await asyncio.to_thread(_chat, base, "sk-free", messages=[{"role": "user", "content": "new"}])
            return await busy, sampled, other

        busy, sampled, other = asyncio.run(scenario())
        assert busy.status_code == 200
        assert sampled.status_code == 200 and sampled.headers["x-tidegate-degradation"] == "cached_answer"
        assert sampled.json()["choices"] == kept.json()["choices"]
        assert other.status_code == 503 and other.headers["x-tidegate-degradation"] == "preset_reply"
        assert _metric(base, "tidegate_overload_degraded_responses_total", rung="cached_answer") == 1
    finally:
        gateway.stop()
        mock.stop()


def test_two_gateways_share_the_redis_tier_and_serve_on_without_it(tmp_path: Path) -> None:
    redis_process, redis_url = start_redis()
    mock, mock_port = _mock()
    first = second = None
    try:
        cache = {"redis_url": redis_url}
        first, first_base = _gateway(tmp_path, [_pool("m", mock_port)], cache=cache)
        second, second_base = _gateway(tmp_path, [_pool("m", mock_port)], cache=cache)
        messages = [{"role": "user", "content": "shared"}]
        stored = _chat(first_base, temperature=0, messages=messages)
        assert stored.headers["x-tidegate-cache"] == "miss"
        time.sleep(0.3)  # stored in Redis in the background
        shared = _chat(second_base, temperature=0, messages=messages)
        assert shared.headers["x-tidegate-cache"] == "hit" and shared.json() == stored.json()
        assert _metric(second_base, "tidegate_response_cache_requests_total", result="hit_redis") == 1
        assert _upstream_requests(mock_port) == 1
        assert _metric(second_base, "tidegate_response_cache_redis_up") == 1

        redis_process.kill()
        answers = [_chat(second_base, temperature=0, messages=[{"role": "user", "content": f"after {i}"}])
                   for i in range(3)]
        assert [a.status_code for a in answers] == [200] * 3
        assert _metric(second_base, "tidegate_response_cache_redis_up") == 0
        assert _chat(second_base, temperature=0, messages=messages).headers["x-tidegate-cache"] == "hit"  # memory
    finally:
        _stop(first, second, mock, redis_process)


def test_a_redis_entry_expires_after_its_ttl(tmp_path: Path) -> None:
    import redis

    redis_process, redis_url = start_redis()
    mock, mock_port = _mock()
    writer = reader = None
    try:
        cache = {"redis_url": redis_url, "ttl_s": 1.0}
        writer, writer_base = _gateway(tmp_path, [_pool("m", mock_port)], cache=cache)
        reader, reader_base = _gateway(tmp_path, [_pool("m", mock_port)], cache=cache)
        store = redis.Redis.from_url(redis_url)
        assert _chat(writer_base, temperature=0, messages=[{"role": "user", "content": "expiring"}]
                     ).headers["x-tidegate-cache"] == "miss"
        deadline = time.monotonic() + 0.8  # stored in the background, well within the TTL
        while not store.keys("*") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.keys("*"), "the answer never reached Redis"
        assert all(0 < store.pttl(key) <= 1000 for key in store.keys("*"))
        time.sleep(1.3)
        assert store.keys("*") == []
        # the reader never held it in memory: only Redis could have answered it, and it has expired
        later = _chat(reader_base, temperature=0, messages=[{"role": "user", "content": "expiring"}])
        assert later.headers["x-tidegate-cache"] == "miss"
        assert _metric(reader_base, "tidegate_response_cache_requests_total", result="hit_redis") == 0
        assert _upstream_requests(mock_port) == 2
    finally:
        _stop(writer, reader, mock, redis_process)


@pytest.mark.slow
def test_a_paraphrase_gets_the_semantic_cache_answer_and_a_near_miss_does_not(tmp_path: Path) -> None:
    mock, mock_port = _mock(ttft_ms=1500)
    semantic = {"embedding_pool": "minilm", "rung_threshold": 0.75}
    pools = [{**_pool("m", mock_port), "response_cache": {"semantic": semantic}},
             {"name": "minilm", "backends": [{"type": "embedded", "model": "all-MiniLM-L6-v2", "threads": 1}]}]
    gateway, base = _gateway(tmp_path, pools)
    try:
        def ask(question: str, key: str = "sk-alice", **body: object) -> Answer:
            return _chat(base, key, messages=[{"role": "system", "content": "You are a helpful support agent."},
                                              {"role": "user", "content": question}], **body)

        stored = ask("How do I reset my password?", temperature=0)
        assert stored.headers["x-tidegate-cache"] == "miss"
        paraphrase = ask("How can I reset my password?", temperature=0)
        assert paraphrase.headers["x-tidegate-cache"] == "hit"
        assert float(paraphrase.headers["x-tidegate-cache-similarity"]) >= 0.86
        assert paraphrase.headers["x-tidegate-cache-threshold"] == "0.860"  # the default, beside the similarity
        assert paraphrase.json()["choices"] == stored.json()["choices"]
        assert ask("How do I reset my password?", "sk-bob", temperature=0).headers["x-tidegate-cache"] == "miss"
        assert ask("What is 15% of 200?", temperature=0).headers["x-tidegate-cache"] == "miss"
        assert ask("What is 25% of 200?", temperature=0).headers["x-tidegate-cache"] == "miss"  # the guard

        async def shed_paraphrase() -> tuple[Answer, Answer]:
            busy = asyncio.create_task(asyncio.to_thread(ask, "something long", "sk-alice"))
            await asyncio.sleep(0.3)  # the pool's only slot is taken; `low` may not queue
            shed = await asyncio.to_thread(ask, "I forgot my password, how do I reset it?", "sk-free",
                                           temperature=0.7)
            return await busy, shed

        busy, sampled = asyncio.run(shed_paraphrase())
        assert sampled.status_code == 503  # `free` has no answer of its own: scopes are per tenant
        assert ask("How do I reset my password?", "sk-free", temperature=0).status_code == 200
        _, sampled = asyncio.run(shed_paraphrase())
        assert sampled.status_code == 200 and sampled.headers["x-tidegate-degradation"] == "cached_answer"
        assert "x-tidegate-cache-similarity" in sampled.headers
        assert sampled.headers["x-tidegate-cache-threshold"] == "0.750"  # the rung's looser one
    finally:
        gateway.stop()
        mock.stop()


@pytest.mark.slow
def test_semantic_entries_kept_in_redis_are_restored_by_a_gateway_that_starts_later(tmp_path: Path) -> None:
    redis_process, redis_url = start_redis()
    mock, mock_port = _mock()
    semantic = {"embedding_pool": "minilm", "threshold": 0.8}
    pools = [{**_pool("m", mock_port), "response_cache": {"semantic": semantic}},
             {"name": "minilm", "backends": [{"type": "embedded", "model": "all-MiniLM-L6-v2", "threads": 1}]}]
    cache = {"redis_url": redis_url}
    first = second = None

    def ask(base: str, question: str) -> Answer:
        return _chat(base, messages=[{"role": "system", "content": "You are a helpful support agent."},
                                     {"role": "user", "content": question}], temperature=0)

    try:
        first, first_base = _gateway(tmp_path, pools, cache=cache)
        assert ask(first_base, "How do I reset my password?").headers["x-tidegate-cache"] == "miss"
        time.sleep(0.5)  # the answer and its semantic entries go to Redis in the background
        first.stop()
        first = None
        second, second_base = _gateway(tmp_path, pools, cache=cache)  # loads the entries as it starts
        paraphrase = ask(second_base, "How can I reset my password?")
        assert paraphrase.headers["x-tidegate-cache"] == "hit"
        assert paraphrase.headers["x-tidegate-cache-threshold"] == "0.800"
        assert _metric(second_base, "tidegate_semantic_cache_lookups_total", result="hit") == 1
        assert _upstream_requests(mock_port) == 1
    finally:
        _stop(first, second, mock, redis_process)
