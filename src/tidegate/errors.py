"""The exception tree shared by the engine and the gateway.

Each error knows its HTTP status and OpenAI error `type`/`code`; `openai_error_body` renders the
body OpenAI clients parse (`{"error": {"message", "type", "param", "code"}}`).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "TidegateError",
    "InvalidRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "MethodNotAllowedError",
    "ConflictError",
    "PayloadTooLargeError",
    "RateLimitError",
    "OverloadedError",
    "UpstreamError",
    "UpstreamTimeoutError",
    "InternalError",
    "openai_error_body",
]


class TidegateError(Exception):
    status: int = 500
    error_type: str = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        # seconds a client should wait before retrying; rendered as the Retry-After header
        self.retry_after_s = retry_after_s


class InvalidRequestError(TidegateError):
    status = 400
    error_type = "invalid_request_error"


class AuthenticationError(TidegateError):
    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(TidegateError):
    status = 403
    error_type = "invalid_request_error"


class NotFoundError(TidegateError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class MethodNotAllowedError(TidegateError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"

    def __init__(self, message: str, *, allow: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        # header lines the answer carries (HTTP requires Allow with a 405): the methods the path takes
        self.headers = f"allow: {allow}\r\n".encode()


class ConflictError(TidegateError):
    """The resource's state forbids the change now (OpenAI answers 409: a file a running batch reads)."""

    status = 409
    error_type = "invalid_request_error"


class PayloadTooLargeError(TidegateError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(TidegateError):
    status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class OverloadedError(TidegateError):
    status = 503
    error_type = "server_error"
    default_code = "overloaded"


class UpstreamError(TidegateError):
    status = 502
    error_type = "server_error"
    default_code = "upstream_error"


class UpstreamTimeoutError(TidegateError):
    status = 504
    error_type = "server_error"
    default_code = "upstream_timeout"


class InternalError(TidegateError):
    status = 500
    error_type = "server_error"


def openai_error_body(error: TidegateError) -> dict[str, Any]:
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    }
