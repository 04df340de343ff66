"""The OpenAI (and vLLM) request fields for features this engine does not implement.

Ignoring them would answer 200 with something other than what was asked (no tool call, no JSON
mode, one choice of several), so a value that turns one on is a 400 naming the field. Each field
maps to the values that leave its feature off; null (or leaving it out) is always off. Fields the
engine implements are typed in `schemas`; fields that cannot change an answer (`user`, `metadata`,
`store`, `service_tier`, `parallel_tool_calls`) and unknown extensions are accepted and ignored,
as vLLM does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from tidegate.errors import InvalidRequestError

__all__ = ["UNSUPPORTED_FIELDS", "refuse_unsupported"]

UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "n": (1,),  # one choice per request
    "best_of": (1,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # harmless without tools, and tools are refused
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    # vLLM's sampling extensions, which clients written for vLLM send
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_tokens": (0,),
    "use_beam_search": (False,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "stop_token_ids": ([],),
}


def _is_off(value: Any, off_values: tuple[Any, ...]) -> bool:
    # compared with their types: True == 1 in Python, yet `n: true` is no count
    return value is None or any(type(value) is type(off) and value == off for off in off_values)


def refuse_unsupported(fields: Mapping[str, Any]) -> None:
    """Raises a 400 naming the first field in `fields` that asks for an unimplemented feature."""
    for name, value in fields.items():
        off_values = UNSUPPORTED_FIELDS.get(name)
        if off_values is None or _is_off(value, off_values):
            continue
        allowed = " or ".join(orjson.dumps(off).decode() for off in off_values)
        message = f"this engine does not support '{name}'; omit it" + (f" or send {allowed}" if allowed else "")
        raise InvalidRequestError(message, param=name, code="unsupported_parameter")
