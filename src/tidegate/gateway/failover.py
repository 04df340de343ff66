"""Mid-stream failover: a stream whose replica dies or stalls after output began is continued on
another replica, and the new tokens are spliced into the same client stream.

The client has been sent part of an answer (`SentStream` keeps the bytes, no parsing while all goes
well). On a failure the gateway parses what was sent (`parse_sent`), decides whether the request may
be continued (`refusal`: None when safe), and asks another replica for a continuation
(`continuation_body`): for chat the original messages plus a final assistant message holding the
text already sent, continued (`continue_final_message: true`, `add_generation_prompt: false`, as
vLLM takes it); for completions the prompt plus that text; `max_tokens` less the tokens sent. The
continuation's events are rewritten (`Splice`) so that the client sees one answer: the first
stream's `id`, `created` and `model` in every chunk, no second role-only opening, one finish, and a
usage chunk whose prompt tokens are the original request's and whose completion tokens are those
sent before plus those after.

The pure parts (parse, decide, build, rewrite) need no I/O; `StreamFailover.resume` is the live part,
called by the proxy when a stream it relays breaks.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import islice
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from tidegate.errors import OverloadedError, UpstreamError, UpstreamTimeoutError, openai_error_body
from tidegate.gateway.upstream import Exchange, UpstreamConnection, UpstreamFailure
from tidegate.policy.routing import any_routable

if TYPE_CHECKING:
    from tidegate.gateway.dispatch import ModelPool, Replica
    from tidegate.gateway.http import HttpConnection
    from tidegate.gateway.proxy import Proxy

__all__ = ["FailoverPolicy", "SentStream", "StreamSoFar", "parse_sent", "refusal", "continuation_body",
           "merge_usage", "Splice", "StreamFailover", "TOKEN_IDS_HEADER"]

log = logging.getLogger("tidegate.failover")

# Asks `tidegate engine` to put each event's generated token ids on an SSE comment line before it
# (`: token_ids 104 105`), which SSE clients ignore: a continuation can then carry the exact ids, not
# the text re-tokenized (the embedded engine's byte tokenizer renders invalid UTF-8 as U+FFFD, lossily)
TOKEN_IDS_HEADER = b"x-tidegate-token-ids: 1\r\n"
_TOKEN_IDS_COMMENT = b": token_ids"
# Past this many bytes sent in one stream, the gateway stops keeping them: the stream then ends with
# an error event on a failure, as without failover (a 4,000-token chat stream is about 600 KB)
MAX_SENT_BYTES = 4 * 1024 * 1024
# request fields with which a continuation would not be the same answer: several choices, tool
# calls (structured output the text cannot carry), per-token logprobs (the sent tokens' are lost)
_UNSAFE_FIELDS = ("tools", "functions", "logprobs", "top_logprobs", "echo", "suffix", "best_of")


@dataclass(frozen=True, slots=True)
class FailoverPolicy:
    """A pool's failover settings (`pools[].failover` in the config)."""

    enabled: bool = True
    max_failovers: int = 1  # continuations per request; a replica failing the continuation too is tried no more


class SentStream(list):
    """The pieces of one stream passed on to the client, kept as they are (no copy, no parsing): all
    that the common case, a stream that does not fail, pays for failover is `sent += pieces` and a
    length check per read. Their size is measured every `_CHECK_EVERY` pieces only."""

    __slots__ = ("check_at", "kept", "size")
    _CHECK_EVERY = 256

    def __init__(self) -> None:
        super().__init__()
        self.check_at = self._CHECK_EVERY  # len(self) at which to measure the bytes kept
        self.kept = True  # False: past MAX_SENT_BYTES, no longer kept
        self.size = 0  # bytes of the pieces measured so far

    def measure(self) -> None:
        """Called by the relay once `len(self) >= check_at`: stops keeping past the bound."""
        measured = self.check_at - self._CHECK_EVERY
        self.size += sum(map(len, islice(self, measured, None)))
        if self.size > MAX_SENT_BYTES:
            self.clear()
            self.kept = False
            self.check_at = 1 << 62
        else:
            self.check_at = len(self) + self._CHECK_EVERY  # the next measure starts where this one ended

    def add(self, pieces: list[bytes]) -> None:
        """What the relay does inline: keep `pieces`, measure now and then."""
        if self.kept:
            self += pieces
            if len(self) >= self.check_at:
                self.measure()

    def data(self) -> bytes:
        return b"".join(self)


