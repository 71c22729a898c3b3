"""KV cache memory per held token under a mixed-length load, against the dense layout it replaced.

    .venv/bin/python bench/kv_memory.py [--short 15] [--long-words 1500] [--max-tokens 64]

Runs the engine in-process on the configured model (env as the worker reads it) with `--short` short chats and
one long document (~2000 tokens) at once, and samples every 5 ms: the tokens the running requests hold (prompt +
generated so far) and the cache's own accounting of bytes in use. Prints the peak and mean bytes per held
token, next to what the earlier dense layout (one row per sequence, every row as wide as the longest, columns in
256-token steps) needed for the same sequences at the same moments, and the output tok/s of the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from throughput import PROMPTS, long_document_prompt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", type=int, default=15)
    parser.add_argument("--long-words", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    from engine import AsyncEngine, SamplingParams
    from worker.settings import load_settings

    engine = AsyncEngine(load_settings().engine_config())
    asyncio.run(engine.start())
    core = engine.engine
    tok = engine.tokenizer
    kv = core.runner.kv
    per_token = kv.nbytes // kv.capacity_tokens

    def ids(text: str) -> list[int]:
        return tok.encode(tok.render_chat([{"role": "user", "content": text}]), add_special_tokens=False)

    prompts = [ids(long_document_prompt(0, args.long_words))] + [ids(PROMPTS[i % len(PROMPTS)])
                                                                  for i in range(args.short)]
    held = [0] * len(prompts)
    samples = []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int) -> int:
        count = 0
        held[i] = len(prompts[i])
        async for output in engine.generate(f"kv-{i}", prompts[i], params):
            count += sum(len(d.token_ids) for d in output.deltas)
            held[i] = len(prompts[i]) + count
        held[i] = 0
        return count

    async def run() -> tuple[int, float]:
        async def watch():
            while True:
                live = [h for h in held if h]
                used = core.stats()["kv_used_bytes"]
                if live and used:
                    columns = -(-(max(live) + 1) // 256) * 256
                    samples.append((sum(live), used, len(live) * columns * per_token))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
        watcher.cancel()
        return sum(counts), wall

    tokens, wall = asyncio.run(run())
    engine.close()
    paged = [used / h for h, used, _ in samples]
    dense = [d / h for h, _, d in samples]
    result = {
        "bench": "kv_memory", "sequences": len(prompts), "long_prompt_tokens": len(prompts[0]),
        "bytes_per_token_of_model": per_token, "samples": len(samples),
        "paged_bytes_per_held_token": {"mean": round(statistics.fmean(paged)), "peak": round(max(paged))},
        "dense_bytes_per_held_token": {"mean": round(statistics.fmean(dense)), "peak": round(max(dense))},
        "peak_paged_mb": round(max(u for _, u, _ in samples) / 2**20, 1),
        "peak_dense_mb": round(max(d for _, _, d in samples) / 2**20, 1),
        "output_tok_s": round(tokens / wall, 1),
    }
    print(f"model KV: {per_token} bytes per token; {len(prompts)} sequences, one of {len(prompts[0])} prompt tokens")
    print("| layout | bytes per held token, mean | peak | peak MB |")
    print("|---|---:|---:|---:|")
    print(f"| paged blocks (now) | {result['paged_bytes_per_held_token']['mean']} | "
          f"{result['paged_bytes_per_held_token']['peak']} | {result['peak_paged_mb']} |")
    print(f"| dense rows (before) | {result['dense_bytes_per_held_token']['mean']} | "
          f"{result['dense_bytes_per_held_token']['peak']} | {result['peak_dense_mb']} |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
