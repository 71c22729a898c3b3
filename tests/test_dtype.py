"""DTYPE=auto on CPU: bfloat16 only where a probe finds native bfloat16 products faster, and bfloat16 output that
agrees with float32 except at near-ties."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine import AsyncEngine, EngineConfig
from engine import loader
from engine.cpu import layout as cpu_layout
from engine_helpers import PROMPTS, chat_ids, generate, greedy
from engine_helpers import BFLOAT16_NEAR_TIE


def test_auto_takes_bfloat16_only_where_the_probe_finds_it_faster(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_layout, "bfloat16_gain", lambda **_: 3.2)
    assert loader.resolve_dtype("auto", cpu) == torch.bfloat16
    monkeypatch.setattr(cpu_layout, "bfloat16_gain", lambda **_: 1.1)
    assert loader.resolve_dtype("auto", cpu) == torch.float32
    assert loader.resolve_dtype("float32", cpu) == torch.float32


def test_the_probe_takes_the_fastest_bfloat16_product_and_refuses_a_prompt_chunk_loss(monkeypatch):
    """With the native kernel the probe times torch's bfloat16 product and the kernel's two arithmetics at a
    decode size and a prompt chunk's size: bfloat16 is worth its decode gain where the best product at the chunk's
    size loses at most 10%, else that loss (which rules it out). The speed-ups are given (the order of the
    products: torch's, VDPBF16PS, float32 FMAs); the products themselves are not timed here."""
    class Kernels:  # the kernel's product is not called: only its presence and packing matter to the probe
        def bf16_linear_supported(self):
            return True

        def bf16_pack(self, weight):
            return weight

    monkeypatch.setattr(cpu_layout, "bfloat16_is_native", lambda: True)
    for decode, prefill, expected in (((1.1, 1.6, 2.4), (0.6, 0.64, 1.04), 2.4),
                                      ((1.1, 1.6, 2.4), (0.6, 0.64, 0.85), 0.85),
                                      ((1.8, 1.7, 1.2), (1.9, 0.9, 0.9), 1.8)):
        given = iter(decode + prefill)
        monkeypatch.setattr(cpu_layout, "speedup", lambda *_, **__: next(given))
        assert cpu_layout.bfloat16_gain(kernels=Kernels()) == expected
    given = iter((1.1, 0.61))  # without the kernel: torch's product alone at each size
    monkeypatch.setattr(cpu_layout, "speedup", lambda *_, **__: next(given))
    assert cpu_layout.bfloat16_gain() == 0.61


def test_only_dense_checkpoints_weigh_the_native_product(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert loader._dense_checkpoint(EngineConfig(), folder, None)
    assert not loader._dense_checkpoint(EngineConfig(quantization="int8"), folder, None)
    assert not loader._dense_checkpoint(EngineConfig(), folder, folder / "model.gguf")
    (folder / "config.json").write_text('{"model_type": "llama", "quantization_config": {"quant_method": "gptq"}}')
    assert not loader._dense_checkpoint(EngineConfig(), folder, None)


def test_probe_reports_no_gain_without_native_bfloat16(monkeypatch):
    monkeypatch.setattr(cpu_layout, "bfloat16_is_native", lambda: False)
    assert cpu_layout.bfloat16_gain() == 0.0


@pytest.fixture(scope="module")
def bf16_engine(worker):
    engine = AsyncEngine(EngineConfig(**{**worker.settings.engine_config().__dict__, "dtype": "bfloat16"}))
    asyncio.run(engine.start())
    yield engine
    engine.close()


@pytest.mark.slow
def test_bfloat16_greedy_agrees_with_float32(worker, bf16_engine):
    fp32 = worker.engine
    assert bf16_engine.engine.runner.dtype == torch.bfloat16
    identical = 0
    for i, prompt in enumerate(PROMPTS):
        reference = asyncio.run(generate(fp32, f"f32-{i}", chat_ids(fp32, prompt), greedy(16)))["choices"][0]
        other = asyncio.run(generate(bf16_engine, f"bf16-{i}", chat_ids(bf16_engine, prompt), greedy(16)))
        ids = other["choices"][0]["ids"]
        if ids == reference["ids"]:
            identical += 1
            continue
        at = next(k for k, (a, b) in enumerate(zip(reference["ids"], ids)) if a != b)
        top = reference["logprobs"][at].top
        assert top[0][1] - top[1][1] < BFLOAT16_NEAR_TIE, (
            f"prompt {i}: bfloat16 parts from float32 at token {at} where float32 was sure: {top[:2]}")
    assert identical >= len(PROMPTS) // 2


@pytest.mark.slow
def test_gguf_block_share_reads_the_files_tensor_types(tmp_path):
    import gguf
    import numpy as np

    from engine.sources import store as model_store
    from engine.cpu import quantized_weights

    embedded = model_store.embedded_model()
    assert quantized_weights.gguf_block_share(embedded.path / embedded.gguf_file) > 0.99  # Q4_1 and Q8_0, F32 norms
    writer = gguf.GGUFWriter(tmp_path / "plain.gguf", "llama")
    writer.add_tensor("blk.0.ffn_up.weight", np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert quantized_weights.gguf_block_share(tmp_path / "plain.gguf") == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("blocks_win", [True, False])
def test_auto_serves_a_gguf_model_from_its_blocks_where_they_beat_bfloat16(monkeypatch, blocks_win):
    """On a CPU with native bfloat16, DTYPE=auto loads a GGUF model of Q4_1/Q8_0 blocks as float32 and keeps it so,
    multiplying from its blocks with 16-bit activations, where they beat bfloat16 products at decode sizes (the
    embedded model on the 2-core AMD EPYC: 5x at 1 row, 1.9x at 16); else it loads the model as bfloat16."""
    from engine.cpu import native_kernels
    from engine.cpu import quantized_weights

    if not (native_kernels.load("auto") and native_kernels.active().word_blocks_supported()):
        pytest.skip("the block product for 16-bit activations needs the native kernels and AVX512_VNNI")
    monkeypatch.setattr(cpu_layout, "bfloat16_gain", lambda **_: 3.2)
    probed = []
    monkeypatch.setattr(quantized_weights, "beats_bfloat16", lambda model, kernels: probed.append(
        model.dtype) or blocks_win)
    loaded = loader.load(EngineConfig(dtype="auto"))
    assert probed == [torch.float32]
    formats = {m.block_format for m in loaded.model.modules() if hasattr(m, "block_format")}
    if blocks_win:
        assert loaded.dtype == loaded.model.dtype == torch.float32
        assert formats == {3, 4}  # the file's Q4_1 and Q8_0 blocks, arranged for 16-bit activations
    else:
        assert loaded.dtype == loaded.model.dtype == torch.bfloat16
        assert not formats


def test_the_blocks_must_keep_up_with_bfloat16_at_decode_sizes(monkeypatch):
    from engine.cpu import native_kernels
    from engine.cpu import quantized_weights
    from tiny_models import tiny_llama

    if not (native_kernels.load("auto") and native_kernels.active().word_blocks_supported()):
        pytest.skip("the block product for 16-bit activations needs the native kernels and AVX512_VNNI")
    kernels = native_kernels.active()
    rivals = []

    def gains(*args):
        rivals.append(args[-1])
        return measured

    monkeypatch.setattr(quantized_weights, "_gains", gains)
    measured = {1: 3.0, 16: 1.5, 64: 1.1, 256: 0.8}  # slower at prefill sizes: decode steps decide
    assert quantized_weights.beats_bfloat16(tiny_llama(exact_blocks=True), kernels)
    assert rivals == [torch.bfloat16]
    # In geometric mean over 1 and 16 rows (measured on the 2-core AMD EPYC against packed bfloat16: 2.8x, 0.88x)
    measured = {1: 2.8, 16: 0.88, 64: 0.86, 256: 0.77}
    assert quantized_weights.beats_bfloat16(tiny_llama(exact_blocks=True), kernels)
    measured = {1: 1.1, 16: 0.8, 64: 0.8, 256: 0.8}
    assert not quantized_weights.beats_bfloat16(tiny_llama(exact_blocks=True), kernels)
    assert not quantized_weights.beats_bfloat16(tiny_llama(exact_blocks=False), kernels)  # no blocks: not timed
    assert len(rivals) == 3
