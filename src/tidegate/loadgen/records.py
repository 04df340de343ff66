"""Per-request measurements, and how a raw HTTP response becomes one."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import orjson

from tidegate.loadgen.http_client import HttpResponse

__all__ = ["ApiKind", "RequestRecord", "measure", "KEPT_HEADER_PREFIXES"]

# Headers kept on every record: tidegate's degradation marks and any rate-limit advice.
KEPT_HEADER_PREFIXES = ("x-tidegate-", "x-ratelimit-", "retry-after")


class ApiKind(Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    EMBEDDINGS = "embeddings"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    index: int
    target: int  # 0, or 1 for the --compare target
    tenant: str
    tier: str
    scheduled_s: float  # planned send offset from the run's start
    sent_s: float  # actual send offset; sent_s - scheduled_s is the generator's lag
    status: int  # HTTP status; 0 when no response (see reason)
    reason: str | None  # OpenAI error code/type, or timeout | connection_error | dropped_inflight_cap
    ttft_s: float | None  # first content token (non-streaming: whole response)
    itl_s: tuple[float, ...]  # gaps between successive content events (streaming only)
    e2e_s: float | None
    target_prompt_tokens: int
    max_tokens: int
    prompt_tokens: int | None  # from the response's usage
    completion_tokens: int | None
    headers: dict[str, str]

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and self.reason is None

    @property
    def degraded(self) -> bool:
        return "x-tidegate-degradation" in self.headers  # the gateway names the rung that served

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (DistServe); 0 for one-token answers."""
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens is None:
            return None
        if self.completion_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_json(self) -> dict:
        return {
            "index": self.index, "target": self.target, "tenant": self.tenant, "tier": self.tier,
            "scheduled_s": self.scheduled_s, "sent_s": self.sent_s, "status": self.status,
            "reason": self.reason, "ok": self.ok, "ttft_s": self.ttft_s, "itl_s": list(self.itl_s),
            "tpot_s": self.tpot_s, "e2e_s": self.e2e_s,
            "target_prompt_tokens": self.target_prompt_tokens, "max_tokens": self.max_tokens,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "headers": self.headers,
        }


def _error_reason(body: bytes, status: int) -> str:
    try:
        error = orjson.loads(body).get("error") or {}
        return str(error.get("code") or error.get("type") or f"http_{status}")
    except (orjson.JSONDecodeError, AttributeError):
        return f"http_{status}"


def _event_text(event: dict, kind: ApiKind) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if kind is ApiKind.CHAT:
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


@dataclass(slots=True)
class _Measured:
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


def _finish_reason(event: dict) -> str | None:
    choices = event.get("choices") or []
    return choices[0].get("finish_reason") if choices and isinstance(choices[0], dict) else None


def _measure_stream(response: HttpResponse, sent_at: float, kind: ApiKind) -> _Measured:
    result = _Measured()
    token_times: list[float] = []
    content_events = 0
    finished_at: float | None = None  # when a choice said why it ended: the answer is complete
    buffer = b""
    for received_at, chunk in response.chunks:
        buffer += chunk
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            raw, buffer = buffer[:end], buffer[end + 2:]
            for line in raw.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]" or not payload:
                    continue
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    result.reason = "bad_stream_event"
                    continue
                if event.get("error"):
                    error = event["error"]
                    result.reason = str(error.get("code") or error.get("type") or "stream_error")
                if _event_text(event, kind):
                    token_times.append(received_at)
                    content_events += 1
                if _finish_reason(event) and finished_at is None:
                    finished_at = received_at
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens")
                    result.completion_tokens = usage.get("completion_tokens")
    if token_times:
        result.ttft_s = token_times[0] - sent_at
        result.itl_s = tuple(b - a for a, b in zip(token_times, token_times[1:]))
    elif result.reason is None and finished_at is not None:
        # the model's first token was end-of-sequence (random weights do it): an empty answer, but
        # a complete one; counting it failed made chaos runs report failures no fault caused. Its
        # first token is the end-of-sequence, so its TTFT is when the finish arrived
        result.ttft_s = finished_at - sent_at
        result.completion_tokens = result.completion_tokens or 0
    elif result.reason is None:
        result.reason = "empty_stream"  # no content and no finish_reason: the stream was cut
    if result.completion_tokens is None and content_events:
        result.completion_tokens = content_events  # no usage chunk: one token per event, best effort
    return result


def _measure_whole(response: HttpResponse, sent_at: float) -> _Measured:
    result = _Measured()
    try:
        body = orjson.loads(response.body())
    except orjson.JSONDecodeError:
        result.reason = "bad_json"
        return result
    usage = body.get("usage") or {}
    result.prompt_tokens = usage.get("prompt_tokens")
    result.completion_tokens = usage.get("completion_tokens")
    if response.chunks:
        result.ttft_s = response.chunks[-1][0] - sent_at
    return result


def measure(
    response: HttpResponse,
    *,
    index: int,
    target: int,
    tenant: str,
    tier: str,
    scheduled_s: float,
    sent_at: float,
    run_start: float,
    stream: bool,
    kind: ApiKind,
    target_prompt_tokens: int,
    max_tokens: int,
) -> RequestRecord:
    """Turns a completed response into a record; `sent_at`/`run_start` are perf_counter values."""
    measured = _Measured()
    if response.error is not None:
        measured.reason = response.error
    elif not 200 <= response.status < 300:
        measured.reason = _error_reason(response.body(), response.status)
    elif stream and kind is not ApiKind.EMBEDDINGS:
        measured = _measure_stream(response, sent_at, kind)
    else:
        measured = _measure_whole(response, sent_at)
    e2e = response.chunks[-1][0] - sent_at if response.chunks and response.error is None else None
    headers = {k: v for k, v in response.headers.items() if k.startswith(KEPT_HEADER_PREFIXES)}
    return RequestRecord(
        index=index, target=target, tenant=tenant, tier=tier, scheduled_s=scheduled_s,
        sent_s=sent_at - run_start, status=response.status, reason=measured.reason,
        ttft_s=measured.ttft_s, itl_s=measured.itl_s, e2e_s=e2e,
        target_prompt_tokens=target_prompt_tokens, max_tokens=max_tokens,
        prompt_tokens=measured.prompt_tokens, completion_tokens=measured.completion_tokens,
        headers=headers,
    )
