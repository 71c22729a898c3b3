"""OpenAI API parity, proven through the real gateway process with the official `openai` client.

Every parameter is checked for its effect on the real embedded model (SmolLM2-135M-Instruct), not only for a
200: stop really cuts, seeds reproduce, logit_bias forces or bans tokens, logprobs line up with the tokens,
and so on. Generations are kept to a few tokens because the model runs on a shared CPU. Requests whose
results are compared exactly run one at a time, so that batch composition cannot change the arithmetic.
"""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from conftest import MODEL, start_gateway
from api_helpers import PROMPT, bad_request, complete, error_of

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
PARIS_ANSWER = "The capital of France is Paris."
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # PROMPT in SmolLM2's tokenizer (checked by test_prompt_forms)
COUNT_IDS = [33, 28, 216, 34, 28, 216, 35, 28]  # "1, 2, 3,"
BANANA = 21285  # " banana"
THE = 504  # "The", the greedy first token of PARIS_ANSWER
PERIOD = 30  # "."
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(messages: list[dict], add_generation_prompt: bool = True, continue_final: bool = False) -> str:
    """SmolLM2's chat template, written out: what the chat endpoint must feed the model."""
    text = ""
    if messages[0]["role"] != "system":
        text += f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
    for m in messages:
        text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    if continue_final:
        text = text[:-len("<|im_end|>\n")]
    elif add_generation_prompt:
        text += "<|im_start|>assistant\n"
    return text


def chat(client, messages=PARIS, **kwargs):
    kwargs.setdefault("max_tokens", 20)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def run_async(gateway_url: str, make):
    """Run `make(async_client)` on a fresh event loop with an AsyncOpenAI client bound to it."""
    async def main():
        async with openai.AsyncOpenAI(base_url=gateway_url, api_key="unused", max_retries=0, timeout=300) as client:
            return await make(client)

    return asyncio.run(main())


