"""`tidegate serve` over an embedded pool: one body limit, OpenAI's nulls, refusals of what the engine lacks."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import yaml
from support import free_port, start_process, tidegate_argv

pytestmark = pytest.mark.slow
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    config = {"server": {"port": port, "max_body_bytes": 4 * MIB},  # the default, said out loud
              "pools": [{"name": MODEL, "backends": [{"type": "embedded", "model": "tiny-random-llama"}]}]}
    path = tmp_path_factory.mktemp("embedded") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    process = start_process(tidegate_argv("serve", "--config", str(path)),
                            ready_url=f"http://127.0.0.1:{port}/ready", timeout_s=240)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop(timeout_s=40)


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, body: dict | bytes) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST", headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_a_body_under_the_gateways_limit_gets_past_the_engines_size_check(base: str) -> None:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * (2 * MIB)}]}
    status, answer = _post(f"{base}/v1/chat/completions", body)
    # 2 MiB is past aiohttp's default of 1 MiB, so the engine used to answer 413; now its context is the limit
    assert status == 400, answer[:300]
    assert json.loads(answer)["error"]["code"] == "context_length_exceeded"


def test_a_body_over_the_gateways_limit_is_its_413(base: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (4 * MIB + 1024)}]}
    status, answer = _post(f"{base}/v1/chat/completions", body)
    assert status == 413
    assert json.loads(answer)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_null_options_mean_not_set_in_the_engine(base: str, path: str, body: dict) -> None:
    nulls = {"stream": None, "temperature": None, "top_p": None, "n": None, "stop": None, "seed": None,
             "stream_options": None, "user": None, "presence_penalty": None, "tools": None}
    status, answer = _post(base + path, {"model": MODEL, "max_tokens": 2, **body, **nulls})
    assert status == 200, answer[:300]


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("logit_bias", {"42": 5}),
    ("n", 2),
])
def test_a_feature_the_engine_lacks_is_its_400_naming_the_field(client: openai.OpenAI, field: str,
                                                                value: object) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={field: value})
    assert caught.value.body["param"] == field and field in caught.value.body["message"]


def test_error_param_names_the_field_not_a_union_member(base: str) -> None:
    status, answer = _post(f"{base}/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": 123}]})
    assert status == 400 and json.loads(answer)["error"]["param"] == "messages.0.content"


def test_the_chat_message_has_a_null_refusal(base: str) -> None:
    status, answer = _post(f"{base}/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    message = json.loads(answer)["choices"][0]["message"]
    assert status == 200 and "refusal" in message and message["refusal"] is None
    status, answer = _post(f"{base}/v1/chat/completions",
                           {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True})
    first = json.loads(answer.split(b"\n\n")[0].removeprefix(b"data: "))
    assert status == 200 and first["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
