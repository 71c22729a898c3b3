"""Shared fixtures. The real embedded model loads once per process: in-process tests share the handler's
worker, and the HTTP tests share one gateway subprocess for the whole run."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The exactness tests compare with transformers in float32; DTYPE=auto may pick bfloat16 on CPUs that run it
# natively (tests/test_dtype.py covers that choice), so the shared worker and gateways pin float32.
os.environ.setdefault("DTYPE", "float32")
# The suite runs on two pytest-xdist workers (README): each holds an engine and starts processes, so OpenMP's
# threads sleep between parallel regions instead of spinning on cores that the other worker's threads need.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PARIS_REQUEST = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20,
                 "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(job_input, job_id: str = "test") -> list:
    """Every part the real handler yields for one job."""
    from worker import handler

    async def collect():
        return [part async for part in handler.handler({"id": job_id, "input": job_input})]

    return asyncio.run(collect())


def start_gateway(env: dict | None = None, extra_args: tuple = (), log: list | None = None
                  ) -> tuple[subprocess.Popen, str]:
    """A gateway subprocess and its base URL; its output lines are appended to `log` when one is given."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "worker.gateway", "--port", str(port), *extra_args], cwd=ROOT,
        env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    lines = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "gateway ready" in line:
            # Keep draining the log so the gateway never blocks on a full pipe.
            import threading
            if log is not None:
                log.extend(lines)
            threading.Thread(target=lambda: [log.append(line) if log is not None else None
                                             for line in process.stdout], daemon=True).start()
            return process, f"http://127.0.0.1:{port}/openai/v1"
    process.kill()
    raise RuntimeError("gateway did not start:\n" + "".join(lines[-40:]))


def stop_gateway(process: subprocess.Popen) -> None:
    """Stop a gateway from start_gateway: SIGTERM (it drains), killed if it has not exited within 20 s."""
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()


# The modules that take the most of a worker's time (kernel builds, emulated CPUs, many processes and engines),
# longest first: --dist loadfile hands out whole modules in collection order, so handing these out first lets the
# short ones fill in beside them and both workers end together (the longest-first schedule). Ordered by the
# suite's --durations per module on a 2-core machine; the rest keep their alphabetical order after them.
LONG_MODULES = ("test_hardening.py", "test_quantized_formats.py", "test_native_kernel_builds.py",
                "test_tool_formats.py", "test_model_families.py", "test_handler.py", "test_dockerfile.py",
                "test_bad_input.py", "test_cold_start.py", "test_vision.py", "test_model_sources.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONG_MODULES.index(name) if name in LONG_MODULES else len(LONG_MODULES)
    items.sort(key=rank)  # stable: each module's own order is kept


@pytest.fixture(scope="session")
def gateway_url():
    process, url = start_gateway()
    yield url
    stop_gateway(process)


@pytest.fixture(scope="session")
def client(gateway_url):
    from openai import OpenAI
    return OpenAI(base_url=gateway_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def async_client(gateway_url):
    from openai import AsyncOpenAI
    return AsyncOpenAI(base_url=gateway_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def worker():
    """The in-process worker with its model loaded."""
    from worker import handler
    w = handler.get_worker()
    asyncio.run(w.engine.start())
    return w


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory):
    """The embedded model's tokenizer alone, for the tiny random models (tests/tiny_models.py) to save beside
    their weights."""
    from transformers import AutoTokenizer

    from engine import EngineConfig
    from engine.loader import model_folder
    folder = tmp_path_factory.mktemp("tokenizer")
    AutoTokenizer.from_pretrained(model_folder(EngineConfig())).save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _close_started_engines():
    """Engines a test started through api_helpers.Worker stop with the test: a loop left running idles beside
    the later tests' engines."""
    yield
    from api_helpers import close_started

    close_started()
