"""The upstream key stays out of what clients receive, however a leaky upstream quotes it back.

A real `tidegate serve` in front of `leaky_upstream`, one pool per leak, each with an `api_key`.
Every answer is checked in all its views (raw bytes, decoded JSON strings, `\\uXXXX` and percent
escapes undone, base64 runs decoded) for any 10-character piece of the key, and for being intact.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import re
import time
import urllib.parse
from collections.abc import Iterator

import pytest

from gateway_harness import Gateway, upstream_pool
from leaky_upstream import LEAKS, serve_leaky_upstream

UPSTREAM_KEY = "sk-upstream-SECRET-0123456789abcdefXYZ"
MESSAGES = [{"role": "user", "content": "hello"}]
_KEY_PIECES = {UPSTREAM_KEY[start:start + 10] for start in range(len(UPSTREAM_KEY) - 9)}
_UNICODE_ESCAPE = re.compile(r"\\+u([0-9a-fA-F]{4})")
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{12,}")


@pytest.fixture(scope="module")
def gateway(start_gateway) -> Iterator[Gateway]:
    with serve_leaky_upstream() as port:
        yield start_gateway([upstream_pool(leak, f"http://127.0.0.1:{port}/{leak}/v1", api_key=UPSTREAM_KEY,
                                           health_path=None, metrics_path=None) for leak in LEAKS])


def _post(gateway: Gateway, model: str, stream: bool = False) -> tuple[int, str, list[tuple[str, str]], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=10)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(
            {"model": model, "messages": MESSAGES, "stream": stream}), {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, response.reason, response.getheaders(), response.read()
    finally:
        connection.close()


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)


def _views(text: str) -> Iterator[str]:
    """`text` as a reader of it could decode it: JSON strings, escapes undone, base64 runs decoded."""
    texts = [text]
    for line in [text, *text.splitlines()]:
        try:
            texts.extend(_strings(json.loads(line.removeprefix("data:"))))
        except ValueError:
            pass
    for each in texts:
        unescaped = _UNICODE_ESCAPE.sub(lambda match: chr(int(match[1], 16)), each)
        for view in (each, unescaped, urllib.parse.unquote(unescaped)):
            yield view
            for run in _BASE64_RUN.findall(view.replace("\\/", "/")):
                for skip in range(4):
                    part = run[skip:]
                    part = part[:len(part) - len(part) % 4]
                    for decode in (base64.b64decode, base64.urlsafe_b64decode):
                        try:
                            yield decode(part).decode("latin-1")
                        except (binascii.Error, ValueError):
                            pass


def _assert_key_hidden(*texts: str) -> None:
    for text in texts:
        for view in _views(text):
            leaked = [piece for piece in _KEY_PIECES if piece in view]
            assert not leaked, f"key piece {leaked[0]!r} in {view[:300]!r}"


def _assert_answer_hidden(reason: str, headers: list[tuple[str, str]], body: bytes) -> None:
    _assert_key_hidden(reason, *(f"{name}: {value}" for name, value in headers), body.decode("utf-8"))


def _events(body: bytes) -> list[dict]:
    """The stream's JSON events; fails unless every `data:` line parses and it ends with [DONE]."""
    data = [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", body
    return [json.loads(item) for item in data[:-1]]


def test_escaped_key_in_an_error_body_is_scrubbed(gateway: Gateway) -> None:
    status, reason, headers, body = _post(gateway, "escaped-error")
    assert status == 401
    _assert_answer_hidden(reason, headers, body)
    error = json.loads(body)["error"]  # still the upstream's error, as valid JSON
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert error["message"].startswith("Incorrect API key provided: Bearer ***")


def test_key_in_a_plain_text_error_is_scrubbed(gateway: Gateway) -> None:
    status, reason, headers, body = _post(gateway, "plain-error")
    assert status == 500
    _assert_answer_hidden(reason, headers, body)
    assert body.startswith(b"upstream crashed handling Bearer ***")
    assert dict((name.lower(), value) for name, value in headers)["content-type"] == "text/plain"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_content_type_quoting_the_key_is_replaced(gateway: Gateway, stream: bool) -> None:
    status, reason, headers, body = _post(gateway, "content-type", stream=stream)
    assert status == 200
    _assert_answer_hidden(reason, headers, body)
    content_type = dict((name.lower(), value) for name, value in headers)["content-type"]
    assert content_type == ("text/event-stream" if stream else "application/json")
    if stream:
        assert _events(body)[0]["choices"][0]["delta"]["content"] == "hi"
    else:
        assert json.loads(body)["choices"][0]["message"]["content"] == "hi / hi"


def test_error_event_in_a_stream_is_scrubbed(gateway: Gateway) -> None:
    status, reason, headers, body = _post(gateway, "stream-error-event", stream=True)
    assert status == 200
    _assert_answer_hidden(reason, headers, body)
    events = _events(body)
    assert events[1]["choices"][0]["delta"]["content"] == "hi"
    assert events[2]["error"] == {"message": "quota exceeded for key ***", "type": "server_error",
                                  "code": "rate_limited"}


def test_key_echoed_in_a_200_body_is_scrubbed(gateway: Gateway) -> None:
    status, reason, headers, body = _post(gateway, "success-echo")
    assert status == 200
    _assert_answer_hidden(reason, headers, body)
    reply = json.loads(body)
    assert reply["choices"][0]["message"]["content"] == "you sent Bearer *** / you sent Bearer ***"
    assert reply["usage"]["completion_tokens"] == 3


def test_key_echoed_in_a_200_stream_is_scrubbed(gateway: Gateway) -> None:
    status, reason, headers, body = _post(gateway, "success-echo", stream=True)
    assert status == 200
    _assert_answer_hidden(reason, headers, body)
    events = _events(body)
    assert events[1]["choices"][0]["delta"]["content"] == "you sent Bearer ***"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_key_never_in_the_gateway_log(gateway: Gateway) -> None:
    for leak in LEAKS:
        _post(gateway, leak)
        _post(gateway, leak, stream=True)
    time.sleep(0.5)  # the access log is written in batches
    _assert_key_hidden(gateway.process.log())
