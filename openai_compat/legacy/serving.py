"""worker-vllm's native job form served: a LegacyJob in, `{"choices": [{"tokens": [...]}], "usage": {"input": N,
"output": M}}` out."""
from __future__ import annotations

from typing import AsyncIterator

from ..errors import OpenAIError
from ..chat.protocol import ChatCompletionRequest, ChatMessage
from ..chat.render import render_chat
from ..protocol import random_id
from ..serving import OpenAIServing, Prompt
from ..streaming import BatchSize, batched
from .protocol import LegacyJob


async def run_legacy(serving: OpenAIServing, job: LegacyJob, batch_size: BatchSize) -> AsyncIterator[dict]:
    """Generate for a legacy job: one output with the whole text, or growing batches of text pieces."""
    await serving.ready()
    if job.lora not in (None, serving.served_model_name) and serving.adapter_of(job.lora) is None:
        raise OpenAIError(f"no LoRA adapter named `{job.lora}` is loaded", status=404, param="lora")
    serving.check_generation(job.sampling_params, "completions", 1)
    if job.messages is not None:
        prompt = await render_chat(serving, ChatCompletionRequest(messages=job.messages))
    elif job.apply_chat_template:
        prompt = await render_chat(serving, ChatCompletionRequest(
            messages=[ChatMessage(role="user", content=job.prompt)]))
    else:
        prompt = Prompt(await serving.tokenize(job.prompt, True), job.prompt)
        if not prompt.token_ids:
            raise OpenAIError("the prompt is empty after tokenization", param="prompt")
    sp = job.sampling_params
    (params,) = serving.sampling_params(sp, [len(prompt.token_ids)], await serving.grammar(sp), model=job.lora)
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