@dataclass(slots=True)
class StreamSoFar:
    """What the client was sent of one stream, as parsed at a failure (and grown by continuations)."""

    chat: bool
    id: Any = None
    created: Any = None
    model: Any = None
    system_fingerprint: Any = None
    texts: list[str] = field(default_factory=list)
    tokens: int = 0  # token events sent: one a token, as engines stream (the max_tokens reduction)
    token_ids: list[int] | None = None  # from the engine's `: token_ids` comments, when it sent them all
    finished: bool = False  # a finish_reason or `[DONE]` was sent
    problem: str | None = None  # why it cannot be continued, from what was sent
    failovers: int = 0

    @property
    def text(self) -> str:
        return "".join(self.texts)


def parse_sent(data: bytes, chat: bool) -> StreamSoFar:
    """Parses the SSE bytes sent to the client. Only whole events count; a partial last line (the
    relay holds those back, so only a bug leaves one) makes the stream unsafe to continue."""
    state = StreamSoFar(chat=chat, token_ids=[])
    ids: list[int] | None = None  # announced for the next event
    for line in data[:data.rfind(b"\n") + 1].split(b"\n"):
        if line.startswith(_TOKEN_IDS_COMMENT):
            ids = _comment_ids(line)
            continue
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            state.finished = True
            continue
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            state.problem = "an event sent was not JSON"
            continue
        note_event(state, event, ids)
        ids = None
    if not state.token_ids:
        state.token_ids = None  # no ids announced (an upstream other than `tidegate engine`)
    if data and not data.endswith(b"\n"):
        state.problem = "the client holds part of an event"
    return state


def _comment_ids(line: bytes) -> list[int] | None:
    try:
        return [int(i) for i in line[len(_TOKEN_IDS_COMMENT):].split()]
    except ValueError:
        return None


def note_event(state: StreamSoFar, event: Any, ids: list[int] | None = None) -> None:
    """Adds one event sent to the client to `state`; `ids`: the token ids announced for it, if any.
    A token event without them ends the use of ids: the text is then all there is to continue from."""
    if not isinstance(event, dict):
        state.problem = "an event sent was not a JSON object"
        return
    if "error" in event:
        state.problem = "an error event was sent"
        return
    tokens_before = state.tokens
    _note_choices(state, event)
    if state.tokens > tokens_before and state.token_ids is not None:
        if ids is None:
            state.token_ids = None
        else:
            state.token_ids.extend(ids)


def _note_choices(state: StreamSoFar, event: dict) -> None:
    if state.id is None:
        state.id, state.created, state.model = event.get("id"), event.get("created"), event.get("model")
        state.system_fingerprint = event.get("system_fingerprint")
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if choice.get("index", 0) != 0:
            state.problem = "several choices were streamed"
        if choice.get("logprobs"):
            state.problem = "logprobs were streamed"
        if choice.get("finish_reason") is not None:
            state.finished = True
        if state.chat:
            delta = choice.get("delta") or {}
            if delta.get("tool_calls") or delta.get("function_call"):
                state.problem = "tool calls were streamed"
            content = delta.get("content")
            if isinstance(content, str) and not ("role" in delta and content == "" and choice.get("finish_reason") is None):
                state.texts.append(content)
                state.tokens += 1
        elif isinstance(choice.get("text"), str):
            state.texts.append(choice["text"])
            state.tokens += 1


def _requested_max_tokens(body: dict, chat: bool) -> tuple[str | None, int | None]:
    """(the field that bounds the answer, its value): None when unbounded (chat without a limit)."""
    for key in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key, value
    return (None, None) if chat else ("max_tokens", 16)  # completions: OpenAI's default of 16


def refusal(body: dict, state: StreamSoFar, policy: FailoverPolicy) -> str | None:
    """Why this stream may not be continued elsewhere, or None when it may (the documented conditions)."""
    if not policy.enabled:
        return "failover is off for this pool"
    if state.failovers >= policy.max_failovers:
        return f"already failed over {state.failovers} time(s)"
    if state.problem is not None:
        return state.problem
    if state.finished:
        return "the stream had already ended"
    if state.tokens == 0:
        return "no token was sent"
    n = body.get("n")
    if n not in (None, 1):
        return "n > 1"
    for name in _UNSAFE_FIELDS:
        if body.get(name) not in (None, False, 0, [], "", 1 if name == "best_of" else None):
            return f"the request sets {name!r}"
    if state.chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
        if body.get("continue_final_message") and not isinstance(messages[-1].get("content"), str):
            return "the final assistant message's content is not text"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and len(prompt) == 1
                                                and isinstance(prompt[0], str)):
            if state.token_ids is None or body.get("stop") or not _is_token_ids(prompt):
                return "the prompt is not one string"
    _key, limit = _requested_max_tokens(body, state.chat)
    if limit is not None and limit - state.tokens <= 0:
        return "every token asked for was sent; only the end was lost"
    return None


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(i, int) and not isinstance(i, bool)
                                                             for i in prompt)


