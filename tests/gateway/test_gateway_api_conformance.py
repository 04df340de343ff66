"""OpenAI API and HTTP details a client relies on: nulls, models.retrieve, 405s, HTTP/1.0 streams."""

from __future__ import annotations

import http.client
import json
import socket
import time

import openai
import pytest

from gateway_harness import Gateway, upstream_pool

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateway(start_mock, start_gateway) -> Gateway:
    upstream = start_mock(tokens=8)
    return start_gateway([upstream_pool("mock", upstream, model="mock-model"),
                          upstream_pool("org/model-1", upstream, model="mock-model")])


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=10)


def _request(gateway: Gateway, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)
    try:
        payload = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=payload, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"model": "mock", "messages": MESSAGES}),
    ("/v1/completions", {"model": "mock", "prompt": "once"}),
    ("/v1/embeddings", {"model": "mock", "input": "a"}),
])
def test_null_options_mean_not_set(gateway: Gateway, path: str, body: dict) -> None:
    nulls = {"stream": None, "temperature": None, "top_p": None, "n": None, "max_tokens": None, "user": None}
    status, _, answer = _request(gateway, "POST", path, {**body, **nulls})
    assert status == 200, answer


def test_models_retrieve_gives_the_model_object(client: openai.OpenAI) -> None:
    model = client.models.retrieve("mock")
    assert (model.id, model.object, model.owned_by) == ("mock", "model", "tidegate")
    assert client.models.retrieve("org/model-1").id == "org/model-1"  # a name with a slash, as HF's


def test_models_retrieve_of_an_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("POST", "/health", "GET, HEAD"),
    ("POST", "/ready", "GET, HEAD"),
    ("DELETE", "/metrics", "GET, HEAD"),
    ("POST", "/v1/models", "GET, HEAD"),
    ("DELETE", "/v1/models/mock", "GET, HEAD"),
    ("GET", "/v1/chat/completions", "POST"),
    ("PUT", "/v1/completions", "POST"),
    ("HEAD", "/v1/embeddings", "POST"),
])
def test_a_wrong_method_on_a_known_path_is_405_with_allow(gateway: Gateway, method: str, path: str,
                                                           allow: str) -> None:
    status, headers, body = _request(gateway, method, path)
    assert (status, headers.get("allow")) == (405, allow)
    if method != "HEAD":
        assert json.loads(body)["error"]["code"] == "method_not_allowed"


def test_an_unknown_path_is_404_whatever_the_method(gateway: Gateway) -> None:
    assert _request(gateway, "POST", "/v2/nothing")[0] == 404
    assert _request(gateway, "GET", "/v1/nothing")[0] == 404


@pytest.mark.parametrize("connection_header", [b"", b"connection: keep-alive\r\n"])
def test_an_http_10_stream_is_delimited_by_closing_the_connection(gateway: Gateway, connection_header: bytes) -> None:
    body = json.dumps({"model": "mock", "messages": MESSAGES, "stream": True}).encode()
    received = b""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + connection_header + b"content-length: %d\r\n\r\n%b" % (len(body), body))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)  # b"" once the gateway closes; a timeout fails the test
            if not chunk:
                break
            received += chunk
    head, _, payload = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    events = [line for line in payload.split(b"\n\n") if line]
    assert all(event.startswith(b"data: ") for event in events), payload[:200]
    assert events[-1] == b"data: [DONE]" and len(events) >= 8
