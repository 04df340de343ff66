"""What the engine's request schemas accept: OpenAI's nulls, and a 400 naming the field otherwise."""

from __future__ import annotations

import orjson
import pytest

from tidegate.engine.schemas import ChatRequest, CompletionRequest, parse_request
from tidegate.errors import InvalidRequestError

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
# every optional field OpenAI's spec makes nullable, as clients send the options they leave unset
NULLS = {"stream": None, "temperature": None, "top_p": None, "n": None, "max_tokens": None, "seed": None,
         "stop": None, "stream_options": None, "user": None, "presence_penalty": None, "logprobs": None,
         "tools": None, "tool_choice": None, "response_format": None, "logit_bias": None}


def _parse(body: dict, kind: type = ChatRequest):
    return parse_request(orjson.dumps(body), kind)


def _refusal(body: dict, kind: type = ChatRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        _parse(body, kind)
    return raised.value


@pytest.mark.parametrize(("base", "kind"), [(CHAT, ChatRequest), (COMPLETION, CompletionRequest)])
def test_null_optional_fields_take_their_defaults(base: dict, kind: type) -> None:
    body = _parse({**base, **NULLS}, kind)
    assert (body.stream, body.temperature, body.top_p, body.include_usage) == (False, 1.0, 1.0, False)


def test_null_in_nested_optional_fields_takes_their_defaults() -> None:
    body = _parse({**CHAT, "stream": True, "stream_options": {"include_usage": None},
                   "messages": [{"role": "assistant", "content": None}, {"role": "user", "content": "hi"}]})
    assert body.include_usage is False and body.messages[0].text() == ""


def test_a_null_required_field_is_refused_by_name() -> None:
    assert _refusal({**CHAT, "model": None}).param == "model"
    assert _refusal({"model": "m", "messages": None}).param == "messages"


def test_param_names_the_field_not_the_union_member_that_failed() -> None:
    assert _refusal({**CHAT, "messages": [{"role": "user", "content": 123}]}).param == "messages.0.content"
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    error = _refusal({**CHAT, "messages": [{"role": "user", "content": image}]})
    assert error.param == "messages.0.content.0.type" and "'text'" in error.message
    assert _refusal({**COMPLETION, "prompt": 5}, CompletionRequest).param == "prompt"
    assert _refusal({**CHAT, "stop": 5}).param == "stop"


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "required"),
    ("response_format", {"type": "json_object"}),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("logit_bias", {"50256": -100}),
    ("n", 2),
    ("n", True),
    ("logprobs", True),
    ("presence_penalty", 0.5),
    ("reasoning_effort", "low"),
])
def test_unimplemented_features_are_refused_by_name(field: str, value: object) -> None:
    error = _refusal({**CHAT, field: value})
    assert (error.status, error.param, error.code) == (400, field, "unsupported_parameter")
    assert f"'{field}'" in error.message


def test_completion_only_features_are_refused_by_name() -> None:
    assert _refusal({**COMPLETION, "echo": True}, CompletionRequest).param == "echo"
    assert _refusal({**COMPLETION, "best_of": 3}, CompletionRequest).param == "best_of"


def test_the_off_values_of_unimplemented_features_and_harmless_fields_are_accepted() -> None:
    _parse({**CHAT, "n": 1, "response_format": {"type": "text"}, "tool_choice": "none", "tools": [],
            "logit_bias": {}, "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0,
            "user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "seed": 7,
            "parallel_tool_calls": True, "stream_options": {"include_usage": True}})
