"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status as `code`
(as vLLM's server reports it) so that any transport can pick the status from the body.

Routes that speak Anthropic's Messages API answer in its dialect instead:
`{"type": "error", "error": {"type", "message"}}`, the status standing in the error's type. Every failure is
raised as one OpenAIError (status, message, param) and takes its route's dialect only as it becomes a body.
"""
from __future__ import annotations

from typing import Any, Literal

Dialect = Literal["openai", "anthropic"]

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _TYPES.get(status, "BadRequestError")

    def body(self, dialect: Dialect = "openai") -> dict[str, Any]:
        if dialect == "anthropic":
            return anthropic_error_body(self.message, self.status, self.param)
        return error_body(self.message, self.status, self.param, self.type)


def context_exceeded(limit: int, detail: str, remedy: str) -> str:
    """vLLM's wording for a request over the context, which clients match on: `detail` says what is over it."""
    return f"This model's maximum context length is {limit} tokens. However, {detail}. Please reduce {remedy}."


def error_body(message: str, status: int = 400, param: str | None = None, type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "BadRequestError"), "param": param,
                      "code": status}}


# Anthropic's error types (https://docs.anthropic.com/en/api/errors) for the statuses this worker answers with.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error"}
_ANTHROPIC_STATUS = {kind: status for status, kind in _ANTHROPIC_TYPES.items()}


def anthropic_error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error body. It has no `param`: the message starts with the field (`max_tokens: Field
    required`), in place of a location the message gives for the field's parent."""
    if param:
        head, colon, rest = message.partition(": ")
        if colon and head != param and param.startswith(head):
            message = f"{param}: {rest}"
        elif param not in message:
            message = f"{param}: {message}"
    kind = _ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body_in(dialect: Dialect, message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """An error body in a route's dialect."""
    if dialect == "anthropic":
        return anthropic_error_body(message, status, param)
    return error_body(message, status, param)


def status_of(body: Any) -> int | None:
    """The HTTP status an error body (of either dialect) stands for, or None when `body` is not an error."""
    if isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict):
        return _ANTHROPIC_STATUS.get(body["error"].get("type"), 500)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return code if isinstance(code, int) and 400 <= code < 600 else 500
    return None
