"""Batch invariance (BATCH_INVARIANT, on by default): a request's output does not depend on what else runs with
it. Mixed concurrent requests (short chats, a long document prefilled in chunks, greedy and seeded sampling) must
give exactly the tokens and logprobs each gives alone: no near-tie tolerance, since with a row's computation
independent of the step's other rows there is no rounding difference left to tolerate."""
from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from conftest import ROOT
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine_helpers import chat_ids, generate

sys.path.insert(0, str(ROOT / "bench"))
from throughput import PROMPTS, long_document_prompt  # noqa: E402


def _cases(engine, document: int) -> list[tuple[list[int], SamplingParams]]:
    greedy = dict(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = dict(max_tokens=16, temperature=0.9, top_p=0.95, ignore_eos=True, logprobs=2)
    # ~1000 tokens: prefilled in two chunks alone, at other boundaries when the step's budget is shared
    document = chat_ids(engine, long_document_prompt(document, 700))
    assert len(document) > engine.config.max_num_batched_tokens
    return ([(chat_ids(engine, p), SamplingParams(**greedy)) for p in PROMPTS[:6]]
            + [(document, SamplingParams(**greedy)),
               (chat_ids(engine, PROMPTS[6]), SamplingParams(**seeded, seed=5)),
               (chat_ids(engine, PROMPTS[7]), SamplingParams(**seeded, seed=9))])


def _exact(result: dict) -> tuple:
    choice = result["choices"][0]
    return choice["ids"], [(lp.token_id, lp.logprob, lp.top) for lp in choice["logprobs"]]


@pytest.mark.slow
def test_mixed_concurrent_requests_equal_solo_runs_exactly(worker):
    assert worker.engine.batch_invariant  # BATCH_INVARIANT=auto turns it on for the embedded GGUF model
    _assert_mixed_equal_solo(worker.engine, document=3)


@pytest.mark.slow
def test_another_engine_in_the_process_leaves_this_ones_invariance(worker, tmp_path):
    """Batch invariance belongs to the engine that chose it: starting a second engine without it in the same
    process (a float32 safetensors model, BATCH_INVARIANT=false) must not turn it off for the first. It was one
    switch for the whole process, set by the last engine to start."""
    from tiny_models import build_small_model
    other = AsyncEngine(EngineConfig(model=str(build_small_model(tmp_path)), batch_invariant=False))
    asyncio.run(other.start())
    try:
        assert not other.batch_invariant and worker.engine.batch_invariant
        _assert_mixed_equal_solo(worker.engine, document=4)  # not in the prefix cache from the test above
    finally:
        other.close()


def _assert_mixed_equal_solo(engine, document: int) -> None:
    cases = _cases(engine, document)

    async def solo():
        return [await generate(engine, f"alone-{i}", ids, p) for i, (ids, p) in enumerate(cases)]

    async def mixed():
        async def staggered(i, ids, params):
            # Later arrivals join while earlier ones decode: decode rows share steps with prefill chunks.
            await asyncio.sleep(0.15 * (i % 3))
            return await generate(engine, f"mixed-{i}", ids, params)

        return await asyncio.gather(*(staggered(i, ids, p) for i, (ids, p) in enumerate(cases)))

    alone = asyncio.run(solo())
    together = asyncio.run(mixed())
    for i, (a, b) in enumerate(zip(alone, together)):
        assert _exact(a) == _exact(b), f"request {i} differs: {a['choices'][0]['text']!r} alone, " \
                                       f"{b['choices'][0]['text']!r} batched"
        assert len(a["choices"][0]["ids"]) == 16


def test_a_decode_rows_attention_does_not_depend_on_the_other_rows():
    """The decode kernel splits long rows' keys into parts for idle threads; the split must follow the row's own
    length, so a long row attends bitwise alike alone and beside others (it used to split only when alone)."""
    from engine.cpu import native_kernels
    assert native_kernels.load("auto"), native_kernels.reason()
    kernels = native_kernels.active()
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, block, width = 9, 3, 64, 16, 80
    k_pool = torch.randn(8 * width, block, kv_heads, dim, generator=gen)
    v_pool = torch.randn(8 * width, block, kv_heads, dim, generator=gen)
    lengths = torch.tensor([1200, 40, 700, 9, 1279, 300, 17, 5])
    blocks = torch.randperm(8 * width, generator=gen)
    query = torch.randn(8, heads, dim, generator=gen)
    together = torch.empty(8, heads, dim)
    kernels.paged_decode_attention(query, k_pool, v_pool, blocks, lengths, 0, 0.125, together)
    for r in range(8):
        alone = torch.empty(1, heads, dim)
        kernels.paged_decode_attention(query[r:r + 1], k_pool, v_pool, blocks[r * width:(r + 1) * width],
                                       lengths[r:r + 1], 0, 0.125, alone)
        assert torch.equal(alone[0], together[r]), r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_linear_product_does_not_depend_on_the_batch(tmp_path, dtype):
    """With batch invariance each linear layer multiplies a row alike at any number of rows, one included."""
    from transformers import AutoModelForCausalLM

    from engine.cpu import layout as cpu_layout
    from engine.cpu import fusion
    from tiny_models import build_small_model

    if dtype == torch.bfloat16 and not cpu_layout.bfloat16_is_native():
        pytest.skip("bfloat16 products are not native here")
    model = AutoModelForCausalLM.from_pretrained(build_small_model(tmp_path), dtype=dtype).eval()
    with torch.inference_mode():
        fusion.apply(model)
        cpu_layout.apply(model, batch_invariant=True)
        gen = torch.Generator().manual_seed(1)
        for module in (model.model.layers[0].mlp.down_proj, model.lm_head):
            x = torch.randn(40, module.in_features, generator=gen).to(dtype)
            batched = {rows: module(x[:rows]) for rows in (1, 2, 7, 40)}
            for i in range(40):
                alone = module(x[i:i + 1])[0]
                assert all(torch.equal(alone, out[i]) for rows, out in batched.items() if i < rows), i
