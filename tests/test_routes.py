"""Every route a vLLM client may call exists on both transports, the gateway over HTTP and the platform's job input,
with the same spellings; a path that is not a route is a 404 on both. The list here is vLLM's surface, written
out by hand, not read from the worker's route table."""
from __future__ import annotations

import pytest
import requests

from conftest import run_job

# (method, path over HTTP, the job's openai_route for it)
VLLM_ROUTES = [
    ("POST", "/openai/v1/chat/completions", "/v1/chat/completions"),
    ("POST", "/v1/chat/completions", "/v1/chat/completions"),
    ("POST", "/openai/v1/completions", "/v1/completions"),
    ("POST", "/openai/v1/responses", "/v1/responses"),
    ("GET", "/openai/v1/models", "/v1/models"),
    ("GET", "/v1/models", "/v1/models"),
    ("POST", "/openai/v1/embeddings", "/v1/embeddings"),
    ("POST", "/tokenize", "/tokenize"),
    ("POST", "/openai/v1/tokenize", "/v1/tokenize"),
    ("POST", "/detokenize", "/detokenize"),
    ("POST", "/pooling", "/pooling"),
    ("POST", "/score", "/score"),
    ("POST", "/v1/score", "/v1/score"),
    ("POST", "/rerank", "/rerank"),
    ("POST", "/v1/rerank", "/v1/rerank"),
    ("POST", "/v2/rerank", "/v2/rerank"),
    ("GET", "/metrics", "/metrics"),
    ("GET", "/openai/v1/stats", "/v1/stats"),
]


@pytest.mark.parametrize("method, path, job_route", VLLM_ROUTES, ids=[f"{m} {p}" for m, p, _ in VLLM_ROUTES])
def test_route_exists_on_both_transports(gateway_url, worker, method, path, job_route):
    root = gateway_url.removesuffix("/openai/v1")
    # An empty body is the caller's 400 on every POST route: the route exists, the request is incomplete.
    expected = 400 if method == "POST" else 200
    answer = requests.request(method, root + path, json={} if method == "POST" else None, timeout=120)
    assert answer.status_code == expected, answer.text
    (part,) = run_job({"openai_route": job_route, "openai_input": {} if method == "POST" else None})
    status = part.get("error", {}).get("code", 200) if isinstance(part, dict) else 200
    assert status == expected, part


@pytest.mark.parametrize("path", ["/v1/nothing", "/embeddings", "/openai/tokenize", "/v2/score"])
def test_a_path_that_is_no_route_is_a_404_on_both(gateway_url, worker, path):
    root = gateway_url.removesuffix("/openai/v1")
    assert requests.post(root + path, json={}, timeout=60).status_code == 404
    (part,) = run_job({"openai_route": path, "openai_input": {}})
    assert part["error"]["code"] == 404 and part["error"]["param"] == "openai_route", part
