"""Helpers for tests of the API: calls through the official client with the error shape checked, and a worker
built from environment variables exactly as worker/handler.py builds its own."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import MODEL

PROMPT = "The capital of France is"


def complete(client, prompt=PROMPT, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def metric_samples(root: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a gateway's /metrics page (root: its URL without /openai/v1), by name and labels."""
    response = httpx.get(f"{root}/metrics", timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def metric_value(samples, name: str) -> float:
    """A metric's value for the served model, summed over its other labels."""
    return sum(v for (n, labels), v in samples.items() if n == name and dict(labels).get("model_name") == MODEL)


def error_of(call) -> tuple[int, dict]:
    """The HTTP status and the wire error body of a call that must fail."""
    with pytest.raises(openai.APIStatusError) as info:
        call()
    body = info.value.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == info.value.status_code and body["error"]["message"]
    return info.value.status_code, body["error"]


def bad_request(call, param: str) -> dict:
    status, error = error_of(call)
    assert (status, error["type"], error["param"]) == (400, "BadRequestError", param), error
    return error


_started: list = []


def close_started() -> None:
    """Stop every engine a Worker started (conftest does it after each test)."""
    while _started:
        _started.pop().close()


def _share_builds(base: Path, default_model: bool) -> None:
    """A fresh BASE_PATH with the default one's CPU kernel builds and (for the embedded default model) its GGUF
    conversion and start-up verdicts linked in, as test_cold_start links the first two: neither the compiler,
    the conversion nor the start-up probes' timings (seconds a start) are what a test of a Worker is about. Each
    is named by what it is made from (a verdict by the CPU, model, versions and engine sources), so a linked one
    is the one that would be made; test_cold_start covers probing and reusing them."""
    from engine.config import EngineConfig
    from engine.cpu import native_kernels
    from engine.loader import model_folder
    from worker.settings import load_settings

    default = load_settings().base_path
    base.mkdir(parents=True, exist_ok=True)
    if not (base / "native-kernels").exists():
        (base / "native-kernels").symlink_to(native_kernels.build_dir(default), target_is_directory=True)
    if default_model and not (base / "converted").exists():
        model_folder(EngineConfig(cache_dir=default))  # converted there once, by the first test that needs it
        (base / "converted").symlink_to(default / "converted", target_is_directory=True)
    if default_model and not (base / "startup-verdicts").exists():
        (default / "startup-verdicts").mkdir(parents=True, exist_ok=True)
        (base / "startup-verdicts").symlink_to(default / "startup-verdicts", target_is_directory=True)


class Worker:
    """The handler's worker (settings -> engine -> OpenAI serving -> job router) for the given environment."""

    def __init__(self, monkeypatch, tmp_path, **env):
        from engine import AsyncEngine
        from openai_compat.jobs import JobRouter
        from openai_compat.serving import OpenAIServing
        from worker.settings import load_settings

        monkeypatch.delenv("CUSTOM_CHAT_TEMPLATE", raising=False)
        _share_builds(tmp_path, default_model="MODEL_NAME" not in env)
        monkeypatch.setenv("BASE_PATH", str(tmp_path))
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        settings = load_settings()
        self.engine = AsyncEngine(settings.engine_config())
        _started.append(self.engine)
        self.router = JobRouter(OpenAIServing(self.engine, settings.serving_config()), settings.serving_config())

    def job(self, job_input) -> dict:
        async def collect():
            return [part async for part in self.router.run(job_input)]
        (part,) = asyncio.run(collect())
        return part

    def chat(self, content: str) -> dict:
        return self.job({"openai_route": "/v1/chat/completions",
                         "openai_input": {"messages": [{"role": "user", "content": content}], **GREEDY}})

    def complete(self, prompt: str) -> dict:
        return self.job({"openai_route": "/v1/completions", "openai_input": {"prompt": prompt, **GREEDY}})

    def render(self, content: str) -> str:
        asyncio.run(self.engine.start())
        return self.engine.tokenizer.render_chat([{"role": "user", "content": content}])


GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}
