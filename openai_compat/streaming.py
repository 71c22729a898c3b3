"""Streams: the chunks of one stream, their server-sent-event framing (`data: ...` and the closing
`[DONE]`, for the job router and the gateway alike), and the batching of chunks into job outputs.

Streams of typed events (the Responses API's and Anthropic's Messages API's) are framed as those APIs frame
them: each event named by its body's `type` (`event: content_block_delta`), a failure as the API's error event,
and no `[DONE]`. The Responses API's come wrapped in an EventStream, which also names its error event."""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from pydantic import BaseModel

from .errors import Dialect, OpenAIError
from .protocol import UsageInfo

if TYPE_CHECKING:
    from .sampling import OpenAIRequest

log = logging.getLogger("openai_compat.jobs")

DONE = "data: [DONE]\n\n"


def sse(data: BaseModel | dict, event: str | None = None) -> str:
    """One server-sent event carrying a JSON body, with an `event:` line when it is given a name."""
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"event: {event}\ndata: {body}\n\n" if event else f"data: {body}\n\n"


def sse_events(chunks: list[BaseModel | dict], named: bool = False) -> str:
    """A batch of chunks as consecutive events; `named`: each named by its `type` (typed event streams)."""
    if named:
        return "".join(sse(c, c.type if isinstance(c, BaseModel) else c.get("type")) for c in chunks)
    return "".join(sse(chunk) for chunk in chunks)


class StreamChunks:
    """The chunks of one stream: each carries the stream's id, creation time and model, and has a `usage` key
    only when the request asked for usage (OpenAI: null on every chunk but the last, which has no choices;
    vLLM's continuous_usage_stats: the counts so far on every chunk that gives them)."""

    def __init__(self, chunk_type: type[BaseModel], response_id: str, model: str, request: OpenAIRequest,
                 prompt_tokens: int):
        self.chunk_type = chunk_type
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.include_usage = request.include_usage
        self.continuous_usage = request.continuous_usage

    def chunk(self, choices: list, generated: int | None = None) -> BaseModel:
        """A chunk of `choices`; with continuous usage, its usage counts `generated` tokens (None: null)."""
        extra = {}
        if self.include_usage or self.continuous_usage:
            extra["usage"] = (UsageInfo.of(self.prompt_tokens, generated)
                              if self.continuous_usage and generated is not None else None)
        return self.chunk_type(id=self.response_id, created=self.created, model=self.model, choices=choices,
                               **extra)

    def usage(self, generated: int) -> BaseModel | None:
        """The closing usage chunk, when the request asked for one."""
        if not self.include_usage:
            return None
        return self.chunk_type(id=self.response_id, created=self.created, model=self.model, choices=[],
                               usage=UsageInfo.of(self.prompt_tokens, generated))


class EventStream:
    """A stream of typed events (objects with a `type`), framed as OpenAI frames the Responses API's: `event:
    <type>` before each `data:`, and no `[DONE]`. `counts(event)` says which events count towards a job output's
    batch (those that carry output); `error_event(exc)` is the event that ends a stream failing after it began."""

    def __init__(self, events: AsyncIterator[BaseModel], counts: Callable[[BaseModel], bool],
                 error_event: Callable[[OpenAIError], BaseModel]):
        self.events = events
        self.counts = counts
        self.error_event = error_event

    def __aiter__(self) -> AsyncIterator[BaseModel]:
        return self.events

    async def aclose(self) -> None:
        await self.events.aclose()



class BatchSize:
    """Chunks per job output: starts small so the first token leaves at once, grows to save round trips."""

    def __init__(self, minimum: int, growth: float, maximum: int):
        self.current = max(1, minimum)
        self._growth = growth
        self._maximum = max(maximum, self.current)

    def grow(self) -> None:
        self.current = min(max(int(self.current * self._growth), self.current + (self._growth > 1)), self._maximum)


def carries_tokens(chunk: BaseModel) -> bool:
    """A chunk counts towards a batch when it carries generated output (not the opening role-only chunk)."""
    if getattr(chunk, "type", None) == "content_block_delta":  # an Anthropic stream's output
        return True
    for choice in getattr(chunk, "choices", ()):
        delta = getattr(choice, "delta", None)
        text = delta.content if delta is not None else getattr(choice, "text", None)
        parsed = delta is not None and (delta.reasoning_content or delta.tool_calls)
        if text or parsed or choice.finish_reason is not None or choice.logprobs is not None:
            return True
    return getattr(chunk, "usage", None) is not None and not getattr(chunk, "choices", None)


async def batched(chunks: AsyncIterator[Any], size: BatchSize, count=lambda chunk: True
                  ) -> AsyncIterator[list[Any]]:
    """Group items into lists of `size.current` counted items, growing the size after each list."""
    batch: list[Any] = []
    counted = 0
    async for chunk in chunks:
        batch.append(chunk)
        if count(chunk):
            counted += 1
        if counted >= size.current:
            yield batch
            batch, counted = [], 0
            size.grow()
    if batch:
        yield batch


async def job_stream(chunks: AsyncIterator[BaseModel], size: BatchSize, raw: bool, dialect: Dialect = "openai",
                     events: bool = False) -> AsyncIterator[str | list]:
    """A stream as job outputs: batches of SSE text ending in `[DONE]` (`raw`), or lists of chunk dicts. An
    error before the first output is raised (the job answers with it alone); after, it is the stream's last
    event. Typed events (`events`, or an EventStream) are named by their type and end without `[DONE]`; an error
    in Anthropic's dialect is its `error` event."""
    typed = isinstance(chunks, EventStream)
    named = events or typed or dialect == "anthropic"  # Anthropic's streams are always typed events
    count = chunks.counts if typed else carries_tokens
    started = False
    try:
        async for batch in batched(chunks, size, count):
            started = True
            yield sse_events(batch, named) if raw else [c.model_dump(mode="json") for c in batch]
    except OpenAIError as exc:
        if not started:
            raise
        log.warning("stream failed after it started: %s", exc.message)
        last = chunks.error_event(exc).model_dump(mode="json") if typed else exc.body(dialect)
        yield sse_events([last], named) if raw else [last]
    if raw and not named:
        yield DONE
