"""OpenAI request bodies the engine accepts, validated strictly (a string is not a number)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidegate.engine.unsupported import refuse_unsupported
from tidegate.errors import InvalidRequestError

__all__ = ["ChatRequest", "CompletionRequest", "parse_request"]


class _Body(BaseModel):
    # fields not typed here are kept in `model_extra`: those of features the engine lacks are
    # refused by `refuse_unsupported`, the rest (user, metadata, ...) ignored, as vLLM does
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        """OpenAI's spec makes optional fields nullable, and clients send options they leave unset
        as null: such a field takes its default. A required field stays null, and is refused."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, field in cls.model_fields.items() if not field.is_required()}
        return {key: value for key, value in data.items() if value is not None or key not in optional}


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # lower is served first; the gateway maps tiers onto it
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # vLLM's chat template switches: `continue_final_message` leaves the final (assistant) message's
    # turn open and generates its continuation (a gateway's mid-stream failover sends one)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # tidegate's extension, with continue_final_message: the token ids this engine generated for the
    # final message's text (announced on `: token_ids` comment lines), used instead of re-encoding it
    continue_token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _continuation_is_consistent(self) -> ChatRequest:
        if self.continue_final_message:
            if self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message needs the final message to be the assistant's")
            if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
                raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        elif self.continue_token_ids is not None:
            raise ValueError("continue_token_ids needs continue_final_message")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    # tidegate's extension: token ids this engine generated after the prompt, continued from (a
    # gateway's mid-stream failover sends them)
    continue_token_ids: list[int] | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's completions default


def parse_request(raw: bytes, kind: type[_SamplingFields]) -> _SamplingFields:
    """Validates a JSON body; any problem becomes a 400 naming the offending field."""
    try:
        body = kind.model_validate_json(raw)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        if errors[0]["type"] == "json_invalid":
            raise InvalidRequestError(f"request body is not valid JSON: {errors[0]['msg']}") from None
        # of a union's failed members, the one that got furthest says most ("Input should be
        # 'text'" for an image part, not "Input should be a valid string")
        deepest = max(errors, key=lambda item: len(item["loc"]))
        param = _field_path(deepest["loc"])
        raise InvalidRequestError(f"{param or 'body'}: {deepest['msg']}", param=param) from None
    refuse_unsupported(body.model_extra or {})
    return body


def _field_path(loc: tuple[int | str, ...]) -> str | None:
    """`messages.0.content` for pydantic's ('messages', 0, 'content', 'str'): a union adds the name
    of the member that failed to the path, which is no field of the request."""
    return ".".join(str(part) for part in loc if isinstance(part, int) or part in _FIELD_NAMES) or None


_FIELD_NAMES = frozenset(name for model in (ChatRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
                         for name in model.model_fields)
