"""Load-balancing endpoints: `python -m worker` with PORT set serves HTTP itself, and the platform polls /ping on
PORT_HEALTH. Driven as the platform and a client would: /ping polled from a thread through the start, the load
and the drain, requests from the official openai and anthropic clients, SIGTERM at the end."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import anthropic
import openai
import pytest
import requests

from conftest import MODEL, ROOT, free_port

pytestmark = pytest.mark.slow


class PingLog:
    """/ping's answers, each change of answer once, in order ("refused" while nothing listens)."""

    def __init__(self, url: str):
        self.url, self.seen, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                status = requests.get(self.url, timeout=10).status_code
            except requests.ConnectionError:
                status = "refused"
            if not self.seen or self.seen[-1] != status:
                self.seen.append(status)
            self._stop.wait(0.02)

    def wait_for(self, status, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while status not in self.seen:
            assert time.monotonic() < deadline, f"/ping never answered {status}: {self.seen}"
            time.sleep(0.05)

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.seen


def start_worker(**env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "worker"], cwd=ROOT, env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_worker(worker: subprocess.Popen, ping: PingLog) -> tuple[str, list]:
    """SIGTERM, then the worker's output and what /ping answered throughout."""
    try:
        worker.send_signal(signal.SIGTERM)
        return worker.communicate(timeout=120)[0], ping.stop()
    finally:
        if worker.poll() is None:
            worker.kill()
        ping.stop()


def test_a_load_balancing_worker_answers_ping_through_its_start_serves_and_drains():
    port, health_port = free_port(), free_port()
    worker = start_worker(PORT=str(port), PORT_HEALTH=str(health_port), MAX_CONCURRENCY="1")
    ping = PingLog(f"http://127.0.0.1:{health_port}/ping")
    try:
        ping.wait_for(200)
        chat = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0,
                                     timeout=300)
        reply = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=5, temperature=0)
        assert reply.choices[0].message.content
        # Tokens stream as server-sent events; a second request past MAX_CONCURRENCY=1 is a 429 in its
        # route's own error shape while the first runs.
        stream = chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}],
                                              max_tokens=400, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        with pytest.raises(openai.RateLimitError) as busy:
            chat.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert "MAX_CONCURRENCY" in busy.value.body["message"]
        with pytest.raises(anthropic.RateLimitError) as busy:
            claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert busy.value.body["error"]["type"] == "rate_limit_error"
        assert sum(1 for _ in stream) > 100  # the stream ran to its end meanwhile
        message = claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
        assert message.content[0].text
    finally:
        output, seen = stop_worker(worker, ping)
    assert worker.returncode == 0, output[-3000:]
    assert "shutdown: done" in output
    # Up before the model: 204 while it loads, then 200; after SIGTERM not healthy (503, then gone).
    assert seen[seen.index(204):seen.index(200) + 1] == [204, 200], seen
    assert set(seen[:seen.index(204)]) <= {"refused"} and set(seen[seen.index(200) + 1:]) <= {503, "refused"}, seen


def test_a_worker_that_cannot_load_answers_ping_500_with_the_reason_in_its_log(tmp_path):
    port = free_port()
    worker = start_worker(PORT=str(port), MODEL_NAME=str(tmp_path / "no-such-model"))
    ping = PingLog(f"http://127.0.0.1:{port}/ping")
    try:
        ping.wait_for(500)
        assert requests.get(f"http://127.0.0.1:{port}/ping", timeout=10).json()["reason"]
    finally:
        output, seen = stop_worker(worker, ping)
    assert "unhealthy:" in output and "no-such-model" in output
    assert 200 not in seen


def test_serving_mode_queue_keeps_a_worker_with_port_set_on_jobs():
    """SERVING_MODE forces the kind: `queue` with PORT set runs the local test job as before."""
    done = subprocess.run([sys.executable, "-m", "worker", "--test_input",
                           '{"input": {"openai_route": "/v1/models"}}'], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PORT": str(free_port()), "SERVING_MODE": "queue"}, timeout=300)
    assert done.returncode == 0 and '"COMPLETED"' in done.stdout, done.stderr[-2000:]
