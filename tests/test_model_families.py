"""Every decoder-only family the worker claims to serve, served exactly.

Tiny random models are built from transformers' own config classes, saved with the embedded model's tokenizer and
served through the real engine (float32, a small MAX_NUM_BATCHED_TOKENS so long prompts prefill in chunks, small
sliding windows so prompts outrun them). Greedy tokens must equal transformers' own `generate` on the same
folder, token for token, for rows of different lengths batched together, a prompt longer than the window, a
prefix-cache hit and n > 1.
"""
from __future__ import annotations

import asyncio
import zlib
import warnings

import pytest
import torch

from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.core.fallback import FallbackEngine
from engine.core.loop import Engine
from engine_helpers import choice_ids, generate
from tiny_models import (FALLBACK_FAMILIES, FAST_FAMILIES, HYBRID_FAMILIES, MAMBA1_FAMILIES, NEW_TOKENS, VOCAB, WINDOW,
                         build_model, family_greedy, prompts, reference)

BATCHED_TOKENS = 32  # chunked prefill: the longest prompt takes several steps


def serve_and_compare(engine: AsyncEngine, model, rows: list[list[int]], prefix_cache: bool = True) -> None:
    """Batched rows of different lengths, then the longest again (a prefix-cache hit) with n = 2: every
    choice equals transformers' greedy tokens."""
    expected = [reference(model, ids) for ids in rows]

    async def batched():
        return await asyncio.gather(*(choice_ids(engine, f"r{i}", ids, family_greedy()) for i, ids in enumerate(rows)))

    got = asyncio.run(batched())
    for i, (choices, want) in enumerate(zip(got, expected)):
        assert choices[0] == want, f"row {i} ({len(rows[i])} prompt tokens): {choices[0]} != {want}"
    hits = engine.engine.stats()["prefix_cache_hit_tokens"]
    again = asyncio.run(choice_ids(engine, "again", rows[-1], family_greedy(n=2)))
    if prefix_cache:
        assert engine.engine.stats()["prefix_cache_hit_tokens"] > hits, "the repeated prompt missed the prefix cache"
    assert again == [expected[-1]] * 2, f"prefix hit, n=2: {again} != {expected[-1]}"


def _engine(folder) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(folder), dtype="float32", max_num_batched_tokens=BATCHED_TOKENS,
                                    kv_cache_memory=8 * 2**20, max_num_seqs=8))


