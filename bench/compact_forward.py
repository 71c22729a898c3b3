"""The compact forward (engine/executor/compact_decoder.py), with and without the native CPU kernels
(engine/cpu/native_kernels.py) and the block product of GGUF weights (engine/cpu/quantized_weights.py), against the
model's own forward, in one process and taking turns, so that machine drift falls on all alike: the median time
of one decode step at fixed batch sizes, then streaming throughput at several concurrency levels. Sides: the
model's own forward without the kernels, the compact forward without them, the compact forward through them
(where they built here), and that with the linear layers multiplying from their GGUF blocks (where the model's
weights are exact blocks and the product won its probe at load): with float32 activations, and where the
blocks took 16-bit integer activations at load (DTYPE=auto, AVX512_VNNI), with those too.

    .venv/bin/python bench/compact_forward.py [--levels 1,8,16,32] [--rounds 3] [--tokens 96] [--rows 1,8,32]

Runs the embedded model (or MODEL and the other settings from the environment, as the worker does); greedy
decoding with ignore_eos, so every stream decodes --tokens tokens. Needs a model the compact forward serves.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import threading
import time
from pathlib import Path

import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from worker import handler  # noqa: E402
from engine import SamplingParams  # noqa: E402
from engine.cpu import native_kernels
from engine.cpu import quantized_weights
from engine.executor.compact_decoder import CompactDecoder  # noqa: E402
from engine.executor.step import DecodeRow, PrefillChunk  # noqa: E402


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
    # Layers with a block product use it up to `blocks_until` rows: 0 turns it off for a side. Blocks arranged
    # for 16-bit activations get a float32-activation copy for the side before theirs.
    blocks = {m: (m.blocks_until, m.block_format, m.weight_blocks) for m in runner.model.modules()
              if hasattr(m, "weight_blocks")}
    words = any(f in quantized_weights.WORD_FORMATS for _, f, _ in blocks.values())
    # Blocks serving every size are their layers' only weight: the sides without them multiply a float32 copy
    # decoded from the blocks (this benchmark's own, as the layers held before they served from blocks).
    dense = {m: m.dense_forward or functools.partial(F.linear, weight=m.weight.detach(), bias=m.bias) for m in blocks}
    # Packed on a thread that ends, as the kernels' check below (the packing runs parallel operations).
    float_blocks = _in_own_thread(lambda: {m: (64, *m.block_kernels.pack_blocks(m.weight.detach()))
                                           for m in blocks}) if words else blocks  # float32 activations win to 64
    sides = {"model's own": (None, "off", None), "compact": (CompactDecoder(runner.model), "off", None)}
    if compact.kernels is not None:
        sides["compact + kernels"] = (compact, "auto", None)
        if blocks:
            sides["compact + kernels + GGUF blocks"] = (compact, "auto", float_blocks)
            if words:
                sides["... with 16-bit activations"] = (compact, "auto", blocks)
        else:
            print("no block product in use (the weights are not exact GGUF blocks, or it lost its probe)")
    else:
        print(f"native kernels not in use ({native_kernels.reason() or 'the model does not suit them'})")
    tokenizer = worker.engine.tokenizer
    prompts = [tokenizer.encode(f"Write story number {i} about a robot who learns to paint.") for i in range(64)]

    def use(side: str) -> None:
        decoder, kernels, side_blocks = sides[side]
        runner.compact = decoder
        for module in blocks:
            module.blocks_until, module.block_format, module.weight_blocks = (side_blocks or blocks)[module]
            module.dense_forward = dense[module]
            if side_blocks is None:
                module.blocks_until = 0
        # The kernels' load-time check runs parallel operations: on a thread that ends, as the timing below.
        _in_own_thread(native_kernels.load, kernels, runner.dtype)

    def header(first: str) -> None:
        print(f"| {first} | " + " | ".join(sides) + " | ratios to the first |")
        print("|---|" + "---:|" * (len(sides) + 1))

    def row(label: str, values: list[float], unit: str, faster) -> None:
        ratios = ", ".join(f"{faster(values[0], v):.2f}x" for v in values[1:])
        print(f"| {label} | " + " | ".join(f"{v:.1f} {unit}" for v in values) + f" | {ratios} |", flush=True)

    async def throughput() -> None:
        await _throughput(worker.engine, prompts, 8, 8)  # warm-up
        header("load")
        for streams in (int(n) for n in args.levels.split(",") if n):
            best = {name: 0.0 for name in sides}
            for _ in range(args.rounds):
                for name in sides:
                    use(name)
                    best[name] = max(best[name], await _throughput(worker.engine, prompts, streams, args.tokens))
            row(f"{streams} streams", list(best.values()), "tok/s", lambda base, v: v / base)

    try:
        header("decode step")
        for rows in (int(n) for n in args.rows.split(",") if n):
            times = {name: [] for name in sides}
            for _ in range(6):
                for name in sides:
                    use(name)
                    times[name] += _in_own_thread(_step_times, runner, rows, 25)
            row(f"{rows} rows", [statistics.median(t) * 1e3 for t in times.values()], "ms", lambda base, v: base / v)
        print()
        asyncio.run(throughput())
    finally:
        use(list(sides)[-1])
        worker.engine.close()


if __name__ == "__main__":
    main()
