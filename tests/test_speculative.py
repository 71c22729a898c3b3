"""Speculative decoding on the real embedded model: greedy output equals plain decoding token for token (under
batching, for both proposers), sampled output keeps its distribution, and the configuration and per-request
controls are checked."""
from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter

import pytest

from engine import AsyncEngine, SamplingParams
from engine.loader import model_folder
from engine.core.speculative import SpeculativeConfig
from engine_helpers import assert_same_greedy, chat_ids, generate, greedy

ECHO = ["Repeat exactly: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps on.",
        "Copy this list: apples, pears, plums, apples, pears, plums, cherries.",
        "What is two plus two?"]


def _engine(worker, spec: str) -> AsyncEngine:
    config = worker.settings.engine_config()
    if "MODEL" in spec:
        spec = spec.replace("MODEL", str(model_folder(config)))
    engine = AsyncEngine(dataclasses.replace(config, speculative=SpeculativeConfig.parse(spec)))
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def ngram_engine(worker):
    # Not adaptive: these tests check what speculation computes, so every step must speculate.
    engine = _engine(worker, '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                             '"adaptive": false}')
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def draft_engine(worker):
    # The embedded model drafting for itself: every draft should be kept (up to float noise).
    engine = _engine(worker, '{"model": "MODEL", "num_speculative_tokens": 3, "adaptive": false}')
    yield engine
    engine.close()


def _run_batch(engine, prompts, params, tag):
    async def together():
        return await asyncio.gather(*(generate(engine, f"{tag}-{i}", ids, params) for i, ids in enumerate(prompts)))
    return asyncio.run(together())


@pytest.mark.slow
@pytest.mark.parametrize("which", ["ngram_engine", "draft_engine"])
def test_greedy_speculation_equals_plain_decoding(worker, request, which):
    engine = request.getfixturevalue(which)
    prompts = [chat_ids(engine, p) for p in ECHO]
    plain = _run_batch(worker.engine, prompts, greedy(28), "plain")
    # Batched: three requests speculate in the same steps.
    fast = _run_batch(engine, prompts, greedy(28), f"spec-{which}")
    for a, b in zip(fast, plain):
        assert_same_greedy(a["choices"][0], b["choices"][0]["ids"])
        assert [lp.token_id for lp in a["choices"][0]["logprobs"]] == a["choices"][0]["ids"]
    stats = engine.engine.stats()
    assert stats["speculative_accepted_tokens"] > 10  # it really speculated and kept drafts
    # Stop strings, max_tokens and usage behave exactly as without speculation.
    stop_text = plain[0]["choices"][0]["text"][10:16]
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, stop=(stop_text,))
    a = asyncio.run(generate(engine, f"stop-{which}", prompts[0], params))["choices"][0]
    b = asyncio.run(generate(worker.engine, "stop-plain", prompts[0], params))["choices"][0]
    assert (a["text"], a["ids"], a["finish"]) == (b["text"], b["ids"], b["finish"]) and a["finish"] == "stop"
    short = asyncio.run(generate(engine, f"short-{which}", prompts[0], greedy(5)))["choices"][0]
    assert short["ids"] == plain[0]["choices"][0]["ids"][:5] and short["finish"] == "length"
    # OVMS's per-request controls change how much is drafted, never the result.
    control = {"num_assistant_tokens": 1} if which == "ngram_engine" else {"assistant_confidence_threshold": 0.9}
    before = stats["speculative_proposed_tokens"]
    tuned = asyncio.run(generate(engine, f"tuned-{which}", prompts[1], greedy(28, **control)))["choices"][0]
    assert_same_greedy(tuned, plain[1]["choices"][0]["ids"])
    assert engine.engine.stats()["speculative_proposed_tokens"] - before <= 28


