"""Malformed input, through the real handler (job inputs) and the real gateway process (HTTP bodies, raw bytes
included), on the real embedded model.

Every case must get one OpenAI error body `{"error": {"message", "type", "param", "code"}}` whose message
names the problem, with the right status, within seconds, and without traceback text; and the worker must keep
serving: after every case its health says the engine has not failed and holds no request, and a real generation
round trip follows every few cases and the last one (KeepsServing), naming the cases since the previous one.
test_handler.py and test_openai_conformance.py hold the basic cases (unknown model, bad ranges, wrong role, empty
message list, ...); this file covers the rest.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import httpx
import pytest

from api_helpers import metric_samples, metric_value
from conftest import run_job

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
VOCAB = 49152  # SmolLM2's vocabulary: ids 0..49151
GOOD = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
HUGE_TEXT = "hello " * 300_000  # 300,000 tokens, far past the 8192-token context
TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestTooLargeError", 500: "InternalServerError"}
TRACEBACK_MARKERS = ("Traceback", 'File "', '.py", line', "site-packages", "raise ")


def nested(depth: int, leaf=1, key: str | None = None):
    """`depth` levels of lists (or of objects under `key`) around `leaf`, built without recursion."""
    value = leaf
    for _ in range(depth):
        value = [value] if key is None else {key: value}
    return value


def assert_error(body, status: int, words: tuple[str, ...], param="any") -> dict:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert (error["code"], error["type"]) == (status, TYPES[status]), error
    message = error["message"]
    assert isinstance(message, str) and message
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    for marker in TRACEBACK_MARKERS:
        assert marker not in message, message
    if param != "any":
        assert error["param"] == param, error
    return error


def _in_process_engine_tokens() -> tuple[int, int]:
    from worker import handler
    stats = handler.get_worker().engine.stats() or {}
    return stats.get("prompt_tokens_total", 0), stats.get("generation_tokens_total", 0)


def _gateway_engine_tokens(base: str) -> tuple[float, float]:
    """The gateway's prompt and generated token counters, from its Prometheus page."""
    samples = metric_samples(base)
    return metric_value(samples, "vllm:prompt_tokens_total"), metric_value(samples, "vllm:generation_tokens_total")


def job_error(job_input, job_id: str = "bad-input") -> dict:
    """The one part a refused job yields. Refused before the engine: it prefilled and generated nothing."""
    before = _in_process_engine_tokens()
    parts = run_job(job_input, job_id)
    assert _in_process_engine_tokens() == before, "a refused job reached the engine"
    assert len(parts) == 1, parts
    return parts[0]


def http(gateway_url: str, method: str, path: str, content: bytes | None = None, refused: bool = True
         ) -> httpx.Response:
    """A raw request to the gateway; one that is `refused` must not reach the engine (no token prefilled or
    generated)."""
    base = gateway_url.removesuffix("/openai/v1")
    before = _gateway_engine_tokens(base) if refused else None
    response = httpx.request(method, base + path, content=content, timeout=60,
                             headers={"content-type": "application/json"})
    if refused:
        assert _gateway_engine_tokens(base) == before, "a refused request reached the engine"
    return response


def http_error(response: httpx.Response, status: int, words: tuple[str, ...], param="any") -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    return assert_error(response.json(), status, words, param)


def assert_worker_serves(after: str = "") -> None:
    (body,) = run_job({"openai_route": COMPLETIONS, "openai_input": GOOD}, "good-after-bad")
    assert body["choices"][0]["text"] == " Paris", (after, body)


def assert_gateway_serves(gateway_url: str, after: str = "") -> None:
    response = http(gateway_url, "POST", "/openai/v1/completions", json.dumps(GOOD).encode(), refused=False)
    assert response.status_code == 200, (after, response.text[:500])
    assert response.json()["choices"][0]["text"] == " Paris", after


def assert_idle_and_healthy(read_health, side: str) -> None:
    """The engine has not failed and holds no request: the bad one left nothing behind (a request's last output
    can reach its caller a moment before the loop lets go of it, hence the short wait)."""
    deadline = time.monotonic() + 5
    while True:
        state = read_health()
        assert state["status"] == "ok", (side, state)
        if not state["model_loaded"] or state["requests_in_engine"] == 0:
            return
        assert time.monotonic() < deadline, (side, "a request stayed in the engine", state)
        time.sleep(0.05)


class KeepsServing:
    """Whether the worker and the gateway keep serving after bad input, checked at two depths. After every case,
    cheaply: its health (no generation). After every SERVE_EVERY cases of a side, and once more when the module
    ends (the fixture below): a real generation round trip, whose failure names the cases since the last one.
    A full round trip after each of these hundreds of cases cost most of this file's time (the gateway's engine
    and the in-process one take turns on two cores), and showed no more than this does."""

    SERVE_EVERY = 8

    def __init__(self):
        self.unserved: dict[str, list[str]] = {"worker": [], "gateway": []}
        self.gateway_url: str | None = None

    @staticmethod
    def case() -> str:
        return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]

    def worker(self) -> None:
        from worker import handler

        assert_idle_and_healthy(handler.health, "worker")
        self.unserved["worker"].append(self.case())
        if len(self.unserved["worker"]) >= self.SERVE_EVERY:
            self.serve("worker")

    def gateway(self, gateway_url: str) -> None:
        self.gateway_url = gateway_url
        base = gateway_url.removesuffix("/openai/v1")
        assert_idle_and_healthy(lambda: httpx.get(base + "/health", timeout=60).json(), "gateway")
        self.unserved["gateway"].append(self.case())
        if len(self.unserved["gateway"]) >= self.SERVE_EVERY:
            self.serve("gateway")

    def serve(self, side: str) -> None:
        cases, self.unserved[side] = self.unserved[side], []
        if not cases:
            return
        after = f"the {side} stopped serving after one of: {cases}"
        if side == "worker":
            assert_worker_serves(after)
        else:
            assert_gateway_serves(self.gateway_url, after)


KEEPS_SERVING = KeepsServing()


@pytest.fixture(scope="module", autouse=True)
def _serves_after_the_last_case():
    yield
    KEEPS_SERVING.serve("worker")
    KEEPS_SERVING.serve("gateway")


def worker_keeps_serving() -> None:
    KEEPS_SERVING.worker()


def gateway_keeps_serving(gateway_url: str) -> None:
    KEEPS_SERVING.gateway(gateway_url)


# ---------------------------------------------------------------- request bodies, in-process and over HTTP

def chat(**fields) -> tuple[str, dict]:
    return CHAT, {"messages": USER, "max_tokens": 2, **fields}


def content(*parts) -> tuple[str, dict]:
    return chat(messages=[{"role": "user", "content": list(parts)}])


