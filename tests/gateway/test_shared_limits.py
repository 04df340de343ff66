"""Per-tenant RPM/TPM limits shared by several gateways through a real `redis-server`.

First the Lua scripts, driven through `SharedLimits` with a time passed in: they decide exactly as
the in-process `RateLimiter` does (same outcomes, waits, headers, messages), charge every bucket or
none, ignore a clock stepping back, and their keys expire once full. Then the client's edges: a
flushed script cache, a slow Redis, a caller that leaves, Redis down at start. Then real `tidegate
serve` processes over mock upstreams: two gateways share one tenant's limit exactly, a token
reservation is settled across gateways, a gateway with a clock hours off changes nothing, and with
Redis killed each `on_redis_error` mode behaves as configured, the gateway serves on, and
reservations go back to Redis when it returns.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support import ManagedProcess, free_port, start_process, start_redis, tidegate_argv  # noqa: E402

from tidegate.errors import OverloadedError  # noqa: E402
from tidegate.gateway.shared_limits import SharedLimits, SharedLimitSettings  # noqa: E402
from tidegate.policy.admission import AdmissionOutcome, LimitKind, RateLimit, RateLimiter  # noqa: E402

_T0 = 1_000_000.0  # the scripts' time in these tests: exact in binary with quarter seconds added


@pytest.fixture(scope="module")
def redis_server() -> Iterator[str]:
    process, url = start_redis()
    try:
        yield url
    finally:
        process.stop()


_prefixes = itertools.count()


def _shared(url: str, limiter: RateLimiter, clock: list[float] | None = None, *, mode: str = "local",
            gateways: int = 1, timeout_s: float = 0.25, retry_s: float = 0.2, local_refusals: bool = True
            ) -> SharedLimits:
    """SharedLimits on their own key prefix; with `clock`, the scripts run at _T0 + clock[0]."""
    settings_ = SharedLimitSettings(url, mode, gateways, timeout_s, retry_s, key_prefix=f"test{next(_prefixes)}:")
    if clock is None:
        return SharedLimits(settings_, limiter, CollectorRegistry(), local_refusals=local_refusals)
    return SharedLimits(settings_, limiter, CollectorRegistry(), clock=lambda: clock[0],
                        redis_now=lambda: _T0 + clock[0], local_refusals=local_refusals)


def _limiter() -> RateLimiter:
    # refills of 2 requests, 20 and 10 tokens a second: quarter seconds keep every level exact
    return RateLimiter({"t": RateLimit(requests_per_minute=120, tokens_per_minute=1200)},
                       model_limits={("t", "big"): RateLimit(tokens_per_minute=600)})


# ---- the scripts ---------------------------------------------------------------------------------

_OPS = st.lists(st.tuples(st.sampled_from(["admit", "admit", "settle"]), st.integers(0, 12).map(lambda q: q / 4),
                          st.sampled_from(["m", "big"]), st.integers(0, 400), st.integers(0, 700)),
                min_size=1, max_size=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_the_scripts_decide_as_the_in_process_limiter(redis_server: str, ops: list) -> None:
    async def run() -> None:
        clock = [0.0]
        shared = _shared(redis_server, _limiter(), clock, local_refusals=False)  # every decision the scripts'
        await shared.start()
        local = _limiter()
        open_: list = []
        try:
            for op, step_s, model, a, b in ops:
                clock[0] += step_s
                now_s = clock[0]
                if op == "admit":
                    admission = await shared.admit("t", model, a, b)
                    ours, theirs = admission.decision, local.admit(now_s, "t", model, a, b)
                    assert (ours.outcome, ours.limit_hit, ours.retry_after_s, ours.headers, ours.message) == \
                        (theirs.outcome, theirs.limit_hit, theirs.retry_after_s, theirs.headers, theirs.message)
                    if ours.outcome is AdmissionOutcome.ADMITTED:
                        open_.append((admission, theirs.reservation))
                elif open_:
                    admission, reservation = open_.pop(a % len(open_))
                    admission.settle(b)  # used tokens: under, at or over the reservation
                    local.settle(now_s, reservation, b)
                    await shared.barrier()
        finally:
            await shared.close()

    asyncio.run(run())


async def test_an_empty_request_bucket_refuses_without_asking_redis_until_it_can_refill(redis_server: str) -> None:
    clock = [0.0]
    shared = _shared(redis_server, RateLimiter({"t": RateLimit(requests_per_minute=60, tokens_per_minute=6000)}),
                     clock)
    await shared.start()
    try:
        for _ in range(60):
            assert (await shared.admit("t", "m", 1, 1)).decision.admitted
        asked = (await shared.admit("t", "m", 1, 1)).decision
        assert asked.limit_hit is LimitKind.REQUESTS and asked.retry_after_s == 1.0
        clock[0] = 0.75
        here = (await shared.admit("t", "m", 1, 1)).decision
        assert shared.metrics.local_refusals._value.get() == 1  # noqa: SLF001 - answered without a round trip
        assert here.outcome is AdmissionOutcome.RATE_LIMITED and here.retry_after_s == pytest.approx(0.25)
        assert here.headers.remaining_requests == 0 and here.headers.reset_requests_s == pytest.approx(59.25)
        assert "requests per minute (tenant t)" in here.message
        clock[0] = 1.0  # one request refilled: Redis decides again
        assert (await shared.admit("t", "m", 1, 1)).decision.admitted
        assert shared.metrics.local_refusals._value.get() == 1  # noqa: SLF001
    finally:
        await shared.close()


async def test_a_request_is_charged_to_every_bucket_or_to_none(redis_server: str) -> None:
    clock = [0.0]
    shared = _shared(redis_server, _limiter(), clock)
    await shared.start()
    client = redis.Redis.from_url(redis_server)
    try:
        assert (await shared.admit("t", "big", 100, 300)).decision.admitted  # 400 of big's 600 tokens
        tenant_key = f"{shared.settings.key_prefix}{{t}}"
        before = client.hgetall(tenant_key)
        refused = (await shared.admit("t", "big", 100, 200)).decision  # the tenant's 800 left would take it
        assert refused.outcome is AdmissionOutcome.RATE_LIMITED and refused.limit_hit is LimitKind.TOKENS
        assert "model big" in refused.message
        assert client.hgetall(tenant_key) == before  # refused by big's limit: the tenant's buckets untouched
        too_large = (await shared.admit("t", "big", 100, 501)).decision
        assert too_large.outcome is AdmissionOutcome.TOO_LARGE and too_large.retry_after_s is None
    finally:
        client.close()
        await shared.close()


async def test_a_clock_stepping_back_refills_nothing(redis_server: str) -> None:
    clock = [10.0]
    shared = _shared(redis_server, RateLimiter({"t": RateLimit(requests_per_minute=60)}), clock)
    await shared.start()
    try:
        assert (await shared.admit("t", "m", 1, 1)).decision.headers.remaining_requests == 59
        clock[0] = 5.0
        assert (await shared.admit("t", "m", 1, 1)).decision.headers.remaining_requests == 58
        clock[0] = 11.0  # one second after the latest time seen: one request refilled, not six
        assert (await shared.admit("t", "m", 1, 1)).decision.headers.remaining_requests == 58
    finally:
        await shared.close()


async def test_keys_expire_once_their_buckets_would_be_full(redis_server: str) -> None:
    shared = _shared(redis_server, RateLimiter({"t": RateLimit(requests_per_minute=60, tokens_per_minute=6000)}))
    await shared.start()
    client = redis.Redis.from_url(redis_server)
    try:
        await shared.admit("t", "m", 100, 200)  # 1 s to refill the request, 3 s the tokens
        ttl_ms = client.pttl(f"{shared.settings.key_prefix}{{t}}")
        assert 3000 <= ttl_ms <= 4000 + 50
    finally:
        client.close()
        await shared.close()


async def test_settlement_refunds_within_capacity_and_an_overrun_never_goes_below_zero(redis_server: str) -> None:
    clock = [0.0]
    shared = _shared(redis_server, RateLimiter({"t": RateLimit(tokens_per_minute=1000)}), clock)
    await shared.start()
    try:
        first = await shared.admit("t", "m", 100, 400)
        second = await shared.admit("t", "m", 100, 300)
        first.settle(5000)  # far past its reservation: takes what is left (200), never more
        await shared.barrier()
        assert (await shared.admit("t", "m", 0, 0)).decision.headers.remaining_tokens == 0
        second.settle(0)  # gives back 400, whatever the overrun took
        await shared.barrier()
        assert (await shared.admit("t", "m", 0, 0)).decision.headers.remaining_tokens == 400
        clock[0] = 60.0
        assert (await shared.admit("t", "m", 0, 0)).decision.headers.remaining_tokens == 1000  # not past capacity
    finally:
        await shared.close()


async def test_a_flushed_script_cache_is_answered_by_eval(redis_server: str) -> None:
    shared = _shared(redis_server, RateLimiter({"t": RateLimit(requests_per_minute=60, tokens_per_minute=1000)}))
    await shared.start()
    client = redis.Redis.from_url(redis_server)
    try:
        client.script_flush()
        admitted = await shared.admit("t", "m", 100, 100)
        assert admitted.decision.admitted and admitted.decision.headers.remaining_tokens == 800
        client.script_flush()
        admitted.settle(50)
        await shared.barrier()
        assert (await shared.admit("t", "m", 0, 0)).decision.headers.remaining_tokens >= 950
        assert shared.redis_up and shared.metrics.errors._metrics == {}  # noqa: SLF001 - no error counted
    finally:
        client.close()
        await shared.close()


# holds Redis busy (a script runs alone) for ARGV[1] seconds: a Redis too slow to answer
_BUSY_SCRIPT = """
local function now() local t = redis.call('TIME') return tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local until_s = now() + tonumber(ARGV[1])
while now() < until_s do end
return 1
"""


async def test_a_redis_slower_than_the_timeout_is_an_outage(redis_server: str) -> None:
    shared = _shared(redis_server, RateLimiter({"t": RateLimit(requests_per_minute=60)}), mode="fail_open",
                     timeout_s=0.1, retry_s=0.2)
    await shared.start()
    client = redis.Redis.from_url(redis_server)
    sleeper = threading.Thread(target=lambda: client.eval(_BUSY_SCRIPT, 0, "0.6"))
    try:
        sleeper.start()
        time.sleep(0.05)
        started = time.monotonic()
        decision = (await shared.admit("t", "m", 1, 1)).decision
        assert decision.admitted and decision.headers is None  # fail_open: admitted, no account
        assert time.monotonic() - started < 0.3
        assert not shared.redis_up
        assert shared.metrics.errors.labels("timeout")._value.get() == 1  # noqa: SLF001
        sleeper.join()
        deadline = time.monotonic() + 5
        while not shared.redis_up and time.monotonic() < deadline:
            await shared.admit("t", "m", 1, 1)  # an admission after redis_retry_s tries Redis again
            await asyncio.sleep(0.05)
        assert shared.redis_up
        assert (await shared.admit("t", "m", 1, 1)).decision.headers is not None
    finally:
        sleeper.join()
        client.close()
        await shared.close()


async def test_an_admission_whose_caller_left_gives_its_tokens_back(redis_server: str) -> None:
    shared = _shared(redis_server, RateLimiter({"t": RateLimit(tokens_per_minute=6000)}))
    await shared.start()
    try:
        task = asyncio.ensure_future(shared.admit("t", "m", 1000, 2000))
        await asyncio.sleep(0)  # written, not yet answered
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await shared.barrier()
        await shared.barrier()  # the give-back, sent when the orphaned decision came
        assert (await shared.admit("t", "m", 0, 0)).decision.headers.remaining_tokens >= 5999
    finally:
        await shared.close()


async def test_redis_down_at_start_is_an_outage_until_it_comes(tmp_path: Path) -> None:
    port = free_port()
    shared = _shared(f"redis://127.0.0.1:{port}/0", RateLimiter({"t": RateLimit(requests_per_minute=4)}),
                     mode="local", gateways=2, retry_s=0.1)
    await shared.start()  # no Redis: starts anyway
    process = None
    try:
        assert not shared.redis_up
        decisions = [(await shared.admit("t", "m", 1, 1)).decision for _ in range(3)]
        assert [d.admitted for d in decisions] == [True, True, False]  # 4 / 2 gateways, in this process
        assert decisions[0].headers.limit_requests == 2
        process, _ = start_redis(port=port)
        deadline = time.monotonic() + 5
        while not shared.redis_up and time.monotonic() < deadline:
            await shared.admit("t", "m", 1, 1)
            await asyncio.sleep(0.05)
        assert shared.redis_up
        # its two local admissions were charged to Redis on its return: 2 of 4 left, not 4
        assert (await shared.admit("t", "m", 1, 1)).decision.headers.remaining_requests == 1
    finally:
        await shared.close()
        if process is not None:
            process.stop()


async def test_fail_closed_refuses_with_retry_after(tmp_path: Path) -> None:
    shared = _shared(f"redis://127.0.0.1:{free_port()}/0", RateLimiter({"t": RateLimit(requests_per_minute=4)}),
                     mode="fail_closed")
    await shared.start()
    try:
        with pytest.raises(OverloadedError) as refused:
            await shared.admit("t", "m", 1, 1)
        assert refused.value.status == 503 and refused.value.retry_after_s >= 1
        assert (await shared.admit("unlimited", "m", 1, 1)).decision.admitted  # no limit: nothing to ask
    finally:
        await shared.close()


# ---- gateways -------------------------------------------------------------------------------------

_TENANTS = {
    "rpm": {"api_keys": ["sk-rpm"], "requests_per_minute": 12},
    "tpm": {"api_keys": ["sk-tpm"], "tokens_per_minute": 6000},
    "skew": {"api_keys": ["sk-skew"], "requests_per_minute": 10},
    "capped": {"api_keys": ["sk-capped"], "requests_per_minute": 4},
    "poll": {"api_keys": ["sk-poll"], "requests_per_minute": 100000},
    "free": {"api_keys": ["sk-free"]},
}
_TIERS = {"default": "high", "levels": {"high": {"rank": 0, "max_queue_wait_s": 10, "ttft_target_s": 10}}}
# a gateway process whose clocks run hours ahead (time.time and time.monotonic)
_SKEWED_CLOCK = '''
import os, time
_offset = float(os.environ.get("TIDEGATE_TEST_CLOCK_OFFSET_S", "0"))
if _offset:
    _time, _monotonic = time.time, time.monotonic
    time.time = lambda: _time() + _offset
    time.monotonic = lambda: _monotonic() + _offset
'''


def _mock(ttft_ms: int = 0, tokens: int = 4) -> tuple[ManagedProcess, int]:
    port = free_port()
    process = start_process(tidegate_argv("mock-upstream", "--port", str(port), "--tokens", str(tokens),
                                          "--ttft-ms", str(ttft_ms), "--itl-ms", "0"),
                            ready_url=f"http://127.0.0.1:{port}/health", timeout_s=30)
    return process, port


def _gateway(tmp: Path, mock_ports: dict[str, int], shared_state: dict, env: dict[str, str] | None = None
             ) -> tuple[ManagedProcess, str]:
    port = free_port()
    config = {"server": {"port": port, "access_log": False}, "health": {"interval_s": 0.5},
              "pools": [{"name": name, "backends": [{"type": "upstream", "url": f"http://127.0.0.1:{p}/v1"}]}
                        for name, p in mock_ports.items()],
              "tenants": _TENANTS, "tiers": _TIERS, "shared_state": shared_state}
    path = tmp / f"gateway-{port}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = start_process(tidegate_argv("serve", "--config", str(path)), ready_url=f"http://127.0.0.1:{port}/ready",
                            timeout_s=30, env=env)
    return process, f"http://127.0.0.1:{port}"


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


def _chat(base: str, key: str, model: str = "m", max_tokens: int = 4, content: str = "hello") -> Answer:
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/v1/chat/completions", headers={"authorization": f"Bearer {key}",
                                                                    "content-type": "application/json"},
                           body=json.dumps({"model": model, "max_tokens": max_tokens,
                                            "messages": [{"role": "user", "content": content}]}))
        response = connection.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


def _metric(base: str, name: str, **labels: str) -> float:
    request = urllib.request.Request(f"{base}/metrics", headers={"authorization": "Bearer sk-free"})
    text = urllib.request.urlopen(request, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"{name}(\{{|\s)", line) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory, redis_server: str) -> Iterator[tuple[str, str, str]]:
    """Two gateways, and a third whose clocks run three hours ahead, on one Redis."""
    tmp = tmp_path_factory.mktemp("shared-limits")
    (tmp / "skewed").mkdir()
    (tmp / "skewed" / "sitecustomize.py").write_text(_SKEWED_CLOCK)
    started: list[ManagedProcess] = []
    try:
        for ttft_ms in (0, 1500):
            process, port = _mock(ttft_ms)
            started.append(process)
            if ttft_ms == 0:
                fast = port
            else:
                slow = port
        shared_state = {"backend": "redis", "redis_url": redis_server, "redis_retry_s": 0.2}
        bases = []
        for env in (None, None, {"PYTHONPATH": str(tmp / "skewed"), "TIDEGATE_TEST_CLOCK_OFFSET_S": "10800"}):
            process, base = _gateway(tmp, {"m": fast, "slow": slow}, shared_state, env)
            started.append(process)
            bases.append(base)
        yield bases[0], bases[1], bases[2]
    finally:
        for process in reversed(started):
            process.stop()


def _spread(bases: list[str], key: str, count: int) -> list[tuple[str, Answer]]:
    """`count` requests at once, dealt round-robin over the gateways."""
    with ThreadPoolExecutor(8) as pool:
        targets = [bases[i % len(bases)] for i in range(count)]
        return list(zip(targets, pool.map(lambda base: _chat(base, key), targets)))


def test_two_gateways_share_one_tenants_request_limit_exactly(gateways: tuple[str, str, str]) -> None:
    first, second, _ = gateways
    started = time.monotonic()
    answers = _spread([first, second], "sk-rpm", 24)
    assert time.monotonic() - started < 4.0  # 12 a minute refill one request in 5 s: none refilled
    admitted = [answer for _, answer in answers if answer.status == 200]
    assert len(admitted) == 12  # not 12 per gateway
    assert sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in admitted) == list(range(12))
    refused = [answer for _, answer in answers if answer.status == 429]
    assert len(refused) == 12
    assert all(int(a.headers["retry-after"]) >= 1 and a.headers["x-ratelimit-limit-requests"] == "12"
               for a in refused)
    assert "requests per minute" in json.loads(refused[0].body)["error"]["message"]


def test_a_token_reservation_is_settled_across_gateways(gateways: tuple[str, str, str]) -> None:
    first, second, _ = gateways
    with ThreadPoolExecutor(1) as pool:
        # reserves ~4,002 of 6,000 tokens for the 1.5 s its answer takes on the first gateway
        long_one = pool.submit(_chat, first, "sk-tpm", "slow", 4000)
        time.sleep(0.5)
        refused = _chat(second, "sk-tpm", max_tokens=3000)
        assert refused.status == 429 and "tokens per minute" in json.loads(refused.body)["error"]["message"]
        assert long_one.result().status == 200
    # it used ~6 tokens: the rest is given back at once, not refilled over 30 s
    deadline = time.monotonic() + 1.0
    again = _chat(second, "sk-tpm", max_tokens=3000)
    while again.status != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
        again = _chat(second, "sk-tpm", max_tokens=3000)
    assert again.status == 200
    # 6,000 less the first's ~6 used, less this one's ~3,002 reserved, plus a few seconds of refill
    assert 2900 <= int(again.headers["x-ratelimit-remaining-tokens"]) <= 3000 + 100 * 4


def test_a_gateway_clock_hours_off_changes_nothing(gateways: tuple[str, str, str]) -> None:
    first, _, skewed = gateways
    answers = _spread([first, skewed], "sk-skew", 20)
    by_gateway = {base: sum(a.status == 200 for b, a in answers if b == base) for base in (first, skewed)}
    assert sum(by_gateway.values()) == 10, by_gateway  # Redis's clock decides: 3 h ahead refills nothing


def _logged(process: ManagedProcess, text: str) -> int:
    return process.log().count(text)


def test_with_redis_gone_each_mode_behaves_as_configured_and_redis_takes_over_again(
        tmp_path: Path) -> None:
    redis_process, url = start_redis()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    started: list[ManagedProcess] = []
    try:
        mock, mock_port = _mock()
        started.append(mock)
        common = {"backend": "redis", "redis_url": url, "redis_retry_s": 0.3, "redis_timeout_s": 0.25}
        modes = {}
        for mode, extra in (("fail_open", {}), ("fail_closed", {}), ("local", {"gateway_count": 2})):
            process, base = _gateway(tmp_path, {"m": mock_port}, {**common, "on_redis_error": mode, **extra})
            started.append(process)
            modes[mode] = (process, base)
        for _, base in modes.values():
            assert _chat(base, "sk-poll").status == 200
            assert _metric(base, "tidegate_shared_state_redis_up") == 1

        redis_process.kill()
        open_base, closed_base, local_base = (modes[m][1] for m in ("fail_open", "fail_closed", "local"))
        assert [_chat(open_base, "sk-capped").status for _ in range(6)] == [200] * 6  # past its 4 a minute
        closed = _chat(closed_base, "sk-capped")
        assert closed.status == 503 and int(closed.headers["retry-after"]) >= 1
        assert json.loads(closed.body)["error"]["code"] == "rate_limits_unavailable"
        assert _chat(closed_base, "sk-free").status == 200  # no limit: served without Redis
        assert [_chat(local_base, "sk-capped").status for _ in range(3)] == [200, 200, 429]  # 4 / 2 gateways
        time.sleep(0.7)  # reconnections fail meanwhile: still one outage, one log line
        for mode, (process, base) in modes.items():
            assert _chat(base, "sk-poll").status == (503 if mode == "fail_closed" else 200)
            assert _metric(base, "tidegate_shared_state_redis_up") == 0
            assert _metric(base, "tidegate_shared_state_errors_total") >= 2  # the lost connection, a reconnection
            assert _metric(base, "tidegate_shared_state_fallback_admissions_total", mode=mode) >= 1
            assert _logged(process, "Redis unavailable") == 1, mode

        redis_process, _ = start_redis(port=port)  # empty: a fresh Redis
        for mode, (process, base) in modes.items():
            deadline = time.monotonic() + 10
            while _metric(base, "tidegate_shared_state_redis_up") != 1 and time.monotonic() < deadline:
                _chat(base, "sk-poll")  # an admission after redis_retry_s tries Redis again
                time.sleep(0.1)
            assert _metric(base, "tidegate_shared_state_redis_up") == 1, mode
            assert _logged(process, "Redis answers again") == 1, mode
        # the local gateway charged its ~2 local admissions to the fresh Redis on its return: of
        # 4 a minute, 2 are left to all three gateways together
        answers = [_chat(modes[m][1], "sk-capped").status for m in ("fail_open", "fail_closed", "local") * 2]
        assert answers.count(200) == 2, answers
        assert redis.Redis.from_url(url).exists("tidegate:rl:{capped}")
    finally:
        for process in reversed(started):
            process.stop()
        redis_process.stop()
