"""The one table of OpenAI-compatible routes: the job router (jobs.py) dispatches on it and the local gateway
(worker/gateway.py) mounts it, so a route exists on both transports or on neither.

A route's `paths` are the spellings a job's `openai_route` may use. The gateway serves each of them over HTTP,
and each `/v1/...` one under `/openai` too (the platform's OpenAI route forwards `/openai/v1/<path>` to the job
as `/v1/<path>`). vLLM serves its extra routes (tokenizer, pooling, score, rerank, metrics) at the root; they are
accepted under `/v1` as well, so a client with an `/openai/v1` base URL reaches them.

A route's `dialect` is the API it speaks: OpenAI's, or Anthropic's for the Messages API routes, whose errors
take Anthropic's body. A path below a route's (`/v1/messages/batches`) is refused in that route's dialect. A
route with `events` streams typed events, each named by its type (`event: message_start`), with no `[DONE]`.

A path may end in one parameter, `{name}` (one path segment): the gateway mounts it as aiohttp's variable
resource, and a job's `openai_route` names it with the value in place (`/v1/responses/resp_...`), which reaches
the endpoint as a keyword argument (`params_of`).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .errors import Dialect
from .messages.protocol import CountTokensRequest, MessagesRequest
from .responses.protocol import ResponsesRequest
from .pooling.protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from .chat.protocol import ChatCompletionRequest
from .completions.protocol import CompletionRequest
from .lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from .tokenization.protocol import DetokenizeRequest, TokenizeRequest


@dataclass(frozen=True)
class Route:
    paths: tuple[str, ...]
    method: str  # "POST" (a JSON body) or "GET" (none)
    endpoint: str  # the JobRouter method that serves it
    request: type[BaseModel] | None = None  # the body's model
    limited: bool = False  # parsed against the loaded model's request limits (prompt sizes)
    dialect: Dialect = "openai"  # the API it speaks: its error bodies
    events: bool = False  # its stream is typed events, each named by its `type`, with no `[DONE]`

    @property
    def name(self) -> str:
        return self.paths[0]

    def params_of(self, openai_route: str) -> dict[str, str]:
        """The values of the path's parameters in a job's `openai_route` (none for exact paths)."""
        for pattern in map(_pattern, self.paths):
            found = pattern.fullmatch(_job_path(openai_route)) if pattern is not None else None
            if found:
                return found.groupdict()
        return {}

    def http_paths(self) -> list[str]:
        return [prefix + path for path in self.paths
                for prefix in (("", "/openai") if path.startswith("/v1/") else ("",))]


ROUTES = (
    Route(("/v1/chat/completions",), "POST", "chat", ChatCompletionRequest, limited=True),
    Route(("/v1/completions",), "POST", "completions", CompletionRequest, limited=True),
    Route(("/v1/models",), "GET", "models"),
    Route(("/v1/responses",), "POST", "responses", ResponsesRequest, limited=True, events=True),
    Route(("/v1/responses/{response_id}",), "GET", "retrieve_response"),
    Route(("/v1/embeddings",), "POST", "embeddings", EmbeddingRequest),
    Route(("/tokenize", "/v1/tokenize"), "POST", "tokenize", TokenizeRequest),
    Route(("/detokenize", "/v1/detokenize"), "POST", "detokenize", DetokenizeRequest),
    Route(("/pooling", "/v1/pooling"), "POST", "pooling", PoolingRequest),
    Route(("/score", "/v1/score"), "POST", "score", ScoreRequest),
    Route(("/rerank", "/v1/rerank", "/v2/rerank"), "POST", "rerank", RerankRequest),
    Route(("/metrics", "/v1/metrics"), "GET", "metrics"),
    Route(("/stats", "/v1/stats"), "GET", "stats"),
    Route(("/v1/messages",), "POST", "messages", MessagesRequest, limited=True, dialect="anthropic", events=True),
    Route(("/v1/messages/count_tokens",), "POST", "count_message_tokens", CountTokensRequest, limited=True,
          dialect="anthropic"),
    Route(("/v1/load_lora_adapter",), "POST", "load_lora_adapter", LoadLoraAdapterRequest),
    Route(("/v1/unload_lora_adapter",), "POST", "unload_lora_adapter", UnloadLoraAdapterRequest),
)


@functools.cache
def _pattern(path: str) -> re.Pattern | None:
    """A path with a `{name}` parameter as a regular expression; None for an exact path."""
    if "{" not in path:
        return None
    return re.compile(re.sub(r"\\{(\w+)\\}", r"(?P<\1>[^/]+)", re.escape(path)))


def _job_path(openai_route: str) -> str:
    return openai_route.removeprefix("/openai") if openai_route.startswith("/openai/v1/") else openai_route


_BY_PATH = {path: route for route in ROUTES for path in route.paths if "{" not in path}
_PATTERNS = [(pattern, route) for route in ROUTES for path in route.paths if (pattern := _pattern(path))]
CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE = (route.name for route in ROUTES[:3])


def find(openai_route: str) -> Route | None:
    """The route a job's `openai_route` names (`/openai/v1/...` as `/v1/...`), or None."""
    path = _job_path(openai_route)
    route = _BY_PATH.get(path)
    if route is None:
        route = next((r for pattern, r in _PATTERNS if pattern.fullmatch(path)), None)
    return route


def dialect(path: Any) -> Dialect:
    """The dialect a path is answered in: its route's, or for an unknown path below a route's path, that
    route's (so `/v1/messages/batches` gets Anthropic's 404); OpenAI's otherwise."""
    if not isinstance(path, str):
        return "openai"
    route = find(path)
    if route is None:
        path = path.removeprefix("/openai") if path.startswith("/openai/v1/") else path
        route = next((r for known, r in _BY_PATH.items() if path.startswith(known + "/")), None)
    return route.dialect if route is not None else "openai"


def names() -> list[str]:
    return [path for route in ROUTES for path in route.paths]
