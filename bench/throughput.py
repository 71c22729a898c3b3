"""Streaming throughput of the worker's gateway against plain `model.generate`, in one run.

    .venv/bin/python bench/throughput.py [--model FOLDER] [--levels 1,4,8,16] [--long-levels 4] [--prefill]
                                         [--long-words 1000] [--max-tokens 64] [--rounds 2] [--env KEY=VALUE ...]

1. Baseline: transformers' `model.generate`, batch 1, greedy, `--max-tokens` new tokens, on the same model in
   this process (stock attention and cache), over the same prompts.
2. Starts `python -m worker.gateway` on a free port and drives streaming chat requests through the
   official `openai` client (greedy, `ignore_eos`, `--max-tokens` tokens each, usage from include_usage) at
   each concurrency level: a closed loop of `concurrency x rounds` requests.
3. The long-document load: each request carries its own ~1300-token document (`--long-words`), at each of
   `--long-levels`, `--long-requests` requests per level.
With `--base-url` the same loads drive another running OpenAI-compatible server (vLLM's, say) instead of the
gateway, so that two servers are measured one after the other in one sitting.
`--model` serves that model (MODEL_NAME: a local folder such as a bfloat16 checkpoint) in both, instead of the
embedded one; with `--base-url` it only names the weights whose bytes are counted.
Prints the machine's own ceilings (torch's matmul GFLOP/s in float32 and bfloat16, VDPBF16PS's rate, copy and
read GB/s), a table (aggregate output tok/s, TTFT p50/mean/p95, ratio to the baseline) and one JSON line. For a
local safetensors model it also prints the weights a decode step reads per token (every linear weight, the output
head included, once) and the bytes per second that 1 stream reads them at, as a share of the read ceiling, and
(with `--prefill`) the rate one long prompt is read at alone (prompt tokens / time to first token, best of 3):
its multiply-adds per second (every decoder linear weight once per prompt token, plus attention over the tokens
before) as a share of the ceiling of the model's type (bfloat16: the larger of torch.mm's and VDPBF16PS's).
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
    process = subprocess.Popen([sys.executable, "-m", "worker.gateway", "--port", str(port)], cwd=ROOT,
                               env={**os.environ, "LOG_LEVEL": "WARNING", **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "gateway ready" in line:
            threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
            return process, f"http://127.0.0.1:{port}/openai/v1"
    raise SystemExit(f"gateway failed to start (exit {process.wait()})")


FILLER = ("the river carried old boats past the mill while farmers argued about rain prices and the school bell "
          "rang twice before noon as children ran across the square to the bakery ").split()


def long_document_prompt(index: int, words: int) -> str:
    """A prompt with its own long document (~1.3 tokens a word): no two share more than a few leading tokens,
    so the prefix cache cannot shortcut the prefill (a RAG-like load)."""
    body = " ".join(FILLER[(index * 7 + k) % len(FILLER)] for k in range(words))
    return f"Document {index * 7919 % 10007}: {body}\n\nQuestion: {PROMPTS[index % len(PROMPTS)]}"


def weight_bytes_per_token(folder: str | Path) -> int:
    """The bytes of weights one decode step reads from a safetensors folder: every tensor once (the output head
    included, the input embeddings only where the head is tied to them: a lookup reads one row)."""
    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    sizes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                count = 1
                for dim in piece.get_shape():
                    count *= dim
                sizes[name] = count * {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I16": 2, "I32": 4,  # GPTQ/AWQ's packed
                                       "I64": 8}.get(piece.get_dtype(), 1)  # words are I32
    tied = config.get("tie_word_embeddings", False) and not any("lm_head" in n for n in sizes)
    return sum(size for name, size in sizes.items() if tied or "embed_tokens" not in name)


def machine_ceilings(threads: int | None) -> dict:
    """This machine's own limits, so every report carries the ceiling it is measured against: torch's matmul
    GFLOP/s in float32 and bfloat16, VDPBF16PS's own rate on every thread (where the CPU kernels have the bfloat16
    product; torch.mm's bfloat16 rate stays well under it on AVX512_BF16 without AMX), memory copy GB/s (read +
    write) and read GB/s (a sum over 768 MB: what a decode step does to its weights)."""
    import torch

    from engine.cpu import native_kernels
    from engine.cpu.layout import best_time as best

    if threads:
        torch.set_num_threads(threads)

    n = 2048
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        out[f"matmul_{name}_gflops"] = round(2 * n ** 3 / best(lambda: torch.mm(a, b)) / 1e9, 1)
    native_kernels.load()
    kernels = native_kernels.active()
    if kernels is not None and kernels.bf16_linear_supported():
        out["vdpbf16ps_gflops"] = round(kernels.bf16_peak_gflops(0.3), 1)
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    out["copy_gb_s"] = round(2 * src.numel() * 4 / best(lambda: dst.copy_(src)) / 1e9, 1)
    big = torch.ones(192 * 2**20, dtype=torch.float32)
    out["read_gb_s"] = round(big.numel() * 4 / best(lambda: big.sum()) / 1e9, 1)
    return out


def bfloat16_ceiling(ceilings: dict) -> float:
    """The bfloat16 products' limit: the larger of torch.mm's rate and VDPBF16PS's."""
    return max(ceilings.get("matmul_bfloat16_gflops", 0.0), ceilings.get("vdpbf16ps_gflops", 0.0))


