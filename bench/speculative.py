"""Speculative decoding: output tokens per second at 1, 8, 16 and 32 streams, without speculation, with n-gram
prompt lookup, and with a draft model (by default the embedded model drafting for itself, a correctness check that
shows the draft's cost), on an echo-heavy task (repeat / lightly edit a given paragraph), greedy. Each proposer
runs adaptive (the default: engine/core/speculation_control.py) and fixed (`-fixed`: every step speculates).

    .venv/bin/python bench/speculative.py [--streams 1,8,16,32] [--max-tokens 48] [--k 4] [--draft MODEL]
                                          [--modes plain,ngram,ngram-fixed,draft,draft-fixed]
                                          [--rounds 3]

Runs the engines in this process (no gateway), one at a time and taking turns; prints a table (tok/s, ratio to
plain, acceptance = kept / proposed draft tokens) and one JSON line. Each configuration takes well under a
minute on a small CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
             "the members agreed to fund the children's reading room, the study hall and the repair of the old "
             "roof, and to postpone the purchase of new computers until next spring.")
TASKS = [
    f"Repeat the following paragraph exactly:\n\n{PARAGRAPH}",
    f"Rewrite the following paragraph, changing Tuesday to Friday and nothing else:\n\n{PARAGRAPH}",
    f"Copy this text word for word:\n\n{PARAGRAPH}",
    f"Repeat this paragraph, replacing 'library' with 'museum':\n\n{PARAGRAPH}",
]


async def run_level(engine, streams: int, max_tokens: int) -> tuple[float, int]:
    from engine import SamplingParams
    tok = engine.tokenizer
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": TASKS[i % len(TASKS)]}]),
                          add_special_tokens=False) for i in range(streams)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i, ids):
        count = 0
        async for output in engine.generate(f"bench-{streams}-{i}-{time.monotonic_ns()}", ids, params):
            count += sum(len(d.token_ids) for d in output.deltas)
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return sum(counts) / (time.perf_counter() - started), sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="1,8,16,32")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--draft", default=None, help="draft model source (default: the served model itself)")
    parser.add_argument("--modes", default="plain,ngram,ngram-fixed,draft,draft-fixed")
    args = parser.parse_args()
    os.environ.setdefault("DTYPE", "float32")

    from engine import AsyncEngine
    from engine.loader import model_folder
    from engine.core.speculative import SpeculativeConfig
    from worker.settings import load_settings

    base = load_settings().engine_config()
    specs = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                  "prompt_lookup_min": 2},
        "draft": {"model": args.draft or str(model_folder(base)), "num_speculative_tokens": args.k},
    }
    # The same proposers with the load switch and draft lengths off: every step speculates, k guesses each.
    specs["ngram-fixed"] = {**specs["ngram"], "adaptive": False}
    specs["draft-fixed"] = {**specs["draft"], "adaptive": False}
    levels = [int(x) for x in args.streams.split(",")]
    configs = {mode: dataclasses.replace(base, speculative=SpeculativeConfig.parse(json.dumps(specs[mode]))
                                         if specs[mode] else None) for mode in args.modes.split(",")}

    def counters(engine) -> tuple[int, int]:
        stats = engine.stats()
        return stats.get("speculative_proposed_tokens", 0), stats.get("speculative_accepted_tokens", 0)

    async def measure() -> list[dict]:
        # One engine alive at a time: an idle engine's thread keeps its OpenMP team, and while a process holds more
        # OpenMP threads than cores, libgomp makes every team sleep at its barriers instead of spinning (up to 2x
        # slower steps). Modes take turns each round, each from a fresh start through every level, so a change in
        # the machine's load falls on all of them; a level's figure is its median over the rounds.
        rates: dict[tuple[str, int], list[float]] = {}
        counts: dict[tuple[str, int], list[int]] = {}
        for _ in range(args.rounds):
            for mode, config in configs.items():
                engine = AsyncEngine(config)
                await engine.start()
                await run_level(engine, 1, 8)  # warm-up
                for level in levels:
                    before = counters(engine)
                    rate, _tokens = await run_level(engine, level, args.max_tokens)
                    after = counters(engine)
                    rates.setdefault((mode, level), []).append(rate)
                    proposed, accepted = counts.setdefault((mode, level), [0, 0])
                    counts[(mode, level)] = [proposed + after[0] - before[0], accepted + after[1] - before[1]]
                engine.close()
        rows = []
        for mode in configs:
            for level in levels:
                proposed, accepted = counts[(mode, level)]
                rows.append({"mode": mode, "streams": level,
                             "tok_s": round(statistics.median(rates[(mode, level)]), 1),
                             "acceptance": round(accepted / proposed, 3) if proposed else None})
                print(json.dumps(rows[-1]), flush=True)
        return rows

    rows = asyncio.run(measure())
    plain = {r["streams"]: r["tok_s"] for r in rows if r["mode"] == "plain"}
    print(f"{'mode':<13}{'streams':>8}{'tok/s':>10}{'x plain':>9}{'accept':>8}")
    for r in rows:
        ratio = r["tok_s"] / plain[r["streams"]] if r["streams"] in plain else float("nan")
        accept = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        print(f"{r['mode']:<13}{r['streams']:>8}{r['tok_s']:>10.1f}{ratio:>9.2f}{accept:>8}")
    print(json.dumps({"bench": "speculative", "k": args.k, "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
