"""The one table of OpenAI-compatible routes: the job router dispatches on it and the local gateway mounts it, so
a route exists on both transports or on neither.

A route's `paths` are the spellings a job's `openai_route` may use. The gateway serves each of them over HTTP,
and each `/v1/...` one under `/openai` too (the platform's OpenAI route forwards `/openai/v1/<path>` to the job
as `/v1/<path>`). vLLM serves its extra routes (tokenizer, pooling, score, rerank, metrics) at the root; they are
accepted under `/v1` as well, so a client with an `/openai/v1` base URL reaches them.

A route's `dialect` is the API it speaks: OpenAI's, or Anthropic's for the Messages API routes, whose errors
take Anthropic's body and whose streams name their events (`event: message_start`). A path below a route's
(`/v1/messages/batches`) is refused in that route's dialect.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from .errors import Dialect
from .messages.protocol import CountTokensRequest, MessagesRequest
from .pooling.protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from .chat.protocol import ChatCompletionRequest
from .completions.protocol import CompletionRequest
from .tokenization.protocol import DetokenizeRequest, TokenizeRequest


@dataclass(frozen=True)
class Route:
    paths: tuple[str, ...]
    method: str  # "POST" (a JSON body) or "GET" (none)
    endpoint: str  # the JobRouter method that serves it
    request: type[BaseModel] | None = None  # the body's model
    limited: bool = False  # parsed against the loaded model's request limits (prompt sizes)
    dialect: Dialect = "openai"  # the API it speaks: its error bodies and stream framing

    @property
    def name(self) -> str:
        return self.paths[0]

    def http_paths(self) -> list[str]:
        return [prefix + path for path in self.paths
                for prefix in (("", "/openai") if path.startswith("/v1/") else ("",))]


ROUTES = (
    Route(("/v1/chat/completions",), "POST", "chat", ChatCompletionRequest, limited=True),
    Route(("/v1/completions",), "POST", "completions", CompletionRequest, limited=True),
    Route(("/v1/models",), "GET", "models"),
    Route(("/v1/embeddings",), "POST", "embeddings", EmbeddingRequest),
    Route(("/tokenize", "/v1/tokenize"), "POST", "tokenize", TokenizeRequest),
    Route(("/detokenize", "/v1/detokenize"), "POST", "detokenize", DetokenizeRequest),
    Route(("/pooling", "/v1/pooling"), "POST", "pooling", PoolingRequest),
    Route(("/score", "/v1/score"), "POST", "score", ScoreRequest),
    Route(("/rerank", "/v1/rerank", "/v2/rerank"), "POST", "rerank", RerankRequest),
    Route(("/metrics", "/v1/metrics"), "GET", "metrics"),
    Route(("/stats", "/v1/stats"), "GET", "stats"),
    Route(("/v1/messages",), "POST", "messages", MessagesRequest, limited=True, dialect="anthropic"),
    Route(("/v1/messages/count_tokens",), "POST", "count_message_tokens", CountTokensRequest, limited=True,
          dialect="anthropic"),
)

_BY_PATH = {path: route for route in ROUTES for path in route.paths}
CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE = (route.name for route in ROUTES[:3])


def find(openai_route: str) -> Route | None:
    """The route a job's `openai_route` names (`/openai/v1/...` as `/v1/...`), or None."""
    if openai_route.startswith("/openai/v1/"):
        openai_route = openai_route.removeprefix("/openai")
    return _BY_PATH.get(openai_route)


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
