"""From a RunPod job's input to the parts the worker yields.

Routes `{"openai_route", "openai_input"}` jobs to the OpenAI endpoints and `{"prompt" | "messages",
"sampling_params"}` jobs to the legacy (worker-vllm) form. Non-streaming requests yield one dict; streams
yield batches of SSE text (or of chunk dicts with RAW_OPENAI_OUTPUT=0). Every failure becomes one OpenAI error
object; tracebacks go to the log, never to the caller.
"""
from __future__ import annotations

import logging
import math
import re
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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

# Generous for tool JSON schemas (a few levels each), and far below the interpreter's recursion limit, which
# pydantic, the chat template and json.dumps all run into on deeper input.
MAX_DEPTH = 100
# Far wider than any id, seed or count the API takes; Python refuses to print ints past 4300 digits, so an
# error message naming a bigger one would itself fail.
MAX_INT_BITS = 128
_SURROGATE = re.compile("[\ud800-\udfff]")  # halves of UTF-16 pairs: a Python str holds them, UTF-8 cannot


def _loc(parts: tuple) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def check_json(value: Any) -> None:
    """Reject input that no JSON text could carry or that would break the layers below: nesting deeper than
    MAX_DEPTH, lone surrogates (text that cannot be encoded as UTF-8, so neither tokenized nor sent back),
    NaN and infinities, huge ints, non-string keys and non-JSON types. The one place these become a 400
    naming the field. Iterative, so the check itself cannot overflow the stack."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, (dict, list)):
            if len(path) >= MAX_DEPTH:
                where = _loc(path[:1])
                raise OpenAIError(f"{where or 'the request'} is nested more than {MAX_DEPTH} levels deep",
                                  param=where or None)
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str) or _SURROGATE.search(key):
                        where = _loc(path)
                        raise OpenAIError(f"{where or 'the request'} has a key that is not a valid Unicode string: "
                                          f"{ascii(key)[:80]}", param=where or None)
            for key, child in item.items() if isinstance(item, dict) else enumerate(item):
                # Plain values are settled here (a token-id prompt can hold millions); the rest go on the stack.
                if not _plain(child):
                    stack.append((child, (*path, key)))
        elif not _plain(item):
            where = _loc(path)
            raise OpenAIError(f"{where or 'the request'} {_not_json(item)}", param=where or None)


def _plain(value: Any) -> bool:
    """A JSON scalar the layers below can take."""
    return (isinstance(value, str) and (value.isascii() or not _SURROGATE.search(value))
            or isinstance(value, int) and value.bit_length() <= MAX_INT_BITS  # bool too
            or isinstance(value, float) and math.isfinite(value) or value is None)


def _not_json(item: Any) -> str:
    if isinstance(item, str):
        char = _SURROGATE.search(item).group()
        return (f"contains a lone surrogate (U+{ord(char):04X}), which is not valid Unicode text; send text as "
                f"UTF-8")
    if isinstance(item, float):
        return f"is {item}, not a finite number (JSON has no NaN or infinity)"
    if isinstance(item, int):
        return f"is an integer too large to be valid here (more than {MAX_INT_BITS} bits)"
    return f"is a {type(item).__name__}, not a JSON value"


# Union member names that pydantic puts into error locations; a path without them reads like the request the
# caller wrote.
_MEMBER_NAMES = ("str", "int", "float", "bool", "function-after", "function-before", "function-wrap")


def _clean_loc(loc: tuple) -> tuple:
    return tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _MEMBER_NAMES)))


def parse(model: type[BaseModel], body: Any):
    """Validate a request body; a problem becomes a 400 naming the parameter."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        # For a field with several accepted forms, each form reports why it failed; the one that got furthest
        # into the value is the form the caller meant.
        same_field = [e for e in errors if _clean_loc(e["loc"])[:1] == _clean_loc(first["loc"])[:1]]
        depth = max(len(_clean_loc(e["loc"])) for e in same_field)
        chosen = [e for e in same_field if len(_clean_loc(e["loc"])) == depth]
        loc = _clean_loc(chosen[0]["loc"])
        param = _loc(loc) or None
        cause = (chosen[0].get("ctx") or {}).get("error")
        if isinstance(cause, ParamError):
            param = _loc((*loc, cause.param)) if loc else cause.param
        messages: list[str] = []
        for error in chosen:
            where = _loc(_clean_loc(error["loc"]))
            text = error["msg"].removeprefix("Value error, ")
            text = f"{where}: {text}" if where else text
            if text not in messages:
                messages.append(text)
        raise OpenAIError("; ".join(messages[:3]), param=param) from None


class LegacySamplingParams(SamplingFields):
    max_tokens: int = Field(default=100, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    prompt_logprobs: int | None = Field(default=None, ge=0)


class LegacyJob(BaseModel):
    """worker-vllm's native job form."""
    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    sampling_params: LegacySamplingParams = Field(default_factory=lambda: LegacySamplingParams())
    stream: bool = False
    apply_chat_template: bool = False
    max_batch_size: int | None = Field(default=None, ge=1)
    min_batch_size: int | None = Field(default=None, ge=1)
    batch_size_growth_factor: float | None = Field(default=None, ge=1.0)

    @model_validator(mode="after")
    def _one_input(self) -> "LegacyJob":
        # Both or neither would leave it to chance which text the model sees.
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give either prompt (a string) or messages (a list), not both or neither")
        return self


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
            body = job_input.get("openai_input")
            check_json(body)  # errors name fields of the request body, as over HTTP
            async for part in self._openai(job_input["openai_route"], body):
                yield part
        elif "prompt" in job_input or "messages" in job_input:
            check_json(job_input)
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
        if not isinstance(route, str):
            raise OpenAIError(f"openai_route must be a string such as {CHAT_ROUTE!r}, got {type(route).__name__}",
                              param="openai_route")
        route = route.removeprefix("/openai")
        if route == MODELS_ROUTE:
            yield (await self.serving.list_models()).model_dump(mode="json")
            return
        if route == CHAT_ROUTE:
            result = await self.serving.create_chat_completion(parse(ChatCompletionRequest, body))
        elif route == COMPLETIONS_ROUTE:
            result = await self.serving.create_completion(parse(CompletionRequest, body))
        else:
            raise OpenAIError(f"unknown openai_route {ascii(route)[:200]}; supported: {', '.join(ROUTES)}",
                              status=404, param="openai_route")
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
