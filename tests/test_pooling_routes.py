"""The OpenAI surface beyond chat and completions, on the embedded model through the real gateway: tokenizer,
embeddings (with the official client), pooling, score, rerank, metrics, stats and X-Request-Id; and the same
routes as jobs through the handler. Checked by effect: round trips, equal and different vectors, unit
length, batch equals one at a time, rankings, counters growing by the tokens a request used."""
from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest

from api_helpers import metric_samples, metric_value
from conftest import MODEL, run_job

TEXT = "The capital of France is Paris."
QUERY = "How do I bake sourdough bread at home?"
UNRELATED = ["The stock market fell sharply on Tuesday.", "Penguins live in the southern hemisphere.",
             "Jupiter is the largest planet."]


@pytest.fixture(scope="module")
def root(gateway_url):
    return gateway_url.removesuffix("/openai/v1")


def post(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url, json=body, timeout=300, **kwargs)


def embed(client, texts, **kwargs) -> list[np.ndarray]:
    result = client.embeddings.create(model=MODEL, input=texts, encoding_format="float", **kwargs)
    assert [d.index for d in result.data] == list(range(len(result.data)))
    return [np.array(d.embedding) for d in result.data]


# ---------------------------------------------------------------- tokenizer


def test_tokenize_detokenize_round_trip(root, gateway_url):
    text = "Hello world, tokenizers are fun!"
    tokens = post(f"{root}/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 3
    assert tokens["max_model_len"] == httpx.get(f"{gateway_url}/models").json()["data"][0]["max_model_len"]
    assert "".join(tokens["token_strs"]).replace("Ġ", " ") == text  # byte-level pieces spell the text
    back = post(f"{gateway_url}/detokenize", {"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    assert post(f"{root}/v1/tokenize", {"prompt": text}).json()["tokens"] == tokens["tokens"]


def test_tokenize_messages_counts_what_chat_feeds_the_model(root, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokens = post(f"{root}/tokenize", {"messages": messages}).json()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert tokens["count"] == reply.usage.prompt_tokens
    without = post(f"{root}/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert without["tokens"] == tokens["tokens"][:without["count"]] and without["count"] < tokens["count"]


def test_tokenizer_routes_reject_bad_input_naming_the_field(root):
    cases = [("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
             ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
             ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
             ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
             ("/detokenize", {"tokens": ["a"]}, "tokens[0]")]
    for path, body, param in cases:
        response = post(root + path, body)
        assert response.status_code == 400, (path, body, response.text)
        assert response.json()["error"]["param"] == param, response.json()


# ---------------------------------------------------------------- embeddings


def test_embeddings_equal_for_equal_texts_differ_otherwise_and_have_unit_length(client):
    same_a, same_b, other = embed(client, [TEXT, TEXT, "Bananas are yellow."])
    assert np.array_equal(same_a, same_b)
    assert not np.allclose(same_a, other, atol=1e-3)
    for vector in (same_a, other):
        assert vector.shape == (576,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    raw = embed(client, [TEXT], extra_body={"normalize": False})[0]
    assert abs(np.linalg.norm(raw) - 1) > 0.1 and np.allclose(raw / np.linalg.norm(raw), same_a, atol=1e-5)


def test_base64_embeddings_decode_to_the_float_ones(client):
    floats = embed(client, [TEXT, QUERY])
    encoded = client.embeddings.create(model=MODEL, input=[TEXT, QUERY], encoding_format="base64")
    for data, expected in zip(encoded.data, floats):
        assert isinstance(data.embedding, str)
        decoded = np.frombuffer(base64.b64decode(data.embedding), dtype="<f4")
        assert np.array_equal(decoded, expected.astype(np.float32))
    # The client asks for base64 and decodes it. Compared with a float reply of the same one-input batch: another
    # batch shape may round differently (batch invariance is the next test's, to 1e-5).
    default = client.embeddings.create(model=MODEL, input=TEXT)
    assert np.allclose(default.data[0].embedding, embed(client, [TEXT])[0], atol=1e-7)


def test_batched_embeddings_equal_one_at_a_time_and_token_ids_equal_text(client, root):
    texts = [TEXT, QUERY, "Hi", " ".join(UNRELATED)]  # different lengths: padding must not leak into results
    batched = embed(client, texts)
    for text, vector in zip(texts, batched):
        assert np.allclose(embed(client, text)[0], vector, atol=1e-5)
    ids = post(f"{root}/tokenize", {"prompt": QUERY}).json()["tokens"]
    assert np.allclose(embed(client, [ids])[0], batched[1], atol=1e-5)
    result = client.embeddings.create(model=MODEL, input=texts)
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(texts)


def test_embeddings_reject_what_they_cannot_honour(client):
    def status(**kwargs):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL, **kwargs)
        return info.value.body

    assert status(input=TEXT, dimensions=8)["param"] == "dimensions"  # not a matryoshka model
    assert status(input=TEXT, extra_body={"truncate_prompt_tokens": 4})["param"] == "truncate_prompt_tokens"
    assert status(input="")["param"] == "input"
    assert status(input=[[1, 2], []])["param"] == "input"
    assert status(input=[[5, 10**9]])["param"] == "input"
    assert status(input=[0] * 9000)["param"] == "input"  # over the context
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other-model", input=TEXT)


def test_pooling_returns_the_pooled_hidden_states(client, root):
    expected = embed(client, [TEXT, QUERY])
    body = post(f"{root}/pooling", {"model": MODEL, "input": [TEXT, QUERY]}).json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    for data, vector in zip(body["data"], expected):
        assert np.allclose(data["data"], vector, atol=1e-6)
    wrong = post(f"{root}/pooling", {"input": TEXT, "task": "classify"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "task"


# ---------------------------------------------------------------- score and rerank


def test_rerank_puts_the_document_repeating_the_query_first(root, gateway_url):
    documents = [UNRELATED[0], f"{QUERY} {QUERY}", UNRELATED[1], UNRELATED[2]]
    for url in (f"{root}/rerank", f"{root}/v1/rerank", f"{root}/v2/rerank", f"{gateway_url}/rerank"):
        body = post(url, {"model": MODEL, "query": QUERY, "documents": documents}).json()
        results = body["results"]
        assert results[0]["index"] == 1 and results[0]["document"] == {"text": documents[1]}, body
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True) and sorted(r["index"] for r in results) == [0, 1, 2, 3]
        assert body["usage"]["total_tokens"] > 0
    top = post(f"{root}/rerank", {"query": QUERY, "documents": documents, "top_n": 2}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in results[:2]]


def test_score_is_the_cosine_of_the_embeddings(client, root):
    vectors = embed(client, [QUERY, TEXT, UNRELATED[0]])
    body = post(f"{root}/score", {"model": MODEL, "text_1": QUERY, "text_2": [TEXT, UNRELATED[0]]}).json()
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "score"
    for data, other in zip(body["data"], vectors[1:]):
        cosine = float(vectors[0] @ other / np.linalg.norm(vectors[0]) / np.linalg.norm(other))
        assert abs(data["score"] - cosine) < 1e-5
    pairwise = post(f"{root}/v1/score", {"text_1": [TEXT, QUERY], "text_2": [TEXT, QUERY]}).json()
    assert all(abs(d["score"] - 1) < 1e-5 for d in pairwise["data"])
    mismatched = post(f"{root}/score", {"text_1": [TEXT, QUERY], "text_2": [TEXT, QUERY, TEXT]})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_1"


def test_score_and_rerank_reject_unknown_fields(root):
    for path, body in (("/score", {"text_1": "a", "text_2": "b", "extra": 1}),
                       ("/rerank", {"query": "a", "documents": ["b"], "extra": 1}),
                       ("/rerank", {"query": "a", "documents": []}),
                       ("/pooling", {"input": "a", "extra": 1})):
        response = post(root + path, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] in ("extra", "documents"), response.json()


def test_embeddings_do_not_disturb_a_running_generation(async_client):
    async def scenario():
        alone = await async_client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                                      temperature=0, extra_body={"ignore_eos": True})
        generation = asyncio.create_task(async_client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}))
        embeddings = [async_client.embeddings.create(model=MODEL, input=[TEXT, QUERY] * 4, encoding_format="float")
                      for _ in range(3)]
        bad = async_client.embeddings.create(model=MODEL, input=[[5, 10**9]])
        results = await asyncio.gather(*embeddings, bad, return_exceptions=True)
        assert isinstance(results[-1], openai.BadRequestError)
        assert all(len(r.data) == 8 for r in results[:-1])
        return alone.choices[0].text, (await generation).choices[0].text

    alone, together = asyncio.run(scenario())
    assert together == alone


# ---------------------------------------------------------------- metrics, stats, request ids


def test_metrics_counters_grow_by_the_tokens_a_request_used(root, client):
    client.embeddings.create(model=MODEL, input="warm up")  # the model is loaded and labels exist
    before = metric_samples(root)
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    after = metric_samples(root)
    assert metric_value(after, "vllm:generation_tokens_total") - metric_value(before, "vllm:generation_tokens_total") == 5
    assert metric_value(after, "vllm:prompt_tokens_total") - metric_value(before, "vllm:prompt_tokens_total") \
        == reply.usage.prompt_tokens
    for histogram in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                      "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"):
        assert metric_value(after, histogram + "_count") - metric_value(before, histogram + "_count") == 1, histogram
    assert metric_value(after, "vllm:time_to_first_token_seconds_sum") > metric_value(before, "vllm:time_to_first_token_seconds_sum")
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (gauge, (("model_name", MODEL),)) in after, gauge
    embedded = client.embeddings.create(model=MODEL, input=[TEXT, QUERY])
    assert metric_value(metric_samples(root), "vllm:prompt_tokens_total") - metric_value(after, "vllm:prompt_tokens_total") \
        == embedded.usage.prompt_tokens


def test_stats_report_load_and_token_rates(root, gateway_url, client):
    before = httpx.get(f"{root}/stats", timeout=60).json()
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    stats = httpx.get(f"{gateway_url}/stats", timeout=60).json()
    assert stats["model"] == MODEL and stats["model_loaded"] is True
    assert stats["running_requests"] == 0 and stats["waiting_requests"] == 0
    assert stats["kv_cache"]["capacity_tokens"] > 0 and 0 <= stats["kv_cache"]["usage"] <= 1
    assert stats["totals"]["generation_tokens"] - before["totals"]["generation_tokens"] == 4
    assert stats["totals"]["requests"] - before["totals"]["requests"] == 1
    assert stats["last_minute"]["generation_tokens"] >= 4 and stats["last_minute"]["generation_tokens_per_s"] > 0


def test_request_id_header_comes_back(root, gateway_url):
    response = post(f"{gateway_url}/embeddings", {"input": TEXT}, headers={"X-Request-Id": "req-embed-42"})
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "req-embed-42"
    bad_body = httpx.post(f"{root}/tokenize", content=b"{", headers={"X-Request-Id": "req-bad-1"})
    assert bad_body.status_code == 400 and bad_body.headers["X-Request-Id"] == "req-bad-1"
    generated = post(f"{root}/tokenize", {"prompt": "x"})
    assert generated.headers["X-Request-Id"].startswith("local-")
    invalid = post(f"{root}/tokenize", {"prompt": "x"}, headers={"X-Request-Id": "a" * 200})
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "X-Request-Id"


# ---------------------------------------------------------------- as jobs


def test_the_same_routes_as_jobs_through_the_handler(worker):
    def job(route, body=None):
        parts = run_job({"openai_route": route, "openai_input": body})
        assert len(parts) == 1
        return parts[0]

    tokens = job("/v1/tokenize", {"prompt": TEXT})["tokens"]
    assert job("/openai/v1/detokenize", {"tokens": tokens}) == {"prompt": TEXT}
    embeddings = job("/v1/embeddings", {"input": [TEXT, TEXT]})["data"]
    assert embeddings[0]["embedding"] == embeddings[1]["embedding"]
    assert job("/v1/pooling", {"input": TEXT})["data"][0]["data"] == embeddings[0]["embedding"]
    assert job("/v1/score", {"text_1": TEXT, "text_2": TEXT})["data"][0]["score"] == pytest.approx(1, abs=1e-5)
    for route in ("/v1/rerank", "/v2/rerank", "/rerank"):
        ranked = job(route, {"query": QUERY, "documents": [UNRELATED[0], QUERY]})["results"]
        assert ranked[0]["index"] == 1
    metrics = job("/v1/metrics")
    assert metrics["object"] == "metrics" and "vllm:prompt_tokens_total" in metrics["text"]
    assert job("/v1/stats")["totals"]["prompt_tokens"] > 0
    assert job("/v1/embeddings", {"input": TEXT, "bogus": True})["error"]["param"] == "bogus"
    assert job("/v3/rerank", {})["error"]["code"] == 404