# Families the engine runs with its compact forward (engine/executor/compact_decoder.py) rather than the model's own.
COMPACT_FAMILIES = {"llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                    "smollm3"}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FAST_FAMILIES))
def test_family_matches_transformers(model_type, tmp_path, tokenizer_folder):
    model = build_model(model_type, FAST_FAMILIES[model_type], tmp_path, tokenizer_folder)
    engine = _engine(tmp_path)
    try:
        asyncio.run(engine.start())
        rows = prompts(zlib.crc32(model_type.encode()))
        assert max(map(len, rows)) > 2 * BATCHED_TOKENS and max(map(len, rows)) > WINDOW
        serve_and_compare(engine, model, rows)
        assert isinstance(engine.engine, Engine)  # the paged, batched path
        runner = engine.engine.runner
        assert (runner.compact is not None) == (model_type in COMPACT_FAMILIES), runner.compact_reason
        if runner.compact is not None:  # through the CPU kernels (tests/test_native_kernels.py: they build here)
            assert runner.compact.kernels is not None
        # Served at the model's own context, not capped at a sliding window.
        assert engine.max_model_len == model.config.max_position_embeddings
    finally:
        engine.close()


@pytest.mark.slow
def test_comparison_fails_when_a_layer_is_perturbed(tmp_path, tokenizer_folder):
    """The comparison above can fail: a small change to one layer's output in the served model is caught."""
    model = build_model("mistral", FAST_FAMILIES["mistral"], tmp_path, tokenizer_folder)
    engine = _engine(tmp_path)
    try:
        asyncio.run(engine.start())
        served = engine.engine.runner.model
        # A weight both forward paths read (the model's own and engine/executor/compact_decoder.py's) as it stands.
        norm = served.model.layers[-1].post_attention_layernorm.weight
        original = norm.detach().clone()
        norm.data.add_(0.05)
        try:
            with pytest.raises(AssertionError, match="!="):
                serve_and_compare(engine, model, prompts(1))
        finally:
            norm.data.copy_(original)
        serve_and_compare(engine, model, prompts(1))  # and without the change it passes
    finally:
        engine.close()


def _differs(layer_call):
    def call(self, x, *args):
        out = layer_call(self, x, *args)
        if self.index != 1:
            return out
        # __call__ returns the residual stream; fused (the native-kernel path) also returns its norm
        return out + 0.05 if isinstance(out, torch.Tensor) else (out[0] + 0.05, out[1] + 0.05)
    return call


def _raises(layer_call):
    def call(self, x, *args):
        raise RuntimeError("shapes do not broadcast")
    return call


@pytest.mark.slow
@pytest.mark.parametrize("change, reason", [
    (_differs, "its logits differ from the model's own forward"),
    (_raises, "it failed on this model (RuntimeError: shapes do not broadcast)")])
def test_a_compact_forward_that_differs_is_not_used(change, reason, tmp_path, tokenizer_folder, monkeypatch, caplog):
    """The start-up check compares the compact forward's logits with the model's own through the paged cache;
    one layer computing slightly differently, or failing, keeps the model's own forward, which serves exactly.
    Through the native kernels first, then without them: both layer paths are changed here."""
    from engine.executor import compact_decoder

    model = build_model("llama", FAST_FAMILIES["llama"], tmp_path, tokenizer_folder)
    monkeypatch.setattr(compact_decoder._Layer, "__call__", change(compact_decoder._Layer.__call__))
    monkeypatch.setattr(compact_decoder._Layer, "fused", change(compact_decoder._Layer.fused))
    engine = _engine(tmp_path)
    try:
        with caplog.at_level("INFO", logger="engine"):
            asyncio.run(engine.start())
        assert engine.engine.runner.compact is None
        assert f"forward pass: the model's own ({reason})" in caplog.text
        serve_and_compare(engine, model, prompts(2))
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("change", [_differs, _raises])
def test_a_native_kernel_path_that_differs_falls_back_to_the_compact_forward_without_it(
        change, tmp_path, tokenizer_folder, monkeypatch, caplog):
    """Where only the native-kernel layer path (compact_decoder._Layer.fused) differs or fails, the check keeps
    the compact forward without the kernels, and says so."""
    from engine.executor import compact_decoder
    from engine.cpu import native_kernels

    model = build_model("llama", FAST_FAMILIES["llama"], tmp_path, tokenizer_folder)
    monkeypatch.setattr(compact_decoder._Layer, "fused", change(compact_decoder._Layer.fused))
    engine = _engine(tmp_path)
    try:
        with caplog.at_level("INFO", logger="engine"):
            asyncio.run(engine.start())
        assert native_kernels.active() is not None, native_kernels.reason()
        compact = engine.engine.runner.compact
        assert compact is not None and compact.kernels is None
        assert "compact forward through the native kernels: it" in caplog.text
        assert "trying it without them" in caplog.text
        serve_and_compare(engine, model, prompts(3))
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(HYBRID_FAMILIES))
def test_hybrid_family_matches_transformers(model_type, tmp_path, tokenizer_folder, caplog):
    """Recurrent and convolution layers run in the batched engine: rows of different lengths decode in one pass,
    each from its own state slot, and n = 2 forks the prompt's state. Layers that carry a state into a
    multi-token pass prefill the 70-token prompt in chunks of 32; Mamba-1's scan (mamba, falcon_mamba, jamba)
    restarts from zero, which the start-up probe finds, so those prompts go whole (Zamba's too)."""
    model = build_model(model_type, HYBRID_FAMILIES[model_type], tmp_path, tokenizer_folder)
    engine = _engine(tmp_path)
    try:
        with caplog.at_level("INFO", logger="engine"):
            asyncio.run(engine.start())
        assert isinstance(engine.engine, Engine) and engine.engine.states is not None
        messages = [r.getMessage() for r in caplog.records]
        assert "serving path: paged (batched engine)" in messages, messages
        assert any(m.startswith("recurrent state: 8 slots") for m in messages), messages
        assert engine.engine.runner.prefill_continues == (model_type not in MAMBA1_FAMILIES)
        rows = prompts(zlib.crc32(model_type.encode()))
        serve_and_compare(engine, model, rows, prefix_cache=False)
        assert engine.engine.stats()["prefix_cache_hit_tokens"] == 0  # a state cannot be shared by a prefix
        # Embeddings of the same model (rows of different lengths padded into one batch) are its last hidden
        # states, as transformers computes them one by one.
        from engine.core.pooling import PoolingInput, PoolingParams
        pooled = asyncio.run(engine.pool("embed", [PoolingInput(ids) for ids in rows], PoolingParams())).data
        with torch.inference_mode():
            for ids, vector in zip(rows, pooled):
                hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
                assert torch.allclose(vector, torch.nn.functional.normalize(hidden, dim=-1), atol=1e-5)
    finally:
        engine.close()


