"""From a RunPod job's input to the parts the worker yields.

Routes `{"openai_route", "openai_input"}` jobs to the OpenAI endpoints (and vLLM's extra ones: tokenizer,
embeddings, pooling, score, rerank, metrics, stats) and `{"prompt" | "messages",
"sampling_params"}` jobs to the legacy (worker-vllm) form. Non-streaming requests yield one dict; streams
yield batches of SSE text (or of chunk dicts with RAW_OPENAI_OUTPUT=0). Every failure becomes one OpenAI error
object; tracebacks go to the log, never to the caller.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from pydantic import BaseModel

from .config import ServingConfig
from .errors import OpenAIError, error_body
from .legacy import LegacyJob, run_legacy
from .metrics import METRICS_CONTENT_TYPE
from .pooling import EmbeddingRequest, PoolingRequest, PoolingServing, RerankRequest, ScoreRequest
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing
from .tokenization import DetokenizeRequest, TokenizationServing, TokenizeRequest
from .streaming import DONE, BatchSize, batched, carries_tokens, sse
from .validation import check_json, parse

log = logging.getLogger("openai_compat.jobs")

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
MODELS_ROUTE = "/v1/models"
EMBEDDINGS_ROUTE = "/v1/embeddings"
# vLLM serves these at the root (and /v1/rerank, /v2/rerank); the platform forwards /openai/v1/<path> as
# /v1/<path>, so each is also accepted under /v1.
TOKENIZE_ROUTE = "/tokenize"
DETOKENIZE_ROUTE = "/detokenize"
POOLING_ROUTE = "/pooling"
SCORE_ROUTE = "/score"
RERANK_ROUTE = "/rerank"
METRICS_ROUTE = "/metrics"
STATS_ROUTE = "/stats"
ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE, EMBEDDINGS_ROUTE, TOKENIZE_ROUTE, DETOKENIZE_ROUTE,
          POOLING_ROUTE, SCORE_ROUTE, RERANK_ROUTE, "/v2/rerank", METRICS_ROUTE, STATS_ROUTE)


def extra_route(route: str) -> str | None:
    """The route name of a path outside chat, completions and models (`/v1/tokenize` -> `/tokenize`), or None."""
    for prefix in ("/v1", "/v2"):
        if route.startswith(prefix + "/"):
            name = route[len(prefix):]
            if name == RERANK_ROUTE or (prefix == "/v1" and name in _EXTRA_ROUTES):
                return name
            return None
    return route if route in _EXTRA_ROUTES and route != "/embeddings" else None


_EXTRA_ROUTES = ("/embeddings", TOKENIZE_ROUTE, DETOKENIZE_ROUTE, POOLING_ROUTE, SCORE_ROUTE, RERANK_ROUTE,
                 METRICS_ROUTE, STATS_ROUTE)

class JobRouter:
    def __init__(self, serving: OpenAIServing, config: ServingConfig):
        self.serving = serving
        self.config = config
        self.tokenization = TokenizationServing(serving)
        self.pooling = PoolingServing(serving)

    async def run(self, job_input: Any, job_id: str | None = None) -> AsyncIterator[Any]:
        try:
            async for part in self._dispatch(job_input):
                yield part
        except OpenAIError as exc:
            log.info("job %s: %d %s", job_id, exc.status, exc.message)
            yield exc.body()
        except Exception:
            log.exception("job %s: internal error", job_id)
            yield error_body("internal error while processing the request; see the worker log", 500)

    async def _dispatch(self, job_input: Any) -> AsyncIterator[Any]:
        if not isinstance(job_input, dict):
            raise OpenAIError("the job input must be a JSON object")
        # Checking and validating a body is work in proportion to its size (a body can hold a million values):
        # it runs on a worker thread, so the event loop keeps serving other jobs meanwhile.
        if "openai_route" in job_input:
            body = job_input.get("openai_input")
            await asyncio.to_thread(check_json, body)  # errors name fields of the request body, as over HTTP
            async for part in self._openai(job_input["openai_route"], body):
                yield part
        elif "prompt" in job_input or "messages" in job_input:
            await asyncio.to_thread(check_json, job_input)
            await self.serving.ready()
            job = await asyncio.to_thread(parse, LegacyJob, job_input, self.serving.request_limits())
            async for part in run_legacy(self.serving, job, self._batch_size(job)):
                yield part
        else:
            raise OpenAIError("the job input needs openai_route (with openai_input), prompt or messages")

    def _batch_size(self, job: LegacyJob | None = None) -> BatchSize:
        c = self.config
        return BatchSize(job and job.min_batch_size or c.min_batch_size,
                         job and job.batch_size_growth_factor or c.batch_size_growth_factor,
                         job and job.max_batch_size or c.default_batch_size)

    # ---------------------------------------------------------------- OpenAI routes

    async def _openai(self, route: Any, body: Any) -> AsyncIterator[Any]:
        if not isinstance(route, str):
            raise OpenAIError(f"openai_route must be a string such as {CHAT_ROUTE!r}, got {type(route).__name__}",
                              param="openai_route")
        route = route.removeprefix("/openai")
        if route == MODELS_ROUTE:
            yield (await self.serving.list_models()).model_dump(mode="json")
            return
        extra = extra_route(route)
        if route not in (CHAT_ROUTE, COMPLETIONS_ROUTE) and extra is None:
            raise OpenAIError(f"unknown openai_route {ascii(route)[:200]}; supported: {', '.join(ROUTES)}",
                              status=404, param="openai_route")
        await self.serving.ready()  # the limits depend on the model
        limits = self.serving.request_limits()
        if route == CHAT_ROUTE:
            request = await asyncio.to_thread(parse, ChatCompletionRequest, body, limits)
            result = await self.serving.create_chat_completion(request)
        elif route == COMPLETIONS_ROUTE:
            request = await asyncio.to_thread(parse, CompletionRequest, body, limits)
            result = await self.serving.create_completion(request)
        else:
            result = await self._extra(extra, body)
        if isinstance(result, BaseModel):
            yield result.model_dump(mode="json")
            return
        if isinstance(result, dict):
            yield result
            return
        async for part in self._stream(result):
            yield part

    async def _extra(self, name: str, body: Any) -> BaseModel | dict:
        if name == METRICS_ROUTE:  # the Prometheus text, wrapped so that a job output stays JSON
            return {"object": "metrics", "content_type": METRICS_CONTENT_TYPE,
                    "text": self.serving.metrics.exposition()}
        if name == STATS_ROUTE:
            return self.serving.metrics.stats()
        if name == TOKENIZE_ROUTE:
            return await self.tokenization.tokenize(await asyncio.to_thread(parse, TokenizeRequest, body))
        if name == DETOKENIZE_ROUTE:
            return await self.tokenization.detokenize(await asyncio.to_thread(parse, DetokenizeRequest, body))
        if name == "/embeddings":
            return await self.pooling.create_embedding(await asyncio.to_thread(parse, EmbeddingRequest, body))
        if name == POOLING_ROUTE:
            return await self.pooling.create_pooling(await asyncio.to_thread(parse, PoolingRequest, body))
        if name == SCORE_ROUTE:
            return await self.pooling.create_score(await asyncio.to_thread(parse, ScoreRequest, body))
        return await self.pooling.create_rerank(await asyncio.to_thread(parse, RerankRequest, body))

    async def _stream(self, chunks: AsyncIterator[BaseModel]) -> AsyncIterator[Any]:
        raw = self.config.raw_openai_output
        started = False
        try:
            async for batch in batched(chunks, self._batch_size(), carries_tokens):
                started = True
                yield "".join(sse(c) for c in batch) if raw else [c.model_dump(mode="json") for c in batch]
        except OpenAIError as exc:
            if not started:
                raise
            log.warning("stream failed after it started: %s", exc.message)
            yield sse(exc.body()) if raw else [exc.body()]
        if raw:
            yield DONE
