"""Embeddings (`/v1/embeddings`, OpenAI's shape), pooled hidden states (`/pooling`), and scores of text pairs
(`/score`, and `/rerank` in the Jina / Cohere shape), as vLLM serves them.

All run on the engine's pooling path (engine/core/pooling.py): one forward pass per batch of whole inputs, no
decoding. Scores come from the model's classification head when it is a cross-encoder (a sequence-
classification model with one label: its sigmoid), otherwise from the cosine similarity of the two texts'
embeddings.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Literal

import torch
from pydantic import BaseModel, Field, field_validator

from engine import GenerationError
from engine.core.pooling import PoolingInput, PoolingOutput, PoolingParams

from .errors import OpenAIError, context_exceeded
from .protocol import RequestModel, TokenId, UsageInfo, random_id
from .serving import OpenAIServing

log = logging.getLogger("openai_compat")

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


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's form: the little-endian float32 bytes
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class PoolingServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine

    # ---------------------------------------------------------------- shared

    async def _start(self, model: str | None) -> None:
        await self.serving.ready()
        self.serving.check_model(model)

    def _check_len(self, ids: list[int], param: str) -> None:
        limit = self.engine.max_model_len
        if not ids:
            raise OpenAIError(f"{param} is empty after tokenization", param=param)
        if len(ids) > limit:
            raise OpenAIError(context_exceeded(limit, f"{param} has {len(ids)} tokens", "the length of the input"),
                              param=param)

    async def _inputs(self, items: list[str | list[int]], add_special_tokens: bool, param: str
                      ) -> list[PoolingInput]:
        inputs = []
        for i, item in enumerate(items):
            where = param if len(items) == 1 else f"{param}[{i}]"
            if isinstance(item, str):
                ids = await self.serving.tokenize(item, add_special_tokens, where)
            else:
                ids = list(item)
                self.serving.check_in_vocabulary(ids, where)
            self._check_len(ids, where)
            inputs.append(PoolingInput(ids))
        return inputs

    def _embed_params(self, normalize: bool | None, dimensions: int | None) -> PoolingParams:
        config = self.engine.pooling_config
        if config.unsupported:
            raise OpenAIError(f"embeddings of {self.serving.served_model_name} cannot be computed as its "
                              f"configuration asks: {config.unsupported}")
        if dimensions is not None:
            allowed = config.matryoshka_dimensions
            if allowed is None:
                raise OpenAIError(f"dimensions is not supported: {self.serving.served_model_name} is not a "
                                  f"matryoshka model (its embeddings cannot be shortened)", param="dimensions")
            if dimensions > config.hidden_size or (allowed and dimensions not in allowed):
                choices = ", ".join(map(str, allowed)) if allowed else f"1 to {config.hidden_size}"
                raise OpenAIError(f"dimensions must be one of {choices} for this model, got {dimensions}",
                                  param="dimensions")
        return PoolingParams("embed", config.pooling_type, config.normalize if normalize is None else normalize,
                             dimensions)

    async def _pool(self, prefix: str, inputs: list[PoolingInput], params: PoolingParams) -> PoolingOutput:
        request_id = random_id(prefix)
        try:
            output = await self.engine.pool(request_id, inputs, params)
        except GenerationError as exc:
            raise OpenAIError(f"pooling failed: {exc}", status=500) from exc
        self.serving.metrics.pooling_finished(output)
        started = output.started or output.arrival
        log.info("request done request=%s inputs=%d prompt_tokens=%d queue_s=%.3f compute_s=%.3f total_s=%.3f",
                 request_id, len(inputs), output.prompt_tokens, started - output.arrival,
                 (output.finished or started) - started, (output.finished or started) - output.arrival)
        return output

    def _usage(self, output: PoolingOutput) -> UsageInfo:
        return UsageInfo(prompt_tokens=output.prompt_tokens, total_tokens=output.prompt_tokens)

    # ---------------------------------------------------------------- embeddings and pooling

    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        await self._start(request.model)
        inputs = await self._inputs(request.inputs, request.add_special_tokens, "input")
        output = await self._pool("embd", inputs, self._embed_params(request.normalize, request.dimensions))
        data = [EmbeddingData(index=i, embedding=_encode(v, request.encoding_format))
                for i, v in enumerate(output.data)]
        return EmbeddingResponse(id=output.request_id, model=self.serving.served_model_name, data=data,
                                 usage=self._usage(output))

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        await self._start(request.model)
        task = request.task or ("classify" if self.engine.task == "classify" else "embed")
        if task == "classify":
            if self.engine.task != "classify":
                raise OpenAIError(f"task classify needs a sequence-classification model; "
                                  f"{self.serving.served_model_name} has no classification head", param="task")
            for name in ("dimensions", "normalize"):
                if getattr(request, name) is not None:
                    raise OpenAIError(f"{name} applies to task embed, not classify", param=name)
            params = PoolingParams("classify")
        else:
            params = self._embed_params(request.normalize, request.dimensions)
        inputs = await self._inputs(request.inputs, request.add_special_tokens, "input")
        output = await self._pool("pool", inputs, params)
        data = [PoolingData(index=i, data=_encode(v, request.encoding_format)) for i, v in enumerate(output.data)]
        return PoolingResponse(id=output.request_id, model=self.serving.served_model_name, data=data,
                               usage=self._usage(output))

    # ---------------------------------------------------------------- score and rerank

    async def _scores(self, prefix: str, pairs: list[tuple[str, str]], names: list[tuple[str, str]]
                      ) -> tuple[str, list[float], int]:
        """(request id, score of each pair, prompt tokens). `names` are the pair's fields, for errors."""
        if self.engine.task == "classify":
            labels = self.engine.pooling_config.num_labels
            if labels != 1:
                raise OpenAIError(f"scores need a cross-encoder with one output label; "
                                  f"{self.serving.served_model_name} has {labels} (use /pooling for its "
                                  f"class scores)")
            tokenizer = self.engine.tokenizer

            def encode() -> list[PoolingInput]:
                inputs = []
                for (left, right), (_, right_name) in zip(pairs, names):
                    self.serving.check_prompt_chars(left + right, right_name)
                    ids, types = tokenizer.encode_pair(left, right)
                    self._check_len(ids, right_name)
                    inputs.append(PoolingInput(ids, types))
                return inputs

            inputs = await asyncio.to_thread(encode)
            output = await self._pool(prefix, inputs, PoolingParams("classify"))
            return output.request_id, [float(v[0]) for v in output.data], output.prompt_tokens
        named: dict[str, str] = {}  # each distinct text once, named by the field it first appears in
        for pair, pair_names in zip(pairs, names):
            for text, name in zip(pair, pair_names):
                named.setdefault(text, name)
        texts = list(named)
        inputs = [(await self._inputs([text], True, named[text]))[0] for text in texts]
        output = await self._pool(prefix, inputs, self._embed_params(None, None))
        vectors = dict(zip(texts, output.data))
        scores = [float(torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0)) for a, b in pairs]
        return output.request_id, scores, output.prompt_tokens

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        await self._start(request.model)
        left = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        right = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if len(left) == 1:
            left = left * len(right)
        elif len(left) != len(right):
            raise OpenAIError(f"text_1 has {len(left)} texts and text_2 {len(right)}: give one text_1 for all of "
                              f"text_2, or as many as text_2", param="text_1")
        single = isinstance(request.text_1, str) or len(request.text_1) == 1
        names = [("text_1" if single else f"text_1[{i}]", "text_2" if isinstance(request.text_2, str)
                  else f"text_2[{i}]") for i in range(len(right))]
        request_id, scores, tokens = await self._scores("score", list(zip(left, right)), names)
        return ScoreResponse(id=request_id, model=self.serving.served_model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        await self._start(request.model)
        pairs = [(request.query, document) for document in request.documents]
        names = [("query", f"documents[{i}]") for i in range(len(pairs))]
        request_id, scores, tokens = await self._scores("rerank", pairs, names)
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents
                                else None) for i in order]
        return RerankResponse(id=request_id, model=self.serving.served_model_name,
                              usage=RerankUsage(total_tokens=tokens), results=results)
