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
    # `two` takes rsLoRA's scaling (alpha / sqrt(r)) and a per-layer alpha
    options = {"one": {}, "two": {"use_rslora": True, "alpha_pattern": {(targets or TARGETS)[-1]: 5}}}
    merged = {name: make_adapter(model, tmp_path / name, seed, targets=targets, **options[name])
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
        if model_type in FAST_FAMILIES:  # the prefix cache is keyed by adapter: the base's blocks are not `one`'s
            stats = engine.engine.stats
            longest = prompts(8)[-1]
            assert run_mixed(engine, [(None, longest)]) == [reference(model, longest)]
            hits = stats()["prefix_cache_hit_tokens"]
            assert run_mixed(engine, [("one", longest)]) == [reference(merged["one"], longest)]
            assert stats()["prefix_cache_hit_tokens"] == hits, "an adapter reused the base's KV blocks"
            assert run_mixed(engine, [("one", longest)]) == [reference(merged["one"], longest)]
            assert stats()["prefix_cache_hit_tokens"] > hits, "the adapter's own prompt missed the prefix cache"
    finally:
        engine.close()
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_adapters_alone_and_mixed_match_peft_merged(model_type, tmp_path, tokenizer_folder):
    check_family(model_type, FAST_FAMILIES[model_type], tmp_path, tokenizer_folder)


@pytest.mark.slow
def test_speculation_and_beam_search_combine_with_adapters(tmp_path, tokenizer_folder):
    """Speculation (the base drafting, the adapter verifying) keeps the adapter's greedy tokens, and beam search
    with an adapter equals transformers' beam search on the merged model (structured outputs: the API test)."""
    import dataclasses

    from engine.core.speculative import SpeculativeConfig

    model = build_model("llama", FAST_FAMILIES["llama"], tmp_path / "base", tokenizer_folder)
    merged = make_adapter(model, tmp_path / "one", 1)
    ids = prompts(9)[1]
    config = EngineConfig(model=str(tmp_path / "base"), dtype="float32", kv_cache_memory=8 * 2**20, max_num_seqs=8,
                          speculative=SpeculativeConfig.parse(json.dumps({"model": str(tmp_path / "base"),
                                                                          "num_speculative_tokens": 3})),
                          lora=LoraConfig(modules=(LoraSpec("one", str(tmp_path / "one")),)))
    engine = AsyncEngine(config)
    try:
        assert run_mixed(engine, [("one", ids), (None, ids)]) == [reference(merged, ids), reference(model, ids)]
        assert engine.engine.stats()["speculative_proposed_tokens"] > 0, "nothing was speculated"
        beams = dataclasses.replace(family_greedy(), n=2, beam_search=True, lora_name="one")
        got = asyncio.run(choice_ids(engine, "beam", ids, beams))
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = merged.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, num_beams=2,
                                   num_return_sequences=2, do_sample=False, early_stopping=False,
                                   length_penalty=1.0, pad_token_id=0)[:, len(ids):].tolist()
        assert got[0] == want[0], (got, want)
    finally:
        engine.close()


@pytest.mark.slow
def test_fallback_path_matches_peft_merged(tmp_path, tokenizer_folder):
    check_family("gptj", FALLBACK_FAMILIES["gptj"], tmp_path, tokenizer_folder,
                 targets=["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"])


def plain_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """Argmax decoding with the model's own forward (its end-of-text token allowed, as ignore_eos lets the engine
    go on past it; transformers' min_new_tokens would mask it instead)."""
    out, past, step = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(new_tokens):
            result = model(input_ids=step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


@pytest.mark.slow
def test_gguf_blocks_with_an_adapter_match_the_dequantized_weights_plus_delta(tmp_path):
    """The embedded GGUF model served from its Q4_1 / Q8_0 blocks, with a rank-16 adapter on every projection:
    greedy tokens equal PEFT's merged model built on the float32 weights the blocks dequantize to."""
    from transformers import AutoModelForCausalLM

    from engine.loader import model_folder
    from engine_helpers import assert_same_greedy, chat_ids, generate, greedy

    base = AutoModelForCausalLM.from_pretrained(model_folder(EngineConfig()), dtype=torch.float32).eval()
    merged = make_adapter(base, tmp_path / "gguf-lora", seed=3, rank=16)
    engine = AsyncEngine(EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=512, max_num_seqs=4, lora=LoraConfig(
        modules=(LoraSpec("g", str(tmp_path / "gguf-lora")),), max_loras=1)))
    try:
        asyncio.run(engine.start())
        assert any(hasattr(m, "weight_blocks") for m in engine.loaded_model.model.modules()), "not served from blocks"
        ids = chat_ids(engine, "Name three rivers of Europe.")
        import dataclasses
        got = asyncio.run(generate(engine, "g", ids, dataclasses.replace(greedy(12), lora_name="g")))
        want = plain_greedy(merged, ids, 12)
        assert want != plain_greedy(base, ids, 12), "the adapter changes nothing"
        assert_same_greedy(got["choices"][0], want)
    finally:
        engine.close()


