"""The gateway's light body check: OpenAI's nulls mean "not set"."""

from __future__ import annotations

import pytest

from tidegate.errors import InvalidRequestError
from tidegate.gateway.validation import Endpoint, check_body

BODIES = {
    Endpoint.CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    Endpoint.COMPLETIONS: {"model": "m", "prompt": "hi"},
    Endpoint.EMBEDDINGS: {"model": "m", "input": "hi"},
}


@pytest.mark.parametrize("endpoint", list(Endpoint))
def test_null_stream_and_token_limits_are_not_set(endpoint: Endpoint) -> None:
    body = {**BODIES[endpoint], "stream": None, "max_tokens": None, "max_completion_tokens": None,
            "temperature": None, "top_p": None, "n": None}
    assert check_body(endpoint, body, max_tokens_cap=100) == ("m", False)


def test_a_stream_that_is_no_boolean_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError) as raised:
        check_body(Endpoint.CHAT, {**BODIES[Endpoint.CHAT], "stream": "yes"}, max_tokens_cap=100)
    assert raised.value.param == "stream"
