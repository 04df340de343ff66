"""The engine worker's HTTP edge (aiohttp): OpenAI routes, /health, /metrics, draining.

The server listens at once and the CLI attaches the model once loaded, so that /health says 503
until it is ready. A model that `is_embedding_model` recognises is served for embeddings only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from tidegate.engine.generation import Delta, GenerationService, PreparedRequest
from tidegate.engine.metrics import EngineMetrics
from tidegate.engine.schemas import ChatRequest, CompletionRequest, parse_request
from tidegate.errors import (
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    TidegateError,
    openai_error_body,
)

if TYPE_CHECKING:
    from tidegate.engine.builder import BuiltEngine

__all__ = ["EngineOptions", "EngineServer", "ServerState", "TOKEN_IDS_HEADER"]

TOKEN_IDS_HEADER = "x-tidegate-token-ids"  # "1": each streamed step's token id on a comment line

log = logging.getLogger(__name__)


# the gateway's default `server.max_body_bytes`: aiohttp's own default (1 MiB) refused prompts the
# gateway had let through
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class ServerState(Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class EngineOptions:
    model: str
    dtype: str | None = None  # None: the measured default for the kind of model
    quantize: str | None = None
    threads: int | None = None
    max_num_seqs: int = 64
    max_batch_tokens: int = 96
    kv_cache_tokens: int = 32768
    chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # share the KV blocks of prompt prefixes computed before
    fault_injection: bool = False  # serve POST /admin/slow (testing only)
    # larger bodies get 413; a gateway that spawns the worker sets it above its own limit
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def error_response(error: TidegateError) -> web.Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return web.json_response(openai_error_body(error), status=error.status, headers=headers)


def _embedding_support() -> Any | None:
    """The embeddings module, when it is installed alongside (imported lazily: it is optional)."""
    try:
        from tidegate.engine import embeddings
    except ImportError:
        return None
    return embeddings


class EngineServer:
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.metrics = EngineMetrics()
        self.state = ServerState.LOADING
        self.in_flight = 0
        self._embeddings = _embedding_support()
        self.serves_embeddings = bool(self._embeddings and self._embeddings.is_embedding_model(options.model))
        self.served_model_name = options.model
        self.model_card: dict[str, Any] = {}
        self._service: GenerationService | None = None
        self.engine_loop: Any = None
        self._batcher: Any = None
        self._embeddings_handler: Any = None
        self.app = web.Application(client_max_size=options.max_body_bytes)
        self.app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/v1/models", self._models),
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.post("/v1/embeddings", self._embeddings_route),
            ]
        )
        if options.fault_injection:
            self.app.add_routes([web.post("/admin/slow", self._slow)])

    # ---- lifecycle ----

    def attach_generation(self, built: BuiltEngine) -> None:
        """Asyncio thread: serve the engine that `build_generation_engine` made."""
        self.engine_loop = built.loop
        self.served_model_name = built.served_model_name
        self.model_card = built.model_card
        self._service = GenerationService(
            built.loop, built.tokenizer, self.metrics, built.served_model_name, built.max_total_tokens
        )
        self.state = ServerState.READY
        log.info("engine ready: %s", self.served_model_name)

    def load_embedding_model(self) -> Any:
        """Any thread: loads the embedding model (torch, slow)."""
        return self._embeddings.EmbeddingModel.load(
            self.options.model, dtype=self.options.dtype or "auto", quantize=self.options.quantize,
            threads=self.options.threads,
        )

    async def attach_embeddings(self, model: Any) -> None:
        """Asyncio thread: starts the dynamic batcher and serves /v1/embeddings."""
        from tidegate.engine.embeddings_api import make_embeddings_routes

        self._batcher = self._embeddings.EmbeddingBatcher(model)
        await self._batcher.start()
        self.served_model_name = model.name
        self.model_card = {"description": "sentence embeddings", "dimensions": model.dimensions}
        (route,) = make_embeddings_routes(self._batcher, model.name)
        self._embeddings_handler = route.handler
        self.state = ServerState.READY
        log.info("engine ready: %s", self.served_model_name)

    async def drain(self, timeout_s: float) -> None:
        """Stops accepting (503), then waits for in-flight requests up to `timeout_s`."""
        self.state = ServerState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("drain timeout: %d requests still in flight", self.in_flight)

    async def close(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.stop()
        if self._batcher is not None:
            await self._batcher.close()

    # ---- plain routes ----

    async def _health(self, _request: web.Request) -> web.Response:
        status = 200 if self.state is ServerState.READY else 503
        return web.json_response({"status": self.state.value, "model": self.served_model_name}, status=status)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def _models(self, _request: web.Request) -> web.Response:
        card = {"id": self.served_model_name, "object": "model", "created": 0, "owned_by": "tidegate"}
        return web.json_response({"object": "list", "data": [{**card, **self.model_card}]})

    async def _slow(self, request: web.Request) -> web.Response:
        """Fault injection: the body is a factor >= 1; every step then takes that many times longer."""
        text = (await request.text()).strip()
        try:
            factor = float(text)
        except ValueError:
            factor = float("nan")
        if not 1.0 <= factor <= 100.0:
            message = f"the body must be a slowdown factor from 1 to 100, not {text[:40]!r}"
            return error_response(InvalidRequestError(message))
        if self.engine_loop is None:
            return error_response(_not_served("generation", self.served_model_name))
        self.engine_loop.slowdown = factor
        log.warning("fault injection: every engine step now takes %.2fx its time", factor)
        return web.json_response({"slowdown": factor})

    async def _embeddings_route(self, request: web.Request) -> web.StreamResponse:
        if not self.serves_embeddings:
            return error_response(_not_served("embeddings", self.served_model_name))
        with self._accepting() as refusal:
            if refusal is not None:
                return error_response(refusal)
            return await self._embeddings_handler(request)

    # ---- generation ----

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, ChatRequest)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CompletionRequest)

    async def _generate(self, request: web.Request, kind: type[ChatRequest] | type[CompletionRequest]) -> web.StreamResponse:
        with self._accepting() as refusal:
            try:
                if refusal is not None:
                    raise refusal
                if self._service is None:
                    raise _not_served("generation", self.served_model_name)
                try:
                    raw = await request.read()
                except web.HTTPRequestEntityTooLarge as error:
                    raise PayloadTooLargeError(error.text or "request body too large") from None
                body = parse_request(raw, kind)
                prepared = self._service.prepare(body)
                if body.stream:
                    return await self._stream(request, body, prepared)
                return await self._complete(body, prepared)
            except TidegateError as error:
                return error_response(error)
            except Exception:  # a bug must still answer in OpenAI's format, and be logged
                log.exception("generation request failed")
                return error_response(InternalError("internal error while generating"))

    @contextlib.contextmanager
    def _accepting(self):  # type: ignore[no-untyped-def]
        """Counts the request in flight, or yields why it is refused (loading, draining)."""
        if self.state is not ServerState.READY:
            yield OverloadedError(f"engine is {self.state.value}", retry_after_s=1.0)
            return
        self.in_flight += 1
        try:
            yield None
        finally:
            self.in_flight -= 1

    async def _complete(self, body: ChatRequest | CompletionRequest, prepared: PreparedRequest) -> web.Response:
        assert self._service is not None
        parts: list[str] = []
        last: Delta | None = None
        async with contextlib.aclosing(self._service.stream(prepared)) as deltas:
            async for last in deltas:
                parts.append(last.text)
        assert last is not None
        text = "".join(parts)
        if isinstance(body, ChatRequest):
            # `refusal` is in OpenAI's message schema (nullable): this engine never refuses
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None}
            payload = _envelope("chat.completion", "chatcmpl", self.served_model_name)
        else:
            choice = {"index": 0, "text": text, "logprobs": None}
            payload = _envelope("text_completion", "cmpl", self.served_model_name)
        payload["choices"] = [{**choice, "finish_reason": last.finish_reason}]
        payload["usage"] = _usage(last)
        return web.Response(body=orjson.dumps(payload), content_type="application/json")

    async def _stream(
        self, request: web.Request, body: ChatRequest | CompletionRequest, prepared: PreparedRequest
    ) -> web.StreamResponse:
        assert self._service is not None
        is_chat = isinstance(body, ChatRequest)
        envelope = _envelope(
            "chat.completion.chunk" if is_chat else "text_completion", "chatcmpl" if is_chat else "cmpl",
            self.served_model_name,
        )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        # a gateway that may continue this stream elsewhere asks for each step's token id, on an SSE
        # comment line (which clients ignore) before the event (gateway/failover.py)
        with_ids = request.headers.get(TOKEN_IDS_HEADER) == "1"

        async def send(choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
                       token_id: int | None = None) -> None:
            chunk = {**envelope, "choices": choices}
            if body.include_usage:
                chunk["usage"] = usage
            ids = b": token_ids %d\n" % token_id if with_ids and token_id is not None else b""
            await response.write(ids + b"data: " + orjson.dumps(chunk) + b"\n\n")

        last: Delta | None = None
        try:
            if is_chat:
                opening = {"role": "assistant", "content": "", "refusal": None}  # as OpenAI's first delta
                await send([{"index": 0, "delta": opening, "finish_reason": None}])
            async with contextlib.aclosing(self._service.stream(prepared)) as deltas:
                async for last in deltas:
                    if is_chat:
                        delta = {"content": last.text} if last.text or last.finish_reason is None else {}
                        choice = {"index": 0, "delta": delta}
                    else:
                        choice = {"index": 0, "text": last.text}
                    await send([{**choice, "logprobs": None, "finish_reason": last.finish_reason}],
                               token_id=last.token_id)
            if body.include_usage and last is not None:
                await send([], _usage(last))
        except TidegateError as error:
            await response.write(b"data: " + orjson.dumps(openai_error_body(error)) + b"\n\n")
        except ConnectionResetError:
            return response  # the client left; aclosing has aborted its sequence
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _not_served(kind: str, model: str) -> TidegateError:
    return NotFoundError(f"this engine serves {model}, which does not do {kind}", param="model")


def _envelope(obj: str, prefix: str, model: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()), "model": model}


def _usage(delta: Delta) -> dict[str, Any]:
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens},  # OpenAI's field
    }
