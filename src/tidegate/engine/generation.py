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


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    stop_strings: tuple[str, ...]
    arrival_s: float


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
        prompt_ids = self._prompt_ids(request)
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
        return PreparedRequest(prompt_ids, params, request.priority, request.stop_strings, arrival_s)

    def _prompt_ids(self, request: ChatRequest | CompletionRequest) -> list[int]:
        if isinstance(request, ChatRequest):
            return self.tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in request.messages])
        prompt = request.prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if prompt else []
        if not prompt:
            return []
        if all(isinstance(item, str) for item in prompt):
            if len(prompt) > 1:
                raise InvalidRequestError("one prompt per request is supported", param="prompt")
            return self.tokenizer.encode(prompt[0]) if prompt[0] else []
        if any(not 0 <= token < self.tokenizer.vocab_size for token in prompt):
            raise InvalidRequestError("prompt token ids must lie in the vocabulary", param="prompt")
        return list(prompt)

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[Delta]:
        submission = self.engine.submit(prepared.prompt_token_ids, prepared.params, prepared.priority)
        self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        decoder = self.tokenizer.decoder()
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
                    yield Delta(pending[:cut], "stop", prompt_tokens, count, output.num_cached_prompt_tokens)
                    return
                if output.finish_reason is not None:
                    finished = True
                    yield Delta(pending, output.finish_reason.value, prompt_tokens, count,
                                output.num_cached_prompt_tokens)
                    return
                # one delta per token, even an empty one (half a character, a held-back stop
                # prefix): streams then show every step, which the latency benchmarks measure
                emit = max(0, len(pending) - holdback)
                yield Delta(pending[:emit], None, prompt_tokens, count, output.num_cached_prompt_tokens)
                pending = pending[emit:]
        finally:
            if not finished:
                self.engine.forget(submission.seq_id)
            self.metrics.e2e.observe(self.clock() - prepared.arrival_s)


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    positions = [i for s in stops if (i := text.find(s)) >= 0]
    return min(positions) if positions else None
