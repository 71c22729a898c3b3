"""Request and response bodies of the pooling routes: `/v1/embeddings` (OpenAI's shape), `/pooling`, `/score`
and `/rerank` (the Jina / Cohere shape), as vLLM takes and returns them."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from ..protocol import RequestModel, TokenId, UsageInfo

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request

EmbeddingInput = str | list[TokenId] | list[str] | list[list[TokenId]]


def _check_input(value):
    if isinstance(value, str):
        if not value:
            raise ValueError("input must not be an empty string")
        return value
    if not value:
        raise ValueError("input must not be an empty list")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"at most {MAX_INPUTS} inputs are allowed per request, got {len(value)}")
    if any(isinstance(item, (str, list)) and len(item) == 0 for item in value):
        raise ValueError("inputs must not be empty")
    return value


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the model's pooling configuration

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        return _check_input(value)

    @property
    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(item, int) for item in value):
            return [list(value)]
        return list(value)


class PoolingRequest(EmbeddingRequest):
    # embed: the pooled hidden state; classify: the classification head's scores (classification models).
    task: Literal["embed", "classify"] | None = None


class ScoreRequest(RequestModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]

    @field_validator("text_1", "text_2")
    @classmethod
    def _texts(cls, value):
        texts = [value] if isinstance(value, str) else value
        if not texts:
            raise ValueError("must not be an empty list")
        if len(texts) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} texts are allowed, got {len(texts)}")
        if any(not text for text in texts):
            raise ValueError("texts must not be empty")
        return value


class RerankRequest(RequestModel):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _documents(cls, value):
        if any(not text for text in value):
            raise ValueError("documents must not be empty")
        return value


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
