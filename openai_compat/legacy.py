"""worker-vllm's native job form: `{"prompt" | "messages", "sampling_params", "stream", ...}` in,
`{"choices": [{"tokens": [...]}], "usage": {"input": N, "output": M}}` out."""
from __future__ import annotations

from typing import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .errors import OpenAIError
from .protocol import (ChatCompletionRequest, ChatMessage, ParamError, RequestLimits, SamplingFields,
                       check_messages_size, random_id)
from .serving import OpenAIServing, Prompt
from .streaming import BatchSize, batched


class LegacySamplingParams(SamplingFields):
    """vLLM's sampling parameters as worker-vllm takes them. Logprobs are not among them: the legacy output has
    no place for them, so asking is a 400 (use /v1/completions) rather than work whose result is dropped."""
    max_tokens: int = Field(default=100, ge=1)


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

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_size(cls, value, info: ValidationInfo):
        check_messages_size(value, info.context if isinstance(info.context, RequestLimits) else None)
        return value

    @model_validator(mode="after")
    def _one_input(self) -> "LegacyJob":
        # Both or neither would leave it to chance which text the model sees.
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give either prompt (a string) or messages (a list), not both or neither")
        if self.stream and self.sampling_params.beam_search:
            raise ParamError("stream", "beam search cannot stream: beams are reordered and replaced until the "
                                       "search ends, so no beam's text is final before then")
        return self


async def run_legacy(serving: OpenAIServing, job: LegacyJob, batch_size: BatchSize) -> AsyncIterator[dict]:
    """Generate for a legacy job: one output with the whole text, or growing batches of text pieces."""
    await serving.ready()
    serving.check_generation(job.sampling_params, "completions", 1)
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
    (params,) = serving.sampling_params(sp, [len(prompt.token_ids)], await serving.grammar(sp))
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

    async for batch in batched(pieces(), batch_size):
        choices = [{"tokens": []} for _ in range(params.n)]
        for index, text in batch:
            choices[index]["tokens"].append(text)
        yield {"choices": choices, "usage": dict(usage)}
