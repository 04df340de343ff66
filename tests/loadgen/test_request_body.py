"""What the driver sends: the OpenAI body for each request of the plan."""

from __future__ import annotations

import orjson

from tidegate.loadgen.driver import Driver, RunConfig
from tidegate.loadgen.http_client import parse_url
from tidegate.loadgen.mix import DEFAULT_TENANT
from tidegate.loadgen.plan import PlannedRequest


def _body(**config: object) -> dict:
    driver = Driver(RunConfig(targets=(parse_url("http://127.0.0.1:9"),), model="m", **config), [])
    request = PlannedRequest(index=0, send_at_s=0.0, tenant=DEFAULT_TENANT, prompt_tokens=16, max_tokens=8)
    raw = driver._render(request, driver._clients[0])
    return orjson.loads(raw.split(b"\r\n\r\n", 1)[1])


def test_ignore_eos_is_sent_only_when_asked() -> None:
    assert _body(ignore_eos=True)["ignore_eos"] is True
    assert "ignore_eos" not in _body()


def test_streaming_chat_asks_for_usage() -> None:
    body = _body()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 8 and body["messages"][0]["role"] == "user"
