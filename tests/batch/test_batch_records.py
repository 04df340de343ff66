"""The Batch API's pure half: uploads taken apart, input files checked, records and result lines."""

from __future__ import annotations

import json

import pytest

from tidegate.batch.files import parse_batch_file, parse_multipart
from tidegate.batch.records import (BatchStatus, batch_object, can_move, check_metadata, completion_window_s,
                                    error_line, output_line)
from tidegate.errors import InvalidRequestError


def _line(custom_id: str, model: str = "m", url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}})


def test_a_multipart_upload_gives_its_file_and_purpose() -> None:
    body = (b"--XyZ\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--XyZ\r\ncontent-disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            b"content-type: application/jsonl\r\n\r\nline one\r\nline two\n\r\n--XyZ--\r\n")
    upload = parse_multipart(body)
    assert (upload.filename, upload.purpose, upload.content) == ("in.jsonl", "batch", b"line one\r\nline two\n")


def test_an_upload_without_its_file_field_names_it() -> None:
    with pytest.raises(InvalidRequestError, match="'file'"):
        parse_multipart(b"--b\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--b--\r\n")


def test_a_valid_file_gives_its_lines_in_order_and_skips_blank_ones() -> None:
    lines = parse_batch_file(f"{_line('a')}\n\n{_line('b')}\n".encode(), {"m"}, 10)
    assert [(line.index, line.custom_id) for line in lines] == [(0, "a"), (1, "b")]


def test_an_invalid_file_names_each_bad_line_up_to_five() -> None:
    content = "\n".join(["{", _line("a"), _line("a"), _line("c", model="x"), "[]", "{}", "{}", "{}"]).encode()
    with pytest.raises(InvalidRequestError) as refused:
        parse_batch_file(content, {"m"}, 100)
    message = refused.value.message
    assert "line 1: not valid JSON" in message and "line 3: custom_id 'a' is repeated" in message
    assert "line 4: body.model 'x'" in message and "line 5: not a JSON object" in message
    assert "line 7" not in message  # five at most


def test_a_file_over_the_request_limit_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="at most 1"):
        parse_batch_file(f"{_line('a')}\n{_line('b')}".encode(), {"m"}, 1)


def test_streaming_is_refused_in_a_batch() -> None:
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "x", "stream": True}})
    with pytest.raises(InvalidRequestError, match="stream"):
        parse_batch_file(line.encode(), {"m"}, 10)


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("30m", 1800), ("5s", 5)])
def test_completion_windows_up_to_a_day_are_taken(window: str, seconds: int) -> None:
    assert completion_window_s(window) == seconds


@pytest.mark.parametrize("window", ["48h", "0s", "1d", 24, None, "h"])
def test_other_completion_windows_are_refused(window: object) -> None:
    with pytest.raises(InvalidRequestError):
        completion_window_s(window)


def test_metadata_is_at_most_sixteen_string_pairs() -> None:
    assert check_metadata({"a": "b"}) == {"a": "b"}
    with pytest.raises(InvalidRequestError):
        check_metadata({str(i): "v" for i in range(17)})
    with pytest.raises(InvalidRequestError):
        check_metadata({"a": 1})


def test_states_move_only_forward() -> None:
    assert can_move(BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING)
    assert can_move(BatchStatus.CANCELLING, BatchStatus.CANCELLED)
    assert not can_move(BatchStatus.COMPLETED, BatchStatus.IN_PROGRESS)
    assert not can_move(BatchStatus.CANCELLING, BatchStatus.COMPLETED)


def test_a_batch_record_reads_as_openais_batch_object() -> None:
    record = {"id": "batch_1", "endpoint": "/v1/embeddings", "input_file_id": "file-1", "completion_window": "24h",
              "status": "completed", "created_at": "10", "expires_at": "86410", "completed_at": "20",
              "total": "3", "completed": "2", "failed": "1", "output_file_id": "file-o", "metadata": '{"k": "v"}'}
    batch = batch_object(record)
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert (batch["completed_at"], batch["cancelled_at"], batch["error_file_id"]) == (20, None, None)
    assert batch["object"] == "batch" and batch["metadata"] == {"k": "v"}


def test_result_lines_carry_the_response_or_the_error() -> None:
    done = json.loads(output_line("a", "req-1", 200, b'{"object": "chat.completion"}'))
    assert done["response"] == {"status_code": 200, "request_id": "req-1", "body": {"object": "chat.completion"}}
    assert done["error"] is None and done["id"].startswith("batch_req_")
    expired = json.loads(error_line("b", "batch_expired", "too late"))
    assert expired["response"] is None and expired["error"] == {"code": "batch_expired", "message": "too late"}
