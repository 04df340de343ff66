"""A mock OpenAI-compatible upstream: raw asyncio protocol + httptools, fast enough that a gateway
benchmark measures the gateway, with latency models and error injection for load-generator tests.

Per-request overrides, for tests: `x-mock-status: 503` answers that status with an OpenAI error
body; `x-mock-ttft-ms: 250` replaces the sampled time to first token; `x-mock-stall-after: 8`
stalls after 8 tokens (a stream goes silent, a whole answer never comes) with the connection open.

`GET /mock/requests` lists the last 256 API requests' trace headers (`traceparent`, `tracestate`)
and `x-request-id`, oldest first, so that a test sees what a gateway propagated.

The text is a function of the request, as greedy decoding is: each word is chosen by a hash of the
prompt and the words before it (`MockText`), and an answer ends after `tokens` words. So a
continuation (chat: a final assistant message with `continue_final_message: true`; completions:
the prompt followed by the words already generated) yields exactly the rest of the uninterrupted
answer, which is what a gateway's mid-stream failover must splice.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import random
import signal
import time
import zlib
from collections import deque
from dataclasses import dataclass, field

import httptools
import orjson

from tidegate.mock.latency import LatencyModel

__all__ = ["MockConfig", "MockState", "serve"]

_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 429: b"Too Many Requests",
            500: b"Internal Server Error", 502: b"Bad Gateway", 503: b"Service Unavailable"}
_WORDS = (" lorem", " ipsum", " dolor", " sit", " amet", " consectetur", " adipiscing", " elit", " sed", " do",
          " eiusmod", " tempor", " incididunt", " ut", " labore", " et", " dolore", " magna", " aliqua", " enim",
          " ad", " minim", " veniam", " quis", " nostrud", " exercitation", " ullamco", " laboris", " nisi",
          " aliquip", " ex", " commodo")
_WORD_INDEX = {word: index for index, word in enumerate(_WORDS)}


class MockText:
    """The mock's deterministic "model": the next word is `_WORDS[crc32(context) % 32]`, the context
    being the prompt's key and the text generated so far, so a continuation picks up where the
    uninterrupted answer would have gone. CRC-32 runs on, so each word costs its own bytes only."""

    __slots__ = ("crc", "continued", "head_chars")

    def __init__(self, key: bytes, continued_text: str = "") -> None:
        self.crc = zlib.crc32(key)
        # the words at the end of `continued_text` that this rule generated: the answer so far
        self.continued = _generated_words(self.crc, continued_text)
        self.head_chars = len(continued_text) - sum(len(w) for w in self.continued)  # text before them
        self.crc = zlib.crc32(continued_text.encode(), self.crc)

    def next_word(self) -> str:
        word = _WORDS[self.crc % len(_WORDS)]
        self.crc = zlib.crc32(word.encode(), self.crc)
        return word


def _generated_words(key_crc: int, text: str) -> list[str]:
    """The longest run of words ending `text` each of which the rule picks after what precedes it."""
    ends: list[str] = []
    end = len(text)
    while True:
        start = text.rfind(" ", 0, end)
        word = text[start:end] if start >= 0 else ""
        if word not in _WORD_INDEX:
            break
        ends.append(word)
        end = start
    run: list[str] = []
    crc = zlib.crc32(text[:end].encode(), key_crc)
    for word in reversed(ends):  # from the first candidate on: each must follow from the text before it
        if _WORDS[crc % len(_WORDS)] != word:
            run = []  # the rule did not write this one: the run starts after it
        else:
            run.append(word)
        crc = zlib.crc32(word.encode(), crc)
    return run


def _mock_text(is_chat: bool, request: dict) -> tuple[MockText, int]:
    """The request's text generator and its prompt tokens (an engine's count: the prompt's, plus the
    words being continued, which a continuation's prompt holds)."""
    if is_chat:
        messages = request.get("messages")
        messages = messages if isinstance(messages, list) else []
        continued = ""
        if request.get("continue_final_message") and messages and isinstance(messages[-1], dict) \
                and messages[-1].get("role") == "assistant":
            continued = str(messages[-1].get("content") or "")
            messages = messages[:-1]
        key = orjson.dumps(messages)
    else:
        prompt = request.get("prompt")
        continued = prompt if isinstance(prompt, str) else prompt[0] if isinstance(prompt, list) and prompt \
            and isinstance(prompt[0], str) else ""
        key = b"" if continued else orjson.dumps(prompt)
    text = MockText(key, continued)
    head = orjson.dumps(continued[:text.head_chars]) if not is_chat else key
    prompt_tokens = len(head) // 4 + 1 + len(text.continued)
    if is_chat and text.head_chars:
        prompt_tokens += text.head_chars // 4
    return text, prompt_tokens


