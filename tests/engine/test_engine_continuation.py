"""Continuation correctness: with greedy decoding, a stream failed over after k tokens and continued
by `tidegate engine` (as the gateway's failover builds the continuation) yields the same text and
usage as the uninterrupted stream. The first stream is cut after k token events; what was sent is
parsed, the continuation built and its events spliced by the gateway's own (pure) failover code."""

from __future__ import annotations

import http.client
from collections.abc import Iterator

import orjson
import pytest

from tests.support import ManagedProcess, free_port, start_process, tidegate_argv
from tidegate.gateway.failover import FailoverPolicy, Splice, continuation_body, parse_sent, refusal

pytestmark = pytest.mark.slow
MODEL = "tiny-random-llama"
MAX_TOKENS = 24
CUTS = (1, 2, 7, 16, 23)  # tokens sent before the failure


@pytest.fixture(scope="module")
def engine() -> Iterator[int]:
    port = free_port()
    argv = tidegate_argv("engine", "--model", MODEL, "--port", str(port), "--threads", "1", "--kv-cache-tokens", "4096")
    process: ManagedProcess = start_process(argv, ready_url=f"http://127.0.0.1:{port}/health", timeout_s=120)
    try:
        yield port
    finally:
        process.stop()


def _stream(port: int, path: str, body: dict, token_ids: bool = True) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"content-type": "application/json"}
    if token_ids:
        headers["x-tidegate-token-ids"] = "1"  # as the gateway asks an embedded worker
    connection.request("POST", path, orjson.dumps(body), headers)
    response = connection.getresponse()
    assert response.status == 200, response.read()
    data = response.read()
    connection.close()
    return data


def _events(data: bytes) -> list[bytes]:
    """The stream's events, each with the comment line that announced its token id."""
    return [event + b"\n\n" for event in data.split(b"\n\n") if event.strip()]


def _token_events_cut(data: bytes, k: int, chat: bool) -> bytes:
    """The bytes a client had received when the replica died after k token events."""
    sent, tokens = [], 0
    for event in _events(data):
        if tokens == k:
            break
        sent.append(event)
        state = parse_sent(b"".join(sent), chat)
        tokens = state.tokens
    return b"".join(sent)


def _text_and_usage(data: bytes, chat: bool) -> tuple[str, dict]:
    texts, usage = [], {}
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[6:])
        if event.get("usage"):
            # the continuation finds the first stream's prompt in the prefix cache: cached tokens differ
            usage = {key: event["usage"][key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for choice in event["choices"]:
            texts.append((choice["delta"].get("content") or "") if chat else choice["text"])
    return "".join(texts), usage


def _failed_over(port: int, path: str, body: dict, whole: bytes, k: int, chat: bool, token_ids: bool) -> tuple[str, dict]:
    sent = _token_events_cut(whole, k, chat)
    state = parse_sent(sent, chat)
    assert state.tokens == k and refusal(body, state, FailoverPolicy()) is None
    continuation = continuation_body(body, state, MODEL, send_token_ids=token_ids)
    splice = Splice(state, include_usage=True)
    spliced = b"".join(splice.feed(_stream(port, path, continuation, token_ids=token_ids)))
    return _text_and_usage(sent + spliced, chat)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_greedy_stream_failed_over_after_k_tokens_equals_the_uninterrupted_one(engine: int, chat: bool) -> None:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "Where do the tides turn? Ünïcödé ✓"}]} if chat \
        else {"prompt": "The tide gate at the river mouth"}
    body = {"model": MODEL, **prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    whole = _stream(engine, path, body)
    text, usage = _text_and_usage(whole, chat)
    assert usage["completion_tokens"] == MAX_TOKENS and text
    for k in CUTS:
        assert _failed_over(engine, path, body, whole, k, chat, token_ids=True) == (text, usage), f"cut after {k}"


def test_chat_continuation_from_text_alone_is_exact_where_the_text_re_encodes_to_the_ids(engine: int) -> None:
    """Without the ids (an upstream that announces none), the continuation starts from the text: for
    the byte tokenizer exact as long as the tokens sent decode to valid UTF-8 (this prompt's greedy
    answer starts with ASCII), not after the preset's random weights emit a stray byte (U+FFFD)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    whole = _stream(engine, "/v1/chat/completions", body, token_ids=False)
    text, usage = _text_and_usage(whole, True)
    assert "\ufffd" not in text
    for k in (1, 3):
        assert _failed_over(engine, "/v1/chat/completions", body, whole, k, True, token_ids=False) == (text, usage)


def test_engine_refuses_continue_final_message_without_a_final_assistant_message(engine: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", engine, timeout=30)
    connection.request("POST", "/v1/chat/completions", orjson.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
        "add_generation_prompt": False}), {"content-type": "application/json"})
    response = connection.getresponse()
    error = orjson.loads(response.read())["error"]
    assert response.status == 400 and "final message" in error["message"]
