"""`POST /v1/embeddings` in OpenAI's schema, over an EmbeddingBatcher.

Choices where OpenAI's behaviour does not carry over to a small local model:
- `input`: a string or a list of strings (at most MAX_INPUTS, none empty). Token-id input (a list
  of ints, or of lists of ints) is refused with a 400: OpenAI's ids are tiktoken ids, meaningless
  to this model's WordPiece vocabulary.
- Inputs longer than the model's window are truncated, as sentence-transformers does for this
  model; `usage.prompt_tokens` counts the tokens actually embedded.
- `dimensions` must equal the model's: MiniLM is not Matryoshka-trained, so truncated vectors
  would silently lose quality. Anything else is a 400.
- `encoding_format` "base64" is the little-endian float32 bytes, base64-encoded, as OpenAI sends.
Bad input of any kind answers OpenAI's error body with a 4xx; the worker keeps serving.
"""

from __future__ import annotations

import base64
import logging
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from tidegate.errors import (
    InternalError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    TidegateError,
    openai_error_body,
)

if TYPE_CHECKING:
    import numpy as np

    from tidegate.engine.embeddings import EmbeddingBatcher

__all__ = ["MAX_INPUTS", "make_embeddings_routes", "encode_base64", "decode_base64"]

log = logging.getLogger(__name__)

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
_ENCODING_FORMATS = ("float", "base64")


def encode_base64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")


def decode_base64(text: str) -> np.ndarray:
    import numpy as np

    return np.frombuffer(base64.b64decode(text), dtype="<f4")


def _error_response(error: TidegateError) -> web.Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return web.json_response(openai_error_body(error), status=error.status, headers=headers,
                             dumps=lambda body: orjson.dumps(body).decode())


def _parse_texts(raw: Any) -> list[str]:
    if isinstance(raw, str):
        texts = [raw]
    elif isinstance(raw, list) and raw:
        if all(isinstance(item, str) for item in raw):
            texts = raw
        elif all(isinstance(item, int) or isinstance(item, list) for item in raw):
            raise InvalidRequestError("token-id input is not supported by this model; send text",
                                      param="input", code="unsupported_input")
        else:
            raise InvalidRequestError("'input' must be a string or a list of strings", param="input")
    elif isinstance(raw, list):
        raise InvalidRequestError("'input' must not be an empty list", param="input")
    elif raw is None:
        raise InvalidRequestError("you must provide an 'input' parameter", param="input")
    else:
        raise InvalidRequestError("'input' must be a string or a list of strings", param="input")
    if len(texts) > MAX_INPUTS:
        raise InvalidRequestError(f"'input' has {len(texts)} items; at most {MAX_INPUTS} per request",
                                  param="input")
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequestError(f"'input[{i}]' is empty; every input must be a non-empty string",
                                      param="input")
    return texts


def _check_options(body: dict[str, Any], served_names: set[str], dimensions: int) -> str:
    model = body.get("model")
    if model is None:
        raise InvalidRequestError("you must provide a 'model' parameter", param="model")
    if not isinstance(model, str):
        raise InvalidRequestError("'model' must be a string", param="model")
    if model not in served_names:
        raise NotFoundError(f"the model '{model}' does not exist; this worker serves "
                            f"{sorted(served_names)[0]!r}", param="model")
    encoding_format = body.get("encoding_format", "float")
    if encoding_format is None:
        encoding_format = "float"
    if encoding_format not in _ENCODING_FORMATS:
        raise InvalidRequestError(f"'encoding_format' must be one of {list(_ENCODING_FORMATS)}",
                                  param="encoding_format")
    wanted = body.get("dimensions")
    if wanted is not None and (isinstance(wanted, bool) or wanted != dimensions):
        raise InvalidRequestError(f"this model embeds in {dimensions} dimensions only; 'dimensions' "
                                  "must be omitted or equal to it", param="dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise InvalidRequestError("'user' must be a string", param="user")
    return encoding_format


def make_embeddings_routes(batcher: EmbeddingBatcher, served_model_name: str) -> list[web.RouteDef]:
    served_names = {served_model_name, batcher.model.name, *getattr(batcher.model, "aliases", ())}
    dimensions = batcher.model.dimensions

    async def create_embeddings(request: web.Request) -> web.Response:
        try:
            try:
                body = orjson.loads(await request.read())
            except web.HTTPRequestEntityTooLarge as error:
                raise PayloadTooLargeError(error.text or "request body too large") from None
            except orjson.JSONDecodeError as error:
                raise InvalidRequestError(f"request body is not valid JSON: {error}") from None
            if not isinstance(body, dict):
                raise InvalidRequestError("request body must be a JSON object")
            encoding_format = _check_options(body, served_names, dimensions)
            texts = _parse_texts(body.get("input"))
            vectors, prompt_tokens = await batcher.embed(texts)
        except TidegateError as error:
            return _error_response(error)
        except Exception:  # a bug must still answer in OpenAI's format, and be logged
            log.exception("embeddings request failed")
            return _error_response(InternalError("internal error while embedding"))
        if encoding_format == "base64":
            data = [{"object": "embedding", "index": i, "embedding": encode_base64(v)} for i, v in enumerate(vectors)]
        else:
            data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        payload = {
            "object": "list",
            "data": data,
            "model": served_model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
        return web.Response(body=orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
                            content_type="application/json")

    return [web.post("/v1/embeddings", create_embeddings)]
