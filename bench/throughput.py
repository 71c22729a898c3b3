"""Streaming throughput of the worker's gateway against plain `model.generate`, in one run.

    .venv/bin/python bench/throughput.py [--levels 1,4,8,16] [--max-tokens 64] [--rounds 2] [--env KEY=VALUE ...]

1. Baseline: transformers' `model.generate`, batch 1, greedy, `--max-tokens` new tokens, on the same model in
   this process (stock attention and cache), over the same prompts.
2. Starts `python -m openai_compat.server` on a free port and drives streaming chat requests through the
   official `openai` client (greedy, `ignore_eos`, `--max-tokens` tokens each, usage from include_usage) at
   each concurrency level: a closed loop of `concurrency x rounds` requests.
Prints a table (aggregate output tok/s, TTFT p50/p95, ratio to the baseline) and one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain why the sky is blue in simple words.",
    "List five facts about the planet Mars.",
    "What are the benefits of regular exercise?",
    "Describe how a bicycle works.",
    "Give me a recipe for pancakes.",
    "Why do cats purr?",
    "Summarize the plot of a classic fairy tale.",
]


def baseline_tok_s(max_tokens: int, threads: int | None) -> tuple[float, str]:
    """Plain transformers generation, one request at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.config import EngineConfig
    from engine.loader import model_folder

    if threads:
        torch.set_num_threads(threads)
    folder = model_folder(EngineConfig(model=os.environ.get("MODEL_NAME") or None))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rates = []
    for prompt in PROMPTS[:4]:
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=4, do_sample=False)  # warm-up
            start = time.perf_counter()
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            elapsed = time.perf_counter() - start
        rates.append((out.shape[1] - inputs["input_ids"].shape[1]) / elapsed)
    del model
    return statistics.median(rates), str(folder)


def start_gateway(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "openai_compat.server", "--port", str(port)], cwd=ROOT,
                               env={**os.environ, "LOG_LEVEL": "WARNING", **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "gateway ready" in line:
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, f"http://127.0.0.1:{port}/openai/v1"
    raise SystemExit(f"gateway failed to start (exit {process.wait()})")


async def drive(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=900, max_retries=0)
    ttfts: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    next_index = 0

    async def one(index: int) -> None:
        start = time.perf_counter()
        first = None
        usage = None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
                max_tokens=max_tokens, temperature=0.0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
                if chunk.usage is not None:
                    usage = chunk.usage
            if first is None or usage is None or usage.completion_tokens != max_tokens:
                errors.append(f"request {index}: incomplete stream")
                return
            ttfts.append(first)
            tokens.append(usage.completion_tokens)
        except Exception as exc:  # counted and reported, the run goes on
            errors.append(f"request {index}: {exc!r}"[:200])

    async def worker() -> None:
        nonlocal next_index
        while next_index < requests:
            index = next_index
            next_index += 1
            await one(index)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    ordered = sorted(ttfts)
    return {
        "concurrency": concurrency, "requests": requests, "output_tokens": sum(tokens), "wall_s": round(wall, 2),
        "tok_s": round(sum(tokens) / wall, 1),
        "ttft_p50_s": round(statistics.median(ordered), 3) if ordered else None,
        "ttft_p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3) if ordered else None,
        "errors": len(errors), "first_error": errors[:1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = concurrency x rounds")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateway (e.g. DTYPE=bfloat16)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    env = dict(item.split("=", 1) for item in args.env)

    base, folder = baseline_tok_s(args.max_tokens, int(env["TORCH_NUM_THREADS"]) if "TORCH_NUM_THREADS" in env
                                  else None)
    print(f"baseline (model.generate, batch 1, {args.max_tokens} tokens): {base:.1f} tok/s  [{folder}]", flush=True)
    process, url = start_gateway(env)
    try:
        model_id = json.loads(__import__("urllib.request").request.urlopen(f"{url}/models").read())["data"][0]["id"]
        asyncio.run(drive(url, model_id, 1, 1, 8))  # warm-up
        results = []
        for level in levels:
            result = asyncio.run(drive(url, model_id, level, level * args.rounds, args.max_tokens))
            result["ratio_to_baseline"] = round(result["tok_s"] / base, 2)
            results.append(result)
            print(f"  concurrency {level:>3}: {result['tok_s']:7.1f} tok/s  ttft p50 {result['ttft_p50_s']} s  "
                  f"p95 {result['ttft_p95_s']} s  errors {result['errors']}", flush=True)
    finally:
        process.terminate()
        process.wait(timeout=30)

    print()
    print(f"| streams | output tok/s | TTFT p50 | TTFT p95 | vs model.generate ({base:.1f} tok/s) | errors |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['concurrency']} | {r['tok_s']:.1f} | {r['ttft_p50_s']:.2f} s | {r['ttft_p95_s']:.2f} s | "
              f"{r['ratio_to_baseline']:.2f}x | {r['errors']} |")
    print(json.dumps({"bench": "throughput", "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                      "max_tokens": args.max_tokens, "gateway_env": env, "baseline_tok_s": round(base, 1),
                      "levels": results}))


if __name__ == "__main__":
    main()
