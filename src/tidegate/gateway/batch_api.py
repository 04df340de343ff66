"""The Batch API's routes (OpenAI's): /v1/files and /v1/batches, for the tenant the API key names.

A tenant sees only its own files and batches: another tenant's id is answered 404, as one that does
not exist. Every answer is built from the store (`batch_store`): any gateway answers for a batch
that another one created.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from urllib.parse import parse_qs

import orjson
import redis.exceptions

from tidegate.batch.files import BATCH_URLS, parse_batch_file, parse_multipart
from tidegate.batch.records import (BatchStatus, batch_object, check_metadata, completion_window_s, file_object,
                                    new_id)
from tidegate.errors import (ConflictError, InvalidRequestError, MethodNotAllowedError, NotFoundError,
                             OverloadedError)
from tidegate.gateway.batch_store import BatchStore
from tidegate.gateway.http import HttpConnection, HttpRequest
from tidegate.policy.identity import ANONYMOUS_TENANT, Identity

__all__ = ["BatchApi", "BATCH_PATHS"]

BATCH_PATHS = (b"/v1/files", b"/v1/batches")
_JSON = b"content-type: application/json\r\n"
_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class BatchApi:
    def __init__(self, store: BatchStore, served_models: Callable[[], Collection[str]], max_file_bytes: int,
                 max_requests: int) -> None:
        self.store = store
        self._served_models = served_models
        self.max_file_bytes = max_file_bytes
        self.max_requests = max_requests

    async def handle(self, conn: HttpConnection, request: HttpRequest, request_id: bytes,
                     identity: Identity | None) -> int:
        """Answers one request under /v1/files or /v1/batches; raises TidegateError for the proxy to send."""
        tenant = identity.tenant if identity is not None else ANONYMOUS_TENANT
        try:
            status, body, content_type = await self._route(request, tenant)
        except _REDIS_ERRORS:
            raise OverloadedError("the batch store (Redis) is unavailable; retry later",
                                  code="batch_store_unavailable", retry_after_s=1.0) from None
        conn.respond(status, content_type + b"x-request-id: " + request_id + b"\r\n", body)
        return status

    async def _route(self, request: HttpRequest, tenant: str) -> tuple[int, bytes, bytes]:
        parts = request.path.decode("utf-8", "replace").strip("/").split("/")  # v1, files|batches, id?, action?
        method = request.method
        if parts[1] not in ("files", "batches"):
            raise NotFoundError(f"no route {request.path.decode('latin-1')}", code="not_found")
        if parts[1] == "files":
            if len(parts) == 2:
                if method == b"GET":
                    return 200, orjson.dumps(await self._list_files(request, tenant)), _JSON
                _expect(method, b"POST", request.path, allow="GET, POST")
                return 200, orjson.dumps(await self._upload(request.body, tenant)), _JSON
            if len(parts) == 3 and method == b"DELETE":
                return 200, orjson.dumps(await self._delete_file(parts[2], tenant)), _JSON
            record = await self.store.file(parts[2], tenant) if len(parts) in (3, 4) else None
            if len(parts) == 4 and parts[3] != "content":
                record = None
            if record is None:
                raise NotFoundError(f"no file {parts[2]!r}" if len(parts) > 2 else "no such route",
                                    code="not_found", param="file_id")
            _expect(method, b"GET", request.path, allow="GET, DELETE" if len(parts) == 3 else "GET")
            if len(parts) == 3:
                return 200, orjson.dumps(file_object(record)), _JSON
            return 200, await self.store.file_content(record["id"]), b"content-type: application/octet-stream\r\n"
        if len(parts) == 2:
            if method == b"POST":
                return 200, orjson.dumps(await self._create(request.body, tenant)), _JSON
            _expect(method, b"GET", request.path)
            return 200, orjson.dumps(await self._list(request, tenant)), _JSON
        record = await self.store.batch(parts[2], tenant) if len(parts) in (3, 4) else None
        if record is None or (len(parts) == 4 and parts[3] != "cancel"):
            raise NotFoundError(f"no batch {parts[2]!r}" if len(parts) > 2 else "no such route",
                                code="not_found", param="batch_id")
        if len(parts) == 3:
            _expect(method, b"GET", request.path)
            return 200, orjson.dumps(batch_object(record)), _JSON
        _expect(method, b"POST", request.path)
        status = await self.store.cancel(record["id"])
        if status not in (BatchStatus.IN_PROGRESS.value, BatchStatus.VALIDATING.value,
                          BatchStatus.CANCELLING.value, BatchStatus.CANCELLED.value):
            raise InvalidRequestError(f"cannot cancel a batch that is {status}", code="batch_not_cancellable")
        record = await self.store.batch(record["id"])
        assert record is not None
        return 200, orjson.dumps(batch_object(record)), _JSON

    async def _upload(self, body: bytes, tenant: str) -> dict:
        upload = parse_multipart(body)
        if upload.purpose != "batch":
            raise InvalidRequestError(f"purpose {upload.purpose!r} is not supported; this gateway stores 'batch' files",
                                      param="purpose")
        if len(upload.content) > self.max_file_bytes:
            raise InvalidRequestError(f"the file holds {len(upload.content)} bytes; at most {self.max_file_bytes}",
                                      param="file")
        parse_batch_file(upload.content, self._served_models(), self.max_requests)  # raises what is wrong
        return file_object(await self.store.put_file(tenant, upload.filename, upload.purpose, upload.content))

    async def _create(self, raw: bytes, tenant: str) -> dict:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidRequestError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        endpoint = body.get("endpoint")
        if endpoint not in BATCH_URLS:
            raise InvalidRequestError(f"endpoint must be one of {', '.join(BATCH_URLS)}", param="endpoint")
        window = body.get("completion_window")
        window_s = completion_window_s(window)
        metadata = check_metadata(body.get("metadata"))
        file_id = body.get("input_file_id")
        record = await self.store.file(file_id, tenant) if isinstance(file_id, str) else None
        if record is None:
            raise NotFoundError(f"no file {file_id!r}", code="not_found", param="input_file_id")
        if record["purpose"] != "batch":
            raise InvalidRequestError(f"file {file_id!r} has purpose {record['purpose']!r}, not 'batch'",
                                      param="input_file_id")
        batch_id = new_id("batch_")
        created = int(time.time())
        batch = {"id": batch_id, "endpoint": endpoint, "input_file_id": file_id, "completion_window": window,
                 "status": BatchStatus.VALIDATING.value, "created_at": str(created),
                 "expires_at": str(created + window_s), "total": "0", "completed": "0", "failed": "0"}
        if metadata is not None:
            batch["metadata"] = orjson.dumps(metadata).decode()
        if not await self.store.create_batch(tenant, batch):  # deleted since it was looked up
            raise NotFoundError(f"no file {file_id!r}", code="not_found", param="input_file_id")
        content = await self.store.file_content(file_id)
        try:
            lines = parse_batch_file(content, self._served_models(), self.max_requests)
        except InvalidRequestError as error:  # a model no longer served since the upload
            await self.store.fail_batch(batch_id, [{"code": "invalid_batch_file", "message": error.message,
                                                    "param": "input_file_id", "line": None}])
            lines = []
        wrong = [line for line in lines if line.url != endpoint]
        if wrong:
            await self.store.fail_batch(batch_id, [
                {"code": "mismatched_endpoint", "param": "url", "line": line.index + 1,
                 "message": f"the request's url {line.url!r} is not the batch's endpoint {endpoint!r}"}
                for line in wrong[:5]])
        elif lines:
            await self.store.start_batch(batch_id, lines)
        stored = await self.store.batch(batch_id)
        assert stored is not None
        return batch_object(stored)

    async def _list_files(self, request: HttpRequest, tenant: str) -> dict:
        """OpenAI's `GET /v1/files`: purpose, limit (1 to 10,000, all by default), after, order (desc)."""
        query = parse_qs(request.query.decode("utf-8", "replace"))
        try:
            limit = int(query.get("limit", ["10000"])[0])
        except ValueError:
            limit = 0
        if not 1 <= limit <= 10_000:
            raise InvalidRequestError("limit must be an integer from 1 to 10000", param="limit")
        order = query.get("order", ["desc"])[0]
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order must be 'asc' or 'desc'", param="order")
        purpose = query.get("purpose", [None])[0]
        records, has_more = await self.store.list_files(tenant, purpose, limit, query.get("after", [None])[0],
                                                        ascending=order == "asc")
        data = [file_object(record) for record in records]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    async def _delete_file(self, file_id: str, tenant: str) -> dict:
        outcome = await self.store.delete_file(file_id, tenant)
        if outcome == "missing":
            raise NotFoundError(f"no file {file_id!r}", code="not_found", param="file_id")
        if outcome.startswith("in_use:"):
            raise ConflictError(f"file {file_id!r} is the input of batch {outcome.removeprefix('in_use:')}, "
                                "which is not finished; cancel it or wait for it to end", code="file_in_use",
                                param="file_id")
        return {"id": file_id, "object": "file", "deleted": True}

    async def _list(self, request: HttpRequest, tenant: str) -> dict:
        query = parse_qs(request.query.decode("utf-8", "replace"))
        try:
            limit = int(query.get("limit", ["20"])[0])
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise InvalidRequestError("limit must be an integer from 1 to 100", param="limit")
        after = query.get("after", [None])[0]
        records, has_more = await self.store.list_batches(tenant, limit, after)
        data = [batch_object(record) for record in records]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def _expect(method: bytes, wanted: bytes, path: bytes, allow: str | None = None) -> None:
    if method != wanted:
        allow = allow or wanted.decode()
        raise MethodNotAllowedError(f"{path.decode('latin-1')} takes {allow}", allow=allow)
