"""The KV cache under a deliberately small budget: admission by free blocks, preemption of the youngest requests
and their exact resumption, refusal of what can never fit, and one request's memory failure staying its own."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine import AsyncEngine, EngineConfig, GenerationError, SamplingParams
from engine_helpers import PROMPTS, assert_same_greedy, chat_ids, generate, greedy

BUDGET_TOKENS = 768  # 48 blocks: a handful of the 32 requests below fit at once


@pytest.fixture(scope="module")
def small(worker):
    config = worker.settings.engine_config()
    bytes_per_token = _bytes_per_token(worker)
    small_config = EngineConfig(**{**config.__dict__, "max_model_len": 512, "max_num_seqs": 32,
                                   "kv_cache_memory": BUDGET_TOKENS * bytes_per_token})
    engine = AsyncEngine(small_config)
    asyncio.run(engine.start())
    yield engine
    engine.close()


def _bytes_per_token(worker) -> int:
    """The KV bytes a token takes in the worker's own cache (its layers, heads and KV_CACHE_DTYPE)."""
    stats = worker.engine.engine.stats()
    return stats["kv_capacity_bytes"] // stats["kv_capacity_tokens"]


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed, ignore_eos=True)


@pytest.mark.slow
def test_budget_is_fixed_and_reported(small):
    stats = small.engine.stats()
    assert stats["kv_capacity_tokens"] == BUDGET_TOKENS
    assert stats["kv_capacity_bytes"] <= small.config.kv_cache_memory


@pytest.mark.slow
def test_many_long_requests_under_a_small_budget_all_complete_exactly(small):
    core = small.engine
    prompts = [chat_ids(small, p) for p in PROMPTS]
    # Half greedy, half seeded sampling: 32 requests of ~90 tokens each need ~4x the budget at once.
    params = [greedy(40) if i % 2 == 0 else seeded(40, seed=i % 8) for i in range(32)]
    before = core.stats()["preemptions"]
    peak = {"used": 0}

    async def run_all():
        async def watch():
            while True:
                peak["used"] = max(peak["used"], core.stats()["kv_used_tokens"])
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(generate(small, f"load-{i}", prompts[i % 8], params[i])
                                         for i in range(32)))
        watcher.cancel()
        return results

    together = asyncio.run(run_all())
    stats = core.stats()
    assert stats["preemptions"] > before, "the budget was meant to force preemption"
    assert max(peak["used"], stats["kv_peak_used_tokens"]) <= stats["kv_capacity_tokens"]
    assert stats["kv_used_tokens"] == 0 or core.num_requests == 0
    assert core.num_requests == 0

    alone: dict[tuple[int, int], dict] = {}
    for i in range(32):
        key = (i % 8, i % 2)
        if key not in alone:
            alone[key] = asyncio.run(generate(small, f"alone-{i}", prompts[i % 8], params[i]))["choices"][0]
        got = together[i]["choices"][0]
        assert len(got["ids"]) == 40
        if i % 2 == 0:
            assert_same_greedy(alone[key], got["ids"])
        else:
            assert got["ids"] == alone[key]["ids"], f"seeded request {i} changed after preemption"


@pytest.mark.slow
def test_n_choices_survive_preemption(small):
    """Choices of one request share prompt blocks; preempted and recomputed, they still match a quiet run."""
    ids = chat_ids(small, PROMPTS[2])
    three = SamplingParams(max_tokens=30, temperature=0.8, seed=5, n=3, ignore_eos=True)
    quiet = asyncio.run(generate(small, "n-quiet", ids, three))

    async def crowded():
        others = [generate(small, f"crowd-{i}", chat_ids(small, PROMPTS[i]), greedy(60)) for i in range(8)]
        mine = generate(small, "n-crowded", ids, three)
        return (await asyncio.gather(mine, *others))[0]

    loud = asyncio.run(crowded())
    assert [c["ids"] for c in loud["choices"]] == [c["ids"] for c in quiet["choices"]]


def test_a_request_larger_than_the_whole_cache_is_a_400(small):
    from openai_compat.config import ServingConfig
    from openai_compat.jobs import JobRouter
    from openai_compat.serving import OpenAIServing

    router = JobRouter(OpenAIServing(small, ServingConfig()), ServingConfig())

    async def job(body):
        return [part async for part in router.run({"openai_route": "/v1/completions", "openai_input": body})]

    # Fits the context (512) but two choices of it cannot both live in a 768-token cache.
    (error,) = asyncio.run(job({"prompt": "Hello", "max_tokens": 500, "n": 2}))
    assert error["error"]["code"] == 400 and "KV cache" in error["error"]["message"]
    (ok,) = asyncio.run(job({"prompt": "Hello", "max_tokens": 4}))
    assert ok["choices"][0]["finish_reason"] == "length"