def complete(**fields) -> tuple[str, dict]:
    return COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, **fields}


# id: (route and body factory, status, words the message must contain, param)
BODY_CASES = {
    # roles and messages
    "role-not-a-string": (lambda: chat(messages=[{"role": 5, "content": "x"}]), 400, ("role",), "messages[0].role"),
    "role-empty": (lambda: chat(messages=[{"role": "", "content": "x"}]), 400, ("role",), "messages[0].role"),
    "role-missing": (lambda: chat(messages=[{"content": "x"}]), 400, ("role", "required"), "messages[0].role"),
    "message-not-an-object": (lambda: chat(messages=["Hi"]), 400, ("messages[0]",), "messages[0]"),
    "message-unknown-field": (lambda: chat(messages=[{"role": "user", "content": "x", "mood": "sad"}]), 400,
                              ("mood",), "messages[0].mood"),
    "user-content-null": (lambda: chat(messages=[{"role": "user", "content": None}]), 400, ("needs content",),
                          "messages[0]"),
    "content-an-object": (lambda: chat(messages=[{"role": "user", "content": {"text": "hi"}}]), 400,
                          ("messages[0].content",), "messages[0].content"),
    "tool-call-malformed": (lambda: chat(messages=[{"role": "assistant", "tool_calls": [{"function": 5}]}]), 400,
                            ("function",), "messages[0].tool_calls[0].function"),
    # content parts
    "part-audio": (lambda: content({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}), 400,
                   ("input_audio", "text only"), "messages[0].content[0]"),
    "part-image-after-text": (lambda: content({"type": "text", "text": "Look:"}, {"type": "input_image"}), 400,
                              ("input_image",), "messages[0].content[1]"),
    "part-unknown-type": (lambda: content({"type": "hologram", "text": "x"}), 400, ("type", "text"),
                          "messages[0].content[0].type"),
    "part-type-missing": (lambda: content({"text": "x"}), 400, ("type", "required"), "messages[0].content[0].type"),
    "part-text-missing": (lambda: content({"type": "text"}), 400, ("needs a text",), "messages[0].content[0].text"),
    "part-text-not-a-string": (lambda: content({"type": "text", "text": 5}), 400, ("valid string",),
                               "messages[0].content[0].text"),
    "part-not-an-object": (lambda: content("Hi"), 400, ("messages[0].content[0]",), "messages[0].content[0]"),
    # lone surrogates (valid JSON escapes, but not Unicode text: nothing can tokenize or send them back)
    "surrogate-chat-content": (lambda: chat(messages=[{"role": "user", "content": "a\ud800b"}]), 400,
                               ("surrogate", "U+D800"), "messages[0].content"),
    "surrogate-content-part": (lambda: content({"type": "text", "text": "\udc00"}), 400, ("surrogate",),
                               "messages[0].content[0].text"),
    "surrogate-streamed-chat": (lambda: chat(messages=[{"role": "user", "content": "\udfff"}], stream=True), 400,
                                ("surrogate",), "messages[0].content"),
    "surrogate-prompt": (lambda: complete(prompt="x\udbff"), 400, ("surrogate",), "prompt"),
    "surrogate-prompt-list": (lambda: complete(prompt=["fine", "\ud800"]), 400, ("surrogate",), "prompt[1]"),
    "surrogate-stop": (lambda: complete(stop=["\ud800"]), 400, ("surrogate",), "stop[0]"),
    "surrogate-model": (lambda: complete(model="\ud800"), 400, ("surrogate",), "model"),
    "surrogate-key": (lambda: complete(**{"\ud800": 1}), 400, ("key", "unicode"), None),
    "surrogate-in-tools": (lambda: chat(tools=[{"type": "function", "function": {"name": "f\ud800"}}]), 400,
                           ("surrogate",), "tools[0].function.name"),
    # token ids outside the vocabulary or not integers
    "token-id-negative": (lambda: complete(prompt=[504, -5]), 400, ("-5", "outside the vocabulary"), "prompt"),
    "token-id-vocab-size": (lambda: complete(prompt=[VOCAB]), 400, (str(VOCAB), "outside"), "prompt"),
    "token-id-huge": (lambda: complete(prompt=[2**40]), 400, (str(2**40), "outside"), "prompt"),
    "token-id-fraction": (lambda: complete(prompt=[504, 1.5]), 400, ("prompt[1]", "integer"), "prompt[1]"),
    "token-id-integral-float": (lambda: complete(prompt=[504, 3575.0]), 400, ("integer",), "prompt[1]"),
    "token-id-bool": (lambda: complete(prompt=[True]), 400, ("integer",), "prompt[0]"),
    "token-id-string-among-ids": (lambda: complete(prompt=[504, "7"]), 400, ("integer",), "prompt[1]"),
    "token-id-batch-negative": (lambda: complete(prompt=[[504], [-1]]), 400, ("outside",), "prompt[1]"),
    "stop-token-id-fraction": (lambda: complete(stop_token_ids=[0.5]), 400, ("integer",), "stop_token_ids[0]"),
    "stop-token-id-outside": (lambda: complete(stop_token_ids=[VOCAB]), 400, ("outside",), "stop_token_ids"),
    "logit-bias-key-not-an-id": (lambda: complete(logit_bias={"abc": 1}), 400, ("token ids", "abc"), "logit_bias"),
    "logit-bias-key-negative": (lambda: complete(logit_bias={"-1": 1}), 400, ("negative",), "logit_bias"),
    "logit-bias-key-outside": (lambda: complete(logit_bias={str(VOCAB): 1}), 400, ("outside",), "logit_bias"),
    # out-of-range values (the basic ranges are in test_openai_conformance)
    "logit-bias-value-range": (lambda: complete(logit_bias={"5": 1000}), 400, ("-100 and 100",), "logit_bias"),
    "max-tokens-astronomical": (lambda: complete(max_tokens=10**30), 400, ("maximum context length",),
                                "max_tokens"),
    "seed-beyond-any-int": (lambda: complete(seed=2**200), 400, ("seed", "too large"), "seed"),
    "top-k-below-minus-one": (lambda: complete(top_k=-5), 400, ("top_k",), "top_k"),
    "top-logprobs-over-max": (lambda: chat(logprobs=True, top_logprobs=21), 400, ("at most 20",), "top_logprobs"),
    "logprobs-over-max": (lambda: complete(logprobs=21), 400, ("at most 20",), "logprobs"),
    "stream-options-without-stream": (lambda: chat(stream_options={"include_usage": True}), 400, ("stream",),
                                      "stream_options"),
    # empty and oversized prompts
    "prompt-empty": (lambda: complete(prompt=""), 400, ("empty",), "prompt"),
    "prompt-empty-in-batch": (lambda: complete(prompt=["Hi", ""]), 400, ("empty",), "prompt[1]"),
    "prompt-oversized-text": (lambda: complete(prompt=HUGE_TEXT), 400, ("maximum context length is 8192",),
                              "prompt"),
    "prompt-oversized-streamed": (lambda: complete(prompt=HUGE_TEXT, stream=True), 400, ("context length",),
                                  "prompt"),
    "prompt-oversized-ids": (lambda: complete(prompt=[504] * 300_000), 400, ("300000 tokens",), "prompt"),
    "chat-oversized-message": (lambda: chat(messages=[{"role": "user", "content": HUGE_TEXT}]), 400,
                               ("maximum context length is 8192",), "messages"),
    "chat-oversized-conversation": (lambda: chat(messages=[{"role": "user", "content": "hello " * 50}] * 2000), 400,
                                    ("maximum context length is 8192",), "messages"),
    # nesting and body shape
    "nesting-in-metadata": (lambda: chat(metadata=nested(150)), 400, ("metadata", "nested more than 100"),
                            "metadata"),
    "nesting-in-content": (lambda: chat(messages=[{"role": "user", "content": nested(120, "x")}]), 400,
                           ("nested",), "messages"),
    "nesting-of-objects": (lambda: chat(chat_template_kwargs=nested(200, 1, "a")), 400, ("nested",),
                           "chat_template_kwargs"),
    "body-an-array": (lambda: (CHAT, [USER]), 400, ("JSON object",), None),
    "body-a-string": (lambda: (COMPLETIONS, "The capital of France is"), 400, ("JSON object",), None),
    "body-null": (lambda: (CHAT, None), 400, ("JSON object",), None),
    "body-a-number": (lambda: (COMPLETIONS, 42), 400, ("JSON object",), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BODY_CASES))
