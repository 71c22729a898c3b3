"""Soak: many streamed requests with mixed parameters through the gateway; nothing may be lost or cut short.

    .venv/bin/python bench/soak.py [--requests 500] [--concurrency 16] [--url BASE_URL]

Without --url it starts `python -m worker.gateway` itself. Every response must complete: a stream ends
with a finish_reason on every choice and the usage the request asked for; a non-streamed response has a
finish_reason on every choice. Reports failures, throughput and the gateway's resident memory after warm-up
and after the soak (the worker must not grow). Prints one JSON line; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import PROMPTS, start_gateway  # noqa: E402


def request_mix(index: int, model: str) -> tuple[str, dict]:
    """A deterministic variety of requests: chat and completions, streamed or not, and sampling options."""
    rng = random.Random(index)
    prompt = PROMPTS[index % len(PROMPTS)]
    common = {"model": model, "max_tokens": rng.choice([1, 8, 16, 32]), "stream": rng.random() < 0.75}
    options = rng.choice([
        {"temperature": 0},
        {"temperature": 0.8, "top_p": 0.9, "seed": index},
        {"temperature": 1.0, "top_k": 20, "n": 2},
        {"temperature": 0, "stop": [".", "\n"]},
        {"temperature": 0.7, "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"temperature": 0, "ignore_eos": True},
    ])
    body = {**common, **options}
    if common["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.6:
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, 2
        return "chat", {**body, "messages": [{"role": "user", "content": prompt}]}
    if rng.random() < 0.3:
        body["logprobs"] = 2
    return "completions", {**body, "prompt": prompt}


async def _one(client, kind: str, body: dict) -> str | None:
    """None when the response is complete, else what is wrong with it."""
    body = dict(body)
    extra = {k: body.pop(k) for k in ("top_k", "ignore_eos") if k in body}
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    n = body.get("n", 1)
    if not body.get("stream"):
        response = await create(**body, extra_body=extra or None)
        if len(response.choices) != n or any(c.finish_reason not in ("stop", "length") for c in response.choices):
            return f"incomplete response: {response.model_dump_json()[:200]}"
        return None
    finished: dict[int, str] = {}
    usage = None
    stream = await create(**body, extra_body=extra or None)
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    if sorted(finished) != list(range(n)) or any(r not in ("stop", "length") for r in finished.values()):
        return f"stream ended without finish_reason on every choice: {finished}"
    if body.get("stream_options", {}).get("include_usage") and usage is None:
        return "stream ended without the usage chunk"
    return None


async def soak(base_url: str, requests: int, concurrency: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    failures: list[str] = []
    next_index = 0
    started = time.perf_counter()

    async def worker():
        nonlocal next_index
        while next_index < requests:
            index = next_index
            next_index += 1
            kind, body = request_mix(index, model)
            try:
                problem = await _one(client, kind, body)
            except Exception as exc:  # counted as a failure with its request
                problem = repr(exc)[:200]
            if problem:
                failures.append(f"request {index} ({kind}): {problem}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return {"requests": requests, "concurrency": concurrency, "failures": len(failures),
            "first_failures": failures[:3], "wall_s": round(time.perf_counter() - started, 1)}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--url", default=None, help="an already running gateway (memory is then not measured)")
    args = parser.parse_args()
    process = None
    url = args.url
    if url is None:
        process, url = start_gateway({})
    try:
        warm = asyncio.run(soak(url, 2 * args.concurrency, args.concurrency))
        before = rss_mb(process.pid) if process else None
        result = asyncio.run(soak(url, args.requests, args.concurrency))
        after = rss_mb(process.pid) if process else None
    finally:
        if process:
            process.terminate()
            process.wait(timeout=30)
    result["warmup_failures"] = warm["failures"]
    if before is not None:
        result.update(rss_after_warmup_mb=round(before), rss_after_soak_mb=round(after),
                      rss_growth_pct=round(100 * (after - before) / before, 1))
    print(json.dumps({"bench": "soak", **result}))
    grew = result.get("rss_growth_pct", 0) > 10
    sys.exit(1 if result["failures"] or warm["failures"] or grew else 0)


if __name__ == "__main__":
    main()
