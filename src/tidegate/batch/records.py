"""Batch and file records in OpenAI's shapes, the batch's states, and result lines. Pure.

States (OpenAI's): validating -> in_progress -> finalizing -> completed; validating -> failed (the
input did not fit the batch); in_progress -> finalizing -> expired (its completion window ran out:
what finished is kept, the rest are `batch_expired` error lines); in_progress -> cancelling ->
cancelled (requests already running finish and are kept). Records are stored as flat string maps
(Redis hashes): `batch_object` and `file_object` turn them into the objects clients read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

import orjson

from tidegate.errors import InvalidRequestError

__all__ = ["BatchStatus", "FINAL_STATUSES", "ACCEPTING_STATUSES", "can_move", "new_id", "completion_window_s",
           "batch_object", "file_object", "output_line", "error_line", "check_metadata"]


class BatchStatus(Enum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


FINAL_STATUSES = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})
# a request of a batch in these states still runs and its result is kept
ACCEPTING_STATUSES = frozenset({BatchStatus.IN_PROGRESS})

_MOVES = {
    BatchStatus.VALIDATING: {BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING},
    BatchStatus.IN_PROGRESS: {BatchStatus.FINALIZING, BatchStatus.CANCELLING},
    BatchStatus.FINALIZING: {BatchStatus.COMPLETED, BatchStatus.EXPIRED},
    BatchStatus.CANCELLING: {BatchStatus.CANCELLED},
}


def can_move(current: BatchStatus, target: BatchStatus) -> bool:
    return target in _MOVES.get(current, ())


def new_id(prefix: str) -> str:
    """`batch_…`, `file-…`, `batch_req_…`: OpenAI's prefixes, 24 random hex digits."""
    return prefix + os.urandom(12).hex()


_WINDOW = re.compile(r"^(\d+)(s|m|h)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600


def completion_window_s(window: Any) -> int:
    """Seconds of a `completion_window`: OpenAI's "24h", or a shorter one ("30m", "90s")."""
    found = _WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(found.group(1)) * _UNIT_S[found.group(2)] if found else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise InvalidRequestError("completion_window must be '24h' (or a shorter window such as '1h', '30m')",
                                  param="completion_window")
    return seconds


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in metadata.items()):
        raise InvalidRequestError("metadata must be at most 16 string pairs (keys <= 64, values <= 512 characters)",
                                  param="metadata")
    return metadata


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value else None


def batch_object(record: Mapping[str, str]) -> dict[str, Any]:
    """The batch as OpenAI's `GET /v1/batches/{id}` returns it."""
    errors = record.get("errors")
    metadata = record.get("metadata")
    return {
        "id": record["id"], "object": "batch", "endpoint": record["endpoint"],
        "errors": orjson.loads(errors) if errors else None,
        "input_file_id": record["input_file_id"], "completion_window": record["completion_window"],
        "status": record["status"],
        "output_file_id": record.get("output_file_id") or None, "error_file_id": record.get("error_file_id") or None,
        "created_at": int(record["created_at"]),
        **{f"{stage}_at": _int_or_none(record.get(f"{stage}_at")) for stage in (
            "in_progress", "expires", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")},
        "request_counts": {"total": int(record.get("total", 0)), "completed": int(record.get("completed", 0)),
                           "failed": int(record.get("failed", 0))},
        "metadata": orjson.loads(metadata) if metadata else None,
    }


def file_object(record: Mapping[str, str]) -> dict[str, Any]:
    """The file as OpenAI's `GET /v1/files/{id}` returns it."""
    return {"id": record["id"], "object": "file", "bytes": int(record["bytes"]), "created_at": int(record["created_at"]),
            "filename": record["filename"], "purpose": record["purpose"], "status": "processed",
            "expires_at": None, "status_details": None}


def output_line(custom_id: str, request_id: str, status: int, body: bytes) -> bytes:
    """A line of the output (2xx) or error file (other statuses): the response the request got."""
    try:
        parsed: Any = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        parsed = body.decode("utf-8", "replace")
    return orjson.dumps({"id": new_id("batch_req_"), "custom_id": custom_id,
                         "response": {"status_code": status, "request_id": request_id, "body": parsed},
                         "error": None})


def error_line(custom_id: str, code: str, message: str) -> bytes:
    """A line of the error file for a request that got no response (expired, dead-lettered)."""
    return orjson.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                         "error": {"code": code, "message": message}})
