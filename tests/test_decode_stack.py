"""A decode step's layers in one native call (engine/cpu/native/decode_stack.cpp through
engine/executor/compact_decoder.py): the same kernels in the same order as the layer-by-layer path, so a step of
decode rows gives the same logits bit for bit, for bfloat16 products and packed ones, with biases and sliding
windows, at one row and several rows in several length buckets."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine import AsyncEngine, EngineConfig
from engine.cpu import native_kernels
from engine.executor import compact_decoder
from engine.executor.step import DecodeRow, PrefillChunk
from tiny_models import FAST_FAMILIES, build_model

# Rows of different lengths: the short one attends in a bucket of its own, the two longer ones together
# (engine/executor/runner.py's _length_buckets).
PROMPTS = ([3 + (i * 37) % 900 for i in range(20)], [5 + (i * 53) % 900 for i in range(28)],
           [7 + (i * 29) % 900 for i in range(3)])
BLOCKS = ([0, 1], [2, 3], [4, 5])


def _started(folder, dtype: str, **kw) -> AsyncEngine:
    engine = AsyncEngine(EngineConfig(model=str(folder), dtype=dtype, max_num_batched_tokens=64,
                                      kv_cache_memory=8 * 2**20, max_num_seqs=8, **kw))
    asyncio.run(engine.start())
    return engine


def _decode_steps(runner, rows: int) -> list[torch.Tensor]:
    """The prompts written to the cache, then three steps of `rows` decode rows; their logits."""
    with torch.inference_mode():
        runner.execute([], [PrefillChunk(ids, 0, blocks, "none") for ids, blocks in zip(PROMPTS, BLOCKS)])
        logits = []
        for step in range(3):
            decodes = [DecodeRow(11 + 7 * i + step, len(ids) + step, blocks)
                       for i, (ids, blocks) in enumerate(zip(PROMPTS[:rows], BLOCKS))]
            logits.append(runner.execute(decodes, []))
        return logits


@pytest.mark.slow
@pytest.mark.parametrize("family,dtype,quantization", [
    ("llama", "bfloat16", None),  # bf16_linear's products
    ("qwen2", "bfloat16", None),  # biased q/k/v and a sliding window in the first layer
    ("llama", "float32", "int4"),  # blocks_linear with float32 rows
    ("llama", "bfloat16", "int8"),  # blocks_linear with bfloat16 rows
])
def test_the_decode_stack_computes_the_layer_paths_logits(family, dtype, quantization, tmp_path, tokenizer_folder,
                                                            monkeypatch):
    build_model(family, FAST_FAMILIES[family], tmp_path, tokenizer_folder)
    # BATCH_INVARIANT keeps the AVX512_BF16 product at every size: on layers this small its timing against
    # oneDNN's may go either way, and the stack takes only the kernels' own products.
    engine = _started(tmp_path, dtype, batch_invariant=True,
                      **({"quantization": quantization} if quantization else {}))
    try:
        kernels = native_kernels.active()
        if kernels is None:
            pytest.skip(f"no native kernels here: {native_kernels.reason()}")
        if dtype == "bfloat16" and quantization is None and not kernels.bf16_linear_supported():
            pytest.skip("no AVX512_BF16 product on this CPU")
        runner = engine.engine.runner
        compact = runner.compact
        assert compact is not None and compact.kernels is not None, runner.compact_reason
        assert compact.stack is not None
        calls = []
        run = compact_decoder._NativeStack.__call__
        monkeypatch.setattr(compact_decoder._NativeStack, "__call__",
                            lambda self, *a: calls.append(1) or run(self, *a))
        for rows in (1, 3):
            calls.clear()
            stacked = _decode_steps(runner, rows)
            assert len(calls) == 3  # every decode step went through the stack
            stack, compact.stack = compact.stack, None
            try:
                layered = _decode_steps(runner, rows)
            finally:
                compact.stack = stack
            for a, b in zip(stacked, layered):
                assert a.shape[0] == rows and torch.equal(a, b), (family, dtype, quantization, rows)
    finally:
        engine.close()


@pytest.mark.slow
def test_layers_the_stack_does_not_cover_keep_the_layer_path(tmp_path, tokenizer_folder):
    """Qwen3 normalises each query and key head before the rotary embedding, which the stack does not: its
    decode steps go layer by layer through the same kernels."""
    build_model("qwen3", FAST_FAMILIES["qwen3"], tmp_path, tokenizer_folder)
    engine = _started(tmp_path, "bfloat16", batch_invariant=True)
    try:
        kernels = native_kernels.active()
        if kernels is None or not kernels.bf16_linear_supported():
            pytest.skip("no native AVX512_BF16 product here")
        compact = engine.engine.runner.compact
        assert compact is not None and compact.kernels is not None
        assert compact.stack is None
    finally:
        engine.close()


@pytest.mark.slow
def test_a_stack_that_differs_is_caught_at_start_up(tmp_path, tokenizer_folder, monkeypatch, caplog):
    """The start-up probe has a step of decode rows alone, which the stack serves: a stack computing slightly
    differently fails the check of the native-kernel path, and the compact forward runs without the kernels."""
    def differs(self, *args):
        x, normed = run(self, *args)
        return x, normed + 0.05
    run = compact_decoder._NativeStack.__call__
    monkeypatch.setattr(compact_decoder._NativeStack, "__call__", differs)
    build_model("llama", FAST_FAMILIES["llama"], tmp_path, tokenizer_folder)
    with caplog.at_level("INFO", logger="engine"):
        engine = _started(tmp_path, "bfloat16", batch_invariant=True)
    try:
        if native_kernels.active() is None or not native_kernels.active().bf16_linear_supported():
            pytest.skip("no native AVX512_BF16 product here")
        compact = engine.engine.runner.compact
        assert compact is not None and compact.kernels is None
        assert "compact forward through the native kernels: its logits differ" in caplog.text
    finally:
        engine.close()
