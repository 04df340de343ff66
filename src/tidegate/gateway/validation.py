"""The light hot-path check of an OpenAI request body: enough to route it and to refuse obvious
nonsense with a clear 400; the upstream validates the rest."""

from __future__ import annotations

from enum import Enum
from typing import Any

from tidegate.errors import InvalidRequestError

__all__ = ["Endpoint", "check_body", "check_nesting", "MAX_JSON_DEPTH"]

# Deeper than any OpenAI request needs (a tool's JSON schema nests a few dozen levels at most), and
# well inside what orjson re-encodes (255 levels): a body that parsed must also re-encode, or a
# rewrite of it for a replica fails half-way through a request.
MAX_JSON_DEPTH = 64


class Endpoint(Enum):
    # members are singletons: hashed by identity in C, not by Enum's Python-level hash of the name
    # (a dict keyed by an Endpoint is looked up on the request's way)
    __hash__ = object.__hash__

    CHAT = "/chat/completions"
    COMPLETIONS = "/completions"
    EMBEDDINGS = "/embeddings"


_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def check_body(endpoint: Endpoint, body: Any, max_tokens_cap: int) -> tuple[str, bool]:
    """(model, stream) of a well-formed body; raises InvalidRequestError naming the bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' is required and must be a non-empty string", param="model")
    stream = body.get("stream")
    if stream is None:  # OpenAI's spec allows null for "not set", and clients send it so
        stream = False
    elif not isinstance(stream, bool):
        raise InvalidRequestError("'stream' must be a boolean", param="stream")
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidRequestError("each message must be an object with a 'role'", param="messages")
    elif endpoint is Endpoint.COMPLETIONS:
        if not isinstance(body.get("prompt"), (str, list)):
            raise InvalidRequestError("'prompt' must be a string or a list", param="prompt")
    else:
        value = body.get("input")
        if not isinstance(value, (str, list)) or (isinstance(value, list) and not value):
            raise InvalidRequestError("'input' must be a string or a non-empty list", param="input")
        if stream:
            raise InvalidRequestError("embeddings cannot be streamed", param="stream")
    for field in _TOKEN_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= max_tokens_cap:
            raise InvalidRequestError(f"'{field}' must be an integer from 1 to {max_tokens_cap}", param=field)
    return model, stream


def check_nesting(raw_body: bytes, body: Any) -> None:
    """Refuses a body nested deeper than MAX_JSON_DEPTH (400), before any work is done for it.

    Nearly free for ordinary bodies: a body with fewer opening brackets than the limit cannot be
    that deep, and counting brackets is a C loop; only the rest are walked."""
    if raw_body.count(b"[") + raw_body.count(b"{") <= MAX_JSON_DEPTH:
        return
    level: list[Any] = [body] if isinstance(body, (dict, list)) else []
    for _depth in range(MAX_JSON_DEPTH):
        level = [child for node in level
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return
    raise InvalidRequestError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels")
