"""LoRA adapters' cost: decode time per step at 1 and 16 streams with 0, 1 and 4 distinct rank-16 adapters in the
batch (every projection of every layer adapted), against the base alone (LoRA off) in the same run, on the
embedded model as it is served by default (DTYPE=auto: from its GGUF blocks where they win).

    .venv/bin/python bench/lora.py [--streams 1,16] [--max-tokens 48] [--rank 16] [--repeats 2]

The adapters are random (written here in PEFT's format). A step's time is the decode phase's wall time over its
engine steps (from the moment every stream has its first token to the last token). Prints a table and one JSON
line.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUESTIONS = ["Tell me about the history of Rome.", "How do rivers form?", "Describe a good breakfast.",
             "What makes a story interesting?"]


def write_adapter(model, folder: Path, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of every projection of `model`."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in TARGETS and isinstance(module, torch.nn.Linear):
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) \
                / module.in_features ** 0.5
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) \
                * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}))


async def step_time(engine, streams: int, adapters: list[str | None], max_tokens: int) -> float:
    """Seconds per decode step with `streams` streams, stream i using adapters[i % len(adapters)]."""
    from engine import SamplingParams

    tok = engine.tokenizer
    loop = engine.engine
    firsts = 0
    marks: dict[str, tuple[float, int]] = {}

    async def one(i: int) -> None:
        nonlocal firsts
        ids = tok.encode(tok.render_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]),
                         add_special_tokens=False)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                lora_name=adapters[i % len(adapters)])
        first = True
        async for output in engine.generate(f"bench-{streams}-{i}-{time.monotonic_ns()}", ids, params):
            if first and any(d.token_ids for d in output.deltas):
                first = False
                firsts += 1
                if firsts == streams:
                    marks["start"] = (time.perf_counter(), loop.steps)
        marks["end"] = (time.perf_counter(), loop.steps)

    await asyncio.gather(*(one(i) for i in range(streams)))
    (t0, s0), (t1, s1) = marks["start"], marks["end"]
    return (t1 - t0) / max(1, s1 - s0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every case; the fastest counts")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from engine import AsyncEngine, EngineConfig
    from engine.loader import model_folder
    from engine.lora import LoraConfig, LoraSpec

    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    shapes = AutoModelForCausalLM.from_pretrained(model_folder(EngineConfig()), dtype=torch.float32)
    names = [f"a{i}" for i in range(4)]
    for i, name in enumerate(names):
        write_adapter(shapes, folder / name, args.rank, seed=i)
    del shapes
    levels = [int(x) for x in args.streams.split(",")]
    # One start-up cache for both engines: the LoRA engine takes the base engine's probe verdicts (weights' type,
    # GGUF blocks, layouts), so the two serve the base through the same products.
    base = EngineConfig(max_model_len=1024, kv_cache_memory=256 * 2**20, max_num_seqs=max(levels),
                        startup_cache=True, cache_dir=folder / "cache")
    lora = LoraConfig(modules=tuple(LoraSpec(n, str(folder / n)) for n in names), max_loras=4,
                      max_lora_rank=args.rank)
    configs = {"off": base, "on": dataclasses.replace(base, lora=lora)}
    cases = [("base (LoRA off)", "off", [None]), ("0 adapters", "on", [None]), ("1 adapter", "on", names[:1]),
             ("4 adapters", "on", names)]
    results: dict[tuple[str, int], float] = {}

    async def measure():
        # One engine alive at a time: an idle engine's thread keeps its OpenMP team, and while a process holds more
        # OpenMP threads than cores, libgomp makes every team sleep at its barriers instead of spinning, which
        # slowed the measured engine's steps up to 2x. The engines take turns round after round (the fastest round
        # counts), so a change in the machine's load touches every case alike; the first start writes the probe
        # verdicts every later one reads.
        for _ in range(args.repeats):
            for which, config in configs.items():
                engine = AsyncEngine(config)
                await engine.start()
                await step_time(engine, 2, [None] if which == "off" else names[:2], 4)  # warm-up
                for level in levels:
                    for label, owner, adapters in cases:
                        if owner != which or len(adapters) > level:
                            continue
                        seconds = await step_time(engine, level, adapters, args.max_tokens)
                        results[(label, level)] = min(seconds, results.get((label, level), seconds))
                        print(json.dumps({"case": label, "streams": level, "ms_per_step": round(seconds * 1000, 2)}),
                              flush=True)
                engine.close()
    asyncio.run(measure())
    print(f"{'case':<18}{'streams':>8}{'ms/step':>10}{'x base':>8}")
    rows = []
    for (label, level), seconds in sorted(results.items(), key=lambda item: item[0][1]):
        ratio = seconds / results[("base (LoRA off)", level)]
        rows.append({"case": label, "streams": level, "ms_per_step": round(seconds * 1000, 2),
                     "x_base": round(ratio, 3)})
        print(f"{label:<18}{level:>8}{seconds * 1000:>10.2f}{ratio:>8.2f}")
    print(json.dumps({"bench": "lora", "rank": args.rank, "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