@pytest.mark.slow
def test_sampled_speculation_keeps_the_distribution(worker, ngram_engine):
    """Many samples of a short continuation of a repetitive text (prompt lookup guesses most tokens): with and
    without speculation each position's token follows the same distribution (a two-sample chi-square test;
    keeping every guess, or never, would be far off). A seed reproduces its samples."""
    ids = chat_ids(worker.engine, ECHO[1])
    params = SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True, n=25)

    def draws(engine, tag):
        results = _run_batch(engine, [ids] * 10, params, tag)
        return [c["ids"] for r in results for c in r["choices"]]

    before = ngram_engine.engine.stats()
    spec, plain = draws(ngram_engine, "dist-spec"), draws(worker.engine, "dist-plain")
    after = ngram_engine.engine.stats()
    proposed = after["speculative_proposed_tokens"] - before["speculative_proposed_tokens"]
    accepted = after["speculative_accepted_tokens"] - before["speculative_accepted_tokens"]
    assert proposed > 200 and 10 < accepted < proposed  # guesses kept and rejected
    for position in range(1, 6):
        a, b = Counter(s[position] for s in spec), Counter(s[position] for s in plain)
        # Two-sample chi-square over the tokens seen at least 10 times (the rest pooled), at about p < 0.001.
        common = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
        bins = [(a[k], b[k]) for k in common] + [(len(spec) - sum(a[k] for k in common),
                                                  len(plain) - sum(b[k] for k in common))]
        bins = [(x, y) for x, y in bins if x + y]
        chi2 = sum((x - y) ** 2 / (x + y) for x, y in bins)
        df = max(1, len(bins) - 1)
        assert chi2 < df + 4.5 * (2 * df) ** 0.5, (position, chi2, df, a.most_common(4), b.most_common(4))
    seeded = dataclasses.replace(params, seed=7, n=4)
    first = asyncio.run(generate(ngram_engine, "seed-a", ids, seeded))
    again = asyncio.run(generate(ngram_engine, "seed-b", ids, seeded))
    assert [c["ids"] for c in first["choices"]] == [c["ids"] for c in again["choices"]]


def test_speculative_config_is_validated_at_start_up(monkeypatch):
    from worker.settings import SettingsError, load_settings
    for bad in ('{"method": "ngram"}', '{"method": "eagle", "num_speculative_tokens": 2}', "[1]", "{",
                '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5}',
                '{"num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}',
                '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}',
                '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": true}',
                '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": "yes"}'):
        monkeypatch.setenv("SPECULATIVE_CONFIG", bad)
        with pytest.raises(SettingsError, match="SPECULATIVE_CONFIG"):
            load_settings()
    monkeypatch.setenv("SPECULATIVE_CONFIG", '{"model": "org/draft", "num_speculative_tokens": 5}')
    spec = load_settings().engine_config().speculative
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "org/draft", 5)
    assert (spec.adaptive, spec.disable_by_batch_size) == (True, None)  # adaptive unless told otherwise


def test_assistant_controls_need_speculation(client):
    from api_helpers import bad_request, complete
    bad_request(lambda: complete(client, extra_body={"num_assistant_tokens": 3}), "num_assistant_tokens")
    bad_request(lambda: complete(client, extra_body={"num_assistant_tokens": 3,
                                                     "assistant_confidence_threshold": 0.5}),
                "assistant_confidence_threshold")
    bad_request(lambda: complete(client, extra_body={"num_assistant_tokens": 0}), "num_assistant_tokens")


def _drive(switch, batch: int, steps: int, spec_cost: float, plain_cost: float) -> int:
    """Run `steps` decode-only steps of `batch` sequences whose time per token is `spec_cost` when they speculate
    and `plain_cost` when not; returns how many speculated."""
    speculated = 0
    for _ in range(steps):
        chosen = switch.choose(batch)
        speculated += chosen
        switch.record(batch, chosen, (spec_cost if chosen else plain_cost) * batch, batch)
    return speculated


