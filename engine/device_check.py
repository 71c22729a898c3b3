"""`python -m engine.device_check`: which path the worker takes on this machine, and how fast it runs there.

Loads the model the environment configures (the worker's engine variables, read by engine/settings.py: MODEL_NAME,
DEVICE, DTYPE, GPU_MEMORY_UTILIZATION...), prints the path taken (device, dtype, attention, KV cache sizing, CPU
fast paths on or off), then a short benchmark: one prompt's prefill and a batch's decode, in tokens per second. The
CUDA path is only tested in simulation (DEVICE=cuda-sim); on a GPU this is the first thing to run.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time

import torch

from engine.cpu import native_kernels
from engine.async_engine import AsyncEngine
from engine.executor.attention import NATIVE_PREFILL_MIN_TOKENS
from engine.sampling.sampler import SamplingParams
from engine.settings import SettingsError, read_settings


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def describe(engine: AsyncEngine) -> list[str]:
    """The path taken, one 'what: choice' line each."""
    model = engine.loaded_model
    platform = model.platform
    if platform.simulated:
        device = f"{platform.name} (the CUDA path on the CPU, {_size(platform.simulated_memory)} simulated)"
    elif platform.device.type == "cuda":
        device = (f"{platform.device} ({torch.cuda.get_device_name(platform.device)}, "
                  f"{_size(platform.total_memory(platform.device))})")
    else:
        device = platform.name
    lines = [f"model: {model.name}", f"device: {device}", f"dtype: {str(model.dtype).removeprefix('torch.')}"]
    runner = getattr(engine.engine, "runner", None)
    if runner is None:
        lines.append(f"serving path: fallback (transformers' own cache and attention): {model.fallback_reason}")
    else:
        kernels = native_kernels.active() if runner.kv.native_kernels else None
        lines += [
            "serving path: paged (batched engine)",
            "attention: " + (f"native CPU kernels (decode; prefill chunks from {NATIVE_PREFILL_MIN_TOKENS} tokens)"
                             if kernels is not None else "PyTorch SDPA over the paged cache"),
            "forward pass: " + ("compact, checked against the model's own" if runner.compact is not None
                                else f"the model's own ({runner.compact_reason})"),
        ]
        config = engine.config
        rule = (f"GPU_MEMORY_UTILIZATION={config.gpu_memory_utilization} of each device's memory, after a profiled "
                f"step of {config.max_num_batched_tokens} tokens" if platform.accelerator else "KV_CACHE_MEMORY")
        if runner.layer_shapes:
            kv = runner.kv
            layer_devices = sorted({str(s.device) for s in runner.layer_shapes.values()})
            lines += [f"KV cache: {kv.capacity_tokens} tokens, {_size(kv.nbytes)} of "
                      f"{str(kv.dtype).removeprefix('torch.')} ({rule})",
                      f"layers on: {', '.join(layer_devices)}"]
    lines.append("CPU fast paths (native kernels, oneDNN packing, host-memory trimming): "
                 + ("on" if platform.cpu_fast_paths else "off"))
    return lines


async def _run(engine: AsyncEngine, request_id: str, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """When the request's first token came out and when it finished (perf_counter seconds)."""
    first = None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(request_id, ids, params):
        if first is None:
            first = time.perf_counter()
    return first, time.perf_counter()


def benchmark(engine: AsyncEngine, prompt_tokens: int, decode_tokens: int, batch: int) -> list[str]:
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    asyncio.run(_run(engine, "warm-up", prompt(16), 2))
    started = time.perf_counter()
    first, _ = asyncio.run(_run(engine, "prefill", prompt(prompt_tokens), 1))
    prefill = prompt_tokens / (first - started)

    async def decode_batch():
        return await asyncio.gather(*(_run(engine, f"decode-{i}", prompt(16), decode_tokens) for i in range(batch)))

    times = asyncio.run(decode_batch())
    # From the moment every row has its first token, each step decodes one token for each row.
    window = max(end for _, end in times) - max(first for first, _ in times)
    decode = batch * (decode_tokens - 1) / window
    return [f"prefill: {prompt_tokens} tokens, {prefill:.1f} tok/s",
            f"decode: {batch} rows x {decode_tokens} tokens, {decode:.1f} tok/s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        settings = read_settings()
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    engine = AsyncEngine(settings.engine_config())
    asyncio.run(engine.start())
    try:
        for line in describe(engine):
            print(line, flush=True)
        if engine.task == "generate":
            for line in benchmark(engine, args.prompt_tokens, args.decode_tokens, args.batch):
                print(line, flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
