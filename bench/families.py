"""Decode speed of a full-attention model, a sliding-window model and a hybrid model (Mamba-2 and attention layers,
Granite 4's architecture) of the same width, on the paged engine and on the fallback path (transformers' own
cache), at 1 and 16 streams.

    .venv/bin/python bench/families.py [--hidden 256] [--layers 4] [--tokens 48]

The models are random (built from transformers' Mistral config, with and without a sliding window, and its
GraniteMoeHybrid config with dense MLPs) and saved with the embedded model's tokenizer; greedy decoding with ignore_eos, so every stream decodes --tokens tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import AsyncEngine, EngineConfig, SamplingParams  # noqa: E402
from engine.loader import load, model_folder  # noqa: E402


def build(folder: Path, hidden: int, layers: int, window: int | None, hybrid: bool = False) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GraniteMoeHybridConfig, MistralConfig

    if hybrid:  # every other layer a Mamba-2 mixer
        config = GraniteMoeHybridConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 3,
                                        shared_intermediate_size=hidden * 3, num_local_experts=0,
                                        num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                        num_key_value_heads=2, max_position_embeddings=4096,
                                        layer_types=["mamba", "attention"] * (layers // 2), mamba_n_heads=hidden // 32,
                                        mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1)
    else:
        config = MistralConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 3,
                               num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                               head_dim=64, max_position_embeddings=4096, sliding_window=window)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_folder(EngineConfig())).save_pretrained(folder)


def _fallback_loader(config: EngineConfig):
    loaded = load(config)
    loaded.model.set_attn_implementation("sdpa")
    return dataclasses.replace(loaded, fallback_reason="forced by the benchmark")


async def _run(engine: AsyncEngine, streams: int, prompt_len: int, tokens: int) -> float:
    rng = random.Random(streams)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        ids = [rng.randrange(100, 49152) for _ in range(prompt_len)]
        count = 0
        async for output in engine.generate(f"s{streams}-{i}", ids, params):
            count += sum(len(d.token_ids) for d in output.deltas)
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i) for i in range(streams)))
    return sum(counts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--window", type=int, default=32)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-families-"))
    try:
        print(f"hidden {args.hidden}, {args.layers} layers, prompt {args.prompt}, {args.tokens} new tokens per stream;"
              f" tokens/s over all streams")
        print(f"{'model':<22}{'path':<10}{'1 stream':>10}{'16 streams':>12}")
        for name, window, hybrid in (("full attention", None, False),
                                     (f"sliding window {args.window}", args.window, False),
                                     ("hybrid (mamba-2)", None, True)):
            folder = work / name.replace(" ", "-")
            build(folder, args.hidden, args.layers, window, hybrid)
            for path, loader in (("paged", load), ("fallback", _fallback_loader)):
                engine = AsyncEngine(EngineConfig(model=str(folder), dtype="float32", max_num_seqs=16,
                                                  kv_cache_memory=256 * 2**20), loader=loader)
                asyncio.run(engine.start())
                asyncio.run(_run(engine, 1, args.prompt, 4))  # warm-up
                speeds = [asyncio.run(_run(engine, n, args.prompt, args.tokens)) for n in (1, 16)]
                engine.close()
                print(f"{name:<22}{path:<10}{speeds[0]:>10.1f}{speeds[1]:>12.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
