"""Hostile requests and hard stops (issue 10): no request may stall the worker, hold memory, leak a secret, or be
cut silently on shutdown. Shapes are the ones an adversarial pass found; bench/adversarial.py replays them."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, free_port, run_job

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOKEN = 42


def gateway(tmp_path: Path, *args: str, env: dict | None = None, ready: bool = True
            ) -> tuple[subprocess.Popen, str, Path]:
    """A gateway of its own, its log in a file (for the tests that read the log or stop the process)."""
    port = free_port()
    log_path = tmp_path / f"gateway-{port}.log"
    log_file = open(log_path, "w")
    process = subprocess.Popen([sys.executable, "-m", "worker.gateway", "--port", str(port), *args], cwd=ROOT,
                               env={**os.environ, **(env or {})}, stdout=log_file, stderr=subprocess.STDOUT,
                               text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while ready and "gateway ready" not in log_path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("gateway did not start:\n" + log_path.read_text()[-3000:])
        time.sleep(0.1)
    return process, base, log_path


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=30)


def post(base: str, path: str, body, timeout: float = 120, **headers) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(base + "/openai" + path, content=content, timeout=timeout,
                      headers={"Content-Type": "application/json", **headers})


class HealthWatch:
    """Polls /health from a thread while a block runs; `waits` are the seconds each answer took."""

    def __init__(self, base: str):
        self.base = base
        self.waits: list[float] = []
        self.answered_at: list[float] = []  # time.monotonic() of each answer
        self.states: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client() as client:
            while not self._stop.is_set():
                started = time.monotonic()
                state = client.get(self.base + "/health", timeout=60).json()
                self.answered_at.append(time.monotonic())
                self.waits.append(self.answered_at[-1] - started)
                self.states.append(state)
                time.sleep(0.02)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def assert_answered_throughout(self, start: float, end: float) -> None:
        """/health kept answering while [start, end] ran: several answers inside it and no wait as long as half
        of it (work run on the event loop would hold one poll for about all of it). Relative to the span, so a
        busy or a fast machine tells the two apart alike."""
        inside = [t for t in self.answered_at if start < t < end]
        assert len(inside) >= 3, (len(inside), end - start)
        assert max(self.waits) < (end - start) / 2, (max(self.waits), end - start)


def error_of(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json"), response.text[:300]
    error = response.json()["error"]
    assert error["code"] == status
    for word in words:
        assert word in error["message"], error
    return error


# ---------------------------------------------------------------- 1: one request must not freeze the worker


def test_a_hundred_thousand_prompts_are_refused_at_once_and_health_stays_up(gateway_url):
    base = gateway_url.removesuffix("/openai/v1")

    def refuse(count: int) -> tuple[float, float]:
        started = time.monotonic()
        response = post(base, COMPLETIONS, {"prompt": [[TOKEN]] * count, "max_tokens": 1})
        error_of(response, 400, f"{count} prompts", "MAX_PROMPTS_PER_REQUEST")
        return started, time.monotonic()

    start, end = refuse(10_000)
    tenth = end - start
    with HealthWatch(base) as watch:
        time.sleep(0.1)
        start, end = refuse(100_000)
    # Linear in the prompts: ten times as many take about ten times as long (it was quadratic: a hundred times).
    assert end - start < 30 * tenth, (end - start, tenth)
    watch.assert_answered_throughout(start, end)


@pytest.mark.parametrize("body, words, param", [
    ({"prompt": [[TOKEN]] * 300}, ("300 prompts", "MAX_PROMPTS_PER_REQUEST"), "prompt"),
    ({"prompt": [[TOKEN]] * 200, "n": 2}, ("400 sequences", "MAX_SEQUENCES_PER_REQUEST"), "n"),
    ({"prompt": [[TOKEN]] * 100, "n": 2, "best_of": 3}, ("300 sequences", "MAX_SEQUENCES_PER_REQUEST"), "best_of"),
    ({"prompt": [[TOKEN] * 2000] * 200}, ("400000 token ids", "MAX_PROMPT_TOKENS_PER_REQUEST"), "prompt"),
    ({"prompt": [TOKEN] * 300_000}, ("300000 tokens", "maximum context length"), "prompt"),
    ({"prompt": ["hello " * 1000] * 256}, ("256256 tokens", "MAX_PROMPT_TOKENS_PER_REQUEST"), "prompt"),
])
def test_what_one_request_may_ask_for_is_bounded(worker, monkeypatch, body, words, param):
    import dataclasses
    # A lower token bound, so that the text case needs little tokenizing to cross it.
    config = worker.router.serving.config
    if "hello " in str(body["prompt"][0]):
        monkeypatch.setattr(worker.router.serving, "config",
                            dataclasses.replace(config, max_prompt_tokens_per_request=200_000))
    (part,) = run_job({"openai_route": COMPLETIONS, "openai_input": {**body, "max_tokens": 1}}, "bounds")
    error = part["error"]
    assert error["code"] == 400 and error["param"] == param, error
    for word in words:
        assert word in error["message"], error


@pytest.mark.slow
def test_a_small_request_is_answered_while_a_maximal_request_is_prepared(gateway_url):
    """256 text prompts of about 3000 tokens each: as many prompts as one request may carry. Validating and
    tokenizing them takes seconds; none of that may hold up the event loop that answers everyone else. (With
    about 1000 tokens each the preparing took about 1.3 s, short enough that a busy machine's scheduling once
    held a health poll for 0.9 s of it.)"""
    base = gateway_url.removesuffix("/openai/v1")
    text = "the quick brown fox jumps over a lazy dog " * 330
    body = json.dumps({"prompt": [f"{i} {text}" for i in range(256)], "max_tokens": 1}).encode()

    async def send_then_drop() -> tuple[float, float]:
        async with httpx.AsyncClient() as client:
            started = time.monotonic()
            task = asyncio.create_task(client.post(base + "/openai/v1/completions", content=body, timeout=300,
                                                   headers={"Content-Type": "application/json"}))
            # Prepared once it reaches the engine; then the client goes away, which aborts it.
            while True:
                await asyncio.sleep(0.02)
                state = (await client.get(base + "/health", timeout=60)).json()
                if state["requests_in_engine"] or task.done():
                    break
            prepared = time.monotonic()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return started, prepared

    with HealthWatch(base) as watch:
        time.sleep(0.1)
        started, prepared = asyncio.run(send_then_drop())
    # Had the preparing run on the event loop, one health poll would have waited about as long as it took.
    watch.assert_answered_throughout(started, prepared)
    deadline = time.monotonic() + 120
    while httpx.get(base + "/health", timeout=60).json()["requests_in_engine"]:
        assert time.monotonic() < deadline, "the dropped request stayed in the engine"
        time.sleep(0.2)


# ---------------------------------------------------------------- 2: validation memory


MESSAGE_SHAPES = {
    "many small messages": {"messages": [{"role": "user", "content": "hi there"}] * 400_000},
    "many content parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 400_000}]},
    "thousands of long messages": {"messages": [{"role": "user", "content": "word " * 400}] * 8000},
}


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESSAGE_SHAPES)
def test_large_messages_bodies_cost_a_small_multiple_of_their_size(worker, shape):
    body = MESSAGE_SHAPES[shape]
    size = len(json.dumps(body))
    tracemalloc.start()
    try:
        started = time.monotonic()
        json.loads(json.dumps(body))  # the yardstick: a linear pass over the same body, traced alike
        round_trip = time.monotonic() - started
        tracemalloc.reset_peak()
        started = time.monotonic()
        (part,) = run_job({"openai_route": CHAT, "openai_input": body}, "big-messages")
        took = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert part["error"]["code"] in (400, 413), part
    assert peak < 3 * size, f"validating {size / 2**20:.1f} MiB took {peak / 2**20:.0f} MiB at peak"
    assert took < 50 * round_trip, (took, round_trip)  # linear in the body, not quadratic


# ---------------------------------------------------------------- 3: memory goes back after long prompts


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _idle_rss_mb(pid: int, base: str) -> float:
    """RSS once the engine has held nothing for a few seconds (the idle trim runs within about a second)."""
    deadline = time.monotonic() + 60
    while httpx.get(base + "/health", timeout=60).json()["requests_in_engine"]:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(3)
    return _rss_mb(pid)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_memory_returns_to_the_warm_baseline_after_long_prompts(tmp_path):
    """Two distinct ~1300-token prompts grow the KV cache to 8 rows x 1536 columns (566 MB, over the 512 MB kept
    while idle), which is freed once the engine is idle; the freed memory must go back to the system. The
    prefix cache is off, so nothing may legitimately stay."""
    process, base, _ = gateway(tmp_path, env={"PREFIX_CACHE_MB": "0"})
    words = [f"w{i}" for i in range(4000)]

    def burst(prompts: list[str]) -> None:
        async def run():
            async with httpx.AsyncClient() as client:
                replies = await asyncio.gather(*(client.post(base + "/openai/v1/completions", timeout=900,
                                                             json={"prompt": p, "max_tokens": 1}) for p in prompts))
            assert all(r.status_code == 200 for r in replies), [r.text[:200] for r in replies]
        asyncio.run(run())

    try:
        burst(["Hello there", "The capital of France is"])  # warm: the model, the allocator's working set
        baseline = _idle_rss_mb(process.pid, base)
        burst([f"{seed} " + " ".join(words[seed * 7:][:330]) for seed in (10, 11)])
        after = _idle_rss_mb(process.pid, base)
    finally:
        stop(process)
    print(f"idle RSS: warm baseline {baseline:.0f} MB, after two long prompts {after:.0f} MB")
    assert after - baseline < 200, (baseline, after)


@pytest.fixture
def second_engine(worker):
    """Another engine in the same process that has done some work and now sits idle (tests, or a draft model's
    loop, hold several): its idleness must not be confused with the serving engine's."""
    from engine import AsyncEngine, SamplingParams
    from engine_helpers import generate

    config = worker.settings.engine_config()
    engine = AsyncEngine(type(config)(**{**config.__dict__, "kv_cache_memory": 64 * 2**20, "max_model_len": 1024}))
    asyncio.run(engine.start())
    asyncio.run(generate(engine, "second", [1, 2, 3], SamplingParams(max_tokens=3)))
    yield engine
    engine.close()


