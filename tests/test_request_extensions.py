"""vLLM's request extensions on chat and completions, through the real gateway with the official client, each
proven by its effect on the embedded model: prompt_logprobs, truncate_prompt_tokens, allowed_token_ids,
bad_words, return_token_ids, return_tokens_as_token_ids, cache_salt, priority and request_id. Their engine side is
tests/test_request_controls.py."""
from __future__ import annotations

from api_helpers import bad_request, complete
from conftest import MODEL, run_job

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client, messages=PARIS, **extra):
    kwargs = {k: extra.pop(k) for k in ("max_tokens", "logprobs", "top_logprobs", "stream") if k in extra}
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, extra_body=extra, **kwargs)


def test_prompt_logprobs_score_every_prompt_token(client):
    reply = chat(client, prompt_logprobs=2)
    scored = reply.model_extra["prompt_logprobs"]
    usage = reply.usage.prompt_tokens
    assert len(scored) == usage and scored[0] is None
    for entry in scored[1:]:
        assert 1 <= len(entry) <= 3  # the prompt's own token and up to 2 alternatives
        for token_id, value in entry.items():
            assert int(token_id) >= 0 and value["logprob"] <= 0 and value["rank"] >= 1
            assert isinstance(value["decoded_token"], str)
    # The prompt's own token is in each entry, with the rank its logprob earns among the alternatives.
    ids = chat(client, return_token_ids=True).model_extra["prompt_token_ids"]
    for token_id, entry in zip(ids[1:], scored[1:]):
        own = entry[str(token_id)]
        better = [v for k, v in entry.items() if k != str(token_id) and v["logprob"] > own["logprob"]]
        assert own["rank"] >= len(better) + 1
    # Completions report them per choice; absent unless asked.
    choice = complete(client, extra_body={"prompt_logprobs": 1}).choices[0]
    assert choice.model_extra["prompt_logprobs"][0] is None and len(choice.model_extra["prompt_logprobs"]) == 5
    assert "prompt_logprobs" not in complete(client).choices[0].model_extra
    assert "prompt_logprobs" not in chat(client).model_extra


def test_prompt_logprobs_cannot_stream(client):
    bad_request(lambda: chat(client, prompt_logprobs=1, stream=True), "prompt_logprobs")


def test_truncate_prompt_tokens_keeps_the_end(client):
    ids = complete(client, extra_body={"return_token_ids": True}).choices[0].model_extra["prompt_token_ids"]
    cut = complete(client, extra_body={"return_token_ids": True, "truncate_prompt_tokens": 3}).choices[0]
    assert cut.model_extra["prompt_token_ids"] == ids[-3:]
    assert cut.text == complete(client, prompt=ids[-3:]).choices[0].text
    assert chat(client, truncate_prompt_tokens=4).usage.prompt_tokens == 4
    # A prompt longer than the context serves once cut.
    long_ids = ids * 2000
    assert complete(client, prompt=long_ids, extra_body={"truncate_prompt_tokens": 64}).usage.prompt_tokens == 64
    bad_request(lambda: complete(client, extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens")


def test_allowed_token_ids_confine_the_reply(client):
    free = chat(client, return_token_ids=True).choices[0].model_extra["token_ids"]
    allowed = sorted(set(free[2:5]) | {30})
    confined = chat(client, allowed_token_ids=allowed, return_token_ids=True).choices[0].model_extra["token_ids"]
    assert set(confined) <= set(allowed) and confined != free
    bad_request(lambda: chat(client, allowed_token_ids=[10**7]), "allowed_token_ids")
    bad_request(lambda: chat(client, allowed_token_ids=[]), "allowed_token_ids")


def test_bad_words_never_appear(client):
    free = chat(client, max_tokens=12).choices[0].message.content
    assert "Paris" in free
    banned = chat(client, max_tokens=12, bad_words=["Paris"]).choices[0].message.content
    assert "Paris" not in banned
    text = complete(client, max_tokens=6).choices[0].text
    word = text.split()[0]
    assert word not in complete(client, max_tokens=6, extra_body={"bad_words": [word]}).choices[0].text.split()
    bad_request(lambda: chat(client, bad_words=["  "]), "bad_words")


def test_return_token_ids_on_whole_and_streamed_replies(client):
    whole = chat(client, return_token_ids=True)
    prompt_ids = whole.model_extra["prompt_token_ids"]
    token_ids = whole.choices[0].model_extra["token_ids"]
    assert len(prompt_ids) == whole.usage.prompt_tokens and len(token_ids) == whole.usage.completion_tokens
    chunks = list(chat(client, return_token_ids=True, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])] == token_ids
    streamed = list(complete(client, stream=True, extra_body={"return_token_ids": True}))
    ids = complete(client, extra_body={"return_token_ids": True}).choices[0].model_extra
    assert streamed[0].choices[0].model_extra["prompt_token_ids"] == ids["prompt_token_ids"]
    assert [t for c in streamed for t in c.choices[0].model_extra.get("token_ids") or []] == ids["token_ids"]
    assert "token_ids" not in chat(client).choices[0].model_extra  # only when asked


def test_return_tokens_as_token_ids_names_tokens_by_id(client):
    reply = chat(client, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True)
    ids = reply.choices[0].model_extra["token_ids"]
    entries = reply.choices[0].logprobs.content
    assert [e.token for e in entries] == [f"token_id:{i}" for i in ids]
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
    legacy = complete(client, logprobs=1, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = legacy.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{i}" for i in choice.model_extra["token_ids"]]


def test_request_id_names_the_response(client, gateway_url):
    assert chat(client, request_id="my-job-42").id == "chatcmpl-my-job-42"
    assert complete(client, extra_body={"request_id": "my-job-43"}).id == "cmpl-my-job-43"
    bad_request(lambda: chat(client, request_id="has spaces"), "request_id")


def test_cache_salt_and_priority_reach_the_engine(client, worker):
    """Their effects (isolation, admission order) are proven on the engine (test_request_controls.py); here the
    fields reach it: the same greedy answer over HTTP, and jobs through the real handler in this process whose
    salted repeat hits the prefix cache only under its own salt."""
    base = chat(client).choices[0].message.content
    assert chat(client, cache_salt="tenant-a", priority=-5).choices[0].message.content == base
    messages = [{"role": "user", "content": "A question only the salt test asks, long enough to fill blocks " * 4}]

    def hits(salt: str) -> int:
        before = worker.engine.stats()["prefix_cache_hit_tokens"]
        run_job({"openai_route": "/v1/chat/completions", "openai_input": {
            "messages": messages, "max_tokens": 1, "cache_salt": salt}})
        return worker.engine.stats()["prefix_cache_hit_tokens"] - before

    hits("tenant-b")
    other, same = hits("tenant-c"), hits("tenant-b")
    assert same >= other + 32  # the salted prompt's own blocks, beyond the template's shared head
    bad_request(lambda: chat(client, cache_salt=""), "cache_salt")
    bad_request(lambda: chat(client, priority=2**40), "priority")