def continuation_body(body: dict, state: StreamSoFar, upstream_model: str | None = None,
                      send_token_ids: bool = False) -> dict:
    """The request that continues `state` on another replica (call when `refusal` is None)."""
    text = state.text
    out = {key: value for key, value in body.items() if key not in ("stream_options",)}
    out["stream"] = True
    # the continuation's own usage is always asked for: it gives the completion tokens to merge
    out["stream_options"] = {"include_usage": True}
    if upstream_model is not None:
        out["model"] = upstream_model
    key, limit = _requested_max_tokens(body, state.chat)
    if key is not None and limit is not None:
        out[key] = limit - state.tokens
    ids = state.token_ids if send_token_ids else None
    if state.chat:
        messages = list(body["messages"])
        if body.get("continue_final_message") and messages[-1].get("role") == "assistant":
            # the client itself asked to continue its assistant prefix: the text sent extends it
            last = messages[-1]
            messages[-1] = {**last, "content": last["content"] + text}
            ids = None  # the ids cover only the part generated, not the client's prefix
        else:
            messages.append({"role": "assistant", "content": text})
        out["messages"] = messages
        out["continue_final_message"] = True
        out["add_generation_prompt"] = False
        if ids is not None:
            out["continue_token_ids"] = ids  # `tidegate engine`'s extension: the prefix exactly
    else:
        prompt = body["prompt"]
        if ids is not None and not body.get("stop"):
            # `tidegate engine` appends the ids to the prompt's own; with stop strings it may have
            # held back text of them that was never sent, so those continue from the text
            out["continue_token_ids"] = ids
        else:
            prompt_text = prompt if isinstance(prompt, str) else prompt[0]
            out["prompt"] = prompt_text + text
    return out