@dataclass(frozen=True, slots=True)
class MockConfig:
    tokens: int = 16  # completion tokens per response (fewer if the request's max_tokens is lower)
    ttft: LatencyModel = field(default_factory=lambda: LatencyModel(0.0))
    itl: LatencyModel = field(default_factory=lambda: LatencyModel(0.0))
    error_rate: float = 0.0  # fraction of requests answered 500
    embedding_dim: int = 384
    model: str = "mock-model"
    seed: int | None = None
    precise_timing: bool = False  # sub-millisecond pacing at the cost of a busy core
    stall_after: int | None = None  # tokens after which every answer stalls (x-mock-stall-after per request)


class MockState:
    """Shared across connections: config, the seeded generator, counters for /metrics."""

    def __init__(self, config: MockConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.requests_total = 0
        self.api_requests_total = 0  # POSTs to the API: what a gateway's cache saves
        self.errors_total = 0
        self.inflight = 0
        self.inflight_peak = 0  # most requests in flight at once since start
        self.ids = itertools.count()
        # (path, traceparent, tracestate, x-request-id) of the latest API requests
        self.recent: deque[tuple[bytes, bytes | None, bytes | None, bytes | None]] = deque(maxlen=256)
        self.timer = PreciseTimer() if config.precise_timing else MillisecondTimer()
        self.models_body = orjson.dumps(
            {"object": "list", "data": [{"id": config.model, "object": "model", "created": 0, "owned_by": "mock"}]}
        )
        unit = [((i * 2654435761) % 1000) / 1000.0 - 0.5 for i in range(config.embedding_dim)]
        self.embedding_basis = unit


def _head(status: int, content_type: bytes, length: int | None, keep_alive: bool) -> bytes:
    parts = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (status, _REASONS.get(status, b"Status"), content_type)]
    parts.append(b"content-length: %d\r\n" % length if length is not None else b"transfer-encoding: chunked\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _error_body(status: int, message: str, error_type: str = "server_error") -> bytes:
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": None, "code": str(status)}})


def _sse_chunk(payload: bytes) -> bytes:
    event = b"data: " + payload + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(event), event)


