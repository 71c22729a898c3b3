"""The KV cache's own type (KV_CACHE_DTYPE): DTYPE=auto keeps float16 keys and values for a float32 model on CPU
where the native kernels serve and a start-up probe finds the model's logits unchanged, which halves the bytes
per token; explicit choices are honoured; a model whose values overflow float16 keeps float32; a type the worker
does not have is refused at start-up."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import AsyncEngine, EngineConfig
from engine.cpu import native_kernels
from tiny_models import build_model, prompts, reference
from engine_helpers import greedy_tokens


def _kernels_or_skip() -> None:
    """DTYPE=auto's float16 cache needs the native kernels (the engines below load them too)."""
    if not native_kernels.load("auto"):
        pytest.skip(f"no native kernels here: {native_kernels.reason()}")


@pytest.fixture
def float32_under_auto(monkeypatch):
    """DTYPE=auto's float16 cache is for float32 models. On a CPU with native bfloat16 products (the 2-core AMD
    EPYC) DTYPE=auto loads a tiny safetensors model as bfloat16 (tests/test_dtype.py covers that choice): the
    probe reads here as on a CPU without them, so that these models load as float32."""
    from engine.cpu import layout as cpu_layout

    monkeypatch.setattr(cpu_layout, "bfloat16_gain", lambda **_: 0.0)


def _kv(engine: AsyncEngine):
    return engine._engine.runner.kv


@pytest.mark.slow
def test_auto_keeps_float16_keys_and_values_on_cpu(worker):
    """The embedded float32 model under DTYPE=auto (the worker's default): float16 pools, 2 bytes a value, and
    the same greedy tokens as the test worker's float32 activations and cache (DTYPE=float32)."""
    _kernels_or_skip()
    ids = [[(13 * i + 7 * j) % 9000 + 60 for j in range(n)] for i, n in enumerate((7, 130))]
    engine = AsyncEngine(EngineConfig(dtype="auto", kv_cache_memory=32 * 2**20, max_model_len=512, max_num_seqs=4))
    try:
        got = greedy_tokens(engine, ids)
        stats = engine.engine.stats()
        layers, kv_heads, head_dim = 30, 3, 64  # SmolLM2-135M
        assert _kv(engine).dtype == torch.float16
        assert stats["kv_capacity_bytes"] // stats["kv_capacity_tokens"] == layers * 2 * kv_heads * head_dim * 2
    finally:
        engine.close()
    assert _kv(worker.engine).dtype == torch.float32
    assert got == greedy_tokens(worker.engine, ids)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, kv_cache_dtype, expected", [
    ("float32", "auto", torch.float32),  # an explicit model type keeps its cache in it
    ("auto", "float32", torch.float32),
    ("auto", "float16", torch.float16),
    ("float32", "bfloat16", torch.bfloat16),
])
@pytest.mark.usefixtures("float32_under_auto")
def test_other_choices_are_honoured_and_serve(tmp_path, tokenizer_folder, caplog, dtype, kv_cache_dtype,  # noqa: F811
                                              expected):
    """A tiny Llama: the cache takes the type asked for (logged), and serves transformers' greedy tokens (a
    bfloat16 cache rounds too coarsely to promise them)."""
    model = build_model("llama", {}, tmp_path, tokenizer_folder)
    engine = AsyncEngine(EngineConfig(model=str(tmp_path), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                      kv_cache_memory=16 * 2**20, max_model_len=256))
    try:
        with caplog.at_level(logging.INFO):
            got = greedy_tokens(engine, prompts(3))
        assert _kv(engine).dtype == expected
        assert f"{str(expected).removeprefix('torch.')} keys and values" in caplog.text
        if expected != torch.bfloat16:
            assert got == [reference(model, ids, 24) for ids in prompts(3)]
        else:
            assert [len(t) for t in got] == [24] * len(got)
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.usefixtures("float32_under_auto")
def test_a_model_whose_values_overflow_float16_keeps_float32(tmp_path, tokenizer_folder, caplog):  # noqa: F811
    """Values past float16's range would saturate at 65504 in the cache: the start-up probe sees the logits move,
    keeps the model's own type and says why; the model then serves transformers' own greedy tokens."""
    _kernels_or_skip()
    model = build_model("llama", {}, tmp_path, tokenizer_folder)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(3e5)
            layer.self_attn.o_proj.weight.div_(3e5)
    model.save_pretrained(tmp_path)
    engine = AsyncEngine(EngineConfig(model=str(tmp_path), kv_cache_memory=16 * 2**20, max_model_len=256))
    try:
        with caplog.at_level(logging.INFO):
            got = greedy_tokens(engine, prompts(7))
        assert _kv(engine).dtype == torch.float32
        assert "KV cache in float16: its logits differ from a full-precision cache's" in caplog.text
        assert got == [reference(model, ids, 24) for ids in prompts(7)]
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.usefixtures("float32_under_auto")
def test_a_float16_cache_serves_a_tiny_model_as_transformers_does(tmp_path, tokenizer_folder):  # noqa: F811
    """The same tiny Llama without the outlying values keeps the float16 cache, and greedy tokens stay those of
    transformers' float32 forward."""
    _kernels_or_skip()
    model = build_model("llama", {}, tmp_path, tokenizer_folder)
    engine = AsyncEngine(EngineConfig(model=str(tmp_path), kv_cache_memory=16 * 2**20, max_model_len=256))
    try:
        got = greedy_tokens(engine, prompts(7))
        assert _kv(engine).dtype == torch.float16
        assert got == [reference(model, ids, 24) for ids in prompts(7)]
    finally:
        engine.close()


@pytest.mark.parametrize("value", ["fp8", "half", "int8"])
def test_a_type_the_worker_does_not_have_is_refused_at_start(monkeypatch, value):
    from worker.settings import SettingsError, load_settings

    monkeypatch.setenv("KV_CACHE_DTYPE", value)
    with pytest.raises(SettingsError, match="KV_CACHE_DTYPE"):
        load_settings()
