"""`/v1/models`: the model this worker serves, and its LoRA adapters (each with the base as `parent`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from .serving import OpenAIServing


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llm-worker"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


async def list_models(serving: OpenAIServing) -> ModelList:
    await serving.ready()
    engine = serving.engine
    base = serving.served_model_name
    adapters = [ModelCard(id=name, root=name, parent=base, max_model_len=engine.max_model_len)
                for name in engine.lora_names()]
    return ModelList(data=[ModelCard(id=base, root=engine.model_name, max_model_len=engine.max_model_len),
                           *adapters])
