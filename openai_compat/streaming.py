"""Server-sent events and the batching of stream chunks into job outputs."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def sse(data: BaseModel | dict) -> str:
    """One server-sent event carrying a JSON body."""
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data)
    return f"data: {body}\n\n"


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
