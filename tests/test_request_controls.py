"""vLLM's per-request controls in the engine, each proven by its effect on the real embedded model:
allowed_token_ids, bad words, priority (admission order and who gives way) and cache_salt (prefix-cache
isolation). The API tests (test_openai_conformance.py) cover their request fields."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine import AsyncEngine, SamplingParams
from engine_helpers import PROMPTS, chat_ids, generate, greedy


@pytest.fixture(scope="module")
def engine(worker):
    return worker.engine


def _ids(engine, prompt: str, **kw) -> list[int]:
    result = asyncio.run(generate(engine, "rc", chat_ids(engine, prompt), greedy(16, **kw)))
    return result["choices"][0]["ids"]


def test_allowed_token_ids_confine_every_token(engine):
    free = _ids(engine, PROMPTS[0])
    allowed = tuple(sorted(set(free[3:8]) | {28, 30}))  # tokens the model wanted, a few of them
    confined = _ids(engine, PROMPTS[0], allowed_token_ids=allowed)
    assert set(confined) <= set(allowed) and confined != free


def test_bad_words_are_never_generated(engine):
    free = _ids(engine, PROMPTS[1])
    single = free[2]
    without = _ids(engine, PROMPTS[1], bad_words_ids=((single,),))
    assert single not in without and without[:2] == free[:2]
    # A two-token word: its last token is banned only right after its first.
    first, second = free[4], free[5]
    pairs = _ids(engine, PROMPTS[1], bad_words_ids=((first, second),))
    assert pairs[:5] == free[:5] and pairs[5] != second
    assert all((a, b) != (first, second) for a, b in zip(pairs, pairs[1:]))


def test_bad_words_hold_in_beam_search(engine):
    ids = chat_ids(engine, PROMPTS[2])
    params = SamplingParams(max_tokens=8, temperature=0.0, n=2, beam_search=True, ignore_eos=True)
    free = asyncio.run(generate(engine, "b1", ids, params))
    banned = free["choices"][0]["ids"][1]
    result = asyncio.run(generate(engine, "b2", ids, dataclasses.replace(params, bad_words_ids=((banned,),))))
    assert all(banned not in c["ids"] for c in result["choices"])


@pytest.mark.slow
def test_priority_orders_admission_when_requests_wait():
    """One sequence at a time: while the first request runs, a later request with a lower priority value is
    admitted before an earlier one with a higher value."""
    from worker.settings import load_settings

    config = dataclasses.replace(load_settings().engine_config(), max_num_seqs=1)
    engine = AsyncEngine(config)
    order: list[str] = []

    async def waiting(count: int) -> None:
        while engine.engine.num_waiting < count:
            await asyncio.sleep(0.01)

    async def run(name: str, priority: int, max_tokens: int = 6, until: asyncio.Event | None = None):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)
        stream = engine.generate(name, chat_ids(engine, PROMPTS[3]), params)
        async for output in stream:
            if output.deltas and name not in order:
                order.append(name)
            if until is not None and until.is_set():
                break
        await stream.aclose()

    async def main():
        await engine.start()
        # The first request holds the one slot until both later ones wait in the queue, in this order.
        both_wait = asyncio.Event()
        first = asyncio.create_task(run("first", 0, max_tokens=2000, until=both_wait))
        while not order:
            await asyncio.sleep(0.01)
        late_low = asyncio.create_task(run("late-low", 5))
        await waiting(1)
        later_high = asyncio.create_task(run("later-high", -1))
        await waiting(2)
        both_wait.set()
        await asyncio.gather(first, late_low, later_high)

    try:
        asyncio.run(main())
    finally:
        engine.close()
    assert order == ["first", "later-high", "late-low"]


def test_cache_salt_isolates_the_prefix_cache(engine):
    # A plain prompt no other test sends (chat prompts share the template's system block).
    ids = engine.tokenizer.encode("Salted prefix: " + PROMPTS[5] * 3, add_special_tokens=False)

    def hits(**kw) -> int:
        before = engine.stats()["prefix_cache_hit_tokens"]
        asyncio.run(generate(engine, "s", ids, greedy(2, **kw)))
        return engine.stats()["prefix_cache_hit_tokens"] - before

    hits(cache_salt="tenant-a")
    assert hits(cache_salt="tenant-a") >= 16  # the same tenant reuses its blocks
    assert hits(cache_salt="tenant-b") == 0  # another tenant never sees them
    assert hits() == 0  # nor does a request without a salt
    assert hits() >= 16
