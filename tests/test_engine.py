"""The generation engine on the real embedded model: batching must not change results, requests must not leak
into each other, and requests that leave must free their place."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine import AsyncEngine, EngineConfig, GenerationError, SamplingParams
from engine_helpers import PROMPTS, assert_same_greedy, chat_ids, generate, greedy


@pytest.fixture(scope="module")
def engine(worker):
    return worker.engine


@pytest.mark.slow
def test_batched_greedy_equals_solo_greedy(engine):
    prompts = [chat_ids(engine, p) for p in PROMPTS[:6]]

    async def solo():
        return [await generate(engine, f"solo-{i}", ids, greedy()) for i, ids in enumerate(prompts)]

    async def batched():
        return await asyncio.gather(*(generate(engine, f"batch-{i}", ids, greedy()) for i, ids in enumerate(prompts)))

    alone = asyncio.run(solo())
    together = asyncio.run(batched())
    for a, b in zip(alone, together):
        assert_same_greedy(a["choices"][0], b["choices"][0]["ids"])
        assert len(a["choices"][0]["ids"]) == 24
    assert len({tuple(r["choices"][0]["ids"]) for r in alone}) == len(prompts)  # the prompts really differ


@pytest.mark.slow
def test_engine_matches_transformers_generate(engine, worker):
    """Greedy tokens equal transformers' own generate on the same weights, for a short prompt and for a long one
    that is prefilled in several chunks."""
    from transformers import AutoModelForCausalLM

    from engine.loader import model_folder

    reference = AutoModelForCausalLM.from_pretrained(model_folder(worker.settings.engine_config()),
                                                     dtype=torch.float32).eval()
    long_text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box weighs {i * 7 % 13} kg." for i in
                         range(120)) + " Which item is the heaviest?"
    for text in ("What is the capital of France?", long_text):
        ids = chat_ids(engine, text)
        with torch.inference_mode():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
        result = asyncio.run(generate(engine, "reference", ids, SamplingParams(max_tokens=16, temperature=0.0,
                                                                              logprobs=2)))
        assert_same_greedy(result["choices"][0], expected.tolist())
    assert len(chat_ids(engine, long_text)) > 2 * engine.config.max_num_batched_tokens


@pytest.mark.slow
def test_parameters_do_not_leak_across_a_batch(engine):
    ids = [chat_ids(engine, p) for p in PROMPTS[:5]]
    cases = [
        greedy(20),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop=(" the",), ignore_eos=True, logprobs=2),
        greedy(5, logit_bias={}),
        SamplingParams(max_tokens=12, temperature=1.0, top_k=5, seed=11, repetition_penalty=1.3, ignore_eos=True),
    ]

    async def solo():
        return [await generate(engine, f"s{i}", ids[i], p) for i, p in enumerate(cases)]

    async def together():
        return await asyncio.gather(*(generate(engine, f"t{i}", ids[i], p) for i, p in enumerate(cases)))

    alone, mixed = asyncio.run(solo()), asyncio.run(together())
    for i, (a, b) in enumerate(zip(alone, mixed)):
        if cases[i].greedy:
            assert_same_greedy(a["choices"][0], b["choices"][0]["ids"])
        else:  # seeded sampling draws the same numbers alone and in a batch
            assert a["choices"][0]["ids"] == b["choices"][0]["ids"], i
    assert len(mixed[3]["choices"][0]["ids"]) == 5
    assert mixed[2]["choices"][0]["finish"] == "stop" and " the" not in mixed[2]["choices"][0]["text"]
    assert mixed[0]["choices"][0]["finish"] == "length"


def test_streaming_is_incremental(engine):
    result = asyncio.run(generate(engine, "stream", chat_ids(engine, PROMPTS[0]), greedy(12)))
    assert result["outputs"] >= 12  # one output per step, not one at the end


# Long enough that a request left in the engine runs on well past the few outputs a test reads before leaving.
LONG = 1000


class _Tally:
    """The tokens the engine generates from its creation until the engine holds no request again. A request the
    engine failed to take out still ends by itself at its max_tokens (all LONG of them, with ignore_eos), so the
    wait ends either way: the count tells the two apart, not the time it took. The wait runs on the caller's
    event loop, kept open: a closed loop would make the engine drop the request on its own (the last test)."""

    def __init__(self, core):
        assert core.num_requests == 0, "the shared engine is busy"
        self.core, self.before = core, core.stats()["generation_tokens_total"]

    async def until_idle(self) -> int:
        while self.core.num_requests or self.core.num_running:
            await asyncio.sleep(0.02)
        return self.core.stats()["generation_tokens_total"] - self.before


def test_closing_the_stream_frees_the_slot(engine):
    core = engine.engine
    ids = chat_ids(engine, PROMPTS[1])

    async def read_three_then_close():
        tally = _Tally(core)
        stream = engine.generate("dropped", ids, greedy(LONG))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        return seen, await tally.until_idle()

    seen, generated = asyncio.run(read_three_then_close())
    assert seen == 3 and generated < LONG


def test_cancelling_the_task_frees_the_slot(engine):
    core = engine.engine
    ids = chat_ids(engine, PROMPTS[2])

    async def cancel_midway():
        tally = _Tally(core)
        first = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancelled", ids, greedy(LONG)):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()  # running: it has streamed an output
        assert core.num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await tally.until_idle()

    assert asyncio.run(cancel_midway()) < LONG
    after = asyncio.run(generate(engine, "after", ids, greedy(8)))
    assert len(after["choices"][0]["ids"]) == 8


def test_a_request_whose_event_loop_closed_is_dropped(engine):
    """A consumer whose event loop is gone (closed without closing the stream) cannot take outputs: the engine
    drops its request instead of generating all of it."""
    core = engine.engine
    ids = chat_ids(engine, PROMPTS[3])
    loop = asyncio.new_event_loop()

    async def read_two():
        stream = engine.generate("orphan", ids, greedy(LONG))
        await stream.__anext__()
        await stream.__anext__()
        return stream

    tally = _Tally(core)
    stream = loop.run_until_complete(read_two())
    loop.close()
    assert asyncio.run(tally.until_idle()) < LONG  # dropped at its next output, not run to its end
    del stream


@pytest.mark.slow
def test_requests_beyond_the_cap_wait_and_complete(worker):
    config = EngineConfig(**{**worker.settings.engine_config().__dict__, "max_num_seqs": 2})
    small = AsyncEngine(config)
    asyncio.run(small.start())
    core = small.engine
    peaks = {"running": 0, "waiting": 0}
    ids = [chat_ids(small, p) for p in PROMPTS[:5]]

    async def run_all():
        async def watch():
            while True:
                peaks["running"] = max(peaks["running"], core.num_running)
                peaks["waiting"] = max(peaks["waiting"], core.num_waiting)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(generate(small, f"q{i}", x, greedy(10)) for i, x in enumerate(ids)))
        watcher.cancel()
        return results

    results = asyncio.run(run_all())
    assert peaks["running"] == 2 and peaks["waiting"] >= 1
    reference = asyncio.run(generate(small, "ref", ids[4], greedy(10)))
    small.close()
    assert_same_greedy(reference["choices"][0], results[4]["choices"][0]["ids"])
    assert all(len(r["choices"][0]["ids"]) == 10 for r in results)


def test_n_choices_share_the_prompt(engine):
    ids = chat_ids(engine, PROMPTS[3])
    solo = asyncio.run(generate(engine, "one", ids, greedy(12)))["choices"][0]
    three = asyncio.run(generate(engine, "three", ids, greedy(12, n=3)))["choices"]
    assert len(three) == 3
    for choice in three:
        assert_same_greedy(solo, choice["ids"])
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2, ignore_eos=True)
    first = asyncio.run(generate(engine, "s1", ids, sampled))["choices"]
    again = asyncio.run(generate(engine, "s2", ids, sampled))["choices"]
    assert [c["ids"] for c in first] == [c["ids"] for c in again]
    assert first[0]["ids"] != first[1]["ids"]


def test_prefix_cache_reuses_prompt_blocks(engine):
    core = engine.engine
    ids = chat_ids(engine, PROMPTS[4])
    before = core.stats()["prefix_cache_hit_tokens"]
    first = asyncio.run(generate(engine, "p1", ids, greedy(8)))
    second = asyncio.run(generate(engine, "p2", ids, greedy(8)))
    assert core.stats()["prefix_cache_hit_tokens"] - before >= 16
    assert_same_greedy(first["choices"][0], second["choices"][0]["ids"])


@pytest.mark.slow
def test_a_failing_request_fails_alone(engine, monkeypatch):
    """A fault inside generation for one request (injected into its sampling) fails that request only."""
    from engine.sampling.sampler import Sampler

    original = Sampler._adjust_row

    def faulty(self, logits, state, generated):
        if state.params.seed == 666 and generated == 3:
            raise RuntimeError("injected sampling fault")
        return original(self, logits, state, generated)

    monkeypatch.setattr(Sampler, "_adjust_row", faulty)
    ids = [chat_ids(engine, p) for p in PROMPTS[:3]]
    bad = SamplingParams(max_tokens=20, temperature=0.8, seed=666, ignore_eos=True, min_tokens=5)

    async def run():
        async def guarded(i, x, p):
            try:
                return await generate(engine, f"f{i}", x, p)
            except GenerationError as exc:
                return exc

        return await asyncio.gather(guarded(0, ids[0], greedy(20)), guarded(1, ids[1], bad),
                                    guarded(2, ids[2], greedy(20)))

    results = asyncio.run(run())
    assert isinstance(results[1], GenerationError) and "injected" in str(results[1])
    for i in (0, 2):
        alone = asyncio.run(generate(engine, f"r{i}", ids[i], greedy(20)))["choices"][0]
        assert_same_greedy(alone, results[i]["choices"][0]["ids"])
    assert engine.engine.num_requests == 0, engine.engine._groups


@pytest.mark.slow
def test_model_loads_once_for_many_first_jobs_and_failures_reach_every_waiter(worker, tmp_path):
    from engine.loader import load
    from openai_compat.config import ServingConfig
    from openai_compat.jobs import JobRouter
    from openai_compat.serving import OpenAIServing

    calls = []

    def counting_load(config):
        calls.append(config.model)
        time.sleep(0.5)  # a load takes a while: jobs arriving meanwhile must wait for it, not start their own
        return load(config)

    fresh = AsyncEngine(worker.settings.engine_config(), loader=counting_load)

    async def six_first_jobs():
        await asyncio.gather(*(fresh.start() for _ in range(6)))

    asyncio.run(six_first_jobs())
    assert len(calls) == 1
    fresh.close()

    missing = str(tmp_path / "no-such-model")
    broken = AsyncEngine(EngineConfig(**{**worker.settings.engine_config().__dict__, "model": missing}),
                         loader=counting_load)
    router = JobRouter(OpenAIServing(broken, ServingConfig()), ServingConfig())
    job = {"openai_route": "/v1/completions", "openai_input": {"prompt": "Hi", "max_tokens": 2}}

    async def four_jobs():
        async def one():
            return [part async for part in router.run(job)]
        return await asyncio.gather(*(one() for _ in range(4)))

    for (error,) in asyncio.run(four_jobs()):
        assert error["error"]["code"] == 500 and missing in error["error"]["message"]
    assert calls.count(missing) == 1  # the four waited on one attempt
    asyncio.run(four_jobs())
    assert calls.count(missing) == 2  # a later job tries again: the source may have become reachable


@pytest.mark.parametrize("vocab", [49152, 49153, 3000, 700])
def test_the_chunked_argmax_picks_what_torch_picks(vocab):
    """The sampler's CPU argmax (each chunk's maximum, then the winning chunk) against torch's, ties included:
    the first of equal maxima, in the last chunk and the shorter tail alike, and rows of NaN or -inf."""
    from engine.sampling.sampler import argmax

    generator = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab + 5, generator=generator)[:, :vocab]  # a view with padded rows, as the sampler gets
    x[1, 3] = x[1, vocab - 1] = 50.0
    x[2, vocab - 1] = x[2, vocab - 2] = 60.0
    x[3, vocab // 2] = x[3, vocab // 2 + 1] = x[3, vocab - 3] = 70.0
    x[4] = float("-inf")
    x[5, vocab - 7] = float("nan")
    x[6, vocab - 1] = 80.0  # alone in the tail
    x[7, min(1023, vocab - 1)] = x[7, min(1024, vocab - 1)] = 90.0
    assert torch.equal(argmax(x), x.argmax(dim=-1))


def test_a_stream_left_open_across_close_ends_cleanly(tmp_path):
    """A request whose stream is still open when the engine closes (a worker shutting down with a client
    mid-stream) ends with the engine's error, and closing its iterator afterwards raises nothing: the abort goes
    to the loop that took the request, not to the engine's current one, which close() dropped."""
    from tiny_models import build_small_model

    engine = AsyncEngine(EngineConfig(model=str(build_small_model(tmp_path / "model")), dtype="float32"))

    async def run():
        stream = engine.generate("open", [1, 5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0,
                                                                       ignore_eos=True))
        await stream.__anext__()
        engine.close()
        await stream.aclose()

    asyncio.run(run())
