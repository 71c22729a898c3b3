"""Runtime statistics: Prometheus metrics (`/metrics`) and a JSON summary (`/stats`).

Token counters and latency histograms are fed by the serving layer from each request's outputs and the
engine's per-request timings; gauges (running and waiting requests, KV cache use) are read from the engine
when scraped. Metric names are vLLM's (`vllm:...`, with a `model_name` label), so dashboards built for vLLM
chart this worker unchanged. The registry is this object's own, not prometheus_client's global one.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from engine import AsyncEngine, PoolingOutput, RequestOutput

WINDOW_S = 60.0  # the "last minute" of /stats
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_PER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
_LABEL = ["model_name"]

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    def __init__(self, engine: "AsyncEngine", model_name: Callable[[], str]):
        self.engine = engine
        self.model_name = model_name
        self.started = time.time()
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed (generation and pooling).",
                                     _LABEL, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", _LABEL, registry=r)
        self.request_success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                                       _LABEL + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.", _LABEL,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time between generated tokens of a "
                              "request.", _LABEL, buckets=_PER_TOKEN_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to admission into the running "
                                    "batch.", _LABEL, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the request's last output.", _LABEL,
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(self))
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prompt tokens, generated tokens)
        self.total_requests = 0
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0

    # ---------------------------------------------------------------- recording

    def request(self, prompt_tokens: int) -> "RequestRecorder":
        return RequestRecorder(self, prompt_tokens)

    def add_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        if not prompt and not generated:
            return
        name = self.model_name()
        if prompt:
            self.prompt_tokens.labels(name).inc(prompt)
        if generated:
            self.generation_tokens.labels(name).inc(generated)
        now = time.monotonic()
        with self._lock:
            self.total_prompt_tokens += prompt
            self.total_generation_tokens += generated
            self._recent.append((now, prompt, generated))
            self._prune(now)

    def finished(self, reason: str, arrival: float, admitted: float | None, first_token: float | None,
                 finished: float | None, output_tokens: int) -> None:
        """Timings of a finished request, in one clock's seconds (the engine's perf_counter)."""
        name = self.model_name()
        self.request_success.labels(name, reason).inc()
        with self._lock:
            self.total_requests += 1
        if admitted is not None:
            self.queue_time.labels(name).observe(max(0.0, admitted - arrival))
        if first_token is not None:
            self.ttft.labels(name).observe(max(0.0, first_token - arrival))
            if finished is not None and output_tokens > 1:
                self.tpot.labels(name).observe(max(0.0, (finished - first_token) / (output_tokens - 1)))
        if finished is not None:
            self.e2e.labels(name).observe(max(0.0, finished - arrival))

    def pooling_finished(self, output: "PoolingOutput") -> None:
        self.add_tokens(prompt=output.prompt_tokens)
        self.finished("stop", output.arrival, output.started, None, output.finished, 0)

    def _prune(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - WINDOW_S:
            self._recent.popleft()

    # ---------------------------------------------------------------- reading

    def exposition(self) -> str:
        return generate_latest(self.registry).decode("utf-8")

    def stats(self) -> dict:
        now = time.monotonic()
        with self._lock:
            self._prune(now)
            prompt = sum(p for _, p, _ in self._recent)
            generated = sum(g for _, _, g in self._recent)
            totals = {"requests": self.total_requests, "prompt_tokens": self.total_prompt_tokens,
                      "generation_tokens": self.total_generation_tokens}
        uptime = time.time() - self.started
        span = max(1e-9, min(WINDOW_S, uptime))
        engine = self.engine.stats()
        result = {"object": "stats", "model": self.model_name() if engine is not None else None,
                  "model_loaded": engine is not None, "uptime_s": round(uptime, 3),
                  "running_requests": 0, "waiting_requests": 0,
                  "kv_cache": {"used_tokens": 0, "capacity_tokens": 0, "usage": 0.0}, "preemptions": 0,
                  "last_minute": {"prompt_tokens": prompt, "generation_tokens": generated,
                                  "prompt_tokens_per_s": round(prompt / span, 3),
                                  "generation_tokens_per_s": round(generated / span, 3)},
                  "totals": totals}
        if engine is not None:
            capacity = engine["kv_capacity_tokens"]
            result.update(running_requests=engine["num_running"], waiting_requests=engine["num_waiting"],
                          preemptions=engine["preemptions"],
                          kv_cache={"used_tokens": engine["kv_used_tokens"], "capacity_tokens": capacity,
                                    "usage": round(engine["kv_used_tokens"] / capacity, 6) if capacity else 0.0})
        return result


class RequestRecorder:
    """Feeds one generation request's outputs into the metrics as they arrive."""

    def __init__(self, metrics: ServingMetrics, prompt_tokens: int):
        self.metrics = metrics
        self.prompt_tokens = prompt_tokens
        self.started = False
        self.reason = "abort"

    def output(self, output: "RequestOutput") -> None:
        generated = sum(len(delta.token_ids) for delta in output.deltas)
        prompt = 0 if self.started else self.prompt_tokens
        self.started = True
        self.metrics.add_tokens(prompt, generated)
        for delta in output.deltas:
            if delta.finish_reason is not None:
                self.reason = delta.finish_reason
        m = output.metrics
        if output.finished and m is not None:
            self.metrics.finished(self.reason, m.arrival, m.admitted, m.first_token, m.finished, m.output_tokens)


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics

    def collect(self):
        stats = self.metrics.engine.stats()
        if stats is None:
            return
        name = self.metrics.model_name()
        gauges = (("vllm:num_requests_running", "Sequences in the running batch.", stats["num_running"]),
                  ("vllm:num_requests_waiting", "Requests waiting to be admitted.", stats["num_waiting"]),
                  ("vllm:kv_cache_usage_perc", "Fraction of the KV cache's token capacity in use (0 to 1).",
                   stats["kv_used_tokens"] / stats["kv_capacity_tokens"] if stats["kv_capacity_tokens"] else 0.0))
        for metric, help_text, value in gauges:
            family = GaugeMetricFamily(metric, help_text, labels=_LABEL)
            family.add_metric([name], value)
            yield family
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Sequences preempted to free KV cache.",
                                          labels=_LABEL)
        preemptions.add_metric([name], stats["preemptions"])
        yield preemptions