def prefill_flops_per_token(folder: str | Path, prompt_tokens: int) -> float:
    """Floating-point operations a prompt token costs on average in a safetensors model: 2 per decoder linear
    weight (the output head only sees the last position, the embeddings are a lookup), and attention's
    2 x 2 x (the tokens before, on average half the prompt) x the query width per layer."""
    from safetensors import safe_open

    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    config = config.get("text_config", config)
    weights = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                if len(shape) == 2 and "embed_tokens" not in name and "lm_head" not in name:
                    weights += shape[0] * shape[1]
    width = config["num_attention_heads"] * config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 2 * weights + 4 * (prompt_tokens / 2) * width * config["num_hidden_layers"]


async def prefill_rate(base_url: str, model: str, words: int, tries: int = 3) -> tuple[float, int]:
    """(prompt tokens per second, prompt tokens) of one long prompt alone, each try a different document (so no
    prefix is cached), the fastest try: its time to the first token covers the whole prompt's forward."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=900, max_retries=0)
    best, tokens = 0.0, 0
    for index in range(tries):
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": long_document_prompt(1000 + index, words)}],
            max_tokens=1, temperature=0.0, stream=True, stream_options={"include_usage": True})
        first, usage = None, None
        async for chunk in stream:
            if first is None and chunk.choices:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                usage = chunk.usage
        tokens = usage.prompt_tokens
        best = max(best, tokens / first)
    await client.close()
    return best, tokens


async def drive(base_url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                long_words: int = 0, long_every: int = 1) -> dict:
    """A closed loop of `requests` streaming chats at `concurrency`. With `long_words`, every `long_every`-th
    request carries its own long document (1: all of them; 8: a few long prompts among many short ones)."""
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
                model=model, messages=[{"role": "user", "content": long_document_prompt(index, long_words)
                                        if long_words and index % long_every == 0
                                        else PROMPTS[index % len(PROMPTS)]}],
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
        "concurrency": concurrency, "long_words": long_words, "long_every": long_every, "requests": requests, "output_tokens": sum(tokens), "wall_s": round(wall, 2),
        "tok_s": round(sum(tokens) / wall, 1),
        "ttft_p50_s": round(statistics.median(ordered), 3) if ordered else None,
        "ttft_p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3) if ordered else None,
        "ttft_mean_s": round(statistics.fmean(ordered), 3) if ordered else None,
        "errors": len(errors), "first_error": errors[:1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="serve this model folder (MODEL_NAME) instead of the embedded model")
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("--long-levels", default="4",
                        help="concurrency levels of the long-document load ('' to skip)")
    parser.add_argument("--long-words", type=int, default=1000, help="words of each long document")
    parser.add_argument("--long-requests", type=int, default=8, help="requests per long-document level")
    parser.add_argument("--mixed-levels", default="16",
                        help="levels of the mixed load: one request in 8 carries a ~2000-token document")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per level = concurrency x rounds")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateway (e.g. DTYPE=bfloat16)")
    parser.add_argument("--no-baseline", action="store_true", help="skip model.generate and the ceilings")
    parser.add_argument("--prefill", action="store_true",
                        help="also measure one long prompt's rate alone against the matmul ceiling")
    parser.add_argument("--base-url", help="drive this running OpenAI-compatible server (e.g. vLLM's, "
                        "http://127.0.0.1:8100/v1) with the same loads instead of starting the gateway")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x]
    long_levels = [int(x) for x in args.long_levels.split(",") if x]
    mixed_levels = [int(x) for x in args.mixed_levels.split(",") if x]
    env = dict(item.split("=", 1) for item in args.env)
    if args.model:
        env["MODEL_NAME"] = os.environ["MODEL_NAME"] = args.model
    threads = int(env["TORCH_NUM_THREADS"]) if "TORCH_NUM_THREADS" in env else None

    base, folder, ceilings = 0.0, "", {}
    if not args.no_baseline:
        ceilings = machine_ceilings(threads)
        print(f"machine: {ceilings['matmul_float32_gflops']} GFLOP/s float32 matmul, "
              f"{ceilings['matmul_bfloat16_gflops']} GFLOP/s bfloat16 matmul, "
              f"{ceilings.get('vdpbf16ps_gflops', '-')} GFLOP/s VDPBF16PS, {ceilings['copy_gb_s']} GB/s copy "
              f"(read + write), {ceilings['read_gb_s']} GB/s read, torch {__import__('torch').get_num_threads()} "
              f"threads", flush=True)
        base, folder = baseline_tok_s(args.max_tokens, threads)
        print(f"baseline (model.generate, batch 1, {args.max_tokens} tokens): {base:.1f} tok/s  [{folder}]",
              flush=True)
    process, url = (None, args.base_url.rstrip("/")) if args.base_url else start_gateway(env)
    runs = [(level, level * args.rounds, 0, 1) for level in levels]
    runs += [(level, args.long_requests, args.long_words, 1) for level in long_levels]
    runs += [(level, level * args.rounds, 1500, 8) for level in mixed_levels]
    try:
        model_id = json.loads(__import__("urllib.request").request.urlopen(f"{url}/models").read())["data"][0]["id"]
        asyncio.run(drive(url, model_id, 1, 1, 8))  # warm-up
        results = []
        for level, requests, words, every in runs:
            result = asyncio.run(drive(url, model_id, level, requests, args.max_tokens, words, every))
            result["ratio_to_baseline"] = round(result["tok_s"] / base, 2) if base else None
            results.append(result)
            print(f"  concurrency {level:>3}{f' long {words} words every {every}' if words else ''}: "
                  f"{result['tok_s']:7.1f} tok/s  "
                  f"ttft p50 {result['ttft_p50_s']} s  mean {result['ttft_mean_s']} s  errors {result['errors']}",
                  flush=True)
        prefill = asyncio.run(prefill_rate(url, model_id, args.long_words)) if args.prefill else None
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)

    model_dir = Path(os.environ.get("MODEL_NAME") or folder or "/nonexistent")
    weight_bytes = weight_bytes_per_token(model_dir) if any(model_dir.glob("*.safetensors")) else 0
    single = next((r for r in results if r["concurrency"] == 1 and not r["long_words"]), None)
    if weight_bytes and single:
        read = weight_bytes * single["tok_s"] / 1e9
        share = f", {read / ceilings['read_gb_s']:.0%} of the read ceiling" if ceilings else ""
        print(f"1 stream reads {weight_bytes / 1e6:.0f} MB of weights a token: {read:.1f} GB/s{share}")
    prefill_report = None
    if prefill is not None:
        rate, prompt_tokens = prefill
        prefill_report = {"prompt_tokens": prompt_tokens, "tok_s": round(rate, 1)}
        line = f"one {prompt_tokens}-token prompt alone: {rate:.1f} prompt tok/s"
        if any(model_dir.glob("*.safetensors")):
            gflops = rate * prefill_flops_per_token(model_dir, prompt_tokens) / 1e9
            config = json.loads((model_dir / "config.json").read_text())
            dtype = config.get("torch_dtype") or config.get("dtype")
            ceiling = bfloat16_ceiling(ceilings) if dtype == "bfloat16" else ceilings.get("matmul_float32_gflops")
            prefill_report["gflops"] = round(gflops, 1)
            line += f" = {gflops:.1f} GFLOP/s" + (f", {gflops / ceiling:.0%} of the {dtype or 'float32'} matmul "
                                                  f"ceiling" if ceiling else "")
        print(line)
    print()
    print(f"| load | output tok/s | TTFT p50 | TTFT mean | TTFT p95 | vs model.generate ({base:.1f} tok/s) | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        load = f"{r['concurrency']} streams" + (
            "" if not r["long_words"] else f", {r['long_words']}-word documents" if r["long_every"] == 1
            else f", 1 in {r['long_every']} with a {r['long_words']}-word document")
        ratio = f"{r['ratio_to_baseline']:.2f}x" if r["ratio_to_baseline"] else "-"
        print(f"| {load} | {r['tok_s']:.1f} | {r['ttft_p50_s']:.2f} s | {r['ttft_mean_s']:.2f} s | "
              f"{r['ttft_p95_s']:.2f} s | {ratio} | {r['errors']} |")
    print(json.dumps({"bench": "throughput", "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                      "ceilings": ceilings, "max_tokens": args.max_tokens, "server": args.base_url or "gateway",
                      "gateway_env": env,
                      "baseline_tok_s": round(base, 1), "weight_bytes_per_token": weight_bytes,
                      "prefill": prefill_report,
                      "levels": results}))


if __name__ == "__main__":
    main()