@pytest.mark.slow
def test_the_idle_engine_gives_freed_heap_memory_back(worker, second_engine):
    """The mechanism behind the test above, at the scale the issue saw (1.9 GB kept after 20 long prompts): heap
    blocks freed under a raised mmap threshold stay with the allocator until it is trimmed, which the engine
    loop does once it has been idle for a moment, whatever other engines the process holds."""
    import torch

    pid = os.getpid()
    block = 16 * 2**20
    torch.empty(block + 2**20, dtype=torch.uint8)  # freed at once: glibc raises its mmap threshold above `block`
    held = [torch.ones(block, dtype=torch.uint8) for _ in range(48)]  # 768 MB, now from the heap (arena)
    pin = torch.ones(2**20, dtype=torch.uint8)  # a live block above them keeps the heap from shrinking by itself
    before = _rss_mb(pid)
    del held
    # A request ends, the engine goes idle; its loop wakes at least every second and trims after 0.5 s idle.
    (reply,) = run_job({"openai_route": COMPLETIONS, "openai_input": {"prompt": "Hi", "max_tokens": 1}}, "trim")
    assert reply["usage"]["completion_tokens"] == 1
    time.sleep(3)
    after = _rss_mb(pid)
    del pin
    assert before - after > 400, f"RSS {before:.0f} MB with the blocks, {after:.0f} MB after freeing them idle"


