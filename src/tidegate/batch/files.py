"""Uploads: a multipart/form-data body taken apart, and a batch input file checked line by line.

Pure: bytes in, records or an `InvalidRequestError` out (OpenAI's error body at the HTTP edge). A
file is checked whole at upload, so a batch made of it cannot fail on a line nobody could run.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

import orjson

from tidegate.errors import InvalidRequestError

__all__ = ["BATCH_URLS", "Upload", "BatchLine", "parse_multipart", "parse_batch_file"]

# the endpoints a batch may call (OpenAI's, less the ones this gateway does not serve)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
_DISPOSITION_NAME = re.compile(rb'\bname="([^"]*)"', re.IGNORECASE)
_DISPOSITION_FILENAME = re.compile(rb'\bfilename="([^"]*)"', re.IGNORECASE)
_MAX_ERRORS_LISTED = 5  # an invalid file's message names this many lines at most


@dataclass(frozen=True, slots=True)
class Upload:
    filename: str
    purpose: str
    content: bytes


@dataclass(frozen=True, slots=True)
class BatchLine:
    """One request of a batch input file, as it will be run."""

    index: int  # 0-based line of the file (blank lines not counted)
    custom_id: str
    url: str
    body: dict


def parse_multipart(body: bytes) -> Upload:
    """The `file` and `purpose` fields of a multipart/form-data upload (the boundary is read from the
    body's first line, so the content-type header is not needed)."""
    first_end = body.find(b"\r\n")
    if not body.startswith(b"--") or first_end < 3:
        raise InvalidRequestError("expected a multipart/form-data body with the fields 'file' and 'purpose'")
    delimiter = b"\r\n" + body[:first_end]
    fields: dict[str, tuple[bytes, bytes | None]] = {}
    for part in (b"\r\n" + body).split(delimiter)[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head_end = part.find(b"\r\n\r\n")
        if head_end < 0:
            raise InvalidRequestError("malformed multipart part: no blank line after its headers")
        head, value = part[2:head_end], part[head_end + 4:]
        name = _DISPOSITION_NAME.search(head)
        if name is None:
            raise InvalidRequestError("malformed multipart part: no content-disposition name")
        filename = _DISPOSITION_FILENAME.search(head)
        fields[name.group(1).decode("utf-8", "replace")] = (value, filename.group(1) if filename else None)
    if "file" not in fields:
        raise InvalidRequestError("missing the 'file' field", param="file")
    if "purpose" not in fields:
        raise InvalidRequestError("missing the 'purpose' field", param="purpose")
    content, filename = fields["file"]
    purpose = fields["purpose"][0].decode("utf-8", "replace").strip()
    return Upload((filename or b"file.jsonl").decode("utf-8", "replace"), purpose, content)


def parse_batch_file(content: bytes, served_models: Collection[str], max_requests: int) -> list[BatchLine]:
    """Every line of a batch input file, checked: a JSON object with a unique `custom_id`, `method`
    POST, a `url` of BATCH_URLS and a `body` naming a model this gateway serves. Raises one
    InvalidRequestError naming the first few bad lines."""
    problems: list[str] = []
    lines: list[BatchLine] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError("the file is not UTF-8 text (JSONL expected)", param="file") from None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        problem = _check_line(raw, served_models, seen)
        if isinstance(problem, str):
            problems.append(f"line {number}: {problem}")
            if len(problems) >= _MAX_ERRORS_LISTED:
                break
            continue
        custom_id, url, body = problem
        seen.add(custom_id)
        lines.append(BatchLine(len(lines), custom_id, url, body))
    if problems:
        raise InvalidRequestError("invalid batch input file: " + "; ".join(problems), param="file",
                                  code="invalid_batch_file")
    if not lines:
        raise InvalidRequestError("the batch input file holds no request", param="file", code="invalid_batch_file")
    if len(lines) > max_requests:
        raise InvalidRequestError(f"the batch input file holds {len(lines)} requests; at most {max_requests}",
                                  param="file", code="invalid_batch_file")
    return lines


def _check_line(raw: str, served_models: Collection[str], seen: set[str]) -> str | tuple[str, str, dict]:
    """(custom_id, url, body), or what is wrong with the line."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "not valid JSON"
    if not isinstance(record, dict):
        return "not a JSON object"
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return "custom_id must be a non-empty string"
    if custom_id in seen:
        return f"custom_id {custom_id!r} is repeated; each must be unique within the file"
    if record.get("method") != "POST":
        return "method must be POST"
    url = record.get("url")
    if url not in BATCH_URLS:
        return f"url must be one of {', '.join(BATCH_URLS)}"
    body = record.get("body")
    if not isinstance(body, dict):
        return "body must be a JSON object"
    model = body.get("model")
    if not isinstance(model, str) or model not in served_models:
        return f"body.model {model!r} is not a model this gateway serves (see /v1/models)"
    if body.get("stream"):
        return "body.stream is not supported in a batch"
    return custom_id, url, body
