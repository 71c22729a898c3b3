"""The worker keeps serving and loses nothing: under load, when clients vanish, and when it must stop."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import MODEL, ROOT

sys.path.insert(0, str(ROOT / "bench"))
import soak  # noqa: E402


def health(gateway_url: str) -> dict:
    with urllib.request.urlopen(gateway_url.removesuffix("/openai/v1") + "/health", timeout=30) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_short_soak_loses_nothing(gateway_url):
    result = asyncio.run(soak.soak(gateway_url, requests=40, concurrency=8))
    assert result["failures"] == 0, result["first_failures"]


@pytest.mark.slow
def test_cancellation_storm_leaves_nothing_behind(gateway_url, client):
    from openai import AsyncOpenAI

    async def open_and_drop(aclient, index):
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me a long story number {index}."}],
            max_tokens=400, temperature=0.7, seed=index, stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2 + index % 3:
                break
        await stream.close()

    async def storm():
        aclient = AsyncOpenAI(base_url=gateway_url, api_key="unused", max_retries=0, timeout=300)
        await asyncio.gather(*(open_and_drop(aclient, i) for i in range(50)))
        await aclient.close()

    asyncio.run(storm())
    deadline = time.monotonic() + 30
    while True:
        state = health(gateway_url)
        if state["requests_in_engine"] == 0 and state["running_sequences"] == 0 and \
                state["kv_cache"]["kv_used_tokens"] == 0:  # every cancelled request's blocks are free again
            break
        assert time.monotonic() < deadline, f"engine still holds requests: {state}"
        time.sleep(0.2)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                           "What is the capital of France?"}], max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content


_DEVICE_FAILURE = """
import asyncio, sys, time
from worker import handler
import engine.executor.runner as runner

def broken(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

async def main():
    await handler.get_worker().engine.start()
    runner.ModelRunner.execute = broken
    job = {"openai_route": "/v1/completions", "openai_input": {"prompt": "Hello", "max_tokens": 4}}
    parts = [p async for p in handler.handler({"id": "doomed", "input": job})]
    print("JOB", parts[0]["error"]["code"], flush=True)
    await asyncio.sleep(60)
    print("STILL ALIVE", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
def test_device_failure_fails_the_job_then_exits():
    result = subprocess.run([sys.executable, "-c", _DEVICE_FAILURE], cwd=ROOT, capture_output=True, text=True,
                            timeout=240)
    assert "JOB 500" in result.stdout
    assert "STILL ALIVE" not in result.stdout
    assert result.returncode == 1  # exited by itself, before its 60 s sleep could print STILL ALIVE
    assert "device failure" in result.stderr


@pytest.mark.slow
def test_startup_failure_exits_with_one_clear_line(tmp_path):
    env = {**os.environ, "RUNPOD_WEBHOOK_GET_JOB": "http://127.0.0.1:9/unused", "MODEL_NAME": str(tmp_path / "missing")}
    result = subprocess.run([sys.executable, "handler.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("llm-worker:")]
    assert len(lines) == 1 and str(tmp_path / "missing") in lines[0], result.stderr[-2000:]


@pytest.mark.slow
def test_gateway_streams_tokens_as_they_are_produced(client, gateway_url):
    """The first token reaches the client while its request is still generating in the engine, and the tokens
    arrive in separate chunks: nothing is buffered to the end."""
    pieces, in_engine_at_first = [], None
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to a hundred."}],
                                            max_tokens=120, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if not pieces:
                in_engine_at_first = health(gateway_url)["requests_in_engine"]
            pieces.append(chunk.choices[0].delta.content)
    assert in_engine_at_first >= 1  # still generating: had the gateway buffered the stream, it would be done
    assert len(pieces) >= 100


def test_log_lines_name_the_job_and_keep_text_at_debug(worker, caplog):
    import logging

    from conftest import run_job

    secret = "Zanzibar-7731"
    job = {"openai_route": "/v1/completions", "openai_input": {"prompt": f"My password is {secret}. It is",
                                                               "max_tokens": 4, "temperature": 0}}
    with caplog.at_level(logging.INFO):
        run_job(job, job_id="job-info")
    done = [r for r in caplog.records if r.getMessage().startswith("request done")]
    assert done and done[-1].job == "job-info"
    for field in ("prompt_tokens=", "queue_s=", "prefill_s=", "decode_s=", "output_tokens=4"):
        assert field in done[-1].getMessage()
    assert not any(secret in r.getMessage() for r in caplog.records)

    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        run_job(job, job_id="job-debug")
    texts = [r for r in caplog.records if secret in r.getMessage()]
    assert texts and all(r.levelno == logging.DEBUG and r.job == "job-debug" for r in texts)