@pytest.mark.slow
def test_a_closed_engine_leaves_its_model_to_the_collector(worker):
    """Each start freezes the objects alive then (host_memory.freeze_long_lived), and the collector never looks at
    frozen objects: before close() handed them back, every closed engine's model (1 GB for the embedded one,
    held in reference cycles) stayed for the life of the process, and the suite, which starts dozens of
    engines, grew past 20 GB."""
    import gc
    import weakref

    from engine import AsyncEngine

    config = worker.settings.engine_config()
    engine = AsyncEngine(type(config)(**{**config.__dict__, "kv_cache_memory": 32 * 2**20, "max_model_len": 512}))
    asyncio.run(engine.start())
    model = weakref.ref(engine._model.model)
    engine.close()
    deadline = time.monotonic() + 10
    while model() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert model() is None


# ---------------------------------------------------------------- 4: secrets stay out of every output


@pytest.mark.slow
def test_s3_credentials_never_reach_any_output(tmp_path):
    """A password in the endpoint URL, the secret key in the environment, and a profile's key and endpoint
    password: the S3 endpoint is unreachable, so every one of them passes through error paths."""
    dead = free_port()  # nothing listens there
    secrets = {"env": "env-secret-key-0001-do-not-print", "url": "url-password-0002-do-not-print",
               "profile": "profile-secret-key-0003-do-not-print", "profile_url": "profile-url-password-0004"}
    (tmp_path / "credentials").write_text(f"[leaky]\naws_access_key_id = AKIAPROFILETEST\n"
                                          f"aws_secret_access_key = {secrets['profile']}\n")
    (tmp_path / "config").write_text(f"[profile leaky]\nregion = us-east-1\nservices = leaky-s3\n\n"
                                     f"[services leaky-s3]\ns3 =\n  endpoint_url = "
                                     f"http://user:{secrets['profile_url']}@127.0.0.1:{dead}\n")
    base_env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    base_env.update(MODEL_NAME="s3://models/small", BASE_PATH=str(tmp_path / "cache"), LOG_LEVEL="DEBUG",
                    AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1",
                    AWS_CONFIG_FILE=str(tmp_path / "config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
                    AWS_MAX_ATTEMPTS="1")
    from_env = {**base_env, "AWS_ACCESS_KEY_ID": "AKIAENVTEST", "AWS_SECRET_ACCESS_KEY": secrets["env"],
                "AWS_ENDPOINT_URL_S3": f"http://admin:{secrets['url']}@127.0.0.1:{dead}"}
    from_profile = {**base_env, "AWS_PROFILE": "leaky"}
    outputs = []
    for env in (from_env, from_profile):
        # The platform worker: loads before taking jobs, and a failed load is its fatal line.
        result = subprocess.run([sys.executable, "handler.py"], cwd=ROOT, capture_output=True, text=True,
                                timeout=300, env={**env, "RUNPOD_WEBHOOK_GET_JOB": "http://127.0.0.1:9/unused"})
        assert result.returncode == 1
        assert "cannot download s3://models/small" in result.stderr, result.stderr[-2000:]
        outputs.append(result.stdout + result.stderr)
        # The gateway, loading on the first request: the error goes to the caller and to the log.
        process, base, log_path = gateway(tmp_path, "--lazy", env=env)
        try:
            response = post(base, COMPLETIONS, {"prompt": "Hi", "max_tokens": 1})
            error_of(response, 500, "could not be loaded")
            outputs.append(response.text)
        finally:
            stop(process)
        outputs.append(log_path.read_text())
    everything = "\n".join(outputs)
    assert "network error" in everything  # the error paths did run
    for where, secret in secrets.items():
        assert secret not in everything, f"the {where} secret leaked"


# ---------------------------------------------------------------- 5: SIGTERM drains, it does not cut


def _open_streams(base: str, count: int, max_tokens: int) -> tuple[list, threading.Event]:
    """`count` streaming completions read on threads; each result is (tokens, ended with [DONE]). Tokens are the
    final usage chunk's count (a chunk may carry two tokens when the first ends mid-character), or the content
    chunks received when the stream was cut before it."""
    results: list = [None] * count
    started = threading.Barrier(count + 1)

    def read(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        chunks, usage, done, signalled = 0, None, False, False
        try:
            with httpx.stream("POST", base + "/openai/v1/completions", json=body, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line.removeprefix("data: "))
                        if chunk.get("usage"):
                            usage = chunk["usage"]["completion_tokens"]
                        elif chunk.get("choices"):
                            chunks += 1
                        if not signalled:
                            signalled = True
                            started.wait()
                    done = done or line == "data: [DONE]"
        except httpx.HTTPError:
            pass
        if not signalled:
            started.wait()
        results[i] = (usage if usage is not None else chunks, done)

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    started.wait(timeout=120)
    return results, threads


@pytest.mark.slow
def test_sigterm_lets_running_streams_finish_then_exits_0(tmp_path):
    process, base, log_path = gateway(tmp_path, env={"SHUTDOWN_GRACE_SECONDS": "200"})
    try:
        results, threads = _open_streams(base, 3, max_tokens=24)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.HTTPError):  # the listener is closed: no new work
            httpx.get(base + "/openai/v1/models", timeout=5).raise_for_status()
        for thread in threads:
            thread.join(timeout=120)
        assert process.wait(timeout=240) == 0
    finally:
        stop(process)
    assert results == [(24, True)] * 3, results
    log = log_path.read_text()
    assert "shutdown: taking no new requests; 3 running" in log and "3 of 3 running requests finished, 0 cut" in log


@pytest.mark.slow
def test_sigterm_cuts_what_outlives_the_grace_period_and_says_so(tmp_path):
    process, base, log_path = gateway(tmp_path, env={"SHUTDOWN_GRACE_SECONDS": "1"})
    try:
        results, threads = _open_streams(base, 2, max_tokens=4000)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        for thread in threads:
            thread.join(timeout=60)
    finally:
        stop(process)
    assert all(not done for _, done in results), results
    log = log_path.read_text()
    assert log.count("shutdown: cut request local-") == 2 and "/v1/completions, stream" in log, log[-2000:]
    assert "0 of 2 running requests finished, 2 cut" in log


def processes_marked(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (a worker's children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
                state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State"))
            except (OSError, StopIteration):
                continue
            if f"TEST_PROCESS_MARKER={marker}".encode() in environ.split(b"\0") and "zombie" not in state:
                found.append(int(entry.name))
    return found


class FakePlatform:
    """The job API the runpod SDK talks to: hands out one job, records what the worker posts back."""

    def __init__(self, job: dict):
        from aiohttp import web
        self.job = job
        self.taken = False
        self.streamed: list = []
        self.done: list = []
        self.pings: list[float] = []
        self.first_stream = threading.Event()
        app = web.Application()
        app.router.add_get("/job-take/{worker}", self._take)
        app.router.add_get("/job-take-batch/{worker}", self._take_batch)
        app.router.add_get("/job-stop/{worker}", self._stop)
        app.router.add_post("/stream/{job}", self._stream)
        app.router.add_post("/done/{job}", self._done)
        app.router.add_get("/ping/{worker}", self._ping)
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    def env(self) -> dict:
        url = f"http://127.0.0.1:{self.port}"
        return {"RUNPOD_WEBHOOK_GET_JOB": f"{url}/job-take/$ID?gpu=none",
                "RUNPOD_WEBHOOK_POST_OUTPUT": f"{url}/done/$ID?gpu=none",
                "RUNPOD_WEBHOOK_POST_STREAM": f"{url}/stream/$ID?gpu=none", "RUNPOD_POD_ID": "test-pod",
                # The SDK's heartbeat (a child process) runs only with a key and a ping URL, as on the platform.
                "RUNPOD_WEBHOOK_PING": f"{url}/ping/$RUNPOD_POD_ID", "RUNPOD_AI_API_KEY": "test-key",
                "RUNPOD_PING_INTERVAL": "1000"}

    async def _ping(self, request):
        from aiohttp import web
        self.pings.append(time.monotonic())
        return web.Response(text="ok")

    async def _take(self, request):
        from aiohttp import web
        if not self.taken:
            self.taken = True
            return web.json_response(self.job)
        await asyncio.sleep(2)  # a long poll that finds nothing
        return web.Response(status=204)

    async def _take_batch(self, request):
        from aiohttp import web
        if not self.taken:
            self.taken = True
            return web.json_response([self.job])
        await asyncio.sleep(2)
        return web.Response(status=204)

    async def _stop(self, request):
        from aiohttp import web
        await asyncio.sleep(2)
        return web.Response(status=204)

    async def _stream(self, request):
        from aiohttp import web
        self.streamed.append(json.loads(await request.text()))
        self.first_stream.set()
        return web.Response(text="ok")

    async def _done(self, request):
        from aiohttp import web
        self.done.append(json.loads(await request.text()))
        return web.Response(text="ok")


@pytest.mark.slow
@pytest.mark.parametrize("grace, max_tokens", [(180, 12), (1, 4000)], ids=["finishes", "cut"])
def test_platform_worker_drains_on_sigterm(tmp_path, grace, max_tokens):
    job = {"id": "job-sigterm", "input": {"openai_route": COMPLETIONS, "openai_input": {
        "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}}}
    platform = FakePlatform(job)
    marker = f"drain-{grace}-{os.getpid()}-{time.monotonic_ns()}"  # finds the worker's processes, orphans too
    env = {**os.environ, **platform.env(), "SHUTDOWN_GRACE_SECONDS": str(grace), "MIN_BATCH_SIZE": "1",
           "DEFAULT_BATCH_SIZE": "1", "RUNPOD_DEBUG_LEVEL": "INFO", "TEST_PROCESS_MARKER": marker}
    log_path = tmp_path / "worker.log"  # a file, not a pipe: a leftover child would hold a pipe open
    with log_path.open("w") as log_file:
        process = subprocess.Popen([sys.executable, "handler.py"], cwd=ROOT, env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT, text=True)
    try:
        assert platform.first_stream.wait(timeout=300), "the worker never streamed"
        assert platform.pings, "the SDK's heartbeat never pinged"
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=grace + 60)
        output = log_path.read_text()
        assert process.returncode == 0, output[-3000:]
        # Nothing the worker started outlives it, and the platform hears no more pings from a gone worker.
        time.sleep(3)
        assert not processes_marked(marker), f"left running after the worker exited: {processes_marked(marker)}"
        assert not [t for t in platform.pings if t > time.monotonic() - 2], "pings went on after the worker exited"
    finally:
        stop(process)
        for pid in processes_marked(marker):
            os.kill(pid, signal.SIGKILL)
    if grace > 1:
        assert "shutdown: every running job finished" in output, output[-3000:]
        (result,) = platform.done
        text = "".join(json.loads(line.removeprefix("data: "))["choices"][0]["text"]
                       for part in result["output"] for line in part.split("\n\n")
                       if line.startswith("data: {") and json.loads(line.removeprefix("data: "))["choices"])
        assert result["output"][-1].endswith("data: [DONE]\n\n") and text, result
    else:
        assert "shutdown: cut 1 jobs still running after the 1 s grace period: job-sigterm" in output, output[-3000:]


# ---------------------------------------------------------------- 6: HTTP edges


def _raw(port: int, data: bytes, wait: float = 10.0, trickle: float | None = None) -> tuple[bytes, float]:
    """What the server answers to `data` (sent at once, or a byte every `trickle` s) and when it answered or
    closed."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        try:
            if trickle is None:
                sock.sendall(data)
            else:
                for byte in data:
                    sock.sendall(bytes([byte]))
                    time.sleep(trickle)
            answer = sock.recv(4096)
        except (ConnectionResetError, BrokenPipeError):
            answer = b""
        except socket.timeout:
            answer = b"(still open)"
    return answer, time.monotonic() - started


@pytest.mark.slow
def test_http_edges_get_quick_openai_answers_and_clean_logs(tmp_path):
    process, base, log_path = gateway(tmp_path, "--header-timeout", "2", "--body-timeout", "2")
    port = int(base.rsplit(":", 1)[1])
    head = b"POST /openai/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    try:
        # Each answer tells who acted: a 413 before any body byte (a wait for the body would end in the 408), the
        # server's 408 or close at its 2 s timeouts (else the client's 10 s wait ends first: "(still open)").
        answer, _ = _raw(port, head + b"Content-Length: 100000000\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 413") and b'"code": 413' in answer, answer
        answer, _ = _raw(port, head + b"Content-Length: 100\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 408") and b'"code": 408' in answer, answer
        answer, _ = _raw(port, head)  # headers never finished
        assert answer == b"", answer
        slow = head * 40
        answer, took = _raw(port, slow, trickle=0.05)  # slow-loris: a byte at a time
        assert answer == b"" and took < len(slow) * 0.05 / 4, (answer, took)  # cut long before it was all sent
        corrupt = httpx.post(base + "/openai/v1/completions", content=b"not gzip at all", timeout=30,
                             headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        error_of(corrupt, 400, "could not be read")
        answer, _ = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
        assert answer.split(b"\r\n", 1)[0].endswith(b" 400 Bad Request"), answer
        error_of(post(base, COMPLETIONS, {"prompt": "Hi", "max_tokens": "many"}), 400, "max_tokens")
        time.sleep(0.5)
    finally:
        stop(process)
    after_start = log_path.read_text().split("gateway ready", 1)[1]
    assert "job=preload" not in after_start, after_start[-3000:]
    assert " ERROR " not in after_start and "Traceback" not in after_start, after_start[-3000:]
    assert "job=local-" in after_start  # the bad request's line names its own job


# ---------------------------------------------------------------- 7: start-up


@pytest.mark.slow
def test_lazy_gateway_with_a_bad_setting_exits_before_serving(tmp_path):
    process, _, log_path = gateway(tmp_path, "--lazy", env={"MAX_NUM_SEQS": "lots"}, ready=False)
    assert process.wait(timeout=120) != 0
    output = log_path.read_text()
    assert "gateway ready" not in output
    assert [line for line in output.splitlines() if line.startswith("llm-worker:")] == [
        "llm-worker: invalid environment: MAX_NUM_SEQS: Input should be a valid integer, unable to parse string as "
        "an integer (got 'lots')"], output


def test_torch_threads_are_bounded_by_the_machine(monkeypatch):
    from worker.settings import SettingsError, load_settings
    monkeypatch.setenv("TORCH_NUM_THREADS", "99999")
    with pytest.raises(SettingsError, match="TORCH_NUM_THREADS: must be at most the"):
        load_settings()
    monkeypatch.setenv("TORCH_NUM_THREADS", str(os.cpu_count()))
    assert load_settings().torch_num_threads == os.cpu_count()


# ---------------------------------------------------------------- 8: error shapes


@pytest.mark.slow
def test_empty_chat_template_output_is_the_callers_400(monkeypatch, tmp_path, caplog):
    from api_helpers import Worker
    worker = Worker(monkeypatch, tmp_path, CUSTOM_CHAT_TEMPLATE="{% for m in messages %}{% endfor %}")
    try:
        with caplog.at_level(logging.INFO):
            error = worker.chat("Hello")["error"]
    finally:
        worker.engine.close()
    assert error["code"] == 400 and error["param"] == "messages" and "empty prompt" in error["message"], error
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_engine_log_lines_carry_the_job_id(worker, caplog, monkeypatch):
    """A request failing on the engine thread (a fault injected into its sampling) is logged with its job id."""
    from worker import logs as worker_logging
    from engine import GenerationError, SamplingParams
    from engine.sampling.sampler import Sampler

    original = Sampler._adjust_row

    def faulty(self, logits, state, generated):
        if state.params.seed == 4242:
            raise RuntimeError("injected fault")
        return original(self, logits, state, generated)

    monkeypatch.setattr(Sampler, "_adjust_row", faulty)

    async def failing():
        worker_logging.current_job.set("job-engine-log")
        with pytest.raises(GenerationError):
            async for _ in worker.engine.generate("req-failing", [TOKEN] * 8,
                                                  SamplingParams(max_tokens=4, seed=4242, min_tokens=2)):
                pass

    with caplog.at_level(logging.INFO):
        asyncio.run(failing())
    (line,) = [r for r in caplog.records if r.name == "engine" and "req-failing" in r.getMessage()]
    assert line.job == "job-engine-log"


def test_platform_job_error_is_the_openai_error_json(worker, monkeypatch):
    from worker import handler
    import runpod
    from runpod.serverless.modules import rp_job

    captured = {}
    monkeypatch.setattr(runpod.serverless, "start", lambda config: captured.update(config))
    monkeypatch.setenv("RUNPOD_WEBHOOK_GET_JOB", "http://127.0.0.1:9/unused")
    assert handler.main([]) == 0
    sent = []

    async def send_result(session, job_result, job, is_stream=False):
        sent.append(job_result)

    async def stream_result(session, output, job):
        pass

    monkeypatch.setattr(rp_job, "send_result", send_result)
    monkeypatch.setattr(rp_job, "stream_result", stream_result)
    job = {"id": "bad-job", "input": {"openai_route": COMPLETIONS, "openai_input": {"prompt": "Hi", "n": 0}}}
    asyncio.run(rp_job.handle_job(None, captured, job))
    (result,) = sent
    body = json.loads(result["error"])  # JSON text, not a Python repr
    assert body["error"]["code"] == 400 and body["error"]["param"] == "n", body
