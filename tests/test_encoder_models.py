"""Models without a language-model head served as MODEL_NAME. A tiny random BertForSequenceClassification
(built here with the embedded model's tokenizer) scores pairs with its head on /score and /rerank, gives its
encoder's embeddings, and refuses chat and completions with a 400 that says why; its gateway's log also
proves that X-Request-Id tags every line of a request. A plain BertModel with a sentence-transformers
configuration embeds with the pooling that configuration names."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from conftest import start_gateway

NAME = "tiny-cross-encoder"
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "Bananas are yellow.", "Paris is a city in France.",
             "The stock market fell sharply on Tuesday."]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from engine.config import EngineConfig
    from engine.loader import model_folder

    folder = tmp_path_factory.mktemp("cross-encoder")
    tokenizer = AutoTokenizer.from_pretrained(model_folder(EngineConfig()))
    torch.manual_seed(0)
    # is_matryoshka lets requests shorten its embeddings (vLLM's config flag for such models).
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=1, is_matryoshka=True,
                        initializer_range=0.5)  # wide weights, so random scores differ visibly between pairs
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, model, tokenizer


@pytest.fixture(scope="module")
def gateway(cross_encoder):
    log: list[str] = []
    process, url = start_gateway({"MODEL_NAME": str(cross_encoder[0]), "OPENAI_SERVED_MODEL_NAME_OVERRIDE": NAME},
                                 log=log)
    yield url.removesuffix("/openai/v1"), log
    process.terminate()
    process.wait(timeout=20)


def reference_scores(cross_encoder, query: str, documents: list[str]) -> list[float]:
    _, model, tokenizer = cross_encoder
    with torch.inference_mode():
        return [torch.sigmoid(model(**tokenizer(query, d, return_tensors="pt")).logits)[0, 0].item()
                for d in documents]


def post(url: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120, **kwargs)


@pytest.mark.slow
def test_cross_encoder_scores_pairs_with_its_head(gateway, cross_encoder):
    root, _ = gateway
    expected = reference_scores(cross_encoder, QUERY, DOCUMENTS)
    assert max(expected) - min(expected) > 1e-2, expected  # the random head tells the pairs apart
    scores = post(f"{root}/score", {"model": NAME, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=1e-5)
    ranked = post(f"{root}/v1/rerank", {"model": NAME, "query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)[:3]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([expected[i] for i in order], abs=1e-5)
    assert ranked["results"][0]["document"]["text"] == DOCUMENTS[order[0]]
    pooled = post(f"{root}/pooling", {"input": DOCUMENTS[0]}).json()["data"][0]["data"]  # the head, one text
    _, model, tokenizer = cross_encoder
    with torch.inference_mode():
        alone = torch.sigmoid(model(**tokenizer(DOCUMENTS[0], return_tensors="pt")).logits)[0].tolist()
    assert pooled == pytest.approx(alone, abs=1e-5)


def test_cross_encoder_cannot_chat_or_complete(gateway):
    root, _ = gateway
    client = openai.OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}])
    assert "cannot do chat completions" in chat.value.body["message"]
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=NAME, prompt="Hi")
    assert "cannot do completions" in completion.value.body["message"]
    assert post(f"{root}/tokenize", {"prompt": "Hi"}).json()["count"] == 1


def test_cross_encoder_embeddings_from_its_encoder_with_matryoshka_dimensions(gateway, cross_encoder):
    root, _ = gateway
    client = openai.OpenAI(base_url=f"{root}/openai/v1", api_key="unused", max_retries=0)
    full = client.embeddings.create(model=NAME, input=QUERY, encoding_format="float")
    assert len(full.data[0].embedding) == 32 and abs(np.linalg.norm(full.data[0].embedding) - 1) < 1e-5
    raw = np.array(client.embeddings.create(model=NAME, input=QUERY, encoding_format="float",
                                            extra_body={"normalize": False}).data[0].embedding)
    _, model, tokenizer = cross_encoder
    with torch.inference_mode():  # the first ([CLS]) position of the encoder: BERT's usual pooling
        hidden = model.bert(**tokenizer(QUERY, return_tensors="pt")).last_hidden_state[0, 0].numpy()
    assert np.allclose(raw, hidden, atol=1e-5)
    short = client.embeddings.create(model=NAME, input=QUERY, encoding_format="float", dimensions=8)
    assert np.allclose(short.data[0].embedding, raw[:8] / np.linalg.norm(raw[:8]), atol=1e-5)
    with pytest.raises(openai.BadRequestError) as too_wide:
        client.embeddings.create(model=NAME, input=QUERY, dimensions=64)
    assert too_wide.value.body["param"] == "dimensions"


def test_request_id_tags_the_response_and_every_log_line(gateway):
    root, log = gateway
    response = post(f"{root}/rerank", {"query": QUERY, "documents": DOCUMENTS}, headers={"X-Request-Id": "trace-7f3a"})
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "trace-7f3a"
    failing = post(f"{root}/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS},
                   headers={"X-Request-Id": "trace-bad-9"})
    assert failing.status_code == 400 and failing.headers["X-Request-Id"] == "trace-bad-9"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any("job=trace-bad-9" in line for line in log):
        time.sleep(0.1)
    mentions = [line for line in log if response.json()["id"] in line]  # every line about the rerank request
    assert any("request done" in line for line in mentions), log[-20:]
    assert all("job=trace-7f3a" in line for line in mentions), mentions
    assert any("job=trace-bad-9" in line and "400" in line for line in log), log[-20:]


def _plain_encoder(tmp_path, tokenizer, modules: list[dict]):
    from transformers import BertConfig, BertModel

    torch.manual_seed(1)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, initializer_range=0.5)
    model = BertModel(config, add_pooling_layer=False).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    return model


def _router(folder):
    from engine import AsyncEngine, EngineConfig
    from openai_compat.config import ServingConfig
    from openai_compat.jobs import JobRouter
    from openai_compat.serving import OpenAIServing

    # float32, as the references below: DTYPE=auto picks bfloat16 on CPUs with native bfloat16 products
    engine = AsyncEngine(EngineConfig(model=str(folder), cache_dir=folder.parent / "cache", dtype="float32"))
    return engine, JobRouter(OpenAIServing(engine, ServingConfig()), ServingConfig())


def _job(router, route, body):
    async def collect():
        return [part async for part in router.run({"openai_route": route, "openai_input": body})]

    parts = asyncio.run(collect())
    assert len(parts) == 1
    return parts[0]


ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


@pytest.mark.slow
def test_plain_encoder_embeds_with_its_sentence_transformers_pooling(tmp_path, cross_encoder):
    tokenizer = cross_encoder[2]
    model = _plain_encoder(tmp_path / "encoder", tokenizer, ST_MODULES)  # mean pooling, no Normalize module
    engine, router = _router(tmp_path / "encoder")
    try:
        texts = [QUERY, DOCUMENTS[1]]
        data = _job(router, "/v1/embeddings", {"input": texts})["data"]
        with torch.inference_mode():
            for text, item in zip(texts, data):
                expected = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].mean(dim=0)
                assert np.allclose(item["embedding"], expected.numpy(), atol=1e-5)
        assert abs(np.linalg.norm(data[0]["embedding"]) - 1) > 0.01  # the pipeline has no Normalize module
        score = _job(router, "/score", {"text_1": texts[0], "text_2": texts[1]})["data"][0]["score"]
        a, b = (np.array(item["embedding"]) for item in data)
        assert score == pytest.approx(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), abs=1e-5)
        refused = _job(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
        assert refused["error"]["code"] == 400 and "an embedding model" in refused["error"]["message"]
    finally:
        engine.close()


@pytest.mark.slow
def test_a_sentence_transformers_module_the_worker_cannot_run_is_a_400(tmp_path, cross_encoder):
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    _plain_encoder(tmp_path / "encoder", cross_encoder[2], ST_MODULES + [dense])
    engine, router = _router(tmp_path / "encoder")
    try:
        error = _job(router, "/v1/embeddings", {"input": QUERY})["error"]
        assert error["code"] == 400 and "sentence_transformers.models.Dense" in error["message"]
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("pad_token_id", [2, None])
def test_decoder_cross_encoder_scores_a_batch_as_one_pair_at_a_time(tmp_path, cross_encoder, pad_token_id):
    """A decoder's classification head reads the last token that is not padding: batched pairs of different
    lengths must score as each pair alone, with or without a pad id in the config."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = cross_encoder[2]
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                         pad_token_id=pad_token_id, initializer_range=0.5)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(tmp_path / "reranker")
    tokenizer.save_pretrained(tmp_path / "reranker")
    engine, router = _router(tmp_path / "reranker")
    try:
        scores = _job(router, "/score", {"text_1": QUERY, "text_2": DOCUMENTS})["data"]
        expected = reference_scores((None, model, tokenizer), QUERY, DOCUMENTS)
        assert [d["score"] for d in scores] == pytest.approx(expected, abs=1e-5)
    finally:
        engine.close()
