"""From a RunPod job's input to the parts the worker yields.

Routes `{"openai_route", "openai_input"}` jobs to the OpenAI endpoints (and vLLM's extra ones: tokenizer,
embeddings, pooling, score, rerank, metrics, stats) and `{"prompt" | "messages",
"sampling_params"}` jobs to the legacy (worker-vllm) form. Non-streaming requests yield one dict; streams
yield batches of SSE text (or of chunk dicts with RAW_OPENAI_OUTPUT=0). Every failure becomes one OpenAI error
object (an Anthropic one on the Messages API routes); tracebacks go to the log, never to the caller.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from pydantic import BaseModel

from .config import ServingConfig
from .errors import OpenAIError, error_body_in
from .legacy.protocol import LegacyJob
from .legacy.serving import run_legacy
from .metrics import METRICS_CONTENT_TYPE
from .pooling.protocol import EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from .pooling.serving import PoolingServing
from .chat.protocol import ChatCompletionRequest
from .chat.serving import ChatServing
from .completions.protocol import CompletionRequest
from .completions.serving import CompletionServing
from .messages.protocol import CountTokensRequest, MessagesRequest
from .messages.serving import MessagesServing
from .responses.protocol import ResponsesRequest
from .responses.serving import ResponsesServing
from .models import ModelList, list_models
from .lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest, load_adapter, unload_adapter
from . import routes
from .routes import CHAT_ROUTE
from .serving import OpenAIServing
from .tokenization.protocol import DetokenizeRequest, TokenizeRequest
from .tokenization.serving import TokenizationServing
from .streaming import BatchSize, job_stream
from .validation import check_json, parse

log = logging.getLogger("openai_compat.jobs")


class JobRouter:
    def __init__(self, serving: OpenAIServing, config: ServingConfig):
        self.serving = serving
        self.config = config
        self.chat_serving = ChatServing(serving)
        self.completion_serving = CompletionServing(serving)
        self.tokenization = TokenizationServing(serving)
        self.pooling_serving = PoolingServing(serving)
        self.messages_serving = MessagesServing(self.chat_serving)
        self.responses_serving = ResponsesServing(self.chat_serving)  # keeps this worker's stored responses

    async def run(self, job_input: Any, job_id: str | None = None) -> AsyncIterator[Any]:
        dialect = "openai"  # errors answer in the dialect of the route asked for
        try:
            if isinstance(job_input, dict):
                dialect = routes.dialect(job_input.get("openai_route"))
            async for part in self._dispatch(job_input):
                yield part
        except OpenAIError as exc:
            log.info("job %s: %d %s", job_id, exc.status, exc.message)
            yield exc.body(dialect)
        except Exception:
            log.exception("job %s: internal error", job_id)
            yield error_body_in(dialect, "internal error while processing the request; see the worker log", 500)

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

    async def _openai(self, route_name: Any, body: Any) -> AsyncIterator[Any]:
        if not isinstance(route_name, str):
            raise OpenAIError(f"openai_route must be a string such as {CHAT_ROUTE!r}, got "
                              f"{type(route_name).__name__}", param="openai_route")
        route = routes.find(route_name)
        if route is None:
            raise OpenAIError(f"unknown openai_route {ascii(route_name)[:200]}; supported: "
                              f"{', '.join(routes.names())}", status=404, param="openai_route")
        await self.serving.ready()  # the request limits depend on the model
        # route.endpoint names one of this class's methods below; the table listing every route with its endpoint
        # (and request model) is routes.ROUTES, in openai_compat/routes.py.
        if route.request is None:
            result = await getattr(self, route.endpoint)(**route.params_of(route_name))
        else:
            limits = self.serving.request_limits() if route.limited else None
            request = await asyncio.to_thread(parse, route.request, body, limits)
            result = await getattr(self, route.endpoint)(request)
        if isinstance(result, BaseModel):
            yield result.model_dump(mode="json")
            return
        if isinstance(result, dict):
            yield result
            return
        async for part in job_stream(result, self._batch_size(), self.config.raw_openai_output, route.dialect,
                                    route.events):
            yield part

    # ---- the endpoints the route table (routes.ROUTES) names ----

    async def chat(self, request: ChatCompletionRequest):
        return await self.chat_serving.create_chat_completion(request)

    async def completions(self, request: CompletionRequest):
        return await self.completion_serving.create_completion(request)

    async def responses(self, request: ResponsesRequest):
        return await self.responses_serving.create_response(request)

    async def retrieve_response(self, response_id: str) -> dict:
        return self.responses_serving.retrieve(response_id)

    async def models(self) -> ModelList:
        return await list_models(self.serving)

    async def embeddings(self, request: EmbeddingRequest):
        return await self.pooling_serving.create_embedding(request)

    async def tokenize(self, request: TokenizeRequest):
        return await self.tokenization.tokenize(request)

    async def detokenize(self, request: DetokenizeRequest):
        return await self.tokenization.detokenize(request)

    async def pooling(self, request: PoolingRequest):
        return await self.pooling_serving.create_pooling(request)

    async def score(self, request: ScoreRequest):
        return await self.pooling_serving.create_score(request)

    async def rerank(self, request: RerankRequest):
        return await self.pooling_serving.create_rerank(request)

    async def messages(self, request: MessagesRequest):
        return await self.messages_serving.create_message(request)

    async def count_message_tokens(self, request: CountTokensRequest):
        return await self.messages_serving.count_tokens(request)

    async def load_lora_adapter(self, request: LoadLoraAdapterRequest) -> dict:
        return await load_adapter(self.serving, request)

    async def unload_lora_adapter(self, request: UnloadLoraAdapterRequest) -> dict:
        return await unload_adapter(self.serving, request)

    async def metrics(self) -> dict:
        # The Prometheus text, wrapped so that a job output stays JSON.
        return {"object": "metrics", "content_type": METRICS_CONTENT_TYPE, "text": self.serving.metrics.exposition()}

    async def stats(self) -> dict:
        return self.serving.metrics.stats()
