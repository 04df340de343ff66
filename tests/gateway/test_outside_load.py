"""Load from outside the gateway: clients that reach the engine directly take slots the gateway
no longer fills (`policy.slot_split.OutsideLoad`, read off the engine's gauges by the health checks).

An in-process gateway with overload control over a real mock upstream that reports vLLM's running
gauge; requests sent straight to the mock stand for a notebook or another service using the engine.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tidegate.config import parse_config
from tidegate.gateway.app import Gateway

SLOTS = 4
OUTSIDE = 3
_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def mock_url(start_mock) -> str:
    return start_mock(tokens=4).url


def _config(mock_url: str) -> str:
    return (f"server: {{port: 0, access_log: false}}\nhealth: {{interval_s: 0.05}}\npools:\n  - name: m\n"
            f"    backends:\n      - {{type: upstream, url: '{mock_url}', slot_limit: {SLOTS}}}\n")


async def _until(condition, timeout_s: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


async def test_requests_sent_straight_to_the_engine_leave_the_gateway_fewer_slots(mock_url: str) -> None:
    gateway = Gateway(parse_config(_config(mock_url)))
    await gateway.start()
    try:
        assert await gateway.wait_ready(5.0)
        assert gateway.overload is not None
        controller = gateway.overload.bodies["m"].controller
        (replica,) = gateway.pools["m"].replicas
        rid = replica.replica_id
        assert controller.slot_grant(rid) == SLOTS
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
            async def direct() -> int:  # a client of the engine itself, 2 s to its first token
                async with session.post(f"{mock_url}/chat/completions", json=_CHAT,
                                        headers={"x-mock-ttft-ms": "2000"}) as response:
                    await response.read()
                    return response.status

            outside = [asyncio.create_task(direct()) for _ in range(OUTSIDE)]
            assert await _until(lambda: controller.slot_grant(rid) == SLOTS - OUTSIDE, 1.8)
            async with session.get(f"http://127.0.0.1:{gateway.port}/metrics") as response:
                assert f'tidegate_replica_slots{{pool="m",replica="{rid}"}} {float(SLOTS - OUTSIDE)}' in await response.text()
            # the gateway still serves, within the slots left
            async with session.post(f"http://127.0.0.1:{gateway.port}/v1/chat/completions", json=_CHAT) as response:
                assert response.status == 200
            assert await asyncio.gather(*outside) == [200] * OUTSIDE
            # the outside clients are gone: every slot is the gateway's again
            assert await _until(lambda: controller.slot_grant(rid) == SLOTS, 2.0)
    finally:
        await gateway.stop()
