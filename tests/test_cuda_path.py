"""The CUDA path, run on the CPU (DEVICE=cuda-sim): no GPU is at hand where this worker is built and tested, so
these tests are how its branches run at all. A real engine on a tiny model takes every decision CUDA takes
(bfloat16, PyTorch attention, the KV cache sized by GPU_MEMORY_UTILIZATION from the device's memory after a
profiled step) and must serve transformers' greedy tokens, size its cache from the simulated memory, and never
reach a CPU-only path (native kernels, oneDNN packing, GGUF blocks, host-memory trimming, the sampler's chunked
argmax and host-side bitmask)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import re

import pytest
import torch

from conftest import ROOT
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.cpu import layout as cpu_layout
from engine.cpu import host_memory
from engine.cpu import native_kernels
from engine.cpu import quantized_weights
from engine.sampling import sampler as sampling
from engine.sampling import structured
from engine.executor.kv_cache import PagedKVCache
from engine.loader import ModelLoadError
from engine_helpers import BFLOAT16_NEAR_TIE, choice_ids
from tiny_models import FALLBACK_FAMILIES, HYBRID_FAMILIES, build_model, family_greedy, prompts, reference

MIB = 2**20
BATCHED_TOKENS = 32  # the longest prompt prefills in chunks


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer_folder):  # noqa: F811
    """A tiny Llama whose output layer is scaled up, so most greedy choices stand clear of bfloat16's rounding."""
    folder = tmp_path_factory.mktemp("cuda-sim-llama")
    model = build_model("llama", {}, folder, tokenizer_folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    model.save_pretrained(folder)
    return folder


def sim_config(folder, **overrides) -> EngineConfig:
    settings = dict(model=str(folder), device="cuda-sim", simulated_device_memory=64 * MIB,
                    max_num_batched_tokens=BATCHED_TOKENS, max_num_seqs=8)
    return EngineConfig(**{**settings, **overrides})


def started(config: EngineConfig) -> AsyncEngine:
    engine = AsyncEngine(config)
    asyncio.run(engine.start())
    return engine


def served(engine: AsyncEngine, rows: list[list[int]]) -> list[list[int]]:
    async def batched():
        return await asyncio.gather(*(choice_ids(engine, f"r{i}", ids, family_greedy()) for i, ids in enumerate(rows)))
    return [choices[0] for choices in asyncio.run(batched())]


@pytest.mark.slow
def test_the_simulated_cuda_path_serves_transformers_greedy_tokens_in_float32(model_folder):
    from transformers import AutoModelForCausalLM

    engine = started(sim_config(model_folder, dtype="float32"))
    try:
        runner = engine.engine.runner
        assert runner.platform.accelerator and runner.platform.simulated
        assert runner.compact is None or runner.compact.kernels is None  # PyTorch attention, no native kernels
        model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
        rows = prompts(0) + prompts(1)
        assert served(engine, rows) == [reference(model, ids) for ids in rows]
    finally:
        engine.close()


@pytest.mark.slow
def test_the_simulated_cuda_path_runs_bfloat16_and_agrees_with_transformers(model_folder):
    """DTYPE=auto takes bfloat16 as on a GPU. Its greedy tokens are transformers' own in bfloat16, except where a
    choice is a near-tie in float32 (bfloat16 keeps 8 bits of mantissa; the engine sums in another order)."""
    from transformers import AutoModelForCausalLM

    engine = started(sim_config(model_folder))
    try:
        assert engine.engine.runner.dtype == torch.bfloat16 and engine.engine.runner.kv.dtype == torch.bfloat16
        exact = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
        bf16 = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.bfloat16).eval()
        rows = prompts(0) + prompts(1) + prompts(2)
        identical = 0
        for ids, got in zip(rows, served(engine, rows)):
            want = reference(bf16, ids)
            if got == want:
                identical += 1
                continue
            at = next(k for k, (a, b) in enumerate(zip(want, got)) if a != b)
            with torch.inference_mode():
                logprobs = exact(torch.tensor([ids + want[:at]])).logits[0, -1].float().log_softmax(-1)
            gap = abs(logprobs[want[at]] - logprobs[got[at]]).item()
            assert gap < BFLOAT16_NEAR_TIE, f"parts from transformers at token {at} where float32 was sure ({gap})"
        assert identical >= len(rows) * 2 // 3
    finally:
        engine.close()


def _blocks(engine: AsyncEngine) -> tuple[int, int, int]:
    """The KV cache's blocks, bytes per block and the model's weight bytes."""
    kv = engine.engine.runner.kv
    weights = sum(p.numel() * p.element_size() for p in engine.engine.runner.model.parameters())
    return kv.num_blocks, kv.nbytes // kv.num_blocks, weights


