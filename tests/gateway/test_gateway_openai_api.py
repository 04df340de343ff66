"""The official openai client against a real `tidegate serve` fronting two mock upstreams."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from gateway_harness import Gateway, upstream_pool

MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gateway(start_mock, start_gateway) -> Gateway:
    first, second = start_mock(tokens=8), start_mock(tokens=8)
    return start_gateway([upstream_pool("mock", first, second, model="mock-model")],
                         server={"max_body_bytes": 65536, "max_tokens_cap": 4096})


@pytest.fixture(scope="module")
def client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.api, api_key="unused", max_retries=0, timeout=10)


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_chat_completion(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="mock", messages=MESSAGES)
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 8


def test_upstream_gets_its_own_model_name(client: openai.OpenAI) -> None:
    # the pool is "mock"; its backends call the model "mock-model", and the mock echoes what it got
    assert client.chat.completions.create(model="mock", messages=MESSAGES).model == "mock-model"


def test_chat_stream_arrives_in_chunks(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model="mock", messages=MESSAGES, stream=True))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert len(chunks) >= 8
    assert text


def test_completion(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="mock", prompt="once upon a time", max_tokens=8)
    assert reply.choices[0].text


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="mock", prompt="once", max_tokens=8, stream=True))
    assert len(chunks) >= 8


def test_embeddings(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model="mock", input=["a", "b"])
    assert len(reply.data) == 2
    assert len(reply.data[0].embedding) > 0


def test_models_lists_pools(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["mock"]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.body["code"] == "model_not_found"


def test_missing_messages_is_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="mock", messages=[])
    assert caught.value.body["param"] == "messages"


def test_max_tokens_above_cap_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=100_000)
    assert caught.value.body["param"] == "max_tokens"


def test_body_over_cap_is_413(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "x" * 100_000}])
    assert caught.value.status_code == 413


def test_invalid_json_is_400_and_gateway_keeps_serving(gateway: Gateway, client: openai.OpenAI) -> None:
    request = urllib.request.Request(f"{gateway.api}/chat/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400
    assert json.loads(caught.value.read())["error"]["type"] == "invalid_request_error"
    assert client.chat.completions.create(model="mock", messages=MESSAGES).choices


def test_get_on_an_api_path_is_405(gateway: Gateway) -> None:
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(f"{gateway.api}/chat/completions", timeout=5)
    assert caught.value.code == 405
    assert json.loads(caught.value.read())["error"]["code"] == "method_not_allowed"


def test_client_request_id_is_echoed(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="mock", messages=MESSAGES, extra_headers={"x-request-id": "my-trace-42"})
    assert raw.headers["x-request-id"] == "my-trace-42"


def test_request_id_is_made_when_absent(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model="mock", messages=MESSAGES)
    assert raw.headers.get("x-request-id")


def test_health_and_ready(gateway: Gateway) -> None:
    assert _get(f"{gateway.base}/health")[0] == 200
    status, _, body = _get(f"{gateway.base}/ready")
    assert status == 200
    assert json.loads(body)["pools"] == {"mock": True}


def test_metrics_count_requests_by_pool_and_status(gateway: Gateway, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="mock", messages=MESSAGES)
    status, _, body = _get(f"{gateway.base}/metrics")
    text = body.decode()
    assert status == 200
    assert 'tidegate_requests_total{pool="mock",status="200"}' in text
    assert "tidegate_request_duration_seconds_bucket" in text
    assert 'tidegate_replica_healthy{pool="mock"' in text


def test_unknown_path_is_404(gateway: Gateway) -> None:
    assert _get(f"{gateway.base}/v2/nothing")[0] == 404


def test_access_log_lines_are_json_with_request_id(gateway: Gateway, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="mock", messages=MESSAGES, extra_headers={"x-request-id": "logged-1"})
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "logged-1" not in gateway.process.log():
        time.sleep(0.1)
    line = next(line for line in gateway.process.log().splitlines() if "logged-1" in line)
    entry = json.loads(line)
    assert entry["request_id"] == "logged-1"
    assert entry["status"] == 200


def test_expect_100_continue_is_answered(gateway: Gateway) -> None:
    import socket

    body = json.dumps({"model": "mock", "messages": MESSAGES}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body))
        assert sock.recv(4096).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")


def test_pipelined_requests_are_answered_in_order(gateway: Gateway) -> None:
    import socket

    def request(request_id: bytes) -> bytes:
        body = json.dumps({"model": "mock", "messages": MESSAGES}).encode()
        return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-request-id: " + request_id
                + b"\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))

    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(request(b"first") + request(b"second"))
        received = b""
        while received.count(b"HTTP/1.1 200 OK") < 2:
            chunk = sock.recv(65536)
            assert chunk, "connection closed early"
            received += chunk
    assert received.index(b"x-request-id: first") < received.index(b"x-request-id: second")


def test_head_request_gets_no_body_and_connection_stays_usable(gateway: Gateway) -> None:
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=5)
    connection.request("HEAD", "/health")
    head = connection.getresponse()
    assert head.status == 200 and head.read() == b""
    connection.request("GET", "/health")
    assert connection.getresponse().read() == b'{"status":"ok"}'
    connection.close()


def test_oversized_headers_are_431_and_gateway_keeps_serving(gateway: Gateway) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nx-padding: " + b"a" * 100_000 + b"\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 431")
    assert _get(f"{gateway.base}/health")[0] == 200
