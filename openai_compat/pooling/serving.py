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

import torch

from engine import GenerationError, PoolingInput, PoolingOutput, PoolingParams

from ..errors import OpenAIError, context_exceeded
from ..protocol import UsageInfo, random_id
from ..serving import OpenAIServing
from .protocol import (EmbeddingData, EmbeddingRequest, EmbeddingResponse, PoolingData, PoolingRequest,
                       PoolingResponse, RerankDocument, RerankRequest, RerankResponse, RerankResult, RerankUsage,
                       ScoreData, ScoreRequest, ScoreResponse)

log = logging.getLogger("openai_compat")


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's form: the little-endian float32 bytes
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


class PoolingServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine

    # ---------------------------------------------------------------- shared

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

    def _embed_params(self, normalize: bool | None, dimensions: int | None, model: str | None) -> PoolingParams:
        """An embedding request's pooling, from the model's defaults and the request; `model` may name a LoRA
        adapter, whose embeddings come from the base with the adapter applied."""
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
                             dimensions, lora_name=self.serving.adapter_of(model))

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
        await self.serving.ready_for(request.model)
        inputs = await self._inputs(request.inputs, request.add_special_tokens, "input")
        params = self._embed_params(request.normalize, request.dimensions, request.model)
        output = await self._pool("embd", inputs, params)
        data = [EmbeddingData(index=i, embedding=_encode(v, request.encoding_format))
                for i, v in enumerate(output.data)]
        return EmbeddingResponse(id=output.request_id, model=self.serving.served_model_name, data=data,
                                 usage=self._usage(output))

    async def create_pooling(self, request: PoolingRequest) -> PoolingResponse:
        await self.serving.ready_for(request.model)
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
            params = self._embed_params(request.normalize, request.dimensions, request.model)
        inputs = await self._inputs(request.inputs, request.add_special_tokens, "input")
        output = await self._pool("pool", inputs, params)
        data = [PoolingData(index=i, data=_encode(v, request.encoding_format)) for i, v in enumerate(output.data)]
        return PoolingResponse(id=output.request_id, model=self.serving.served_model_name, data=data,
                               usage=self._usage(output))

    # ---------------------------------------------------------------- score and rerank

    async def _scores(self, prefix: str, pairs: list[tuple[str, str]], names: list[tuple[str, str]],
                      model: str | None) -> tuple[str, list[float], int]:
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
        output = await self._pool(prefix, inputs, self._embed_params(None, None, model))
        vectors = dict(zip(texts, output.data))
        scores = [float(torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0)) for a, b in pairs]
        return output.request_id, scores, output.prompt_tokens

    async def create_score(self, request: ScoreRequest) -> ScoreResponse:
        await self.serving.ready_for(request.model)
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
        request_id, scores, tokens = await self._scores("score", list(zip(left, right)), names, request.model)
        return ScoreResponse(id=request_id, model=self.serving.served_model_name,
                             data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

    async def create_rerank(self, request: RerankRequest) -> RerankResponse:
        await self.serving.ready_for(request.model)
        pairs = [(request.query, document) for document in request.documents]
        names = [("query", f"documents[{i}]") for i in range(len(pairs))]
        request_id, scores, tokens = await self._scores("rerank", pairs, names, request.model)
        order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
        if request.top_n:
            order = order[:request.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=request.documents[i]) if request.return_documents
                                else None) for i in order]
        return RerankResponse(id=request_id, model=self.serving.served_model_name,
                              usage=RerankUsage(total_tokens=tokens), results=results)
