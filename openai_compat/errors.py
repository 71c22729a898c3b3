"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status as `code`
(as vLLM's server reports it) so that any transport can pick the status from the body."""
from __future__ import annotations

from typing import Any

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 408: "RequestTimeoutError", 413: "RequestTooLargeError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _TYPES.get(status, "BadRequestError")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.type)


def context_exceeded(limit: int, detail: str, remedy: str) -> str:
    """vLLM's wording for a request over the context, which clients match on: `detail` says what is over it."""
    return f"This model's maximum context length is {limit} tokens. However, {detail}. Please reduce {remedy}."


def error_body(message: str, status: int = 400, param: str | None = None, type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "BadRequestError"), "param": param,
                      "code": status}}


def status_of(body: Any) -> int | None:
    """The HTTP status an error body stands for, or None when `body` is not an error."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return code if isinstance(code, int) and 400 <= code < 600 else 500
    return None