def test_speculative_decoding_is_refused_for_a_hybrid_model(tmp_path, tokenizer_folder):
    """Speculation takes rejected tokens back out of the cache; a recurrent state cannot give them back, so the
    worker refuses SPECULATIVE_CONFIG at load with a line that says why, instead of serving wrong tokens."""
    import dataclasses

    from engine.core.speculative import SpeculativeConfig
    build_model("lfm2", HYBRID_FAMILIES["lfm2"], tmp_path, tokenizer_folder)
    config = _engine(tmp_path).config
    engine = AsyncEngine(dataclasses.replace(config, speculative=SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 4}')))
    try:
        with pytest.raises(RuntimeError, match="not supported for models with recurrent layers"):
            asyncio.run(engine.start())
    finally:
        engine.close()


def _transformers_beams(model, ids: list[int], width: int, n: int) -> list[list[int]]:
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=n, do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[:, len(ids):].tolist()


@pytest.mark.slow
def test_hybrid_states_follow_their_sequences_through_preemption_beams_and_failures(tmp_path, tokenizer_folder):
    """A hybrid model (Mamba and attention layers) under a KV budget so small that requests preempt each other:
    a preempted sequence recomputes its state, beams copy their parent's state when the search reassigns them,
    and a request that fails inside a step (a token id past the vocabulary) costs the others nothing: their
    states are written only once the step has succeeded, so retrying it request by request advances none of them
    twice."""
    model = build_model("granitemoehybrid", HYBRID_FAMILIES["granitemoehybrid"], tmp_path, tokenizer_folder)
    rows = prompts(11) + prompts(12)
    expected = [reference(model, ids, 40) for ids in rows]
    beam_prompt = rows[1]
    expected_beams = _transformers_beams(model, beam_prompt, width=3, n=2)
    engine = AsyncEngine(EngineConfig(model=str(tmp_path), dtype="float32", max_num_batched_tokens=BATCHED_TOKENS,
                                      kv_cache_memory=8 * 6400 + 22 * 16 * 256, max_num_seqs=8))
    try:
        asyncio.run(engine.start())
        # 8 state slots of 6.2 KB, then blocks of 16 tokens x 256 bytes: too few for every row at once
        assert engine.engine.blocks.num_blocks * 16 < sum(len(ids) + 40 for ids in rows)

        async def crowd():
            greedy_rows = [choice_ids(engine, f"g{i}", ids, SamplingParams(max_tokens=40, temperature=0.0,
                                                                          ignore_eos=True))
                           for i, ids in enumerate(rows)]
            beam = choice_ids(engine, "beam", beam_prompt, SamplingParams(
                max_tokens=NEW_TOKENS, temperature=0.0, n=2, best_of=3, beam_search=True, ignore_eos=True))
            return await asyncio.gather(*greedy_rows, beam)

        *got, beams = asyncio.run(crowd())
        assert engine.engine.stats()["preemptions"] > 0, "the crowd was meant to preempt"
        for i, (choices, want) in enumerate(zip(got, expected)):
            assert choices[0] == want, f"row {i}: {choices[0]} != {want}"
        assert beams == expected_beams

        async def failure_beside_a_decode():
            stream = engine.generate("steady", rows[2], SamplingParams(max_tokens=20, temperature=0.0,
                                                                       ignore_eos=True))
            tokens = []
            async for output in stream:
                tokens.extend(output.deltas[0].token_ids if output.deltas else [])
                if len(tokens) == 3:  # decoding: the broken request joins a step with this decode row
                    broken = asyncio.ensure_future(choice_ids(engine, "broken", [VOCAB + 5] * 4, family_greedy()))
            with pytest.raises(Exception, match="index"):
                await broken
            return tokens

        assert asyncio.run(failure_beside_a_decode()) == expected[2][:20]
        states = engine.engine.states  # every slot back once everything has left
        assert engine.engine.num_requests == 0 and states.num_free == states.num_slots
    finally:
        engine.close()


def _serve_on_fallback(model_type: str, tmp_path, tokenizer_folder, caplog, reason, families=None) -> None:
    """Build the family's model, start the worker on it, check that it took the fallback path and logged why
    (`reason(model)` is a text the log line holds), then compare its outputs with transformers'."""
    model = build_model(model_type, (families or FALLBACK_FAMILIES)[model_type], tmp_path, tokenizer_folder)
    engine = _engine(tmp_path)
    try:
        with caplog.at_level("INFO", logger="engine"):
            asyncio.run(engine.start())
        assert isinstance(engine.engine, FallbackEngine)
        assert any(r.getMessage().startswith("serving path: fallback") and reason(model) in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        serve_and_compare(engine, model, prompts(zlib.crc32(model_type.encode())), prefix_cache=False)
        # Beam search is the paged engine's: refused here (a 400 over the API), never sampled instead.
        beams = SamplingParams(max_tokens=4, temperature=0.0, n=2, best_of=2, beam_search=True)
        assert "fallback path" in engine.check_supported(beams)
        with pytest.raises(ValueError, match="beam search"):
            asyncio.run(choice_ids(engine, "beams", [5, 6, 7], beams))
    finally:
        engine.close()


@pytest.mark.slow
def test_fallback_log_lines_carry_the_job_id(tmp_path, tokenizer_folder, monkeypatch):
    """A request failing on the fallback loop's thread (a fault injected into its sampling) is logged inside
    its job's context, as on the paged engine, so the line names the job."""
    import logging

    from engine import GenerationError
    from engine.sampling.sampler import Sampler
    from worker import logs as worker_logging

    original = Sampler._adjust_row

    def faulty(self, logits, state, generated):
        if state.params.seed == 4242:
            raise RuntimeError("injected fault")
        return original(self, logits, state, generated)

    class JobCapture(logging.Handler):  # what the worker's log filter reads at emit time
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append((record.getMessage(), worker_logging.current_job.get()))

    build_model("gptj", FALLBACK_FAMILIES["gptj"], tmp_path, tokenizer_folder)
    engine = _engine(tmp_path)
    capture = JobCapture()
    logging.getLogger("engine").addHandler(capture)
    monkeypatch.setattr(Sampler, "_adjust_row", faulty)

    async def failing():
        worker_logging.current_job.set("job-fallback-log")
        with pytest.raises(GenerationError):
            async for _ in engine.generate("req-failing", [5, 6, 7, 8],
                                           SamplingParams(max_tokens=4, seed=4242, min_tokens=2)):
                pass

    try:
        asyncio.run(engine.start())
        assert isinstance(engine.engine, FallbackEngine)
        asyncio.run(failing())
    finally:
        logging.getLogger("engine").removeHandler(capture)
        engine.close()
    (job,) = [job for message, job in capture.lines if "req-failing" in message]
    assert job == "job-fallback-log"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(FALLBACK_FAMILIES))
def test_fallback_family_matches_transformers(model_type, tmp_path, tokenizer_folder, caplog):
    # The start-up log names the path and why (the model class the check refused).
    _serve_on_fallback(model_type, tmp_path, tokenizer_folder, caplog, lambda model: type(model).__name__)


@pytest.mark.slow
def test_a_fallback_model_over_the_api(tmp_path, tokenizer_folder):
    """Over HTTP with the official client: beam search on a fallback-path model is a 400 naming the parameter
    and why (never sampled instead), and the worker goes on serving the next request; /health, /stats and
    /metrics report its loop as they do the paged engine's (they once read a pooling queue it lacks: a 500)."""
    import openai
    import requests

    from conftest import start_gateway

    build_model("gptj", FALLBACK_FAMILIES["gptj"], tmp_path, tokenizer_folder)
    process, url = start_gateway({"MODEL_NAME": str(tmp_path), "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "tiny-gptj",
                                  "KV_CACHE_MEMORY": str(8 * 2**20)})
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny-gptj", prompt="one two three", max_tokens=4, n=2, best_of=2,
                                      extra_body={"use_beam_search": True})
        error = refused.value.body
        assert error["param"] == "use_beam_search" and "fallback path" in error["message"], error
        served = client.completions.create(model="tiny-gptj", prompt="one two three", max_tokens=4,
                                           extra_body={"ignore_eos": True})
        assert served.usage.completion_tokens == 4
        root = url.removesuffix("/openai/v1")
        health = requests.get(f"{root}/health", timeout=30)
        assert health.status_code == 200 and health.json()["model_loaded"] is True, health.text
        for stats_url in (f"{root}/stats", f"{url}/stats"):
            stats = requests.get(stats_url, timeout=30)
            assert stats.status_code == 200, stats.text
            body = stats.json()
            assert body["model_loaded"] and body["totals"]["generation_tokens"] >= 4, body
            assert body["waiting_requests"] == health.json()["waiting_requests"] == 0
        metrics = requests.get(f"{root}/metrics", timeout=30)
        assert metrics.status_code == 200, metrics.text
        assert 'vllm:num_requests_running{model_name="tiny-gptj"} 0.0' in metrics.text, metrics.text
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["lfm2", "mamba"])
def test_a_model_the_start_up_probe_rejects_is_served_on_the_fallback(model_type, tmp_path, tokenizer_folder,
                                                                       monkeypatch, caplog):
    """The configuration check is the first line; the second is the paged engine's start-up forward pass. A model
    that asks its cache for something the engine's cache does not have (here: the recurrent-state API taken off
    the probe, as a future transformers cache method would be missing) fails that probe, and the worker switches
    to the fallback path and serves it exactly, instead of failing at load or on every request."""
    from engine.executor import startup_checks

    monkeypatch.delattr(startup_checks.ShapeProbe, "get_conv_state")
    monkeypatch.delattr(startup_checks.ShapeProbe, "get_recurrent_state")
    _serve_on_fallback(model_type, tmp_path, tokenizer_folder, caplog,
                       lambda model: "the paged engine cannot run it", HYBRID_FAMILIES)