class MockProtocol(asyncio.Protocol):
    def __init__(self, state: MockState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: dict[bytes, bytes] = {}
        self.body: list[bytes] = []
        self.tasks: set[asyncio.Task] = set()

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        for task in self.tasks:
            task.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send(400, _error_body(400, "malformed HTTP request", "invalid_request_error"), keep_alive=False)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.headers, self.body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        self.state.requests_total += 1
        if method == b"GET":
            self._get(path, keep_alive)
            return
        if path not in (b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings"):
            self._send(404, _error_body(404, f"unknown path {path.decode(errors='replace')}", "invalid_request_error"), keep_alive)
            return
        self.state.api_requests_total += 1
        headers = self.headers
        self.state.recent.append((path, headers.get(b"traceparent"), headers.get(b"tracestate"),
                                  headers.get(b"x-request-id")))
        try:
            request = orjson.loads(b"".join(self.body) or b"null")
            if not isinstance(request, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as error:
            self._send(400, _error_body(400, f"invalid JSON body: {error}", "invalid_request_error"), keep_alive)
            return
        if request.get("continue_final_message") and not _ends_with_assistant(request.get("messages")):
            # as vLLM answers it
            self._send(400, _error_body(400, "continue_final_message needs a final assistant message",
                                        "invalid_request_error"), keep_alive)
            return
        forced_status = self.headers.get(b"x-mock-status")
        if forced_status is not None or (self.state.config.error_rate > 0 and self.state.rng.random() < self.state.config.error_rate):
            status = int(forced_status) if forced_status is not None else 500
            self.state.errors_total += 1
            self._send(status, _error_body(status, "injected error"), keep_alive)
            return
        task = asyncio.get_running_loop().create_task(self._respond(path, request, keep_alive))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- responses
    def _send(self, status: int, body: bytes, keep_alive: bool, content_type: bytes = b"application/json") -> None:
        if self.transport is None:
            return
        self.transport.write(_head(status, content_type, len(body), keep_alive) + body)
        if not keep_alive:
            self.transport.close()

    def _get(self, path: bytes, keep_alive: bool) -> None:
        if path == b"/health":
            self._send(200, b'{"status":"ok"}', keep_alive)
        elif path == b"/v1/models":
            self._send(200, self.state.models_body, keep_alive)
        elif path == b"/mock/requests":
            names = ("path", "traceparent", "tracestate", "x-request-id")
            seen = [{name: None if value is None else value.decode("latin-1") for name, value in zip(names, entry)}
                    for entry in self.state.recent]
            self._send(200, orjson.dumps(seen), keep_alive)
        elif path == b"/metrics":
            text = (
                f"# TYPE mock_requests_total counter\nmock_requests_total {self.state.requests_total}\n"
                f"# TYPE mock_api_requests_total counter\nmock_api_requests_total {self.state.api_requests_total}\n"
                f"# TYPE mock_errors_total counter\nmock_errors_total {self.state.errors_total}\n"
                f"# TYPE mock_inflight_requests gauge\nmock_inflight_requests {self.state.inflight}\n"
                f"# TYPE mock_inflight_peak gauge\nmock_inflight_peak {self.state.inflight_peak}\n"
                # vLLM's names, so a gateway's health checks read this mock's load as an engine's: every
                # request runs at once here (latency does not depend on load), so none waits
                f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running {self.state.inflight}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
            ).encode()
            self._send(200, text, keep_alive, b"text/plain; version=0.0.4")
        else:
            self._send(404, _error_body(404, "not found", "invalid_request_error"), keep_alive)

    def _ttft_s(self) -> float:
        forced = self.headers.get(b"x-mock-ttft-ms")
        if forced is not None:
            return float(forced) / 1000.0
        return self.state.config.ttft.sample_s(self.state.rng)

    async def _respond(self, path: bytes, request: dict, keep_alive: bool) -> None:
        state = self.state
        state.inflight += 1
        state.inflight_peak = max(state.inflight_peak, state.inflight)
        try:
            if path == b"/v1/embeddings":
                await self._embeddings(request, keep_alive)
            else:
                await self._generate(path == b"/v1/chat/completions", request, keep_alive)
        finally:
            self.state.inflight -= 1

    async def _embeddings(self, request: dict, keep_alive: bool) -> None:
        inputs = request.get("input")
        texts = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(texts, list) or not texts:
            self._send(400, _error_body(400, "input must be a string or a non-empty list", "invalid_request_error"), keep_alive)
            return
        delay_s = self._ttft_s()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        basis = self.state.embedding_basis
        data = []
        for index, text in enumerate(texts):
            shift = hash(str(text)) % len(basis)
            data.append({"object": "embedding", "index": index, "embedding": basis[shift:] + basis[:shift]})
        tokens = sum(len(str(text)) // 4 + 1 for text in texts)
        body = {"object": "list", "data": data, "model": request.get("model", self.state.config.model),
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        self._send(200, orjson.dumps(body), keep_alive)

    async def _generate(self, is_chat: bool, request: dict, keep_alive: bool) -> None:
        config, rng = self.state.config, self.state.rng
        max_tokens = request.get("max_completion_tokens", request.get("max_tokens"))
        text, prompt_tokens = _mock_text(is_chat, request)
        natural = max(0, config.tokens - len(text.continued))  # an answer ends after `tokens` words in all
        n_tokens = natural if not isinstance(max_tokens, int) or max_tokens <= 0 else min(natural, max_tokens)
        n_tokens = max(n_tokens, 1 if not text.continued else 0)
        finish_reason = "length" if isinstance(max_tokens, int) and max_tokens <= natural else "stop"
        words = [text.next_word() for _ in range(n_tokens)]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_tokens, "total_tokens": prompt_tokens + n_tokens}
        model = request.get("model", config.model)
        request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-mock{next(self.state.ids)}"
        created = int(time.time())
        start_s = time.perf_counter()
        ttft_s = self._ttft_s()
        # absolute send times, so timer granularity does not accumulate over a stream
        offsets_s = [ttft_s]
        if not config.itl.is_zero:
            for _ in range(n_tokens - 1):
                offsets_s.append(offsets_s[-1] + config.itl.sample_s(rng))
        else:
            offsets_s.extend([ttft_s] * (n_tokens - 1))
        offsets_s = offsets_s[:n_tokens]

        stall_after = self.headers.get(b"x-mock-stall-after")
        stall_at = int(stall_after) if stall_after is not None else config.stall_after
        if not request.get("stream"):
            await self.state.timer.sleep_until(start_s + (offsets_s[-1] if offsets_s else ttft_s))
            if stall_at is not None:
                await self._stall()
                return
            answer = "".join(words)
            choice = ({"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": finish_reason}
                      if is_chat else {"index": 0, "text": answer, "logprobs": None, "finish_reason": finish_reason})
            body = {"id": request_id, "object": "chat.completion" if is_chat else "text_completion",
                    "created": created, "model": model, "choices": [choice], "usage": usage}
            if "priority" in request:  # echoed, so a test sees the priority a gateway forwarded
                body["system_fingerprint"] = f"priority={request['priority']}"
            self._send(200, orjson.dumps(body), keep_alive)
            return

        transport = self.transport
        if transport is None:
            return
        object_name = "chat.completion.chunk" if is_chat else "text_completion"
        include_usage = bool((request.get("stream_options") or {}).get("include_usage"))

        def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> bytes:
            if is_chat:
                delta: dict = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text is not None else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            payload = {"id": request_id, "object": object_name, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return _sse_chunk(orjson.dumps(payload))

        # as vLLM and OpenAI do, a chat stream opens with a role-only event at once, before any token
        transport.write(_head(200, b"text/event-stream", None, keep_alive) + (chunk(None, None, role=True) if is_chat else b""))
        for index, offset_s in enumerate(offsets_s):
            if index == stall_at:
                await self._stall()
                return
            await self.state.timer.sleep_until(start_s + offset_s)
            if self.transport is None:
                return  # client went away: stop generating, as an engine would
            self.transport.write(chunk(words[index], None))
        tail = [chunk(None, finish_reason)]
        if include_usage:
            usage_payload = {"id": request_id, "object": object_name, "created": created, "model": model,
                             "choices": [], "usage": usage}
            tail.append(_sse_chunk(orjson.dumps(usage_payload)))
        tail.append(_sse_chunk(b"[DONE]"))
        tail.append(b"0\r\n\r\n")
        self.transport.write(b"".join(tail))
        if not keep_alive:
            self.transport.close()


    async def _stall(self) -> None:
        """A replica hung mid-answer: silent, the connection open, until the client goes."""
        while self.transport is not None:
            await asyncio.sleep(0.5)


def _ends_with_assistant(messages: object) -> bool:
    return isinstance(messages, list) and bool(messages) and isinstance(messages[-1], dict) \
        and messages[-1].get("role") == "assistant"


class MillisecondTimer:
    """Event-loop timers: libuv and epoll tick in whole milliseconds, so each event is 0-1 ms late."""

    async def sleep_until(self, deadline_s: float) -> None:
        # the loop's cached clock can lag real time, so a timer may fire early: sleep again if so
        while (delay_s := deadline_s - time.perf_counter()) > 0:
            await asyncio.sleep(delay_s)


class PreciseTimer:
    """Sub-millisecond pacing for latency-accuracy measurements: one task sleeps to just short of the
    earliest deadline, then yields to the loop until it is due and wakes every sleeper that is due.
    Costs a busy core while deadlines are dense, so it is opt-in (`--precise-timing`)."""

    SLACK_S = 0.002

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def sleep_until(self, deadline_s: float) -> None:
        if deadline_s <= time.perf_counter():
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (deadline_s, next(self._order), future))
        if self._heap[0][2] is future:
            self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._heap:
                self._wake.clear()
                await self._wake.wait()
                continue
            delay_s = self._heap[0][0] - time.perf_counter()
            if delay_s > self.SLACK_S:
                self._wake.clear()
                handle = loop.call_later(delay_s - self.SLACK_S, self._wake.set)
                await self._wake.wait()
                handle.cancel()
                continue
            await asyncio.sleep(0)
            now_s = time.perf_counter()
            while self._heap and self._heap[0][0] <= now_s:
                future = heapq.heappop(self._heap)[2]
                if not future.done():
                    future.set_result(None)


async def serve(config: MockConfig, host: str, port: int, ready_message: bool = True) -> None:
    loop = asyncio.get_running_loop()
    state = MockState(config)
    server = await loop.create_server(lambda: MockProtocol(state), host, port, backlog=4096)
    if ready_message:
        print(f"mock upstream listening on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    server.close()