# ---------------------------------------------------------------- the API, over HTTP


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer_folder):
    """A tiny Llama with adapter `one` from LORA_MODULES (MAX_LORAS=1, MAX_CPU_LORAS=1: swapping adapters reads
    them again from their files) and runtime loading on; `two`, a rank-32 adapter, another base's adapter and a
    corrupt one wait in folders."""
    from conftest import start_gateway, stop_gateway

    root = tmp_path_factory.mktemp("lora-api")
    model = build_model("llama", FAST_FAMILIES["llama"], root / "base", tokenizer_folder)
    merged = {"one": make_adapter(model, root / "one", 1), "two": make_adapter(model, root / "two", 2)}
    make_adapter(model, root / "big", 4, rank=32)
    other = build_model("llama", {**FAST_FAMILIES["llama"], "hidden_size": 32, "head_dim": 8}, root / "other-base",
                        tokenizer_folder)
    make_adapter(other, root / "other", 5)
    make_adapter(model, root / "corrupt", 6)
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    env = {"MODEL_NAME": str(root / "base"), "DTYPE": "float32", "KV_CACHE_MEMORY": str(16 * 2**20),
           "ENABLE_LORA": "true", "LORA_MODULES": f"one={root / 'one'}", "MAX_LORAS": "1", "MAX_CPU_LORAS": "1",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "MAX_NUM_SEQS": "8"}
    process, url = start_gateway(env)
    from openai import AsyncOpenAI, OpenAI
    try:
        yield {"root": root, "model": model, "merged": merged, "url": url, "base": str(root / "base"),
               "client": OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120),
               "async_client": AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)}
    finally:
        stop_gateway(process)


def _complete(client, model: str, ids: list[int]) -> list[int]:
    out = client.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].token_ids


def _post(client, path: str, body: dict):
    import httpx
    return client.post(path, body=body, cast_to=httpx.Response)


@pytest.mark.slow
def test_models_list_the_adapters_with_their_parent(served):
    cards = {m.id: m for m in served["client"].models.list().data}
    assert set(cards) >= {served["base"], "one"}
    assert cards["one"].parent == served["base"] and getattr(cards[served["base"]], "parent", None) is None


