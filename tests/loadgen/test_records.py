"""From raw HTTP responses to request records: streaming timing, usage, error reasons."""

from __future__ import annotations

import orjson
import pytest

from tidegate.loadgen.http_client import HttpResponse
from tidegate.loadgen.records import ApiKind, measure


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n".encode()


def _chat_delta(content: str | None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _measure(response: HttpResponse, stream: bool = True, kind: ApiKind = ApiKind.CHAT):
    return measure(response, index=0, target=0, tenant="t", tier="critical", scheduled_s=0.0, sent_at=10.0,
                   run_start=10.0, stream=stream, kind=kind, target_prompt_tokens=8, max_tokens=3)


def _stream_response() -> HttpResponse:
    usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3}}
    return HttpResponse(status=200, headers={"x-tidegate-degradation": "cached_answer", "server": "x"}, chunks=[
        (10.05, _sse(_chat_delta(None, role=True))),
        (10.10, _sse(_chat_delta("a"))),
        (10.15, _sse(_chat_delta("b"))[:9]),  # an event split across two reads
        (10.30, _sse(_chat_delta("b"))[9:] + _sse(_chat_delta("c"))),
        (10.31, _sse(usage) + _sse("[DONE]")),
    ])


def test_ttft_is_the_first_content_token_not_the_role_chunk() -> None:
    assert _measure(_stream_response()).ttft_s == pytest.approx(0.10)


def test_inter_token_gaps_use_the_read_that_completed_each_event() -> None:
    assert _measure(_stream_response()).itl_s == pytest.approx((0.20, 0.0))


def test_usage_comes_from_the_final_chunk() -> None:
    record = _measure(_stream_response())
    assert (record.prompt_tokens, record.completion_tokens, record.e2e_s) == (8, 3, pytest.approx(0.31))


def test_only_tidegate_and_rate_limit_headers_are_kept() -> None:
    record = _measure(_stream_response())
    assert record.headers == {"x-tidegate-degradation": "cached_answer"} and record.degraded


def test_error_reason_is_the_openai_error_code() -> None:
    body = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit_error", "code": "rate_limit_exceeded"}})
    record = _measure(HttpResponse(status=429, headers={"retry-after": "1"}, chunks=[(10.01, body)]))
    assert (record.ok, record.status, record.reason, record.headers) == (
        False, 429, "rate_limit_exceeded", {"retry-after": "1"})


def test_error_inside_a_stream_fails_the_request() -> None:
    chunks = [(10.1, _sse(_chat_delta("a"))), (10.2, _sse({"error": {"type": "server_error", "code": "upstream_error"}}))]
    record = _measure(HttpResponse(status=200, chunks=chunks))
    assert (record.ok, record.reason) == (False, "upstream_error")


def test_connection_failure_is_recorded_with_its_reason() -> None:
    record = _measure(HttpResponse(error="connection_error"))
    assert (record.ok, record.status, record.reason, record.e2e_s) == (False, 0, "connection_error", None)


def test_non_streaming_ttft_is_the_whole_response() -> None:
    body = orjson.dumps({"choices": [{"message": {"content": "abc"}}], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    record = _measure(HttpResponse(status=200, chunks=[(10.4, body)]), stream=False)
    assert (record.ttft_s, record.completion_tokens, record.ok) == (pytest.approx(0.4), 3, True)


def _finish(reason: str | None) -> dict:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


def test_an_empty_but_finished_stream_is_a_success_with_no_output_tokens() -> None:
    # the model's first token was end-of-sequence: no content, finish_reason "stop", usage 0 tokens
    usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 0}}
    chunks = [(10.05, _sse(_chat_delta(None, role=True))), (10.2, _sse(_finish("stop"))),
              (10.21, _sse(usage) + _sse("[DONE]"))]
    record = _measure(HttpResponse(status=200, chunks=chunks))
    assert (record.ok, record.reason, record.completion_tokens) == (True, None, 0)
    assert record.ttft_s == pytest.approx(0.2) and record.tpot_s == 0.0


def test_an_empty_finished_stream_without_usage_counts_zero_tokens() -> None:
    chunks = [(10.05, _sse(_chat_delta(None, role=True))), (10.2, _sse(_finish("stop")) + _sse("[DONE]"))]
    record = _measure(HttpResponse(status=200, chunks=chunks))
    assert (record.ok, record.completion_tokens) == (True, 0)


def test_an_empty_stream_that_ends_without_a_finish_reason_fails() -> None:
    chunks = [(10.05, _sse(_chat_delta(None, role=True))), (10.2, _sse(_finish(None)) + _sse("[DONE]"))]
    record = _measure(HttpResponse(status=200, chunks=chunks))
    assert (record.ok, record.reason) == (False, "empty_stream")


def test_an_empty_stream_with_an_error_event_fails_even_after_a_finish_reason() -> None:
    chunks = [(10.05, _sse(_chat_delta(None, role=True))), (10.1, _sse(_finish("stop"))),
              (10.2, _sse({"error": {"type": "server_error", "code": "upstream_error"}}))]
    record = _measure(HttpResponse(status=200, chunks=chunks))
    assert (record.ok, record.reason) == (False, "upstream_error")


def test_an_empty_completions_stream_with_a_finish_reason_is_a_success() -> None:
    chunks = [(10.1, _sse({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}) + _sse("[DONE]"))]
    record = _measure(HttpResponse(status=200, chunks=chunks), kind=ApiKind.COMPLETIONS)
    assert (record.ok, record.completion_tokens) == (True, 0)