@pytest.mark.slow
def test_kv_capacity_follows_simulated_memory_utilization_and_the_profiled_step(model_folder):
    results = {}
    for memory, utilization, batched in ((64, 0.9, 32), (128, 0.9, 32), (128, 0.5, 32), (128, 0.9, 512)):
        engine = started(sim_config(model_folder, simulated_device_memory=memory * MIB,
                                    gpu_memory_utilization=utilization, max_num_batched_tokens=batched))
        results[memory, utilization, batched] = _blocks(engine)
        engine.close()
    blocks, per_block, weights = results[64, 0.9, 32]
    # Everything fits the allowed share: weights, the step's activations and the cache.
    for (memory, utilization, _), (n, _, _) in results.items():
        assert weights + n * per_block < memory * MIB * utilization
    # The same weights and step leave room that grows by exactly the memory allowed in addition.
    for key in ((128, 0.9, 32), (128, 0.5, 32)):
        extra = int(key[0] * MIB * key[1]) - int(64 * MIB * 0.9)
        assert abs(results[key][0] - blocks - extra // per_block) <= 1, (key, results[key][0], blocks)
    # The profiled step is measured: 512-token steps need more activation memory than 32-token ones.
    assert results[128, 0.9, 512][0] < results[128, 0.9, 32][0]


@pytest.mark.slow
def test_a_hybrid_model_keeps_its_state_slots_in_the_simulated_memory(tmp_path, tokenizer_folder):  # noqa: F811
    """LFM2 (convolution and attention layers) is served exactly on the simulated CUDA path, and its recurrent-state
    slots (one per MAX_NUM_SEQS) come out of the device's memory before the KV cache does."""
    model = build_model("lfm2", HYBRID_FAMILIES["lfm2"], tmp_path, tokenizer_folder)
    sizes = {}
    for seqs in (8, 64):
        engine = started(sim_config(tmp_path, dtype="float32", max_num_seqs=seqs, max_num_batched_tokens=64))
        try:
            runner = engine.engine.runner
            sizes[seqs] = runner.kv.num_blocks, runner.kv.nbytes // runner.kv.num_blocks, runner.states.nbytes // seqs
            if seqs == 8:
                rows = prompts(5)
                assert served(engine, rows) == [reference(model, ids) for ids in rows]
        finally:
            engine.close()
    (few_seqs, per_block, per_slot), (many_seqs, _, _) = sizes[8], sizes[64]
    assert 56 * per_slot // per_block >= 2
    assert few_seqs - many_seqs >= 56 * per_slot // per_block


@pytest.mark.slow
def test_a_fallback_model_on_the_simulated_cuda_path(tmp_path, tokenizer_folder):  # noqa: F811
    """BLOOM (its attention does not dispatch through the engine's) is served by the fallback path on the
    simulated CUDA path too, exactly, with the sampler's CUDA ways."""
    model = build_model("bloom", FALLBACK_FAMILIES["bloom"], tmp_path, tokenizer_folder)
    engine = started(sim_config(tmp_path, dtype="float32"))
    try:
        assert engine.loaded_model.fallback_reason and not engine.engine.sampler.cpu_fast_paths
        rows = prompts(6)
        assert served(engine, rows) == [reference(model, ids) for ids in rows]
    finally:
        engine.close()


def test_a_simulated_device_too_small_for_the_weights_and_a_step_stops_the_load(model_folder):
    engine = AsyncEngine(sim_config(model_folder, simulated_device_memory=8 * MIB))
    with pytest.raises(RuntimeError, match="no memory left for the KV cache.*GPU_MEMORY_UTILIZATION"):
        asyncio.run(engine.start())


CPU_ONLY = [(native_kernels, "load"), (native_kernels, "active"), (cpu_layout, "apply"),
            (cpu_layout, "bfloat16_gain"), (quantized_weights, "apply"), (quantized_weights, "beats_bfloat16"),
            (host_memory, "release"), (PagedKVCache, "give_back"), (sampling, "chunked_argmax"),
            (structured, "forbidden_on_host")]


def _record_cpu_only_calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    for owner, name in CPU_ONLY:
        original = getattr(owner, name)

        def recorder(*args, _original=original, _name=f"{owner.__name__.rsplit('.', 1)[-1]}.{name}", **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)
        monkeypatch.setattr(owner, name, recorder)
    return calls


DIGITS = r"[0-9]{3}-[0-9]{4}"


def _serve_then_idle(engine: AsyncEngine) -> str:
    """Greedy rows, a drawn one and a constrained one (the grammar's bitmask), then an idle moment; the
    constrained row's text."""
    served(engine, prompts(3))
    tokenizer = engine.tokenizer
    grammar = structured.GrammarCompiler(tokenizer.hf, tokenizer.eos_token_ids, tokenizer.vocab_size).compile(
        "regex", DIGITS)
    drawn = SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True)
    constrained = SamplingParams(max_tokens=16, temperature=0.0, grammar=grammar)

    async def both():
        return await asyncio.gather(choice_ids(engine, "drawn", prompts(4)[0], drawn),
                                    choice_ids(engine, "constrained", prompts(4)[1], constrained))
    text = tokenizer.hf.decode(asyncio.run(both())[1][0], skip_special_tokens=True)
    time.sleep(host_memory.IDLE_BEFORE_TRIM_S + 1.5)  # the loop ticks once a second when idle
    return text


