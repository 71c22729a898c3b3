"""RunPod serverless entrypoint: an OpenAI-compatible LLM worker on PyTorch + transformers.

    python handler.py                      run test_input.json once and print the result (local test)
    python handler.py --test_input JSON    run that job once and print the result
    python handler.py --rp_serve_api       the runpod SDK's local API (/run, /runsync, ...)
    python handler.py   (on RunPod)        serve jobs from the platform

Importing this module loads no model: weights load on the first job (or before serving on the platform).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

from engine import AsyncEngine, redact_urls
from openai_compat.errors import status_of
from openai_compat.jobs import JobRouter
from openai_compat.serving import OpenAIServing
from worker import logs as worker_logging
from worker.shutdown import GracefulShutdown, children_die_with_the_worker, exit_process
from worker.settings import SettingsError, WorkerSettings, load_settings

log = logging.getLogger("handler")

_FATAL_EXIT_DELAY_S = 5.0  # time for the SDK to report the failed jobs before the process exits


@dataclass
class Worker:
    settings: WorkerSettings
    engine: AsyncEngine
    router: JobRouter


_worker: Worker | None = None
_worker_lock = threading.Lock()


def get_worker() -> Worker:
    """The process's worker, built on first use from the environment (no model is loaded here)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            settings = load_settings()
            worker_logging.configure(settings.log_level)
            engine = AsyncEngine(settings.engine_config())
            engine.on_fatal = _exit_after_fatal
            serving = OpenAIServing(engine, settings.serving_config())
            _worker = Worker(settings, engine, JobRouter(serving, settings.serving_config()))
        return _worker


def _exit_after_fatal(exc: BaseException) -> None:
    """The device is unusable: let the failed jobs be reported, then exit so the platform replaces the worker."""
    log.critical("device failure, exiting in %.0f s so the worker is replaced: %s", _FATAL_EXIT_DELAY_S, exc)
    threading.Timer(_FATAL_EXIT_DELAY_S, exit_process, args=(1,)).start()


async def handler(job: dict[str, Any]) -> AsyncIterator[Any]:
    """The function the local gateway and tests call for every job; yields the job's output parts (an error is
    `{"error": {...}}`, an OpenAI error body)."""
    token = worker_logging.current_job.set(str(job.get("id", "-")))
    try:
        async for part in get_worker().router.run(job.get("input"), job_id=job.get("id")):
            yield part
    finally:
        # The job id must not stay on whatever runs next in this context (the gateway's start-up job once
        # tagged every later log line).
        try:
            worker_logging.current_job.reset(token)
        except ValueError:  # finalized in another context: that context ends with the job anyway
            pass


async def platform_handler(job: dict[str, Any]) -> AsyncIterator[Any]:
    """`handler` as the runpod SDK needs it. The SDK fails a job with `str(part["error"])`, which for a dict is a
    Python repr; the error goes as the OpenAI error body's JSON text instead, which any client can parse."""
    async for part in handler(job):
        yield {"error": json.dumps(part, ensure_ascii=False)} if status_of(part) else part


def health() -> dict[str, Any]:
    """The worker's state, for the local gateway's /health."""
    worker = _worker
    stats = worker.engine.stats() if worker is not None else None
    if stats is None:
        return {"status": "ok", "model_loaded": False}
    return {"status": "ok" if worker.engine.failure is None else "failed", "model_loaded": True,
            "model": worker.engine.model_name, "running_sequences": stats["num_running"],
            "waiting_requests": stats["num_waiting"], "requests_in_engine": stats["num_requests"],
            "kv_cache": {key: stats[key] for key in ("kv_used_tokens", "kv_capacity_tokens", "kv_used_bytes",
                                                     "kv_capacity_bytes", "preemptions")}}


def close() -> None:
    """Stop the engine (the local gateway calls this as it exits): a generation thread still inside torch when
    the interpreter shuts down aborts the process."""
    if _worker is not None:
        _worker.engine.close()


def gateway_options() -> dict[str, Any]:
    """Validate the configuration (a bad value raises SettingsError) and give the local gateway its part."""
    settings = get_worker().settings
    return {"shutdown_grace_s": settings.shutdown_grace_seconds, "max_concurrency": settings.max_concurrency}


_shutdown: GracefulShutdown | None = None


def concurrency_modifier(current: int) -> int:
    # The SDK installs its SIGTERM handler as its job loop starts, and this is the first call that loop makes:
    # the graceful shutdown wraps the SDK's handler here.
    if _shutdown is not None:
        _shutdown.install()
    return get_worker().settings.max_concurrency


# ---------------------------------------------------------------- command line


async def run_local_job(job: dict[str, Any]) -> dict[str, Any]:
    """Run one job the way the platform does (all parts aggregated) and return its result."""
    parts = []
    async for part in handler(job):
        if status_of(part):
            return {"id": job.get("id"), "status": "FAILED", "error": part["error"]}
        parts.append(part)
    return {"id": job.get("id"), "status": "COMPLETED", "output": parts}


def _local_test(test_input: str | None) -> int:
    if test_input is None:
        if not os.path.exists("test_input.json"):
            print("test_input.json not found; pass --test_input JSON", file=sys.stderr)
            return 1
        with open("test_input.json", encoding="utf-8") as file:
            test_input = file.read()
    try:
        job = json.loads(test_input)
    except json.JSONDecodeError as exc:
        print(f"test input is not valid JSON: {exc}", file=sys.stderr)
        return 1
    if not isinstance(job, dict) or "input" not in job:
        print('test input must be a JSON object with an "input" key', file=sys.stderr)
        return 1
    job.setdefault("id", "local_test")
    try:
        result = asyncio.run(run_local_job(job))
    finally:
        close()  # a generation thread still inside torch at interpreter exit aborts the process
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0 if result["status"] == "COMPLETED" else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings = get_worker().settings
    except SettingsError as exc:
        print(f"llm-worker: {exc}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--test_input", default=None)
    parser.add_argument("--rp_serve_api", action="store_true")
    known, _ = parser.parse_known_args(argv)
    on_platform = os.environ.get("RUNPOD_WEBHOOK_GET_JOB") is not None
    serving_api = known.rp_serve_api or bool(os.environ.get("RUNPOD_REALTIME_PORT"))
    if known.test_input is not None or not (on_platform or serving_api):
        # The SDK's own local mode does not iterate generator handlers; run the job here instead.
        return _local_test(known.test_input)

    import runpod

    global _shutdown
    if on_platform:
        # Load before taking jobs: a worker that cannot load exits now, and the platform replaces it.
        try:
            asyncio.run(get_worker().engine.start())
        except Exception as exc:
            print(f"llm-worker: model load failed: {redact_urls(str(exc))}", file=sys.stderr)
            return 1
        _shutdown = GracefulShutdown(settings.shutdown_grace_seconds)
    children_die_with_the_worker()  # the SDK forks its heartbeat from this thread as it starts
    runpod.serverless.start({"handler": platform_handler, "concurrency_modifier": concurrency_modifier,
                             "return_aggregate_stream": True})
    if _shutdown is not None:
        _shutdown.join()  # stopped by SIGTERM: the drain reports and exits
    return 0


if __name__ == "__main__":
    sys.exit(main())