def merge_usage(usage: dict, sent_tokens: int) -> dict:
    """The continuation's usage as the client's: its prompt held the tokens sent before, which are
    completion tokens of the one answer the client sees."""
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return usage
    prompt = max(0, prompt - sent_tokens)
    completion += sent_tokens
    merged = {**usage, "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        merged["prompt_tokens_details"] = {**details, "cached_tokens": min(details["cached_tokens"], prompt)}
    return merged


class Splice:
    """Rewrites a continuation's SSE events into the client's stream (pure: events in, bytes out)."""

    __slots__ = ("state", "include_usage", "base_tokens", "buffer", "completion_tokens", "done", "ids")

    def __init__(self, state: StreamSoFar, include_usage: bool) -> None:
        self.state = state
        self.include_usage = include_usage  # the client asked for the usage chunk
        self.base_tokens = state.tokens  # sent before this continuation
        self.buffer = b""
        self.completion_tokens: int | None = None  # merged, once the continuation's usage came
        self.done = False  # `[DONE]` passed
        self.ids: list[int] | None = None  # announced for the next event

    def feed(self, data: bytes) -> list[bytes]:
        """Body bytes of the continuation in; whole rewritten events out (a partial line waits)."""
        buffer = self.buffer + data
        cut = buffer.rfind(b"\n") + 1
        self.buffer = buffer[cut:]
        out: list[bytes] = []
        for line in buffer[:cut].split(b"\n"):
            rewritten = self.rewrite_line(line)
            if rewritten is not None:
                out.append(rewritten)
        return out

    def rewrite_line(self, line: bytes) -> bytes | None:
        if line.startswith(_TOKEN_IDS_COMMENT):
            self.ids = _comment_ids(line)
            return line + b"\n"
        if not line.startswith(b"data:"):
            return None
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return line + b"\n\n"
        if not isinstance(event, dict) or "error" in event:
            return line + b"\n\n"
        state = self.state
        choices = event.get("choices") or []
        usage = event.get("usage")
        if state.chat and len(choices) == 1 and _role_only(choices[0]):
            return None  # the client had its opening event from the first replica
        if isinstance(usage, dict) and not choices:
            merged = merge_usage(usage, self.base_tokens)
            self.completion_tokens = merged.get("completion_tokens")
            if not self.include_usage:
                return None
            event["usage"] = merged
        elif not self.include_usage:
            event.pop("usage", None)
        event["id"], event["created"], event["model"] = state.id, state.created, state.model
        if state.system_fingerprint is not None or "system_fingerprint" in event:
            event["system_fingerprint"] = state.system_fingerprint
        note_event(state, event, self.ids)
        self.ids = None
        return b"data: " + orjson.dumps(event) + b"\n\n"


def _role_only(choice: Any) -> bool:
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta") or {}
    return "role" in delta and not delta.get("content") and not delta.get("tool_calls")


class _ContinuationRelay:
    """The continuation's response, passed on through `Splice` as it arrives (a `BodyRelay`)."""

    __slots__ = ("splice", "conn", "pending", "exchange", "last_read_s", "clock", "connection", "scrubber",
                 "client_paused")

    def __init__(self, splice: Splice, conn: HttpConnection, clock: Any, scrubber: Any = None) -> None:
        self.splice = splice
        self.scrubber = scrubber  # the replica's key kept out of what is passed on
        self.conn = conn
        self.pending: list[bytes] = []
        self.exchange: Exchange | None = None
        self.clock = clock
        self.last_read_s = clock()
        self.connection: UpstreamConnection | None = None
        self.client_paused = False  # the client reads slower than the upstream writes: not the upstream's silence

    def on_head(self, exchange: Exchange) -> None:
        if exchange.status == 200:
            self.exchange = exchange
            exchange.sink = self.pending.append

    def flush(self, at_end: bool = False) -> None:
        self.last_read_s = self.clock()
        if not self.pending:
            return
        data = b"".join(self.pending)
        self.pending.clear()
        out = self.splice.feed(data + (b"\n" if at_end and not data.endswith(b"\n") else b""))
        if out:
            if self.scrubber is not None:
                out = [self.scrubber.scrub_lines(b"".join(out))]
            self.conn.stream_chunks(out)

    def pause(self) -> None:
        self.client_paused = True
        if self.connection is not None:
            self.connection.pause_reading()

    def resume(self) -> None:
        self.client_paused = False
        self.last_read_s = self.clock()
        if self.connection is not None:
            self.connection.resume_reading()


class StreamFailover:
    """The live part: continues a broken stream on another replica of its pool."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.outcomes = proxy.metrics.stream_failovers

    async def resume(self, conn: HttpConnection, pool: ModelPool, failed: Replica, sent: SentStream,
                     endpoint_path: str, body: dict, request_id: bytes, started: float, usage: Any,
                     failure: UpstreamFailure, trace: Any = None) -> int | None:
        """Continues the stream elsewhere and ends it: the status to log, or None when it may not be
        continued (the caller then ends it with an error event, as without failover). `trace`: the
        request's (`Proxy._record` tells it how each continuation ended)."""
        policy: FailoverPolicy = pool.failover
        proxy = self.proxy
        settings = proxy.settings
        chat = endpoint_path.endswith("chat/completions")
        if not policy.enabled or not sent.kept:
            self.outcomes.labels(pool.name, "refused").inc()
            return None
        state = parse_sent(sent.data(), chat)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        tried = [failed.replica_id]
        kind = "timeout" if failure.timed_out else "broken"
        while True:
            reason = refusal(body, state, policy)
            if reason is None and proxy.clock() >= started + settings.request_timeout_s:
                reason = "the request's time is up"
            if reason is None and not _may_fail_over(proxy, pool, failed, tried):
                reason = "no other replica, or the retry budget is spent"
            if reason is not None:
                log.info("stream not failed over: %s", reason,
                         extra={"fields": {"request_id": request_id.decode("latin-1"), "pool": pool.name}})
                self.outcomes.labels(pool.name, "refused" if state.failovers == 0 else "failed").inc()
                return None
            state.failovers += 1
            try:
                replica = await _acquire_other(proxy, pool, tried, usage, kind)
            except OverloadedError:
                self.outcomes.labels(pool.name, "failed").inc()
                return None
            held = replica if usage is None else None  # overload control frees its own at settle
            tried.append(replica.replica_id)
            try:
                outcome = await self._continue_on(conn, pool, replica, state, body, endpoint_path, request_id,
                                                  started, usage, include_usage, trace)
            finally:
                if held is not None:
                    proxy._release(held)
            if isinstance(outcome, int):
                self.outcomes.labels(pool.name, "resumed").inc()
                return outcome
            failed, kind = replica, ("timeout" if outcome.timed_out else "broken")

    async def _continue_on(self, conn: HttpConnection, pool: ModelPool, replica: Replica, state: StreamSoFar,
                           body: dict, endpoint_path: str, request_id: bytes, started: float, usage: Any,
                           include_usage: bool, trace: Any = None) -> int | UpstreamFailure:
        """One continuation on `replica`: the status when the stream ended well (ended here), or the
        failure (the client's stream is still open and consistent: only whole events were sent)."""
        proxy = self.proxy
        settings = proxy.settings
        loop = asyncio.get_running_loop()
        payload = orjson.dumps(continuation_body(body, state, replica.upstream_model,
                                                 send_token_ids=state.token_ids is not None))
        data = b"".join((replica.request_head(endpoint_path), b"x-request-id: ", request_id,
                         b"\r\ncontent-length: ", str(len(payload)).encode(), b"\r\n\r\n", payload))
        splice = Splice(state, include_usage)
        relay = _ContinuationRelay(splice, conn, proxy.clock, replica.scrubber)
        sent_s = proxy.clock()
        timer: asyncio.TimerHandle | None = None
        exchange: Exchange | None = None
        connection: UpstreamConnection | None = None
        try:
            try:
                connection, _reused = await replica.connections.connection(fresh=True)
            except UpstreamFailure as failure:
                proxy._record(pool, replica, sent_s, usage, "connect", trace)
                return failure
            relay.connection = connection
            exchange = Exchange(loop, relay)
            conn.on_pause_writing, conn.on_resume_writing = relay.pause, relay.resume
            connection.send(data, exchange)
            deadline_s = started + settings.request_timeout_s

            def check_silence() -> None:
                nonlocal timer
                now_s = proxy.clock()
                if relay.client_paused:
                    relay.last_read_s = now_s  # the client's write timeout answers for a client that stopped reading
                limit_s = settings.first_byte_timeout_s if not exchange.got_bytes else settings.stream_idle_timeout_s
                if now_s >= deadline_s or now_s - relay.last_read_s >= limit_s:
                    exchange.fail(UpstreamFailure("timed out", before_first_byte=not exchange.got_bytes,
                                                  timed_out=True))
                    connection.close()
                    return
                timer = loop.call_later(min(limit_s - (now_s - relay.last_read_s), deadline_s - now_s) + 0.001,
                                        check_silence)

            timer = loop.call_later(min(settings.first_byte_timeout_s, max(0.0, deadline_s - proxy.clock())),
                                    check_silence)
            try:
                await exchange.done
            except UpstreamFailure as failure:
                proxy._record(pool, replica, sent_s, usage, "timeout" if failure.timed_out else "broken", trace)
                proxy.metrics.upstream_errors.labels(pool.name, replica.replica_id,
                                                     "timeout" if failure.timed_out else "broken").inc()
                return failure
            if exchange.status != 200:
                proxy._record(pool, replica, sent_s, usage, "status_5xx" if exchange.status >= 500 else None, trace)
                return UpstreamFailure(f"the continuation was answered {exchange.status}: "
                                       f"{exchange.body()[:200]!r}", before_first_byte=True)
            relay.flush(at_end=True)
            proxy._record(pool, replica, sent_s, usage, None, trace)
            if usage is not None and splice.completion_tokens is not None:
                usage.reported = splice.completion_tokens
            if not splice.done:
                conn.stream_chunk(b"data: [DONE]\n\n")
            conn.end_stream()
            return 200
        finally:
            if timer is not None:
                timer.cancel()
            if exchange is not None and connection is not None and (not exchange.done.done()
                                                                    or exchange.done.cancelled()):
                connection.close()


def _may_fail_over(proxy: Proxy, pool: ModelPool, failed: Replica, tried: list[str]) -> bool:
    """Another replica could take it, and the pool's retry budget allows one more attempt."""
    now_s = proxy.clock()
    return any_routable(pool.replicas, now_s, tuple(tried)) and pool.retry_budget.try_spend(now_s)


async def _acquire_other(proxy: Proxy, pool: ModelPool, tried: list[str], usage: Any, kind: str) -> Replica:
    """A slot on a replica not tried yet: the pool's (the caller releases it), or through overload
    control, which moves the request's ticket to it (freed when the request settles)."""
    if usage is not None:
        return await proxy.overload.retry(usage.ticket, kind)  # type: ignore[union-attr]
    return await proxy._acquire(pool, proxy.clock(), tuple(tried))


def error_event(failure: UpstreamFailure) -> bytes:
    """The event that ends a stream that could not be continued."""
    error = UpstreamTimeoutError("the upstream timed out mid-stream") if failure.timed_out \
        else UpstreamError("the upstream failed mid-stream")
    return b"data: " + orjson.dumps(openai_error_body(error)) + b"\n\n"

