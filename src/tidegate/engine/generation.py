"""The asyncio side of generation: validate and tokenize, submit, then stream text deltas.

Detokenizes incrementally, applies stop strings (holding back text that could be the start of
one), records the latency metrics, and aborts the sequence if the caller stops listening.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tidegate.engine.loop import EngineLoop
from tidegate.engine.metrics import EngineMetrics
from tidegate.engine.schemas import ChatRequest, CompletionRequest
from tidegate.engine.sequence import FinishReason, SamplingParams
from tidegate.engine.tokenizer import Tokenizer
from tidegate.errors import InternalError, InvalidRequestError, NotFoundError

__all__ = ["Delta", "PreparedRequest", "GenerationService"]


@dataclass(frozen=True, slots=True)
class Delta:
    text: str
    finish_reason: str | None  # "stop" | "length" on the last delta
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens found in the engine's prefix cache
    token_id: int | None = None  # the token generated at this step


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    stop_strings: tuple[str, ...]
    arrival_s: float
    # a continuation's prefix generated before (its text was sent by another stream): primes the
    # detokenizer, so a character split across the splice comes out whole
    continued_ids: tuple[int, ...] = ()


class GenerationService:
    def __init__(
        self,
        engine: EngineLoop,
        tokenizer: Tokenizer,
        metrics: EngineMetrics,
        served_model_name: str,
        max_total_tokens: int,  # prompt + completion: min(model context, KV capacity)
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.max_total_tokens = max_total_tokens
        self.clock = clock

    def prepare(self, request: ChatRequest | CompletionRequest) -> PreparedRequest:
        arrival_s = self.clock()
        if request.model != self.served_model_name:
            raise NotFoundError(f"The model `{request.model}` does not exist.", param="model")
        prompt_ids, continued_ids = self._prompt_ids(request)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.max_total_tokens - len(prompt_ids)
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's limit is {self.max_total_tokens} tokens "
                "for prompt and completion together",
                param="messages" if isinstance(request, ChatRequest) else "prompt",
                code="context_length_exceeded",
            )
        max_tokens = request.requested_max_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        elif max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens {max_tokens} + {len(prompt_ids)} prompt tokens exceed the limit of "
                f"{self.max_total_tokens} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            ignore_eos=request.ignore_eos,
        )
        return PreparedRequest(prompt_ids, params, request.priority, request.stop_strings, arrival_s,
                               tuple(continued_ids))

    def _prompt_ids(self, request: ChatRequest | CompletionRequest) -> tuple[list[int], list[int]]:
        """(the prompt's ids, the part of them that continues an answer generated before)."""
        continued = self._checked_ids(request.continue_token_ids, "continue_token_ids")
        if isinstance(request, ChatRequest):
            messages = [{"role": m.role, "content": m.text()} for m in request.messages]
            if not request.continue_final_message:
                return self.tokenizer.encode_chat(messages, request.add_generation_prompt), []
            # the turn is rendered as the generation prompt would have opened it, and the text
            # continued is encoded on its own, so the ids at the splice are those of an
            # uninterrupted answer (encoding the whole rendered text could merge across it)
            head = self.tokenizer.encode_chat(messages[:-1])
            text = messages[-1]["content"]
            if continued is not None and self._decoded(continued) != text:
                continued = None  # not the ids of this text (another model's, or text held back): the text rules
            if continued is None:
                continued = self.tokenizer.encode_continuation(text) if text else []
            return head + continued, continued
        prompt = request.prompt
        ids: list[int]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif not prompt:
            ids = []
        elif all(isinstance(item, str) for item in prompt):
            if len(prompt) > 1:
                raise InvalidRequestError("one prompt per request is supported", param="prompt")
            ids = self.tokenizer.encode(prompt[0]) if prompt[0] else []
        else:
            ids = self._checked_ids(prompt, "prompt") or []  # type: ignore[arg-type]
        return ids + (continued or []), continued or []

    def _checked_ids(self, ids: list[int] | None, param: str) -> list[int] | None:
        if ids is not None and any(not 0 <= token < self.tokenizer.vocab_size for token in ids):
            raise InvalidRequestError(f"{param}: token ids must lie in the vocabulary", param=param)
        return None if ids is None else list(ids)

    def _decoded(self, ids: list[int]) -> str:
        """The text a stream sent for `ids` (a partial last character is held back, as in `stream`)."""
        decoder = self.tokenizer.decoder()
        return "".join(decoder.push(token) for token in ids)

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[Delta]:
        submission = self.engine.submit(prepared.prompt_token_ids, prepared.params, prepared.priority)
        self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        decoder = self.tokenizer.decoder()
        for token in prepared.continued_ids:
            decoder.push(token)  # their text was sent; a character they began is completed below
        holdback = max((len(s) for s in prepared.stop_strings), default=1) - 1
        pending, last_token_s, finished = "", None, False
        prompt_tokens = len(prepared.prompt_token_ids)
        try:
            while True:
                output = await submission.outputs.get()
                now = self.clock()
                if output.token_id is not None:
                    self.metrics.generation_tokens.inc()
                    if last_token_s is None:
                        self.metrics.ttft.observe(now - prepared.arrival_s)
                    else:
                        self.metrics.inter_token.observe(now - last_token_s)
                    last_token_s = now
                    pending += decoder.push(output.token_id)
                if output.finish_reason is FinishReason.ABORT:
                    finished = True
                    raise InternalError("the engine failed while generating this request")
                count = output.num_output_tokens
                cut = _find_stop(pending, prepared.stop_strings)
                if cut is not None:
                    yield Delta(pending[:cut], "stop", prompt_tokens, count, output.num_cached_prompt_tokens,
                                output.token_id)
                    return
                if output.finish_reason is not None:
                    finished = True
                    yield Delta(pending, output.finish_reason.value, prompt_tokens, count,
                                output.num_cached_prompt_tokens, output.token_id)
                    return
                # one delta per token, even an empty one (half a character, a held-back stop
                # prefix): streams then show every step, which the latency benchmarks measure
                emit = max(0, len(pending) - holdback)
                yield Delta(pending[:emit], None, prompt_tokens, count, output.num_cached_prompt_tokens,
                            output.token_id)
                pending = pending[emit:]
        finally:
            if not finished:
                self.engine.forget(submission.seq_id)
            self.metrics.e2e.observe(self.clock() - prepared.arrival_s)


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    positions = [i for s in stops if (i := text.find(s)) >= 0]
    return min(positions) if positions else None
