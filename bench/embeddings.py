"""Embedding throughput through the gateway: many inputs in one request (batched forward passes) against the
same inputs one request at a time, and the effect of embedding load on a running generation stream.

    .venv/bin/python bench/embeddings.py [--inputs 64] [--env KEY=VALUE ...]

Starts `python -m worker.gateway` on a free port (the embedded model unless MODEL_NAME is given) and
prints inputs/s for both modes, then a stream's decode tok/s alone and while embeddings requests run, and one
JSON line with the numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

SENTENCES = [
    "The capital of France is Paris.", "Bananas are yellow and rich in potassium.",
    "A bicycle converts pedalling into forward motion through a chain.", "Cats purr when they are content.",
    "The stock market fell sharply on Tuesday after the announcement.", "Jupiter is the largest planet.",
    "Sourdough bread rises with wild yeast and lactic bacteria.", "Penguins live in the southern hemisphere.",
]


async def stream_tok_s(client, model: str, tokens: int) -> float:
    first = None
    count = 0
    async for chunk in await client.completions.create(model=model, prompt="Once upon a time", max_tokens=tokens,
                                                       temperature=0, stream=True,
                                                       extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            count += 1
            first = first or time.perf_counter()
    return (count - 1) / (time.perf_counter() - first) if first and count > 1 else 0.0  # decode rate after TTFT


async def measure(url: str, inputs: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    texts = [SENTENCES[i % len(SENTENCES)] + f" ({i})" for i in range(inputs)]
    await client.embeddings.create(model=model, input=texts[:4])  # warm-up

    started = time.perf_counter()
    await client.embeddings.create(model=model, input=texts)
    batched = inputs / (time.perf_counter() - started)

    started = time.perf_counter()
    for text in texts:
        await client.embeddings.create(model=model, input=text)
    sequential = inputs / (time.perf_counter() - started)

    alone = await stream_tok_s(client, model, 32)
    stream = asyncio.create_task(stream_tok_s(client, model, 32))
    while not stream.done():
        await client.embeddings.create(model=model, input=texts[:16])
    return {"inputs": inputs, "batched_inputs_per_s": round(batched, 1),
            "one_per_request_inputs_per_s": round(sequential, 1), "stream_tok_s_alone": round(alone, 1),
            "stream_tok_s_with_embeddings": round(stream.result(), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateway")
    args = parser.parse_args()
    from conftest import start_gateway

    env = dict(item.split("=", 1) for item in args.env)
    process, url = start_gateway(env)
    try:
        result = asyncio.run(measure(url, args.inputs))
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(f"{result['inputs']} inputs: {result['batched_inputs_per_s']} inputs/s in one request, "
          f"{result['one_per_request_inputs_per_s']} inputs/s one per request")
    print(f"stream decode: {result['stream_tok_s_alone']} tok/s alone, "
          f"{result['stream_tok_s_with_embeddings']} tok/s while embeddings requests run")
    print(json.dumps({"bench": "embeddings", "cpu_count": os.cpu_count(), **result}))


if __name__ == "__main__":
    main()