@pytest.mark.slow
def test_nothing_cpu_only_runs_on_the_cuda_path(model_folder, monkeypatch):
    calls = _record_cpu_only_calls(monkeypatch)
    # The recorders see the CPU path's calls (DTYPE=auto probes bfloat16, packs weights, trims when idle).
    cpu = started(EngineConfig(model=str(model_folder), max_num_batched_tokens=BATCHED_TOKENS, max_num_seqs=8,
                               kv_cache_memory=8 * MIB, native_kernels="off"))
    try:
        assert re.fullmatch(DIGITS, _serve_then_idle(cpu))
    finally:
        cpu.close()
    assert {"native_kernels.load", "layout.apply", "layout.bfloat16_gain", "host_memory.release",
            "sampler.chunked_argmax", "structured.forbidden_on_host"} <= set(calls)
    calls.clear()
    engine = started(sim_config(model_folder))
    try:
        assert re.fullmatch(DIGITS, _serve_then_idle(engine))  # the bitmask unpacked by shifts, as on CUDA
    finally:
        engine.close()
    assert calls == []


def test_the_cuda_paths_bitmask_and_argmax_equal_the_cpu_paths():
    """The CUDA path's ways (shifting the bitmask's words on the device, torch's argmax) give what the CPU path's
    give, so cuda-sim runs them where the tensors are on the CPU."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 40), dtype=torch.int32, generator=generator)
    bitmask[0, 0] = -2**31  # the sign bit is token 31
    device_way = structured._forbidden(bitmask, torch.device("cpu"), cpu_fast_path=False)
    assert torch.equal(device_way, structured.forbidden_on_host(bitmask))
    logits = torch.randn(5, 3000, generator=generator)
    logits[1, [7, 2900]] = 50.0  # a tie: both take the first
    assert torch.equal(sampling.argmax(logits, cpu_fast_path=False), sampling.chunked_argmax(logits))


@pytest.mark.parametrize("env, named", [
    ({"DEVICE": "cuda-sim", "SIMULATED_DEVICE_MEMORY": "lots"}, "SIMULATED_DEVICE_MEMORY"),
    ({"DEVICE": "cuda-sim", "SIMULATED_DEVICE_MEMORY": "1000"}, "SIMULATED_DEVICE_MEMORY"),
    ({"DEVICE": "cpu", "SIMULATED_DEVICE_MEMORY": str(2**30)}, "SIMULATED_DEVICE_MEMORY"),
    ({"TENSOR_PARALLEL_SIZE": "2"}, "TENSOR_PARALLEL_SIZE.*LAYER_SPLIT_DEVICES=2"),
    ({"LAYER_SPLIT_DEVICES": "0"}, "LAYER_SPLIT_DEVICES"),
])
def test_device_settings_are_checked_at_start(monkeypatch, env, named):
    from worker.settings import SettingsError, load_settings

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match=named):
        load_settings()


def test_device_settings_reach_the_engine(monkeypatch):
    from worker.settings import load_settings

    for key, value in {"DEVICE": "CUDA-SIM", "SIMULATED_DEVICE_MEMORY": str(2**30), "TENSOR_PARALLEL_SIZE": "1",
                       "LAYER_SPLIT_DEVICES": "2"}.items():
        monkeypatch.setenv(key, value)
    config = load_settings().engine_config()
    assert (config.device, config.simulated_device_memory, config.layer_split_devices) == ("cuda-sim", 2**30, 2)


@pytest.mark.parametrize("device", ["cpu", "cuda-sim"])
def test_layer_split_devices_needs_several_gpus(model_folder, device):
    """Whole layers on several GPUs need several torch devices; the CPU (or a simulation on it) is one."""
    engine = AsyncEngine(sim_config(model_folder, device=device, layer_split_devices=2,
                                    simulated_device_memory=64 * MIB if device == "cuda-sim" else None))
    with pytest.raises(ModelLoadError, match="LAYER_SPLIT_DEVICES=2"):
        asyncio.run(engine.start())


@pytest.mark.slow
def test_the_device_check_prints_the_path_and_a_benchmark(model_folder):
    env = {**os.environ, "MODEL_NAME": str(model_folder), "DEVICE": "cuda-sim", "SIMULATED_DEVICE_MEMORY": str(
        64 * MIB), "MAX_NUM_BATCHED_TOKENS": "64", "MAX_NUM_SEQS": "4", "DTYPE": "auto"}
    result = subprocess.run([sys.executable, "-m", "engine.device_check", "--prompt-tokens", "64",
                             "--decode-tokens", "8", "--batch", "4"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for line in ("device: cuda-sim (the CUDA path on the CPU, 64 MiB simulated)", "dtype: bfloat16",
                 "attention: PyTorch SDPA", "KV cache: ", "GPU_MEMORY_UTILIZATION=0.9",
                 "CPU fast paths (native kernels, oneDNN packing, host-memory trimming): off"):
        assert line in out, out
    for phase in ("prefill", "decode"):
        assert any(line.startswith(f"{phase}: ") and line.endswith(" tok/s") for line in out.splitlines()), out
