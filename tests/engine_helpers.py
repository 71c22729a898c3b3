"""Helpers for tests that drive the engine directly: a chat prompt's ids, one request's choices gathered, greedy
parameters and the near-tie rule for comparing greedy outputs across batchings."""
from __future__ import annotations

import asyncio
import sys

from conftest import ROOT
from engine import AsyncEngine, SamplingParams

sys.path.insert(0, str(ROOT / "bench"))
import throughput  # noqa: E402  (the benchmark's prompts: varied, short chat questions)

PROMPTS = throughput.PROMPTS


def chat_ids(engine: AsyncEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)


async def generate(engine: AsyncEngine, request_id: str, ids: list[int], params: SamplingParams) -> dict:
    """Token ids, text, logprobs and finish reason per choice, the prompt logprobs, and how many outputs the
    request streamed."""
    choices: dict[int, dict] = {}
    outputs = 0
    prompt_logprobs = None
    async for output in engine.generate(request_id, ids, params):
        outputs += 1
        prompt_logprobs = output.prompt_logprobs or prompt_logprobs
        for delta in output.deltas:
            c = choices.setdefault(delta.index, {"ids": [], "text": "", "finish": None, "logprobs": []})
            c["ids"] += delta.token_ids
            c["text"] += delta.text
            c["logprobs"] += delta.logprobs or []
            c["finish"] = delta.finish_reason or c["finish"]
    return {"choices": [choices[i] for i in sorted(choices)], "outputs": outputs, "prompt_logprobs": prompt_logprobs}


NEAR_TIE = 2e-3  # logprob gap below which float rounding order (which differs by batch size) may pick either


def assert_same_greedy(choice: dict, other_ids: list[int]) -> None:
    """Greedy tokens must be equal; they may part only where `choice` had a near-tie between the two tokens.

    Products over a batch of rows are summed in another order than over one row, so logits differ in the last
    bits between a request run alone and in a batch; a greedy choice between two tokens within that noise is
    a coin toss for any batching engine. Everything else must match exactly."""
    ids = choice["ids"]
    if ids == other_ids:
        return
    at = next((i for i, (a, b) in enumerate(zip(ids, other_ids)) if a != b), min(len(ids), len(other_ids)))
    assert at < min(len(ids), len(other_ids)), f"lengths differ: {len(ids)} vs {len(other_ids)}"
    top = choice["logprobs"][at].top
    assert len(top) >= 2 and top[0][1] - top[1][1] < NEAR_TIE and other_ids[at] in (top[0][0], top[1][0]), (
        f"greedy outputs differ at token {at} without a near-tie: {ids[at]} vs {other_ids[at]}, top {top[:2]}")


def greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2, **kw)


def greedy_tokens(engine: AsyncEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def one(i, ids):
        tokens = []
        async for output in engine.generate(f"k{i}", ids, params):
            for delta in output.deltas:
                tokens.extend(delta.token_ids)
        return tokens

    async def run():
        await engine.start()
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return asyncio.run(run())


async def choice_ids(engine: AsyncEngine, request_id: str, ids: list[int], params: SamplingParams) -> list[list[int]]:
    choices: dict[int, list[int]] = {}
    async for output in engine.generate(request_id, ids, params):
        for delta in output.deltas:
            choices.setdefault(delta.index, []).extend(delta.token_ids)
    return [choices[i] for i in sorted(choices)]


# bfloat16 keeps 8 bits of mantissa: logits move by ~1e-2, so greedy choices within this gap (in float32's own
# logprobs) may go either way. Measured on the embedded model, 8 prompts x 32 tokens: 6 identical, the other two
# part at float32 top-2 gaps of 0.09 and 0.12 nats.
BFLOAT16_NEAR_TIE = 0.25