def test_a_memory_failure_fails_only_its_request(small, monkeypatch):
    """An out-of-memory error in a step that holds one marked request fails that request; the others finish."""
    from engine.executor.runner import ModelRunner

    original = ModelRunner.execute
    marker = 31337

    def failing(self, decodes, chunks):
        if any(marker in c.token_ids for c in chunks) or any(r.token == marker for r in decodes):
            raise torch.OutOfMemoryError("injected: could not allocate activations")
        return original(self, decodes, chunks)

    monkeypatch.setattr(ModelRunner, "execute", failing)
    prompts = [chat_ids(small, p) for p in PROMPTS[:4]]
    doomed = prompts[1][:-3] + [marker] + prompts[1][-3:]

    async def run():
        async def guarded(i, ids):
            try:
                return await generate(small, f"oom-{i}", ids, greedy(16))
            except GenerationError as exc:
                return exc
        return await asyncio.gather(*(guarded(i, ids) for i, ids in enumerate([prompts[0], doomed, *prompts[2:]])))

    results = asyncio.run(run())
    assert isinstance(results[1], GenerationError) and "injected" in str(results[1])
    for i in (0, 2, 3):
        assert len(results[i]["choices"][0]["ids"]) == 16
    assert small.engine.num_requests == 0


@pytest.mark.parametrize("env, named", [
    ({"KV_CACHE_MEMORY": "0"}, "KV_CACHE_MEMORY"),
    ({"KV_CACHE_MEMORY": "lots"}, "KV_CACHE_MEMORY"),
    ({"GPU_MEMORY_UTILIZATION": "1.5"}, "GPU_MEMORY_UTILIZATION"),
    ({"TENSOR_PARALLEL_SIZE": "0"}, "TENSOR_PARALLEL_SIZE"),
    ({"MAX_NUM_SEQS": "64", "MAX_NUM_BATCHED_TOKENS": "32"}, "MAX_NUM_BATCHED_TOKENS"),
])
def test_memory_settings_are_checked_at_start(monkeypatch, env, named):
    from worker.settings import SettingsError, load_settings

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match=named):
        load_settings()


@pytest.mark.slow
def test_a_cache_smaller_than_one_context_stops_the_load(worker):
    config = EngineConfig(**{**worker.settings.engine_config().__dict__, "max_model_len": 2048,
                             "kv_cache_memory": 1000 * _bytes_per_token(worker)})
    engine = AsyncEngine(config)
    with pytest.raises(RuntimeError, match="KV_CACHE_MEMORY or lower MAX_MODEL_LEN"):
        asyncio.run(engine.start())


def test_a_sliding_window_layer_reads_only_the_blocks_its_window_reaches():
    """Decode rows of 300 and 100 keys under a 64-token window gather 6 blocks each instead of 19, and the mask
    picks exactly each row's last 64 positions; a layer without a window reads everything."""
    from engine.core.block_manager import BLOCK_SIZE
    from engine.executor.kv_cache import DecodeBucket, PrefillSegment, StepLayout

    width = 19  # blocks of the longest row (300 keys)
    table = torch.arange(2 * width).view(2, width)  # row r owns blocks r*19 ... r*19+18
    lengths = torch.tensor([300, 100])
    layout = StepLayout([DecodeBucket(0, 2, table.reshape(-1), lengths, 300)],
                        [PrefillSegment(2, 40, 200, torch.arange(100, 115))], torch.zeros(42, dtype=torch.long))

    blocks, keys, mask = layout.bucket_keys(0, 64)
    assert keys == 6 * BLOCK_SIZE and blocks.numel() == 2 * 6
    for row, length in enumerate(lengths.tolist()):
        row_blocks = blocks.view(2, 6)[row]
        positions = [(b - row * width) * BLOCK_SIZE + t for b in row_blocks.tolist() for t in range(BLOCK_SIZE)]
        chosen = [p for p, m in zip(positions, mask[row, 0, 0].tolist()) if m]
        assert chosen == list(range(length - 64, length))
    blocks, keys, mask = layout.bucket_keys(0, None)
    assert keys == 300 and blocks.numel() == 2 * width and mask[1, 0, 0].sum() == 100

    blocks, first, mask = layout.segment_keys(0, 64)
    assert first == (200 - 63) // BLOCK_SIZE * BLOCK_SIZE and blocks.tolist() == list(range(100 + first // 16, 115))
    query, key = 5, 230  # query position 205 sees keys 142 ... 205
    assert mask[0, 0, query].nonzero().view(-1).add(first).tolist() == list(range(142, 206))
    assert key - first < mask.shape[-1] and not mask[0, 0, query, key - first]


@pytest.mark.slow
def test_beam_search_survives_preemption(small):
    """Beams (sequences that park until their siblings' logits are in) preempted by a crowd and recomputed give
    the beams of a quiet run."""
    ids = chat_ids(small, PROMPTS[3])
    params = SamplingParams(max_tokens=40, temperature=0.0, n=2, best_of=3, beam_search=True, ignore_eos=True)
    quiet = asyncio.run(generate(small, "beam-quiet", ids, params))

    async def beams_and_preemptions(request_id):
        choices: dict[int, list[int]] = {}
        preemptions = 0
        async for output in small.generate(request_id, ids, params):
            for delta in output.deltas:
                choices.setdefault(delta.index, []).extend(delta.token_ids)
            if output.metrics is not None:
                preemptions = output.metrics.preemptions
        return [choices[i] for i in sorted(choices)], preemptions

    async def crowded():
        others = [generate(small, f"beam-crowd-{i}", chat_ids(small, PROMPTS[i % 8]), greedy(120))
                  for i in range(12)]
        # Submitted last, the beam request is the youngest: the first the scheduler preempts.
        return (await asyncio.gather(*others, beams_and_preemptions("beam-crowded")))[-1]

    loud, preemptions = asyncio.run(crowded())
    assert preemptions > 0, "the crowd was meant to preempt the beam request"
    assert loud == [c["ids"] for c in quiet["choices"]]