def test_malformed_body_in_process_and_over_http(worker, gateway_url, case):
    make, status, words, param = BODY_CASES[case]
    route, body = make()
    in_process = job_error({"openai_route": route, "openai_input": body})
    assert_error(in_process, status, words, param)
    worker_keeps_serving()

    response = http(gateway_url, "POST", "/openai" + route, json.dumps(body).encode())
    assert http_error(response, status, words, param) == in_process["error"]  # one code path, one answer
    gateway_keeps_serving(gateway_url)


# ---------------------------------------------------------------- job inputs only the platform path can carry

def legacy(**fields) -> dict:
    return {"prompt": "Hi", "sampling_params": {"max_tokens": 2}, **fields}


def openai_job(route, body) -> dict:
    return {"openai_route": route, "openai_input": body}


class Exploding(dict):
    """Job input that fails while it is read: stands in for a bug below the router (no generation mocked)."""

    def __iter__(self):
        raise RuntimeError("boom while reading the job input")

    items = __iter__


JOB_CASES = {
    # input that is not an object, and routes that are not routes
    "input-null": (lambda: None, 400, ("JSON object",), None),
    "input-a-number": (lambda: 42, 400, ("JSON object",), None),
    "input-a-bool": (lambda: True, 400, ("JSON object",), None),
    "route-not-a-string": (lambda: {"openai_route": ["/v1/completions"]}, 400, ("openai_route", "string"),
                           "openai_route"),
    "route-null": (lambda: {"openai_route": None, "openai_input": GOOD}, 400, ("openai_route",), "openai_route"),
    "route-unknown-version": (lambda: openai_job("/v2/chat/completions", GOOD), 404, ("unknown openai_route",),
                              "openai_route"),
    "route-empty": (lambda: openai_job("", GOOD), 404, ("unknown openai_route",), "openai_route"),
    "route-with-surrogate": (lambda: openai_job("/v1/\ud800", GOOD), 404, ("unknown openai_route", "\\ud800"),
                             "openai_route"),
    # the tokenizer, embeddings, pooling, score and rerank routes
    "embeddings-input-missing": (lambda: openai_job("/v1/embeddings", {}), 400, ("input",), "input"),
    "embeddings-input-bool-ids": (lambda: openai_job("/v1/embeddings", {"input": [True, 2]}), 400, ("input",),
                                  "input[0]"),
    "embeddings-format-unknown": (lambda: openai_job("/v1/embeddings", {"input": "a", "encoding_format": "int8"}),
                                  400, ("encoding_format",), "encoding_format"),
    "pooling-task-unknown": (lambda: openai_job("/pooling", {"input": "a", "task": "generate"}), 400, ("task",),
                             "task"),
    "rerank-top-n-negative": (lambda: openai_job("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}),
                              400, ("top_n",), "top_n"),
    "rerank-document-not-text": (lambda: openai_job("/v2/rerank", {"query": "a", "documents": [{"x": 1}]}), 400,
                                 ("documents[0]",), "documents[0]"),
    "score-text-2-number": (lambda: openai_job("/v1/score", {"text_1": "a", "text_2": 5}), 400, ("text_2",),
                            "text_2"),
    "tokenize-neither-form": (lambda: openai_job("/v1/tokenize", {}), 400, ("prompt", "messages"), "prompt"),
    "detokenize-bool-token": (lambda: openai_job("/detokenize", {"tokens": [True]}), 400, ("tokens[0]",),
                              "tokens[0]"),
    # the legacy form
    "legacy-prompt-null": (lambda: {"prompt": None}, 400, ("prompt",), "prompt"),
    "legacy-prompt-and-messages": (lambda: legacy(messages=USER), 400, ("prompt", "messages"), "prompt"),
    "legacy-messages-empty": (lambda: {"messages": []}, 400, ("messages",), "messages"),
    "legacy-apply-template-without-prompt": (lambda: {"messages": None, "apply_chat_template": True}, 400,
                                             ("prompt",), "prompt"),
    "legacy-prompt-empty": (lambda: legacy(prompt=""), 400, ("empty",), "prompt"),
    "legacy-prompt-oversized": (lambda: legacy(prompt=HUGE_TEXT), 400, ("maximum context length",), "prompt"),
    "legacy-unknown-field": (lambda: legacy(temperature=0), 400, ("temperature",), "temperature"),
    "legacy-surrogate": (lambda: legacy(prompt="\udfff"), 400, ("surrogate",), "prompt"),
    "legacy-nan-temperature": (lambda: legacy(sampling_params={"temperature": float("nan")}), 400,
                               ("sampling_params.temperature", "nan"), "sampling_params.temperature"),
    "legacy-growth-below-one": (lambda: legacy(batch_size_growth_factor=0.5), 400, ("batch_size_growth_factor",),
                                "batch_size_growth_factor"),
    "legacy-nested-deep": (lambda: legacy(sampling_params=nested(5000, 1, "x")), 400, ("nested",),
                           "sampling_params"),
    # Python values no JSON text can produce
    "nan-temperature": (lambda: openai_job(*chat(temperature=float("nan"))), 400, ("temperature", "nan"),
                        "temperature"),
    "inf-top-p": (lambda: openai_job(*chat(top_p=float("inf"))), 400, ("top_p", "inf"), "top_p"),
    "minus-inf-penalty": (lambda: openai_job(*complete(presence_penalty=float("-inf"))), 400,
                          ("presence_penalty", "-inf"), "presence_penalty"),
    "nan-max-tokens": (lambda: openai_job(*complete(max_tokens=float("nan"))), 400, ("max_tokens",), "max_tokens"),
    "nan-logit-bias": (lambda: openai_job(*complete(logit_bias={"5": float("nan")})), 400, ("nan",),
                       "logit_bias.5"),
    "nan-inside-tools": (lambda: openai_job(*chat(tools=[{"type": "function", "x": float("nan")}])), 400,
                         ("tools[0].x",), "tools[0].x"),
    "int-with-5000-digits": (lambda: openai_job(*complete(max_tokens=10**5000)), 400, ("too large",),
                             "max_tokens"),
    "set-not-json": (lambda: openai_job(*complete(stop={"a", "b"})), 400, ("set", "not a JSON value"), "stop"),
    "bytes-not-json": (lambda: openai_job(*complete(prompt=b"Hi")), 400, ("bytes",), "prompt"),
    "non-string-key": (lambda: openai_job(*complete(logit_bias={5: 1.0})), 400, ("key",), "logit_bias"),
    "nesting-100k-levels": (lambda: openai_job(CHAT, nested(100_000)), 400, ("nested more than 100",), "[0]"),
    "nesting-5000-levels-in-field": (lambda: openai_job(*chat(messages=nested(5000, USER[0]))), 400, ("nested",),
                                     "messages"),
}


@pytest.mark.parametrize("case", list(JOB_CASES))
def test_malformed_job_in_process(worker, case):
    make, status, words, param = JOB_CASES[case]
    assert_error(job_error(make()), status, words, param)
    worker_keeps_serving()


# ---------------------------------------------------------------- bytes only HTTP can carry

def raw_chat(fields: bytes) -> bytes:
    return b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2' + fields + b"}"


# id: (method, path, body bytes, status, words, param)
HTTP_CASES = {
    "utf8-invalid-start-byte": ("POST", "/openai/v1/completions", b'{"prompt": "caf\xff"}', 400, ("utf-8",), None),
    "utf8-truncated-sequence": ("POST", "/openai/v1/completions", b'{"prompt": "\xe2\x82"}', 400, ("utf-8",), None),
    "utf8-overlong-encoding": ("POST", "/openai/v1/completions", b'{"prompt": "\xc0\xaf"}', 400, ("utf-8",), None),
    # Python's json decodes UTF-8-encoded surrogates (surrogatepass); the input check refuses them by field.
    "utf8-encoded-surrogate": ("POST", "/openai/v1/chat/completions",
                               b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', 400, ("surrogate",),
                               "messages[0].content"),
    "latin1-body": ("POST", "/openai/v1/chat/completions", '{"messages": [{"role": "user", "content": "café"}]}'
                    .encode("latin-1"), 400, ("not valid JSON",), None),
    "json-nan-literal": ("POST", "/openai/v1/chat/completions", raw_chat(b', "temperature": NaN'), 400,
                         ("NaN", "not a JSON value"), None),
    "json-infinity-literal": ("POST", "/openai/v1/completions", b'{"prompt": "Hi", "top_p": Infinity}', 400,
                              ("Infinity",), None),
    "json-minus-infinity": ("POST", "/openai/v1/completions", b'{"prompt": "Hi", "logit_bias": {"5": -Infinity}}',
                            400, ("-Infinity",), None),
    "json-number-overflows-to-inf": ("POST", "/openai/v1/chat/completions", raw_chat(b', "temperature": 1e999'),
                                     400, ("temperature", "inf"), "temperature"),
    "json-integer-5000-digits": ("POST", "/openai/v1/completions", b'{"prompt": "Hi", "seed": 1' + b"0" * 5000 + b"}",
                                 400, ("digits",), None),
    "json-truncated": ("POST", "/openai/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}',
                       400, ("not valid JSON",), None),
    "json-trailing-garbage": ("POST", "/openai/v1/completions", b'{"prompt": "Hi"} {"prompt": "again"}', 400,
                              ("Extra data",), None),
    "body-empty": ("POST", "/openai/v1/chat/completions", b"", 400, ("not valid JSON",), None),
    "body-true": ("POST", "/openai/v1/completions", b"true", 400, ("JSON object",), None),
    "nesting-100k-arrays": ("POST", "/openai/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400,
                            ("nested too deeply",), None),
    "nesting-5000-in-field": ("POST", "/openai/v1/completions",
                              b'{"prompt": "Hi", "metadata": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", 400,
                              ("nested too deeply",), None),
    "nesting-unclosed": ("POST", "/openai/v1/completions", b"[" * 1_000_000, 400, ("nested too deeply",), None),
    "route-audio": ("POST", "/openai/v1/audio/transcriptions", b'{"file": "x"}', 404, ("no route", "audio"), None),
    "route-get-on-embeddings": ("GET", "/openai/v1/embeddings", None, 404, ("GET",), None),
    "embeddings-input-nan": ("POST", "/openai/v1/embeddings", b'{"input": NaN}', 400, ("not valid JSON",), None),
    "route-get-on-chat": ("GET", "/openai/v1/chat/completions", None, 404, ("GET",), None),
    "route-put-on-completions": ("PUT", "/v1/completions", b"{}", 404, ("PUT",), None),
    "route-other-version": ("POST", "/openai/v2/chat/completions", raw_chat(b""), 404, ("/openai/v2",), None),
    "route-root": ("DELETE", "/", None, 404, ("no route",), None),
    "route-percent-encoded-bytes": ("GET", "/openai/v1/%ff%fe", None, 404, ("no route",), None),
}


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_malformed_http_request(gateway_url, case):
    method, path, body, status, words, param = HTTP_CASES[case]
    http_error(http(gateway_url, method, path, body), status, words, param)
    gateway_keeps_serving(gateway_url)


def test_body_over_the_size_limit_is_413(gateway_url):
    body = b'{"prompt": "' + b"a" * (64 * 2**20) + b'"}'
    http_error(http(gateway_url, "POST", "/openai/v1/completions", body), 413, ("64 MiB",), None)
    gateway_keeps_serving(gateway_url)


def test_tens_of_megabytes_of_prompt_are_refused_without_tokenizing(gateway_url):
    # Tokenizing 30 MB takes about 30 s here; the answer must come long before that.
    body = json.dumps({"prompt": "hello " * 5_000_000, "max_tokens": 2}).encode()
    error = http_error(http(gateway_url, "POST", "/openai/v1/completions", body), 400,
                       ("maximum context length is 8192", "30000000 characters"), "prompt")
    assert "tokens" in error["message"]
    gateway_keeps_serving(gateway_url)


# ---------------------------------------------------------------- a wrong type for every field

SAMPLING_WRONG = {
    "n": "many", "best_of": "many", "temperature": "hot", "top_p": "most", "top_k": "some", "min_p": "low",
    "seed": "random", "stop": 5, "stop_token_ids": "2", "include_stop_str_in_output": "maybe", "ignore_eos": "maybe",
    "min_tokens": "few", "presence_penalty": "high", "frequency_penalty": "high", "repetition_penalty": "high",
    "logit_bias": [5], "skip_special_tokens": "maybe", "spaces_between_special_tokens": "maybe",
    "guided_json": 5, "guided_regex": 5, "guided_choice": "yes", "guided_grammar": 5,
    "guided_whitespace_pattern": 5, "structured_outputs": "json",
    "use_beam_search": "maybe", "length_penalty": "long", "early_stopping": "soon", "diversity_penalty": "high",
    "num_beam_groups": "two", "num_assistant_tokens": "four", "assistant_confidence_threshold": "sure",
    "allowed_token_ids": "all", "bad_words": "darn", "truncate_prompt_tokens": "some", "priority": "high",
    "cache_salt": 5,
}
OPENAI_WRONG = {**SAMPLING_WRONG, "model": 5, "stream": "maybe", "stream_options": "usage", "response_format": "json",
                "prompt_logprobs": "some", "return_token_ids": "maybe", "return_tokens_as_token_ids": "maybe",
                "request_id": 5}
CHAT_WRONG = {
    **OPENAI_WRONG, "messages": "Hi", "max_tokens": "many", "max_completion_tokens": "many", "logprobs": "maybe",
    "top_logprobs": "five", "echo": "maybe", "add_generation_prompt": "maybe", "continue_final_message": "maybe",
    "chat_template_kwargs": "x", "chat_template": 5, "tools": "x", "tool_choice": 5, "documents": "x",
    "parallel_tool_calls": "maybe", "reasoning_effort": "extreme", "modalities": "text",
}
COMPLETION_WRONG = {**OPENAI_WRONG, "prompt": {"text": "Hi"}, "suffix": 5, "max_tokens": "many", "echo": "maybe",
                    "logprobs": "five", "add_special_tokens": "maybe"}
LEGACY_WRONG = {"prompt": 5, "messages": "Hi", "sampling_params": "hot", "stream": "maybe",
                "apply_chat_template": "maybe", "max_batch_size": "many", "min_batch_size": "many",
                "batch_size_growth_factor": "fast", "lora": 5}
LEGACY_SAMPLING_WRONG = {**SAMPLING_WRONG, "max_tokens": "many"}


def test_every_field_has_a_wrong_type_case():
    # A field added to a request model without a case here fails this test.
    from openai_compat.legacy.protocol import LegacyJob, LegacySamplingParams
    from openai_compat.chat.protocol import ChatCompletionRequest
    from openai_compat.completions.protocol import CompletionRequest

    assert set(CHAT_WRONG) == set(ChatCompletionRequest.model_fields)
    assert set(COMPLETION_WRONG) == set(CompletionRequest.model_fields)
    assert set(LEGACY_WRONG) == set(LegacyJob.model_fields)
    assert set(LEGACY_SAMPLING_WRONG) == set(LegacySamplingParams.model_fields)


@pytest.mark.parametrize("route,field", [(CHAT, f) for f in CHAT_WRONG] + [(COMPLETIONS, f) for f in COMPLETION_WRONG])
def test_wrong_type_for_every_request_field(worker, gateway_url, route, field):
    wrong = CHAT_WRONG[field] if route == CHAT else COMPLETION_WRONG[field]
    body = {**(chat() if route == CHAT else complete())[1], field: wrong}
    in_process = job_error({"openai_route": route, "openai_input": body})
    assert_error(in_process, 400, (field,), field)
    response = http(gateway_url, "POST", "/openai" + route, json.dumps(body).encode())
    assert http_error(response, 400, (field,), field) == in_process["error"]
    worker_keeps_serving()
    gateway_keeps_serving(gateway_url)


@pytest.mark.parametrize("field", [f"sampling_params.{f}" for f in LEGACY_SAMPLING_WRONG] + list(LEGACY_WRONG))
def test_wrong_type_for_every_legacy_field(worker, field):
    if field.startswith("sampling_params."):
        name = field.removeprefix("sampling_params.")
        job = legacy(sampling_params={name: LEGACY_SAMPLING_WRONG[name]})
    else:
        job = {**({} if field in ("prompt", "messages") else legacy()), field: LEGACY_WRONG[field]}
    assert_error(job_error(job), 400, (field,), field)
    worker_keeps_serving()


# ---------------------------------------------------------------- the Responses API

RESPONSES = "/v1/responses"


def respond(**fields) -> tuple[str, dict]:
    return RESPONSES, {"input": "Hi", "max_output_tokens": 2, **fields}


def items(*entries) -> tuple[str, dict]:
    return respond(input=list(entries))


# id: (route and body factory, status, words the message must contain, param)
RESPONSES_CASES = {
    "item-not-an-object": (lambda: items("Hi"), 400, ("input[0]",), "input[0]"),
    "item-type-not-a-string": (lambda: items({"type": 5}), 400, ("type",), "input[0].type"),
    "item-type-unknown": (lambda: items({"type": "hologram"}), 400, ("hologram",), "input[0].type"),
    "item-type-built-in-call": (lambda: items({"type": "code_interpreter_call"}), 400, ("built-in",),
                                "input[0].type"),
    "item-role-tool": (lambda: items({"role": "tool", "content": "x"}), 400, ("role",), "input[0].role"),
    "item-content-an-object": (lambda: items({"role": "user", "content": {"text": "hi"}}), 400, ("content",),
                               "input[0].content"),
    "item-part-unknown-type": (lambda: items({"role": "user", "content": [{"type": "text", "text": "x"}]}), 400,
                               ("type",), "input[0].content[0].type"),
    "item-part-audio": (lambda: items({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
                        400, ("text only",), "input[0].content[0]"),
    "call-arguments-an-object": (lambda: items({"type": "function_call", "call_id": "c", "name": "f",
                                                "arguments": {"a": 1}}), 400, ("arguments",),
                                 "input[0].arguments"),
    "call-name-empty": (lambda: items({"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}),
                        400, ("name",), "input[0].name"),
    "output-without-call": (lambda: items({"type": "function_call_output", "call_id": "c", "output": "x"}), 400,
                            ("function_call",), "input[0].call_id"),
    "reasoning-summary-malformed": (lambda: items({"type": "reasoning", "summary": ["x"]}), 400, ("summary",),
                                    "input[0].summary[0]"),
    "items-later-one-bad": (lambda: items({"role": "user", "content": "Hi"}, {"role": "user"}), 400,
                            ("content",), "input[1].content"),
    "tool-built-in": (lambda: respond(tools=[{"type": "web_search_preview"}]), 400, ("web_search_preview",),
                      "tools[0].type"),
    "tool-not-an-object": (lambda: respond(tools=["get_weather"]), 400, ("tools[0]",), "tools[0]"),
    "tool-chat-shape": (lambda: respond(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
                        ("function",), "tools[0].function"),
    "tool-parameters-not-an-object": (lambda: respond(tools=[{"type": "function", "name": "f", "parameters": 5}]),
                                      400, ("parameters",), "tools[0].parameters"),
    "tool-schema-broken": (lambda: respond(tools=[{"type": "function", "name": "f", "parameters": {
                               "type": "object", "properties": {"a": {"type": "no-such-type"}}}}],
                                           tool_choice="required"), 400, ("tools",), "tools"),
    "tool-choice-unknown-string": (lambda: respond(tool_choice="always"), 400, ("always",), "tool_choice"),
    "text-format-unknown": (lambda: respond(text={"format": {"type": "xml"}}), 400, ("type",), "text.format.type"),
    "text-format-name-on-text": (lambda: respond(text={"format": {"type": "text", "name": "x"}}), 400,
                                 ("json_schema",), "text.format.name"),
    "reasoning-effort-unknown": (lambda: respond(reasoning={"effort": "extreme"}), 400, ("effort",),
                                 "reasoning.effort"),
    "include-unknown": (lambda: respond(include=["file_search_call.results"]), 400, ("file_search_call",),
                        "include[0]"),
    "metadata-value-not-a-string": (lambda: respond(metadata={"k": 5}), 400, ("string",), "metadata.k"),
    "metadata-too-many-pairs": (lambda: respond(metadata={str(i): "v" for i in range(17)}), 400, ("16",),
                                "metadata"),
    "max-tool-calls-set": (lambda: respond(max_tool_calls=3), 400, ("max_tool_calls",), "max_tool_calls"),
    "stream-options-without-stream": (lambda: respond(stream_options={"include_obfuscation": False}), 400,
                                      ("stream",), "stream_options"),
    "chat-only-field": (lambda: respond(messages=USER), 400, ("messages",), "messages"),
    "sampling-range-from-chat": (lambda: respond(top_k=-5), 400, ("top_k",), "top_k"),
    "two-constraints": (lambda: respond(text={"format": {"type": "json_object"}},
                                        structured_outputs={"regex": "a"}), 400, ("structured_outputs",),
                        "structured_outputs.regex"),
    "previous-id-unknown": (lambda: respond(previous_response_id="resp_0"), 400, ("worker",),
                            "previous_response_id"),
    "oversized-input-text": (lambda: respond(input=HUGE_TEXT), 400, ("maximum context length is 8192",),
                             "input"),
    "oversized-item-list": (lambda: items(*[{"role": "user", "content": "hi"}] * 9000), 400,
                            ("maximum context length is 8192", "9000 items"), "input"),
    "oversized-instructions": (lambda: respond(instructions=HUGE_TEXT), 400, ("maximum context length",),
                               "instructions"),
    "surrogate-in-item": (lambda: items({"role": "user", "content": "\ud800"}), 400, ("surrogate",),
                          "input[0].content"),
    "nesting-in-item": (lambda: items({"role": "user", "content": nested(150, "x")}), 400, ("nested",), "input"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESPONSES_CASES))
def test_malformed_responses_body_in_process_and_over_http(worker, gateway_url, case):
    make, status, words, param = RESPONSES_CASES[case]
    route, body = make()
    in_process = job_error({"openai_route": route, "openai_input": body})
    assert_error(in_process, status, words, param)
    response = http(gateway_url, "POST", "/openai" + route, json.dumps(body).encode())
    assert http_error(response, status, words, param) == in_process["error"]
    worker_keeps_serving()
    gateway_keeps_serving(gateway_url)


RESPONSES_WRONG = {
    "model": 5, "input": 5, "instructions": 5, "previous_response_id": 5, "store": "maybe", "stream": "maybe",
    "stream_options": "x", "max_output_tokens": "many", "temperature": "hot", "top_p": "most",
    "top_logprobs": "five", "include": "logprobs", "tools": "x", "tool_choice": 5, "parallel_tool_calls": "maybe",
    "text": "json", "reasoning": "deep", "metadata": "x", "user": 5, "truncation": 5, "background": "maybe",
    "max_tool_calls": "many", "top_k": "some", "min_p": "low", "repetition_penalty": "high",
    "presence_penalty": "high", "frequency_penalty": "high", "seed": "random", "stop": 5, "stop_token_ids": "2",
    "min_tokens": "few", "ignore_eos": "maybe", "include_stop_str_in_output": "maybe",
    "skip_special_tokens": "maybe", "logit_bias": [5], "structured_outputs": "json", "chat_template_kwargs": "x",
}


def test_every_responses_field_has_a_wrong_type_case():
    from openai_compat.responses.protocol import ResponsesRequest

    assert set(RESPONSES_WRONG) == set(ResponsesRequest.model_fields)


@pytest.mark.parametrize("field", list(RESPONSES_WRONG))
def test_wrong_type_for_every_responses_field(worker, gateway_url, field):
    body = {**respond()[1], field: RESPONSES_WRONG[field]}
    in_process = job_error({"openai_route": RESPONSES, "openai_input": body})
    assert_error(in_process, 400, (field,), field)
    response = http(gateway_url, "POST", "/openai" + RESPONSES, json.dumps(body).encode())
    assert http_error(response, 400, (field,), field) == in_process["error"]
    worker_keeps_serving()


@pytest.mark.parametrize("route, status, words", [
    ("/v1/responses/", 404, ("unknown openai_route",)),
    ("/v1/responses/resp_1/input_items", 404, ("unknown openai_route",)),
    ("/v1/responses/resp_%00", 404, ("resp_%00", "stored on this worker")),
    ("/openai/v1/responses/" + "x" * 5000, 404, ("stored on this worker",)),
])
def test_malformed_response_ids_in_process(worker, route, status, words):
    assert_error(job_error({"openai_route": route}), status, words)
    worker_keeps_serving()


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/openai/v1/responses/resp_1", 404), ("GET", "/openai/v1/responses", 404),
    ("DELETE", "/v1/responses/resp_1", 404), ("GET", "/openai/v1/responses/resp_1/input_items", 404),
    ("GET", "/openai/v1/responses/%ff%fe", 404),
])
def test_responses_routes_refuse_other_methods_and_paths(gateway_url, method, path, status):
    http_error(http(gateway_url, method, path, b"{}" if method == "POST" else None), status, ())
    gateway_keeps_serving(gateway_url)


# ---------------------------------------------------------------- extremes that are valid must still work

def test_valid_extremes_are_served_not_refused(worker, gateway_url):
    # A surrogate pair is how JSON spells an emoji: only lone surrogates are refused.
    emoji = b'{"messages": [{"role": "user", "content": "Say \\ud83d\\ude00"}], "max_tokens": 2}'
    response = http(gateway_url, "POST", "/openai/v1/chat/completions", emoji, refused=False)
    assert response.status_code == 200, response.text[:500]
    assert response.json()["usage"]["completion_tokens"] == 2
    # A temperature or a repetition penalty this small overflowed the logits into NaN (a 500) before.
    for extreme in ({"temperature": 1e-300}, {"temperature": 5e-324, "seed": 1},
                    {"repetition_penalty": 5e-324, "temperature": 1.0}, {"repetition_penalty": 1e308, "temperature": 1.0}):
        (body,) = run_job(openai_job(COMPLETIONS, {**GOOD, "max_tokens": 3, **extreme}))
        assert "error" not in body, (extreme, body)
        assert body["usage"]["completion_tokens"] == 3
        if extreme.get("temperature", 1.0) < 1e-5:  # that small is greedy
            assert body["choices"][0]["text"].startswith(" Paris")
    # Empty content is a valid message; an empty conversation turn must not be refused.
    (body,) = run_job(openai_job(CHAT, {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}))
    assert body["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------- what the worker log keeps

def test_expected_errors_are_logged_at_info_with_the_job_id(worker, caplog):
    caplog.set_level(logging.INFO)
    body = job_error(openai_job(*complete(prompt="\ud800")), job_id="job-bad-surrogate")
    assert_error(body, 400, ("surrogate",), "prompt")
    records = [r for r in caplog.records if "job-bad-surrogate" in r.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO and records[0].exc_info is None
    assert "400" in records[0].getMessage() and "surrogate" in records[0].getMessage()


def test_internal_error_keeps_its_traceback_in_the_log_only(worker, caplog):
    caplog.set_level(logging.INFO)
    body = job_error(Exploding(prompt="Hi"), job_id="job-forced-500")
    error = assert_error(body, 500, ("internal error",), None)
    assert "boom" not in error["message"]
    records = [r for r in caplog.records if "job-forced-500" in r.getMessage()]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert records[0].exc_info is not None
    assert "Traceback" in caplog.text and "RuntimeError: boom while reading the job input" in caplog.text
    assert_worker_serves()


def test_concurrent_bad_and_good_jobs_do_not_disturb_each_other(worker):
    # Bad jobs fail fast beside a generating one, which finishes intact.
    from worker import handler

    async def collect(job_input, job_id):
        return [part async for part in handler.handler({"id": job_id, "input": job_input})]

    async def main():
        good = openai_job(COMPLETIONS, {**GOOD, "max_tokens": 12, "ignore_eos": True})
        bad = [openai_job(*complete(prompt="\ud800")), openai_job(*complete(prompt=HUGE_TEXT)),
               openai_job(CHAT, nested(500)), openai_job(*complete(prompt=[-1])), {"prompt": None}]
        return await asyncio.gather(collect(good, "good"), *(collect(b, f"bad-{i}") for i, b in enumerate(bad)))

    (good,), *bad = asyncio.run(main())
    assert good["usage"]["completion_tokens"] == 12 and good["choices"][0]["text"].startswith(" Paris")
    for (body,) in bad:
        assert_error(body, 400, ())


# ---------------------------------------------------------------- Anthropic's Messages API

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
ANTHROPIC_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}


def assert_anthropic_error(body, status: int, words: tuple[str, ...]) -> dict:
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`, the message naming `words`."""
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", body
    error = body["error"]
    assert set(error) == {"type", "message"} and error["type"] == ANTHROPIC_TYPES[status], error
    for word in words:
        assert word.lower() in error["message"].lower(), (word, error["message"])
    for marker in TRACEBACK_MARKERS:
        assert marker not in error["message"], error["message"]
    return error


def message(**fields) -> dict:
    from conftest import MODEL

    return {"model": MODEL, "messages": USER, "max_tokens": 2, **fields}


def blocks(*content, role="user") -> dict:
    return message(messages=[{"role": role, "content": list(content)}])


TOOL = {"name": "f", "input_schema": {"type": "object"}}

# id: (body factory, status, words the message must contain)
MESSAGES_CASES = {
    "no-messages": (lambda: message(messages=[]), 400, ("messages", "at least 1")),
    "role-tool": (lambda: message(messages=[{"role": "tool", "content": "x"}]), 400, ("messages[0].role",)),
    "content-null": (lambda: message(messages=[{"role": "user", "content": None}]), 400, ("messages[0].content",)),
    "block-type-missing": (lambda: blocks({"text": "x"}), 400, ("messages[0].content[0].type", "required")),
    "block-type-unknown": (lambda: blocks({"type": "hologram"}), 400, ("messages[0].content[0].type", "hologram")),
    "text-missing": (lambda: blocks({"type": "text"}), 400, ("messages[0].content[0].text",)),
    "text-extra-field": (lambda: blocks({"type": "text", "text": "x", "mood": "sad"}), 400,
                         ("messages[0].content[0].mood",)),
    "text-not-a-string": (lambda: blocks({"type": "text", "text": 5}), 400, ("messages[0].content[0].text",)),
    "tool-use-in-user": (lambda: blocks({"type": "tool_use", "id": "t", "name": "f", "input": {}}), 400,
                         ("messages[0].content[0].type", "assistant")),
    "tool-use-no-input": (lambda: blocks({"type": "tool_use", "id": "t", "name": "f"}, role="assistant"), 400,
                          ("messages[0].content[0].input",)),
    "tool-use-input-a-list": (lambda: blocks({"type": "tool_use", "id": "t", "name": "f", "input": [1]},
                                             role="assistant"), 400, ("messages[0].content[0].input",)),
    "tool-result-no-id": (lambda: blocks({"type": "tool_result", "content": "x"}), 400,
                          ("messages[0].content[0].tool_use_id",)),
    "tool-result-in-assistant": (lambda: blocks({"type": "tool_result", "tool_use_id": "t"}, role="assistant"), 400,
                                 ("messages[0].content[0].type", "user messages")),
    "tool-result-image": (lambda: blocks({"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x"}}]}), 400,
                          ("messages[0].content[0].content[0].type", "text only")),
    "thinking-in-user": (lambda: blocks({"type": "thinking", "thinking": "hm", "signature": ""}), 400,
                         ("messages[0].content[0].type",)),
    "redacted-thinking-no-data": (lambda: blocks({"type": "redacted_thinking"}, role="assistant"), 400,
                                  ("messages[0].content[0].data",)),
    "server-tool-result-block": (lambda: blocks({"type": "web_search_tool_result", "tool_use_id": "s",
                                                 "content": []}), 400, ("server tools",)),
    "ends-in-tool-use": (lambda: message(messages=[*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], tools=[TOOL]), 400, ("messages[1]", "tool_use")),
    "system-image": (lambda: message(system=[{"type": "image", "source": {}}]), 400, ("system[0].type", "text only")),
    "tool-no-schema": (lambda: message(tools=[{"name": "f"}]), 400, ("tools[0].input_schema", "required")),
    "tool-schema-array": (lambda: message(tools=[{"name": "f", "input_schema": {"type": "array"}}]), 400,
                          ("tools[0].input_schema.type",)),
    "tool-name-with-space": (lambda: message(tools=[{"name": "get weather", "input_schema": {"type": "object"}}]),
                             400, ("tools[0].name",)),
    "tool-names-twice": (lambda: message(tools=[TOOL, TOOL]), 400, ("tools[1].name", "unique")),
    "tool-openai-shape": (lambda: message(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
                          ("tools[0].type", "function")),
    "tool-unknown-field": (lambda: message(tools=[{**TOOL, "input_examples": [{}]}]), 400,
                           ("tools[0].input_examples",)),
    "tool-choice-openai-string": (lambda: message(tools=[TOOL], tool_choice="required"), 400, ("tool_choice",)),
    "tool-choice-required-type": (lambda: message(tools=[TOOL], tool_choice={"type": "required"}), 400,
                                  ("tool_choice.type",)),
    "tool-choice-tool-no-name": (lambda: message(tools=[TOOL], tool_choice={"type": "tool"}), 400,
                                 ("tool_choice.name",)),
    "tool-choice-any-no-tools": (lambda: message(tool_choice={"type": "any"}), 400, ("tool_choice", "needs tools")),
    "thinking-no-budget": (lambda: message(thinking={"type": "enabled"}, max_tokens=2000), 400,
                           ("thinking.budget_tokens",)),
    "thinking-budget-over-max-tokens": (lambda: message(thinking={"type": "enabled", "budget_tokens": 2048},
                                                        max_tokens=2000), 400, ("thinking.budget_tokens",
                                                                                "max_tokens")),
    "thinking-disabled-with-budget": (lambda: message(thinking={"type": "disabled", "budget_tokens": 1024}), 400,
                                      ("thinking.budget_tokens",)),
    "thinking-unknown-type": (lambda: message(thinking={"type": "between_tools"}), 400, ("thinking.type",)),
    "max-tokens-zero": (lambda: message(max_tokens=0), 400, ("max_tokens",)),
    "max-tokens-astronomical": (lambda: message(max_tokens=10**30), 400, ("max_tokens", "context length")),
    "temperature-above-one": (lambda: message(temperature=1.5), 400, ("temperature",)),
    "stop-sequence-empty": (lambda: message(stop_sequences=[""]), 400, ("stop_sequences",)),
    "stop-sequences-too-many": (lambda: message(stop_sequences=[str(i) for i in range(33)]), 400,
                                ("stop_sequences", "32")),
    "service-tier-unknown": (lambda: message(service_tier="priority"), 400, ("service_tier",)),
    "openai-field": (lambda: message(n=2), 400, ("n", "unsupported")),
    "surrogate-in-block": (lambda: blocks({"type": "text", "text": "\ud800"}), 400,
                           ("messages[0].content[0].text", "surrogate")),
    "nesting-in-tool-input": (lambda: message(messages=[*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": nested(120, 1, "a")}]}, *USER], tools=[TOOL]), 400,
                              ("messages", "nested")),
    "oversized-conversation": (lambda: message(messages=[{"role": "user", "content": "hello " * 50}] * 2000), 400,
                               ("maximum context length is 8192",)),
    "oversized-block": (lambda: blocks({"type": "text", "text": HUGE_TEXT}), 400, ("maximum context length",)),
    "unknown-model": (lambda: message(model="claude-opus-4-1"), 404, ("model", "claude-opus-4-1")),
    "body-an-array": (lambda: [USER], 400, ("JSON object",)),
}


@pytest.mark.parametrize("case", list(MESSAGES_CASES))
def test_malformed_messages_request_in_process_and_over_http(worker, gateway_url, case):
    make, status, words = MESSAGES_CASES[case]
    body = make()
    in_process = job_error({"openai_route": MESSAGES, "openai_input": body})
    assert_anthropic_error(in_process, status, words)
    response = http(gateway_url, "POST", MESSAGES, json.dumps(body).encode())
    assert response.status_code == status and response.json() == in_process  # one code path, one answer
    worker_keeps_serving()
    gateway_keeps_serving(gateway_url)


MESSAGES_COMMON_WRONG = {"model": 5, "messages": "Hi", "system": 5, "tools": "x", "tool_choice": "auto",
                         "thinking": "on", "cache_control": "x"}
MESSAGES_WRONG = {**MESSAGES_COMMON_WRONG, "max_tokens": "many", "stop_sequences": "END", "temperature": "hot",
                  "top_p": "most", "top_k": "some", "stream": "maybe", "metadata": "x", "service_tier": 5}


def test_every_messages_field_has_a_wrong_type_case():
    from openai_compat.messages.protocol import CountTokensRequest, MessagesRequest

    assert set(MESSAGES_WRONG) == set(MessagesRequest.model_fields)
    assert set(MESSAGES_COMMON_WRONG) == set(CountTokensRequest.model_fields)


@pytest.mark.parametrize("route,field", [(MESSAGES, f) for f in MESSAGES_WRONG] +
                         [(COUNT_TOKENS, f) for f in MESSAGES_COMMON_WRONG])
def test_wrong_type_for_every_messages_field(worker, gateway_url, route, field):
    body = {**message(), field: MESSAGES_WRONG[field]}
    if route == COUNT_TOKENS:
        del body["max_tokens"]
    in_process = job_error({"openai_route": route, "openai_input": body})
    assert_anthropic_error(in_process, 400, (field,))
    response = http(gateway_url, "POST", "/openai" + route, json.dumps(body).encode())
    assert response.status_code == 400 and response.json() == in_process
    gateway_keeps_serving(gateway_url)