def test_load_switch_keeps_the_faster_mode_and_rarely_retries_the_slower():
    from engine.core.speculation_control import LoadSwitch
    switch = LoadSwitch()
    # One stream: speculating is 1.3x faster; it is kept for nearly every step.
    assert _drive(switch, 1, 400, spec_cost=1.0, plain_cost=1.3) >= 392
    # Eight streams: speculating is 0.68x; after the first trials it runs on few steps (a retry now and then).
    assert _drive(switch, 8, 400, spec_cost=1.47, plain_cost=1.0) <= 6
    # Sixteen streams, never seen: borrows eight's verdict instead of trying speculation first, and tries it once
    # at most in a burst of 60 steps (a loser's trial costs a step's worth).
    assert _drive(switch, 16, 15, spec_cost=1.47, plain_cost=1.0) == 0
    assert _drive(switch, 16, 60, spec_cost=1.47, plain_cost=1.0) <= 1
    # Thirty-two streams, first thing after start: speculation loses; as the streams finish the batch shrinks
    # (31, 30, ... 17) and keeps that verdict rather than trying speculation again at each new size.
    shrinking = LoadSwitch()
    assert _drive(shrinking, 32, 100, spec_cost=1.6, plain_cost=1.0) <= 4
    assert sum(_drive(shrinking, size, 3, spec_cost=1.6, plain_cost=1.0) for size in range(31, 16, -1)) == 0
    # The machine changes (another load goes away): retries notice and the verdict turns.
    _drive(switch, 8, 600, spec_cost=0.5, plain_cost=1.0)
    assert _drive(switch, 8, 100, spec_cost=0.5, plain_cost=1.0) >= 95
    # A draft that costs 6 times plain a token (a model drafting for itself): after its first trial, the next
    # waits until it would cost under 2% of the steps between.
    costly = LoadSwitch()
    assert _drive(costly, 1, 200, spec_cost=6.0, plain_cost=1.0) == 1
    # vLLM's switch wins over measurements; without adaptation every step below it speculates.
    fixed = LoadSwitch(disable_by_batch_size=4, adaptive=False)
    assert _drive(fixed, 3, 50, spec_cost=9.0, plain_cost=1.0) == 50
    assert _drive(fixed, 4, 50, spec_cost=0.1, plain_cost=1.0) == 0


def test_draft_length_follows_each_sequences_acceptance():
    from engine.core.speculation_control import DraftLength
    lengths = DraftLength()
    for _ in range(30):  # sequence 1: every guess kept; sequence 2: every guess rejected
        lengths.verified(1, lengths.length(1, 4) or 1, lengths.length(1, 4) or 1)
        k = lengths.length(2, 4)
        if k:
            lengths.verified(2, k, 0)
    assert lengths.length(1, 4) == 4
    tried = [lengths.length(2, 4) for _ in range(16)]
    assert tried.count(0) >= 14 and 1 in tried  # stopped guessing, but still probes now and then
    lengths.forget_except({2})
    assert lengths.length(1, 4) == 2  # a new sequence starts from even odds: guesses kept 1/2, 1/4 > 0.2


@pytest.mark.slow
def test_speculating_engine_switches_modes_and_keeps_greedy_output(worker):
    prompt = chat_ids(worker.engine, ECHO[0])
    plain = asyncio.run(generate(worker.engine, "plain-adaptive", prompt, greedy(32)))["choices"][0]["ids"]
    adaptive = _engine(worker, '{"method": "ngram", "num_speculative_tokens": 4}')
    never = _engine(worker, '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 1}')
    try:
        got = asyncio.run(generate(adaptive, "adaptive", prompt, greedy(32)))["choices"][0]
        assert_same_greedy(got, plain)
        stats = adaptive.engine.stats()
        assert stats["speculative_proposed_tokens"] > 0 and stats["speculative_plain_steps"] > 0  # tried both
        got = asyncio.run(generate(never, "never", prompt, greedy(32)))["choices"][0]
        assert_same_greedy(got, plain)
        stats = never.engine.stats()
        assert stats["speculative_proposed_tokens"] == 0 and stats["speculative_plain_steps"] >= 31
    finally:
        adaptive.close()
        never.close()