@pytest.mark.slow
def test_a_model_that_keeps_its_state_in_its_modules_is_served_on_the_fallback(tmp_path, tokenizer_folder, caplog):
    """RecurrentGemma keeps its recurrent state in its own modules, outside any cache: the start-up probe sees a
    stateful model that left no state in the cache and picks the fallback, which (as the model hands back no
    cache either) computes each request's whole sequence at every step, exactly."""
    families = {"recurrent_gemma": dict(lru_width=64, attention_window_size=16, conv1d_width=4, head_dim=None,
                                        block_types=["recurrent", "attention"], num_key_value_heads=1,
                                        tie_word_embeddings=False)}  # tied, the random model repeats one token
    _serve_on_fallback("recurrent_gemma", tmp_path, tokenizer_folder, caplog,
                       lambda model: "keeps recurrent state outside the cache", families)


@pytest.mark.slow
def test_fallback_outputs_equal_the_paged_engine(tmp_path, tokenizer_folder):
    """The fallback path gives what the paged engine gives for a model both can run: streamed text, stop
    strings, finish reasons, logprobs, prompt logprobs; and an aborted request leaves it."""
    import dataclasses

    from engine.loader import load

    build_model("llama", FAST_FAMILIES["llama"], tmp_path, tokenizer_folder)

    def forced_fallback(config):
        loaded = load(config)
        loaded.model.set_attn_implementation("sdpa")
        return dataclasses.replace(loaded, fallback_reason="forced by the test")

    rows = prompts(7)

    async def outputs(engine):
        results = []
        for i, ids in enumerate(rows):
            free = await generate(engine, f"free{i}", ids, SamplingParams(max_tokens=12, temperature=0.0,
                                                                         ignore_eos=True, logprobs=2,
                                                                         prompt_logprobs=1))
            text = free["choices"][0]["text"]
            stop = text[len(text) // 2:len(text) // 2 + 2]
            stopped = await generate(engine, f"stop{i}", ids, SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True, stop=(stop,) if stop.strip() else ()))
            results.append((free, stopped))
        return results

    async def abort_one(engine) -> int:
        stream = engine.generate("abort", rows[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if engine.engine.num_requests == 0:
                break
            await asyncio.sleep(0.05)
        return engine.engine.num_requests

    def run(loader):
        engine = AsyncEngine(EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory=8 * 2**20,
                                          max_num_seqs=8), loader=loader)
        try:
            asyncio.run(engine.start())
            results = asyncio.run(outputs(engine))
            assert asyncio.run(abort_one(engine)) == 0
            return type(engine.engine), results
        finally:
            engine.close()

    kind, paged = run(load)
    assert kind is Engine
    kind, fallback = run(forced_fallback)
    assert kind is FallbackEngine
    for (free_p, stop_p), (free_f, stop_f) in zip(paged, fallback):
        for a, b in ((free_p, free_f), (stop_p, stop_f)):
            ca, cb = a["choices"][0], b["choices"][0]
            assert (ca["ids"], ca["text"], ca["finish"]) == (cb["ids"], cb["text"], cb["finish"])
            assert [lp.token_id for lp in ca["logprobs"]] == [lp.token_id for lp in cb["logprobs"]]
            assert [lp.logprob for lp in ca["logprobs"]] == pytest.approx([lp.logprob for lp in cb["logprobs"]],
                                                                         abs=1e-4)
        assert [p and p.token_id for p in free_p["prompt_logprobs"]] == \
            [p and p.token_id for p in free_f["prompt_logprobs"]]
    assert any(s["choices"][0]["finish"] == "stop" for _, s in fallback)  # a stop string really ended one
