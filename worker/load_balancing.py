"""RunPod load-balancing endpoints: requests come straight to the worker's HTTP server on PORT, with no queue,
and the platform polls `GET /ping` on PORT_HEALTH (PORT unless set): 204 while the model loads, 200 once it
serves, 500 when it cannot (the reason is logged), and the worker is replaced.

The server is up before anything heavy is imported (torch, transformers: seconds), so the first probes already
get an answer. The gateway (gateway.py) is then built behind it and every request but `/ping` goes to it: every
route of the route table at its path, streams as server-sent events, a 429 past MAX_CONCURRENCY (the platform
has no queue to hold a request), SIGTERM draining as in queue mode.

Only the standard library and aiohttp are imported here.
"""
from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import sys
from typing import Any, Callable

from aiohttp import web

log = logging.getLogger("worker.load_balancing")

MODES = ("auto", "queue", "http")
DEFAULT_PORT = 5000  # RunPod's load-balancing examples use it


def serving_mode(argv: list[str], environ=os.environ) -> str:
    """"http" (load-balancing) or "queue": SERVING_MODE, or with it unset ("auto") http exactly when PORT is set,
    as RunPod's load-balancing docs have users set it. A local run's options (`--test_input`, `--rp_serve_api`)
    keep their own meaning."""
    mode = (environ.get("SERVING_MODE") or "auto").strip().lower()
    if mode not in MODES:
        raise SystemExit(f"llm-worker: SERVING_MODE must be one of {', '.join(MODES)}, not {mode!r}")
    if any(arg.split("=")[0] in ("--test_input", "--rp_serve_api") for arg in argv):
        return "queue"
    return "http" if mode == "http" or (mode == "auto" and environ.get("PORT")) else "queue"


def entrypoint_main() -> Callable[[], int]:
    """The main function of `python -m worker` and `python handler.py` for this process's mode."""
    if serving_mode(sys.argv[1:]) == "http":
        return main
    from worker.handler import main as queue_main
    return queue_main


def _port(name: str, default: int, environ=os.environ) -> int:
    text = (environ.get(name) or "").strip()
    if not text:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise SystemExit(f"llm-worker: {name} must be a TCP port number (1-65535), not {text!r}")
    return int(text)


class Front:
    """The server the platform talks to. Until `attach` gives it the gateway, `/ping` says 204 and other
    requests wait for the gateway; afterwards `/ping` follows the worker's health."""

    def __init__(self):
        self.gateway: web.Application | None = None
        self.health: Callable[[], dict[str, Any]] | None = None
        self.failure: str | None = None  # why the worker cannot serve (set once, logged once)
        self._attached = asyncio.Event()

    def attach(self, gateway: web.Application, health: Callable[[], dict[str, Any]] | None) -> None:
        self.gateway, self.health = gateway, health
        self._attached.set()

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            log.error("unhealthy: %s; /ping answers 500 so the platform replaces this worker", reason)

    async def ping(self) -> web.Response:
        if self.failure is None and self.health is not None:
            state = self.health()
            if state.get("status") == "failed":
                self.fail("the engine has stopped (see the error above)")
            elif state.get("status") == "stopping":
                return web.json_response(state, status=503)
            elif state.get("model_loaded"):
                return web.json_response(state)
        if self.failure is not None:
            return web.json_response({"status": "failed", "reason": self.failure}, status=500)
        return web.Response(status=204)  # initializing

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/ping" and request.method in ("GET", "HEAD"):
            return await self.ping()
        await self._attached.wait()
        # The gateway application, set up (frozen) but not bound to a socket of its own, answers the request
        # with its routes and middlewares.
        return await self.gateway._handle(request)


def main() -> int:
    port = _port("PORT", DEFAULT_PORT)
    health_port = _port("PORT_HEALTH", port)
    return asyncio.run(_serve(port, health_port))


async def _serve(port: int, health_port: int) -> int:
    front = Front()
    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("*", "/{tail:.*}", front.handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=30.0,
                           shutdown_timeout=1.0)
    await runner.setup()
    sites = [web.TCPSite(runner, "0.0.0.0", p) for p in dict.fromkeys((port, health_port))]
    for site in sites:
        await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"llm-worker: load-balancing mode: HTTP on port {port}, /ping on port {health_port}", flush=True)
    # The heavy imports run on a thread so that /ping keeps being answered meanwhile.
    gateway = await asyncio.to_thread(importlib.import_module, "worker.gateway")
    try:
        return await gateway.serve_behind(front, sites, stop)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
