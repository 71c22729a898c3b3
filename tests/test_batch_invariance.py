"""Batch invariance (BATCH_INVARIANT, on by default): a request's output does not depend on what else runs with
it. Mixed concurrent requests (short chats, a long document prefilled in chunks, greedy and seeded sampling) must
give exactly the tokens and logprobs each gives alone: no near-tie tolerance, since with a row's computation
independent of the step's other rows there is no rounding difference left to tolerate."""
from __future__ import annotations

import asyncio
import sys

from conftest import ROOT
from engine import SamplingParams
from test_engine import chat_ids, generate

sys.path.insert(0, str(ROOT / "bench"))
from throughput import PROMPTS, long_document_prompt  # noqa: E402


def _cases(engine) -> list[tuple[list[int], SamplingParams]]:
    greedy = dict(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    seeded = dict(max_tokens=16, temperature=0.9, top_p=0.95, ignore_eos=True, logprobs=2)
    # ~1000 tokens: prefilled in two chunks alone, at other boundaries when the step's budget is shared
    document = chat_ids(engine, long_document_prompt(3, 700))
    assert len(document) > engine.config.max_num_batched_tokens
    return ([(chat_ids(engine, p), SamplingParams(**greedy)) for p in PROMPTS[:6]]
            + [(document, SamplingParams(**greedy)),
               (chat_ids(engine, PROMPTS[6]), SamplingParams(**seeded, seed=5)),
               (chat_ids(engine, PROMPTS[7]), SamplingParams(**seeded, seed=9))])


def _exact(result: dict) -> tuple:
    choice = result["choices"][0]
    return choice["ids"], [(lp.token_id, lp.logprob, lp.top) for lp in choice["logprobs"]]


def test_mixed_concurrent_requests_equal_solo_runs_exactly(worker):
    engine = worker.engine
    assert engine.config.batch_invariant
    cases = _cases(engine)

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
