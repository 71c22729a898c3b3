"""Speculative decoding: output tokens per second at 1 and 8 streams, without speculation, with n-gram prompt
lookup, and with a draft model (by default the embedded model drafting for itself, a correctness check that
shows the draft's cost), on an echo-heavy task (repeat / lightly edit a given paragraph), greedy.

    .venv/bin/python bench/speculative.py [--streams 1,8] [--max-tokens 48] [--k 4] [--draft MODEL]
                                          [--modes plain,ngram,draft]

Runs the engine in this process (no gateway), one configuration at a time; prints a table (tok/s, ratio to
plain, acceptance = kept / proposed draft tokens) and one JSON line. Each configuration takes well under a
minute on a small CPU.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
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
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft", default=None, help="draft model source (default: the served model itself)")
    parser.add_argument("--modes", default="plain,ngram,draft")
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
    levels = [int(x) for x in args.streams.split(",")]
    rows = []
    for mode in args.modes.split(","):
        spec = specs[mode]
        config = dataclasses.replace(base, speculative=SpeculativeConfig.parse(json.dumps(spec)) if spec else None)
        engine = AsyncEngine(config)

        async def measure():
            await engine.start()
            await run_level(engine, 1, 8)  # warm-up
            before = engine.stats()
            result = {level: await run_level(engine, level, args.max_tokens) for level in levels}
            after = engine.stats()
            proposed = after.get("speculative_proposed_tokens", 0) - before.get("speculative_proposed_tokens", 0)
            accepted = after.get("speculative_accepted_tokens", 0) - before.get("speculative_accepted_tokens", 0)
            return result, proposed, accepted

        result, proposed, accepted = asyncio.run(measure())
        engine.close()
        for level, (rate, tokens) in result.items():
            rows.append({"mode": mode, "streams": level, "tok_s": round(rate, 1), "tokens": tokens,
                         "acceptance": round(accepted / proposed, 3) if proposed else None})
            print(json.dumps(rows[-1]), flush=True)
    plain = {r["streams"]: r["tok_s"] for r in rows if r["mode"] == "plain"}
    print(f"{'mode':<8}{'streams':>8}{'tok/s':>10}{'x plain':>9}{'accept':>8}")
    for r in rows:
        ratio = r["tok_s"] / plain[r["streams"]] if r["streams"] in plain else float("nan")
        accept = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        print(f"{r['mode']:<8}{r['streams']:>8}{r['tok_s']:>10.1f}{ratio:>9.2f}{accept:>8}")
    print(json.dumps({"bench": "speculative", "k": args.k, "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