@pytest.mark.slow
def test_model_chooses_the_adapter_in_every_generating_api(served):
    client, ids = served["client"], prompts(11)[1]
    assert _complete(client, "one", ids) == reference(served["merged"]["one"], ids)
    assert _complete(client, served["base"], ids) == reference(served["model"], ids)
    messages = [{"role": "user", "content": "Say something."}]
    chat = client.chat.completions.create(model="one", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(served["base"])
    chat_prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False).input_ids
    assert chat.choices[0].token_ids == reference(served["merged"]["one"], chat_prompt, 8)
    text = chat.choices[0].message.content
    response = client.responses.create(model="one", input=messages, max_output_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert response.output_text == text
    import anthropic
    claude = anthropic.Anthropic(base_url=served["url"].removesuffix("/v1"), api_key="unused", max_retries=0)
    message = claude.messages.create(model="one", messages=messages, max_tokens=8, extra_body={"temperature": 0})
    plain = client.chat.completions.create(model="one", messages=messages, max_tokens=8, temperature=0)
    assert message.content[0].text == plain.choices[0].message.content
    choice = client.chat.completions.create(model="one", messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].message.content in ("yes", "no")  # structured outputs with an adapter
    import openai
    with pytest.raises(openai.NotFoundError):
        _complete(client, "nobody", ids)


def _embedding(model, ids: list[int]) -> torch.Tensor:
    """transformers' last-token embedding (the decoder's default pooling), normalized."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden.float(), dim=0)


def test_embeddings_with_an_adapter_equal_the_merged_model(served):
    """`model` names the adapter on /v1/embeddings too: the vectors are the merged model's, and the adapter's and
    the base's inputs batched together each get their own."""
    client, rows = served["client"], prompts(14)[:2]

    async def both():
        from openai import AsyncOpenAI  # its own client: the fixture's belongs to another test's event loop
        async with AsyncOpenAI(base_url=served["url"], api_key="unused", max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(aclient.embeddings.create(model=name, input=rows)
                                          for name in ("one", served["base"], "one")))
    for name, out in zip(("one", "base", "one"), asyncio.run(both())):
        reference_model = served["merged"]["one"] if name == "one" else served["model"]
        for ids, item in zip(rows, out.data):
            expected = _embedding(reference_model, ids)
            assert torch.allclose(torch.tensor(item.embedding), expected, atol=1e-4), name
    adapted, base = (client.embeddings.create(model=m, input=rows[0]).data[0].embedding
                     for m in ("one", served["base"]))
    assert not torch.allclose(torch.tensor(adapted), torch.tensor(base), atol=1e-3), "the adapter changed nothing"


def test_runtime_load_swap_and_unload(served):
    import openai

    client, root, ids = served["client"], served["root"], prompts(12)[0]
    loaded = _post(client, "/load_lora_adapter", {"lora_name": "two", "lora_path": str(root / "two")})
    assert loaded.status_code == 200 and "two" in loaded.text
    assert "two" in {m.id for m in client.models.list().data}
    # MAX_LORAS=1: both adapters asked for at once; one waits for the other's slot, both come out right
    rows = prompts(13)

    async def both():  # and an embedding of `two`, which waits for the slot as the completions do
        aclient = served["async_client"]
        return await asyncio.gather(aclient.embeddings.create(model="two", input=rows[:1]), *(
            aclient.completions.create(model=name, prompt=ids, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
            for name in ("one", "two", "one", "two") for ids in rows[:2]))
    embedded, *outs = asyncio.run(both())
    assert torch.allclose(torch.tensor(embedded.data[0].embedding), _embedding(served["merged"]["two"], rows[0]),
                          atol=1e-4)
    jobs = [(name, ids) for name in ("one", "two", "one", "two") for ids in rows[:2]]
    for (name, ids), out in zip(jobs, outs):
        assert out.choices[0].token_ids == reference(served["merged"][name], ids), name
    with pytest.raises(openai.BadRequestError, match="already loaded"):
        _post(client, "/load_lora_adapter", {"lora_name": "two", "lora_path": str(root / "two")})
    assert _post(client, "/unload_lora_adapter", {"lora_name": "two"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "two", ids)
    with pytest.raises(openai.NotFoundError, match="cannot be found"):
        _post(client, "/unload_lora_adapter", {"lora_name": "two"})
    assert _complete(client, "one", ids) == reference(served["merged"]["one"], ids)  # still serving


@pytest.mark.parametrize("name, why", [("big", "rank 32 is above MAX_LORA_RANK=16"),
                                       ("other", "do not fit the base model"),
                                       ("corrupt", "weights file cannot be read"),
                                       ("missing", "does not exist")])
def test_bad_adapters_are_a_400_and_the_worker_keeps_serving(served, name, why):
    import openai

    client = served["client"]
    with pytest.raises(openai.BadRequestError, match=why) as info:
        _post(client, "/load_lora_adapter", {"lora_name": name, "lora_path": str(served["root"] / name)})
    assert info.value.body["param"] == "lora_path"
    assert name not in {m.id for m in client.models.list().data}
    ids = prompts(14)[0]
    assert _complete(client, "one", ids) == reference(served["merged"]["one"], ids)


def test_bad_adapter_at_start_up_is_one_line_naming_it(tmp_path, tokenizer_folder):
    model = build_model("llama", FAST_FAMILIES["llama"], tmp_path / "base", tokenizer_folder)
    make_adapter(model, tmp_path / "big", 4, rank=32)
    engine = lora_engine(tmp_path / "base", [LoraSpec("big", str(tmp_path / "big"))])
    with pytest.raises(RuntimeError, match=r"^LORA_MODULES: LoRA adapter 'big' .*rank 32 is above MAX_LORA_RANK=16$"):
        asyncio.run(engine.start())
    engine = lora_engine(tmp_path / "base", [LoraSpec("x", str(tmp_path / "big"), base_model_name="org/other")],
                         max_lora_rank=32)
    with pytest.raises(RuntimeError, match="base_model_name 'org/other' is not the served model"):
        asyncio.run(engine.start())


@pytest.mark.parametrize("option, why", [({"use_dora": True}, "use_dora: DoRA adapters are not supported"),
                                         ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                                         ({"target_modules": ["embed_tokens"]}, "embedding adapter")])
def test_unsupported_adapter_kinds_are_refused(option, why, tmp_path, tokenizer_folder):
    from engine.lora import AdapterError, LoraRegistry

    model = build_model("llama", FAST_FAMILIES["llama"], tmp_path / "base", tokenizer_folder)
    make_adapter(model, tmp_path / "x", 1, **({"targets": option["target_modules"]} if "target_modules" in option
                                             else option))
    registry = LoraRegistry(model, LoraConfig(), cache_dir=tmp_path, baked_dir=None, base_names=("base",))
    with pytest.raises(AdapterError, match=why):
        registry.add(LoraSpec("x", str(tmp_path / "x")))
    assert registry.names() == []


@pytest.mark.slow
def test_lora_settings_are_checked(monkeypatch):
    from worker.settings import SettingsError, load_settings

    monkeypatch.setenv("LORA_MODULES", "a=/x")
    with pytest.raises(SettingsError, match="LORA_MODULES needs ENABLE_LORA=true"):
        load_settings()
    monkeypatch.setenv("ENABLE_LORA", "true")
    for bad, why in (("a", "name=path"), ('[{"name": "a"}]', "name and a path"), ("a=/x a=/y", "must differ")):
        monkeypatch.setenv("LORA_MODULES", bad)
        with pytest.raises(SettingsError, match=why):
            load_settings()
    monkeypatch.setenv("LORA_MODULES", json.dumps([{"name": "a", "path": "/x", "base_model_name": "b"}]))
    monkeypatch.setenv("MAX_LORAS", "2")
    monkeypatch.setenv("MAX_CPU_LORAS", "1")
    with pytest.raises(SettingsError, match="MAX_CPU_LORAS"):
        load_settings()
    monkeypatch.setenv("MAX_CPU_LORAS", "3")
    config = load_settings().engine_config().lora
    assert config.modules == (LoraSpec("a", "/x", "b"),) and (config.max_loras, config.max_cpu_loras) == (2, 3)


@pytest.mark.slow
def test_legacy_jobs_and_job_routes_name_adapters(served, monkeypatch, tmp_path):
    """worker-vllm's job form takes the adapter in a `lora` field, and the load/unload routes work as job routes
    (openai_route), through the handler's job router."""
    from transformers import AutoTokenizer

    from api_helpers import Worker

    root = served["root"]
    worker = Worker(monkeypatch, tmp_path, MODEL_NAME=served["base"], DTYPE="float32", ENABLE_LORA="true",
                    LORA_MODULES=f"one={root / 'one'}", VLLM_ALLOW_RUNTIME_LORA_UPDATING="true",
                    KV_CACHE_MEMORY=str(16 * 2**20))
    tok = AutoTokenizer.from_pretrained(served["base"])
    ids = prompts(15)[0]
    text = tok.decode(ids)
    ids = tok(text).input_ids
    params = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
    out = worker.job({"prompt": text, "lora": "one", "sampling_params": params})
    assert out["choices"][0]["tokens"][0] == tok.decode(reference(served["merged"]["one"], ids))
    assert worker.job({"prompt": text, "lora": "nobody", "sampling_params": params})["error"]["code"] == 404
    loaded = worker.job({"openai_route": "/v1/load_lora_adapter",
                         "openai_input": {"lora_name": "two", "lora_path": str(root / "two")}})
    assert loaded["id"] == "two", loaded
    out = worker.job({"prompt": text, "lora": "two", "sampling_params": params})
    assert out["choices"][0]["tokens"][0] == tok.decode(reference(served["merged"]["two"], ids))
    assert worker.job({"openai_route": "/v1/unload_lora_adapter", "openai_input": {"lora_name": "two"}})["deleted"]
    missing = worker.job({"openai_route": "/v1/unload_lora_adapter", "openai_input": {"lora_name": "two"}})
    assert missing["error"]["code"] == 404
