"""From a RunPod job's input to the parts the worker yields.

Routes `{"openai_route", "openai_input"}` jobs to the OpenAI endpoints and `{"prompt" | "messages",
"sampling_params"}` jobs to the legacy (worker-vllm) form. Non-streaming requests yield one dict; streams
yield batches of SSE text (or of chunk dicts with RAW_OPENAI_OUTPUT=0). Every failure becomes one OpenAI error
object; tracebacks go to the log, never to the caller.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import ServingConfig
from .errors import OpenAIError, error_body
from .protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, ParamError, SamplingFields,
                       random_id)
from .serving import OpenAIServing, Prompt
from .streaming import DONE, BatchSize, batched, carries_tokens, sse

log = logging.getLogger("openai_compat.jobs")

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"
MODELS_ROUTE = "/v1/models"
ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE)


def _loc(parts: tuple) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def parse(model: type[BaseModel], body: Any):
    """Validate a request body; a problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        # Union members each report a failure; the field path without the member name reads best.
        loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in (
            "str", "int", "list[int]", "list[str]", "list[list[int]]", "function-after"))))
        param = _loc(loc) or None
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, ParamError):
            param = _loc((*loc, cause.param)) if loc else cause.param
        messages = []
        for error in errors[:3]:
            where = _loc(error["loc"])
            messages.append(f"{where}: {error['msg']}" if where else error["msg"])
        return_message = "; ".join(m.replace("Value error, ", "") for m in messages)
        raise OpenAIError(return_message, param=param) from None


class LegacySamplingParams(SamplingFields):
    max_tokens: int = Field(default=100, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)


class LegacyJob(BaseModel):
    """worker-vllm's native job form."""
    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling_params: LegacySamplingParams = Field(default_factory=lambda: LegacySamplingParams())
    stream: bool = False
    apply_chat_template: bool = False
    max_batch_size: int | None = Field(default=None, ge=1)
    min_batch_size: int | None = Field(default=None, ge=1)
    batch_size_growth_factor: float | None = Field(default=None, ge=1.0)


class JobRouter:
    def __init__(self, serving: OpenAIServing, config: ServingConfig):
        self.serving = serving
        self.config = config

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
        if "openai_route" in job_input:
            async for part in self._openai(job_input["openai_route"], job_input.get("openai_input")):
                yield part
        elif "prompt" in job_input or "messages" in job_input:
            async for part in self._legacy(parse(LegacyJob, job_input)):
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
        route = route.removeprefix("/openai") if isinstance(route, str) else route
        if route == MODELS_ROUTE:
            yield (await self.serving.list_models()).model_dump(mode="json")
            return
        if route == CHAT_ROUTE:
            result = await self.serving.create_chat_completion(parse(ChatCompletionRequest, body))
        elif route == COMPLETIONS_ROUTE:
            result = await self.serving.create_completion(parse(CompletionRequest, body))
        else:
            raise OpenAIError(f"unknown openai_route {route!r}; supported: {', '.join(ROUTES)}", status=404,
                              param="openai_route")
        if isinstance(result, BaseModel):
            yield result.model_dump(mode="json")
            return
        async for part in self._stream(result):
            yield part

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

    # ---------------------------------------------------------------- legacy form

    async def _legacy(self, job: LegacyJob) -> AsyncIterator[dict]:
        serving = self.serving
        await serving.ready()
        if job.messages is not None:
            prompt = await serving.chat_prompt(ChatCompletionRequest(messages=job.messages))
        elif job.apply_chat_template:
            prompt = await serving.chat_prompt(ChatCompletionRequest(
                messages=[ChatMessage(role="user", content=job.prompt)]))
        else:
            prompt = Prompt(await serving.tokenize(job.prompt, True), job.prompt)
            if not prompt.token_ids:
                raise OpenAIError("the prompt is empty after tokenization", param="prompt")
        sp = job.sampling_params
        params = serving.sampling_params(sp, len(prompt.token_ids), sp.max_tokens, sp.logprobs, sp.prompt_logprobs)
        usage = {"input": len(prompt.token_ids), "output": 0}
        outputs = serving.run(random_id("legacy"), prompt, params)
        if not job.stream:
            texts = [""] * params.n
            async for output in outputs:
                for delta in output.deltas:
                    texts[delta.index] += delta.text
                    usage["output"] += len(delta.token_ids)
            yield {"choices": [{"tokens": [text]} for text in texts], "usage": usage}
            return

        async def pieces():
            async for output in outputs:
                for delta in output.deltas:
                    usage["output"] += len(delta.token_ids)
                    if delta.text:
                        yield delta.index, delta.text

        async for batch in batched(pieces(), self._batch_size(job)):
            choices = [{"tokens": []} for _ in range(params.n)]
            for index, text in batch:
                choices[index]["tokens"].append(text)
            yield {"choices": choices, "usage": dict(usage)}
