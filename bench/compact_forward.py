"""The compact forward (engine/compact_decoder.py) against the model's own, in one process and taking turns, so
that machine drift falls on both alike: the median time of one decode step at fixed batch sizes, then streaming
throughput at several concurrency levels.

    .venv/bin/python bench/compact_forward.py [--levels 1,8,16,32] [--rounds 3] [--tokens 96] [--rows 1,8,32]

Runs the embedded model (or MODEL and the other settings from the environment, as the worker does); greedy
decoding with ignore_eos, so every stream decodes --tokens tokens. Needs a model the compact forward serves.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import handler  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.runner import DecodeRow, PrefillChunk  # noqa: E402


async def _stream(engine, request_id: str, prompt: list[int], tokens: int) -> int:
    count = 0
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async for output in engine.generate(request_id, prompt, params):
        count += sum(len(delta.token_ids) for delta in output.deltas)
    return count


async def _throughput(engine, prompts: list[list[int]], streams: int, tokens: int) -> float:
    start = time.perf_counter()
    counts = await asyncio.gather(*(_stream(engine, f"bench-{time.time()}-{i}", prompts[i % len(prompts)], tokens)
                                    for i in range(streams)))
    return sum(counts) / (time.perf_counter() - start)


def _step_times(runner, rows: int, steps: int, context: int = 100, first_block: int = 64) -> list[float]:
    """Decode steps of `rows` sequences of `context` tokens each (their prompts computed first)."""
    per_row = -(-(context + 1) // 16)
    decodes = []
    for i in range(rows):
        blocks = list(range(first_block + i * per_row, first_block + (i + 1) * per_row))
        runner.execute([], [PrefillChunk([10 + i] * context, 0, blocks, "none")])
        decodes.append(DecodeRow(7, context, blocks))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.execute(decodes, [])
        times.append(time.perf_counter() - start)
    return times


def _in_own_thread(fn, *args):
    """Run `fn` on a thread that ends with it. A long-lived second thread that has run a parallel torch operation
    keeps an OpenMP team, and with more OpenMP threads than CPUs libgomp stops spinning between parallel regions:
    the engine's thread then decodes up to 2x slower (measured), and so would this one. A thread's team goes
    when the thread ends."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    thread.join()
    return result[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8,16,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rows", default="1,8,32")
    args = parser.parse_args()

    worker = handler.get_worker()
    asyncio.run(worker.engine.start())
    runner = worker.engine.engine.runner
    compact = runner.compact
    if compact is None:
        raise SystemExit(f"this model runs its own forward ({runner.compact_reason}): nothing to compare")
    sides = {"own": None, "compact": compact}
    tokenizer = worker.engine.tokenizer
    prompts = [tokenizer.encode(f"Write story number {i} about a robot who learns to paint.") for i in range(64)]

    async def throughput() -> None:
        await _throughput(worker.engine, prompts, 8, 8)  # warm-up
        print("| load | model's own forward | compact forward | ratio |\n|---|---:|---:|---:|")
        for streams in (int(n) for n in args.levels.split(",") if n):
            best = {name: 0.0 for name in sides}
            for _ in range(args.rounds):
                for name, decoder in sides.items():
                    runner.compact = decoder
                    best[name] = max(best[name], await _throughput(worker.engine, prompts, streams, args.tokens))
            print(f"| {streams} streams | {best['own']:.1f} tok/s | {best['compact']:.1f} tok/s | "
                  f"{best['compact'] / best['own']:.2f}x |", flush=True)

    try:
        print("| decode step | model's own forward | compact forward | ratio |\n|---|---:|---:|---:|")
        for rows in (int(n) for n in args.rows.split(",") if n):
            times = {name: [] for name in sides}
            for _ in range(6):
                for name, decoder in sides.items():
                    runner.compact = decoder
                    times[name] += _in_own_thread(_step_times, runner, rows, 25)
            own, fast = (statistics.median(times[name]) * 1e3 for name in sides)
            print(f"| {rows} rows | {own:.1f} ms | {fast:.1f} ms | {own / fast:.2f}x |", flush=True)
        print()
        asyncio.run(throughput())
    finally:
        runner.compact = compact
        worker.engine.close()


if __name__ == "__main__":
    main()