def stream_texts(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return texts


# ---------------------------------------------------------------- model and routes


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_unknown_model_is_404(client, endpoint):
    call = (lambda: client.chat.completions.create(model="no-such-model", messages=PARIS, max_tokens=2)) \
        if endpoint == "chat" else (lambda: client.completions.create(model="no-such-model", prompt="x", max_tokens=2))
    status, error = error_of(call)
    assert (status, error["type"], error["param"]) == (404, "NotFoundError", "model")
    assert "no-such-model" in error["message"]


def test_model_may_be_omitted(gateway_url):
    # vLLM serves a request without `model` with its one model; raw HTTP, as the client insists on one.
    body = httpx.post(f"{gateway_url}/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                      timeout=120).json()
    assert body["model"] == MODEL and body["choices"][0]["text"] == " Paris."


# ---------------------------------------------------------------- messages


def test_every_role_reaches_the_chat_template(client):
    conversation = [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "developer", "content": "Be factual."},
        {"role": "user", "content": "Which tool tells the weather?"},
        {"role": "assistant", "content": "The weather tool."},
        {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    reply = chat(client, conversation, max_tokens=6)
    # The same prompt written out by hand, through the completions endpoint: same tokens, same greedy text.
    expected = complete(client, chatml(conversation), max_tokens=6)
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    assert reply.choices[0].message.content == expected.choices[0].text


def test_text_content_parts_equal_string_content(client):
    as_string = chat(client, [{"role": "user", "content": "What is the capital\nof France?"}], max_tokens=6)
    as_parts = chat(client, [{"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                                          {"type": "text", "text": "of France?"}]}], max_tokens=6)
    # vLLM joins text parts with a newline.
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_invalid_messages_are_400(client):
    bad_request(lambda: chat(client, [{"role": "wizard", "content": "hi"}]), "messages[0].role")
    bad_request(lambda: chat(client, [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages[0].content[0]")
    bad_request(lambda: chat(client, []), "messages")


# ---------------------------------------------------------------- prompt forms (completions)


def test_prompt_forms(client):
    single = complete(client, PROMPT, max_tokens=4)
    text = single.choices[0].text
    assert text.startswith(" Paris")
    # Token ids are the same prompt: same text; echo shows the ids decode to PROMPT.
    by_ids = complete(client, PROMPT_IDS, max_tokens=4, echo=True)
    assert [c.text for c in by_ids.choices] == [PROMPT + text]
    assert by_ids.usage.prompt_tokens == single.usage.prompt_tokens == len(PROMPT_IDS)

    counting = complete(client, "1, 2, 3,", max_tokens=4).choices[0].text
    for prompt in (["The capital of France is", "1, 2, 3,"], [PROMPT_IDS, COUNT_IDS]):
        both = complete(client, prompt, max_tokens=4, n=2)
        # One set of n choices per prompt, numbered prompt * n + k, in order.
        assert [c.index for c in both.choices] == [0, 1, 2, 3]
        assert [c.text for c in both.choices] == [text, text, counting, counting]
        assert both.usage.prompt_tokens == len(PROMPT_IDS) + len(COUNT_IDS)
        assert both.usage.completion_tokens == 16


def test_invalid_prompts_are_400(client):
    bad_request(lambda: complete(client, []), "prompt")
    bad_request(lambda: complete(client, [[1, 2], []]), "prompt")
    bad_request(lambda: complete(client, [10**9]), "prompt")
    bad_request(lambda: complete(client, [PROMPT_IDS, [10**9]]), "prompt[1]")


# ---------------------------------------------------------------- length and finish_reason


def test_finish_reason_stop_and_length(client):
    natural = chat(client, max_tokens=20).choices[0]
    assert (natural.message.content, natural.finish_reason, natural.stop_reason) == (PARIS_ANSWER, "stop", None)
    capped = chat(client, max_tokens=3)
    assert capped.choices[0].finish_reason == "length" and capped.usage.completion_tokens == 3
    assert PARIS_ANSWER.startswith(capped.choices[0].message.content)


def test_max_completion_tokens_wins_over_max_tokens(client):
    reply = chat(client, max_tokens=10, max_completion_tokens=2)
    assert reply.usage.completion_tokens == 2 and reply.choices[0].finish_reason == "length"


def test_context_limit_is_400(client):
    long_text = "hello " * 9000  # over the 8192-token context
    error = bad_request(lambda: complete(client, long_text), "prompt")
    assert "maximum context length is 8192" in error["message"]
    error = bad_request(lambda: chat(client, [{"role": "user", "content": long_text}]), "messages")
    assert "maximum context length" in error["message"]
    error = bad_request(lambda: chat(client, max_tokens=8190), "max_tokens")
    assert "maximum context length" in error["message"]
    bad_request(lambda: chat(client, max_completion_tokens=8190), "max_completion_tokens")
    bad_request(lambda: complete(client, max_tokens=8190), "max_tokens")


# ---------------------------------------------------------------- sampling


def test_temperature_zero_is_greedy(client):
    reply = chat(client, max_tokens=8, logprobs=True, top_logprobs=1, temperature=0)
    # Every chosen token is the most likely one.
    for entry in reply.choices[0].logprobs.content:
        assert entry.token == entry.top_logprobs[0].token
    assert chat(client, max_tokens=8, temperature=0).choices[0].message.content == \
        reply.choices[0].message.content


def test_seed_reproduces_and_different_seeds_differ(client):
    def sample(seed):
        return complete(client, "Once upon a time", max_tokens=10, temperature=1.0, seed=seed,
                        extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_top_k_top_p_min_p_narrow_sampling_to_greedy(client):
    def sample(**kwargs):
        return complete(client, "Once upon a time", max_tokens=8, seed=7,
                        extra_body={"ignore_eos": True, **kwargs.pop("extra", {})}, **kwargs).choices[0].text

    greedy = sample(temperature=0)
    assert sample(temperature=2.0) != greedy  # hot sampling wanders, so the cases below prove their filter
    assert sample(temperature=2.0, extra={"top_k": 1}) == greedy
    assert sample(temperature=2.0, top_p=1e-6) == greedy
    assert sample(temperature=2.0, extra={"min_p": 1.0}) == greedy


def test_n_returns_n_distinct_choices(client):
    reply = chat(client, n=3, temperature=1.0, seed=11, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == 18


def test_best_of_returns_the_most_likely_candidates(client):
    kwargs = dict(prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=5, logprobs=0,
                  extra_body={"ignore_eos": True})
    # With the same seed, n=3 shows the three candidates best_of=3 draws (sequence i uses seed + i).
    candidates = complete(client, n=3, **kwargs).choices
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in candidates}
    assert len(scores) == 3
    best = complete(client, n=1, best_of=3, **kwargs)
    assert len(best.choices) == 1
    assert best.choices[0].text == max(scores, key=scores.get)
    top_two = complete(client, n=2, best_of=3, **kwargs).choices
    assert [c.text for c in top_two] == sorted(scores, key=scores.get, reverse=True)[:2]
    bad_request(lambda: complete(client, n=2, best_of=1), "best_of")
    bad_request(lambda: complete(client, best_of=2, stream=True), "best_of")


def test_stop_strings_cut_the_text(client):
    cut = chat(client, stop="Paris").choices[0]
    assert (cut.message.content, cut.finish_reason, cut.stop_reason) == ("The capital of France is ", "stop", "Paris")
    earliest = chat(client, stop=["Paris", "France"]).choices[0]
    assert (earliest.message.content, earliest.stop_reason) == ("The capital of ", "France")
    kept = chat(client, stop=["Paris"], extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == "The capital of France is Paris"
    streamed = stream_texts(chat(client, stop=["Paris"], stream=True))
    assert streamed == {0: "The capital of France is "}


def test_stop_token_ids(client):
    cut = chat(client, extra_body={"stop_token_ids": [PERIOD]}).choices[0]
    assert (cut.message.content, cut.finish_reason, cut.stop_reason) == ("The capital of France is Paris", "stop",
                                                                         PERIOD)
    kept = chat(client, extra_body={"stop_token_ids": [PERIOD], "include_stop_str_in_output": True}).choices[0]
    assert kept.message.content == PARIS_ANSWER


def test_ignore_eos_and_special_tokens(client):
    # The answer ends with <|im_end|> (EOS) after 8 tokens; ignore_eos generates on to max_tokens.
    plain = chat(client, max_tokens=11, extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 11 and plain.choices[0].finish_reason == "length"
    raw = chat(client, max_tokens=11, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    raw_text = raw.choices[0].message.content
    assert raw_text.startswith(PARIS_ANSWER + "<|im_end|>")
    assert plain.choices[0].message.content == raw_text.replace("<|im_end|>", "").replace("<|im_start|>", "")
    # A fast (Rust) tokenizer does not put spaces between special tokens either way, as in vLLM.
    unspaced = chat(client, max_tokens=11, extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                       "spaces_between_special_tokens": False})
    assert unspaced.choices[0].message.content == raw_text
    # With include_stop_str_in_output the EOS that stopped generation is part of the text (vLLM).
    eos = chat(client, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}).choices[0]
    assert (eos.message.content, eos.finish_reason) == (PARIS_ANSWER + "<|im_end|>", "stop")


def test_min_tokens_holds_off_eos(client):
    reply = chat(client, max_tokens=14, extra_body={"min_tokens": 12})
    assert reply.usage.completion_tokens >= 12
    assert reply.choices[0].message.content.startswith(PARIS_ANSWER)
    bad_request(lambda: chat(client, max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens")


async def _distinct_tokens(async_client, prompt: str, max_tokens: int, **kwargs) -> int:
    reply = await async_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, **kwargs.pop("extra", {})}, **kwargs)
    return len(set(reply.choices[0].logprobs.tokens))


def test_penalties_change_repetition(gateway_url):
    # Coarse counts of distinct tokens, so the requests may share batches.
    looping, diverse = "I like apples. I like apples. I like", "The cat sat on the mat. The cat sat on the mat. The cat"

    async def run(async_client):
        return await asyncio.gather(
            _distinct_tokens(async_client, looping, 16),
            _distinct_tokens(async_client, looping, 16, presence_penalty=2.0),
            _distinct_tokens(async_client, looping, 16, frequency_penalty=2.0),
            _distinct_tokens(async_client, looping, 16, extra={"repetition_penalty": 1.5}),
            _distinct_tokens(async_client, diverse, 20),
            _distinct_tokens(async_client, diverse, 20, presence_penalty=-2.0),
            _distinct_tokens(async_client, diverse, 20, frequency_penalty=-2.0),
            _distinct_tokens(async_client, diverse, 20, extra={"repetition_penalty": 0.5}))

    base, presence, frequency, repetition, base2, presence2, frequency2, repetition2 = run_async(gateway_url, run)
    assert min(presence, frequency, repetition) > base + 3, (base, presence, frequency, repetition)
    assert max(presence2, frequency2, repetition2) < base2 - 3, (base2, presence2, frequency2, repetition2)


def test_logit_bias_forces_and_bans_tokens(client):
    forced = complete(client, max_tokens=4, logit_bias={str(BANANA): 100})
    assert forced.choices[0].text == " banana" * 4
    banned = chat(client, max_tokens=3, logit_bias={str(THE): -100}, logprobs=True)
    assert not banned.choices[0].message.content.startswith("The")
    assert banned.choices[0].logprobs.content[0].token != "The"
    bad_request(lambda: complete(client, logit_bias={"banana": 1}), "logit_bias")
    bad_request(lambda: complete(client, logit_bias={str(BANANA): 101}), "logit_bias")
    bad_request(lambda: complete(client, logit_bias={str(10**9): 1}), "logit_bias")


# ---------------------------------------------------------------- logprobs and echo


def test_chat_logprobs(client):
    reply = chat(client, max_tokens=6, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 6
    assert "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and e.logprob == values[0]  # greedy: the top one
    assert all(e.top_logprobs == [] for e in chat(client, max_tokens=3, logprobs=True, top_logprobs=0)
               .choices[0].logprobs.content)
    assert chat(client, max_tokens=3).choices[0].logprobs is None
    bad_request(lambda: chat(client, logprobs=True, top_logprobs=21), "top_logprobs")
    bad_request(lambda: chat(client, top_logprobs=2), "top_logprobs")


def test_completion_logprobs_stream_and_not(client):
    full = complete(client, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == full.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # The top 2 and the chosen token (the same one, greedy), as vLLM lists them.
        assert len(top) == 2 and top[token] == value == max(top.values())
    streamed = list(complete(client, max_tokens=6, logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    assert [t for c in streamed for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens] == lp.tokens
    assert [v for c in streamed for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs] == \
        pytest.approx(lp.token_logprobs)
    bad_request(lambda: complete(client, logprobs=21), "logprobs")


def test_completion_echo(client):
    plain = complete(client, max_tokens=3).choices[0].text
    echoed = complete(client, max_tokens=3, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    scored = complete(client, max_tokens=3, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == PROMPT + plain
    assert len(lp.tokens) == scored.usage.prompt_tokens + scored.usage.completion_tokens
    assert "".join(lp.tokens) == PROMPT + plain
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has no context
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    streamed = list(complete(client, max_tokens=3, echo=True, logprobs=1, stream=True))
    assert stream_texts(streamed) == {0: PROMPT + plain}
    assert all(len(c.choices) == 1 for c in streamed)  # the prompt rides with the first tokens, as in vLLM
    assert [t for c in streamed for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens] == lp.tokens
    assert stream_texts(complete(client, ["1, 2, 3,", PROMPT], max_tokens=3, echo=True, stream=True))[1] == \
        PROMPT + plain


def test_chat_echo_repeats_a_continued_message(client):
    prefix = [*PARIS, {"role": "assistant", "content": "The capital of France is"}]
    reply = chat(client, prefix, max_tokens=3, extra_body={
        "echo": True, "continue_final_message": True, "add_generation_prompt": False})
    assert reply.choices[0].message.content == "The capital of France is Paris."
    streamed = list(chat(client, prefix, max_tokens=3, stream=True, extra_body={
        "echo": True, "continue_final_message": True, "add_generation_prompt": False}))
    assert stream_texts(streamed) == {0: "The capital of France is Paris."}
    assert streamed[0].choices[0].delta.role == "assistant" and not streamed[0].choices[0].delta.content
    # The reply does not continue the user's message, so echo adds nothing (vLLM).
    assert chat(client, max_tokens=3, extra_body={"echo": True}).choices[0].message.content == "The capital of"


def test_suffix_needs_fill_in_the_middle_tokens(client):
    error = bad_request(lambda: complete(client, "def add(a, b):", suffix="return c"), "suffix")
    assert "fill-in-the-middle" in error["message"]


# ---------------------------------------------------------------- streaming


def test_chat_stream_matches_non_stream(client):
    kwargs = dict(max_tokens=12, extra_body={"ignore_eos": True})
    full = chat(client, **kwargs)
    chunks = list(chat(client, stream=True, **kwargs))
    assert stream_texts(chunks) == {0: full.choices[0].message.content}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert all(c.finish_reason is None for chunk in chunks[:-1] for c in chunk.choices)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"
    assert all(c.usage is None for c in chunks)


def test_completion_stream_matches_non_stream(client):
    full = complete(client, ["1, 2, 3,", PROMPT], max_tokens=6)
    chunks = list(complete(client, ["1, 2, 3,", PROMPT], max_tokens=6, stream=True))
    assert stream_texts(chunks) == {c.index: c.text for c in full.choices}
    assert {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason} == \
        {c.index: c.finish_reason for c in full.choices}


def test_stream_n_matches_non_stream_n(client):
    kwargs = dict(n=2, temperature=1.0, seed=3, max_tokens=5, extra_body={"ignore_eos": True})
    full = chat(client, **kwargs)
    assert stream_texts(chat(client, stream=True, **kwargs)) == {c.index: c.message.content for c in full.choices}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_include_usage_adds_a_final_usage_chunk(client, gateway_url, endpoint):
    call = chat if endpoint == "chat" else complete
    full = call(client, max_tokens=4)
    chunks = list(call(client, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                                 "total_tokens"}) == \
        full.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})
    assert body and all(c.usage is None for c in body)
    # On the wire the other chunks carry "usage": null, as OpenAI sends them.
    path = "chat/completions" if endpoint == "chat" else "completions"
    request = {"model": MODEL, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
               **({"messages": PARIS} if endpoint == "chat" else {"prompt": PROMPT})}
    events = [line for line in httpx.post(f"{gateway_url}/{path}", json=request, timeout=120).text.split("\n\n")
              if line]
    assert events[-1] == "data: [DONE]"
    assert all('"usage":null' in e for e in events[:-2]) and '"choices":[]' in events[-2]
    bad_request(lambda: call(client, stream_options={"include_usage": True}), "stream_options")


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client):
    chunks = list(chat(client, max_tokens=4, stream=True, extra_body={"ignore_eos": True}, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 4
    assert {c.usage.prompt_tokens for c in chunks} == {chat(client, max_tokens=1).usage.prompt_tokens}


def test_sync_and_async_clients_agree(client, gateway_url):
    async def ask(async_client):
        return await async_client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=20, temperature=0)

    assert run_async(gateway_url, ask).choices[0].message.content == chat(client).choices[0].message.content == \
        PARIS_ANSWER


# ---------------------------------------------------------------- chat template parameters


def test_add_generation_prompt_false(client):
    reply = chat(client, max_tokens=4, extra_body={"add_generation_prompt": False})
    expected = complete(client, chatml(PARIS, add_generation_prompt=False), max_tokens=4)
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens < chat(client, max_tokens=1).usage.prompt_tokens
    assert reply.choices[0].message.content == expected.choices[0].text
    assert reply.choices[0].message.role == "user"  # it continues the last message's turn (vLLM)


def test_continue_final_message(client):
    messages = [*PARIS, {"role": "assistant", "content": "The capital of France is"}]
    reply = chat(client, messages, max_tokens=3,
                 extra_body={"continue_final_message": True, "add_generation_prompt": False})
    expected = complete(client, chatml(messages, continue_final=True), max_tokens=3)
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    assert reply.choices[0].message.content == expected.choices[0].text == " Paris."
    bad_request(lambda: chat(client, messages, extra_body={"continue_final_message": True}),
                "continue_final_message")
    bad_request(lambda: chat(client, extra_body={"continue_final_message": True, "add_generation_prompt": False}),
                "continue_final_message")


def test_user_and_metadata_are_accepted_and_ignored(client):
    reply = chat(client, user="someone", parallel_tool_calls=False, store=False, metadata={"team": "x"})
    assert reply.choices[0].message.content == PARIS_ANSWER


@pytest.mark.parametrize("param,value", [
    ("chat_template", "{{ messages }}"), ("add_special_tokens", True), ("logprob_token_ids", [1]),
])
def test_unsupported_features_are_400(client, param, value):
    # Features this worker does not have fail loudly instead of being silently ignored.
    bad_request(lambda: chat(client, extra_body={param: value}), param)


def test_unknown_parameter_is_rejected_by_name(client):
    error = bad_request(lambda: chat(client, extra_body={"frobnicate": 1}), "frobnicate")
    assert "frobnicate" in error["message"]


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize("param,value", [
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("n", 0), ("n", 33), ("best_of", 0), ("presence_penalty", 2.5), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("max_tokens", 0), ("seed", 2**64), ("stop", [""]), ("stop", ["x"] * 33),
    ("stop_token_ids", [-1]), ("stop_token_ids", [10**9]), ("min_tokens", -1), ("logprobs", -1),
    ("echo", "maybe"), ("suffix", 3), ("prompt", None),
])
def test_bad_values_are_400_naming_the_parameter(client, param, value):
    error = bad_request(lambda: complete(client, extra_body={param: value}), param)
    assert param in error["message"]


@pytest.mark.parametrize("param,value", [
    ("temperature", 3), ("top_logprobs", -1), ("max_completion_tokens", 0), ("logprobs", "x"),
    ("chat_template_kwargs", "x"), ("add_generation_prompt", "x"), ("n", 1.5),
])
def test_bad_chat_values_are_400_naming_the_parameter(client, param, value):
    bad_request(lambda: chat(client, extra_body={param: value}), param)


def test_malformed_json_is_400(gateway_url):
    response = httpx.post(f"{gateway_url}/chat/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"


# ---------------------------------------------------------------- concurrency


def test_concurrent_requests_do_not_mix(gateway_url):
    """Eight requests at once, each with its own prompt and parameters and an output only it can produce."""
    hello, bang, paris_token = 19556, 17, 7042  # "Hello", "!", " Paris"

    async def run(ac: openai.AsyncOpenAI):
        async def forced_chat(token, stream):
            reply = await ac.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Say {token}"}], max_tokens=3, temperature=0,
                logit_bias={str(token): 100}, stream=stream)
            if stream:
                return stream_texts([c async for c in reply])
            return {c.index: c.message.content for c in reply.choices}

        async def forced_completion(token, n):
            reply = await ac.completions.create(model=MODEL, prompt=f"Token {token}:", max_tokens=3, n=n,
                                                temperature=0, logit_bias={str(token): 100})
            return {c.index: c.text for c in reply.choices}

        async def paris(stream):
            reply = await ac.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=12, temperature=0,
                                                     stop=["France"], stream=stream)
            if stream:
                return stream_texts([c async for c in reply])
            return {c.index: c.message.content for c in reply.choices}

        async def counting():
            reply = await ac.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3, echo=True,
                                                temperature=0, stop=["5"])
            return {c.index: c.text for c in reply.choices}

        return await asyncio.gather(
            forced_chat(hello, False), forced_chat(bang, True), forced_completion(BANANA, 1),
            forced_completion(paris_token, 2), paris(False), paris(True), counting(), forced_chat(hello, True))

    hellos, bangs, bananas, paris_n, cut, cut_streamed, count, hellos_streamed = run_async(gateway_url, run)
    assert hellos == hellos_streamed == {0: "Hello" * 3}
    assert bangs == {0: "!!!"}
    assert bananas == {0: " banana" * 3}
    assert paris_n == {0: " Paris" * 3, 1: " Paris" * 3}
    assert cut == cut_streamed == {0: "The capital of "}
    assert count[0].startswith("1, 2, 3, 4") and "5" not in count[0]


# ---------------------------------------------------------------- chat_template_kwargs

# SmolLM2's own template with one change: the default system prompt comes from a template variable, so that
# chat_template_kwargs has something to act on (the model's template reads no variables of its own).
PERSONA_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n' + (persona | default('" + DEFAULT_SYSTEM + "')) + '<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def persona_client():
    process, url = start_gateway({"CUSTOM_CHAT_TEMPLATE": PERSONA_TEMPLATE, "MAX_MODEL_LEN": "512",
                                  "MAX_NUM_SEQS": "4"})
    try:
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_template(client, persona_client):
    default = chat(persona_client, max_tokens=8)
    assert default.choices[0].message.content == PARIS_ANSWER  # the same prompt as the model's own template
    assert default.usage.prompt_tokens == chat(client, max_tokens=1).usage.prompt_tokens

    persona = "You are a pirate. You answer every question like a pirate would."
    reply = chat(persona_client, max_tokens=8, extra_body={"chat_template_kwargs": {"persona": persona}})
    system = [{"role": "system", "content": persona}, *PARIS]
    expected = complete(client, chatml(system), max_tokens=8)
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens != default.usage.prompt_tokens
    assert reply.choices[0].message.content == expected.choices[0].text
    # A template variable never overrides the request's own fields (vLLM merges them the same way).
    same = chat(persona_client, max_tokens=1, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert same.usage.prompt_tokens == default.usage.prompt_tokens


@pytest.mark.parametrize("exclude_none", [False, True])
def test_the_sdks_own_reply_message_goes_back_as_it_was_dumped(client, exclude_none):
    """A client keeps its history as the SDK's reply objects dumped to JSON (`refusal`, `annotations`, `audio`,
    `function_call` as None, this worker's `reasoning` fields) and sends them back with the tool's result."""
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
        "additionalProperties": False}}}]
    question = [{"role": "user", "content": "What time is it in Paris?"}]
    reply = client.chat.completions.create(model=MODEL, messages=question, tools=tools, max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = reply.choices[0].message
    (call,) = message.tool_calls
    history = question + [message.model_dump(exclude_none=exclude_none),
                          {"role": "tool", "tool_call_id": call.id, "content": "14:05"}]
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=tools, tool_choice="none",
                                            max_tokens=2)
    assert follow.choices[0].finish_reason == "length"
    # A value this worker cannot honour is still refused, naming the field; a misspelt field too.
    for field, value in (("audio", {"id": "audio_1"}), ("refusals", None)):
        sent = dict(history[1], **{field: value})
        with pytest.raises(openai.BadRequestError) as failure:
            client.chat.completions.create(model=MODEL, messages=[history[0], sent, history[2]], max_tokens=2)
        assert field in failure.value.body["message"] or field in str(failure.value.body.get("param")), \
            failure.value.body
