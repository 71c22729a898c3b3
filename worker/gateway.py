"""A local stand-in for the platform's OpenAI route: `/openai/v1/...` over HTTP, each call run as a job.

    python -m worker.gateway [--host 127.0.0.1] [--port 8000] [--handler worker.handler:handler] [--lazy]

Like https://api.runpod.ai/v2/<endpoint>/openai/v1, every call becomes
`{"input": {"openai_route": "/v1/...", "openai_input": <body>}}` for the same handler function the platform
calls, and what the handler yields goes back to the client: a JSON body, or server-sent events relayed as
they are produced. Error bodies set the HTTP status from their `code`. A client that disconnects cancels its
job, which takes the request out of the engine. vLLM's extra routes (tokenizer, embeddings, pooling, score,
rerank, metrics, stats) are served the same way, under the prefixes and at the root where vLLM has them.

An `X-Request-Id` header becomes the job id: it comes back in the response's header and every log line
written while serving the request carries it (`job=<id>`).

Every answer the gateway gives itself (oversized, slow or undecodable bodies, unknown routes, its own failures)
is an OpenAI error body (Anthropic's on the Messages API paths). Connections that do not finish their headers
or body in time are closed. On SIGTERM or SIGINT it stops taking requests, lets running ones finish within the
handler's grace period, logs any it had to cut, and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib
import json
import logging
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from engine import redact
from openai_compat import routes
from openai_compat.errors import Dialect, error_body_in, status_of
from openai_compat.routes import MODELS_ROUTE, ROUTES
from openai_compat.streaming import DONE, sse_events

from . import logs as worker_logging

log = logging.getLogger("worker.gateway")

Handler = Callable[[dict[str, Any]], AsyncIterator[Any]]

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
MAX_BODY_BYTES = 64 * 2**20  # room for a full context of token ids or text many times over
# Parsing JSON holds the interpreter for the whole parse, on any thread: a body of millions of tiny values would
# stall every other request for seconds. Each value but the first in a container follows a comma, so counting
# commas (a fast byte scan) bounds the values before parsing; no request within the per-request limits needs
# more (validation.MAX_JSON_VALUES).
MAX_BODY_COMMAS = 2**19
_THREAD_PARSE_BYTES = 2**20  # bodies above this are parsed on a worker thread
HEADER_TIMEOUT_S = 30.0  # a connection must send a request's headers this soon (also: idle keep-alive limit)
BODY_TIMEOUT_S = 60.0  # and its body this soon after the headers
DEFAULT_SHUTDOWN_GRACE_S = 30.0


def _reject_constant(name: str) -> None:
    # Python's json reads NaN and Infinity, which JSON does not have; a client sending them has a bug.
    raise ValueError(f"{name} is not a JSON value (JSON numbers are finite)")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(body, ensure_ascii=False), status=status, content_type="application/json",
                        headers=headers)


# The dialect of the request being answered (set per request by the error_dialect middleware), so every
# error the gateway makes itself takes the body its route speaks.
_dialect: contextvars.ContextVar[Dialect] = contextvars.ContextVar("gateway_error_dialect", default="openai")


def _error(message: str, status: int, headers: dict[str, str] | None = None, param: str | None = None
           ) -> web.Response:
    return _json(error_body_in(_dialect.get(), message, status, param), status, headers)


def _request_id(request: web.Request) -> str:
    """The caller's X-Request-Id, or a new id."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return f"local-{uuid.uuid4().hex[:12]}"
    if not (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable() and " " not in given):
        raise ValueError(f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII "
                         f"characters")
    return given


def _parse_body(raw: bytes) -> Any:
    return json.loads(raw, parse_constant=_reject_constant)


@dataclass
class _Running:
    """A request being served, for the shutdown log."""
    route: str
    task: asyncio.Task | None
    started: float = field(default_factory=time.monotonic)
    streaming: bool = False


@dataclass
class GatewayState:
    running: dict[str, _Running] = field(default_factory=dict)
    draining: bool = False
    cut: list[str] = field(default_factory=list)
    # Requests taken at once; past it a 429 (load-balancing endpoints: the platform has no queue to hold them).
    max_running: int | None = None


class _Refused(Exception):
    """A request answered by the gateway itself before any job starts (its body unreadable or too large)."""

    def __init__(self, response: web.Response):
        super().__init__(response.status)
        self.response = response


def _too_large() -> web.Response:
    response = _error(f"the request body is larger than the {MAX_BODY_BYTES // 2**20} MiB limit", 413)
    response.force_close()  # the unread body must not be taken for the next request
    return response


async def _read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request's body, read within `timeout_s` and the size limits; _Refused with the answer otherwise."""
    # Refused from the headers alone: no point waiting for (or reading) a body that will be refused anyway.
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise _Refused(_too_large())
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except web.HTTPRequestEntityTooLarge:
        raise _Refused(_too_large()) from None
    except asyncio.TimeoutError:
        response = _error(f"the request body did not arrive within {timeout_s:g} s", 408)
        response.force_close()
        raise _Refused(response) from None
    except (RequestPayloadError, HttpProcessingError) as exc:  # a corrupt gzip body, a broken chunk
        raise _Refused(_error(f"the request body could not be read: {str(exc).splitlines()[-1].strip()}",
                              400)) from None
    if raw.count(b",") > MAX_BODY_COMMAS:
        raise _Refused(_error(f"the request body has more than {MAX_BODY_COMMAS} commas: more JSON values than any "
                              f"request this worker accepts can hold", 413))
    return raw


async def _json_body(raw: bytes) -> Any:
    """The body parsed as JSON (large ones on a thread); _Refused with a 400 saying why it is not JSON."""
    try:
        if len(raw) > _THREAD_PARSE_BYTES:
            return await asyncio.to_thread(_parse_body, raw)
        return _parse_body(raw)
    except RecursionError:
        raise _Refused(_error("the request body is nested too deeply to parse", 400)) from None
    except ValueError as exc:  # also broken UTF-8, NaN and integers too long to convert
        # What follows a ';' is advice for Python programmers (sys.set_int_max_str_digits), not the caller.
        raise _Refused(_error(f"the request body is not valid JSON: {str(exc).split(';')[0]}", 400)) from None


async def _relay_stream(request: web.Request, route: str, first: str | list, parts: AsyncIterator[Any],
                        headers: dict[str, str]) -> web.StreamResponse:
    """A streamed answer: the job's parts, from `first` on, written as server-sent events as they come."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **headers})
    await response.prepare(request)
    part = first
    found = routes.find(route)
    named = found is not None and found.events  # typed events: named, no [DONE]
    while True:
        # RAW_OPENAI_OUTPUT=0 yields lists of chunk dicts; the wire format is SSE either way.
        text = part if isinstance(part, str) else sse_events(part, named)
        await response.write(text.encode("utf-8"))
        try:
            part = await parts.__anext__()
        except StopAsyncIteration:
            break
    if not isinstance(first, str) and not named:
        await response.write(DONE.encode("utf-8"))
    await response.write_eof()
    return response


def _job_route(path: str) -> str:
    return path.removeprefix("/openai")  # as the platform forwards /openai/v1/<path>


@dataclass
class _Jobs:
    """The gateway's routes: each call run as a job of `handler`, what it yields relayed to the client."""
    handler: Handler
    health: Callable[[], dict] | None
    state: GatewayState
    body_timeout_s: float

    async def run_job(self, request: web.Request, route: str, body: Any) -> web.StreamResponse:
        try:
            job_id = _request_id(request)
        except ValueError as exc:
            return _error(str(exc), 400, param=REQUEST_ID_HEADER)
        worker_logging.current_job.set(job_id)
        id_header = {REQUEST_ID_HEADER: job_id}
        limit = self.state.max_running
        if limit is not None and len(self.state.running) >= limit:
            return _error(f"this worker is serving its limit of {limit} requests (MAX_CONCURRENCY); retry shortly "
                          f"or add workers", 429, id_header)
        job = {"id": job_id, "input": {"openai_route": route, "openai_input": body}}
        running = self.state.running[job_id] = _Running(route, asyncio.current_task())
        parts = self.handler(job)
        try:
            try:
                first = await parts.__anext__()
            except StopAsyncIteration:
                return _error("the handler produced no output", 500, id_header)
            if isinstance(first, dict) and first.get("object") == "metrics" and route.endswith("/metrics"):
                return web.Response(text=first["text"], headers={"Content-Type": first["content_type"], **id_header})
            if not isinstance(first, (str, list)):  # a whole response or an error
                return _json(first, status_of(first) or 200, id_header)
            running.streaming = True
            return await _relay_stream(request, route, first, parts, id_header)
        except asyncio.CancelledError:
            if self.state.draining:  # cancelled by the shutdown, not by the client
                what = f"{job_id} ({route}{', stream' if running.streaming else ''}, " \
                       f"{time.monotonic() - running.started:.1f} s)"
                self.state.cut.append(what)
                log.warning("shutdown: cut request %s after the grace period", what)
            raise
        finally:
            del self.state.running[job_id]
            await parts.aclose()  # on disconnect or cancellation this aborts the generation

    async def post_route(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await _json_body(await _read_body(request, self.body_timeout_s))
        except _Refused as refused:
            return refused.response
        return await self.run_job(request, _job_route(request.path), body)

    async def get_route(self, request: web.Request) -> web.StreamResponse:
        return await self.run_job(request, _job_route(request.path), None)

    async def health_check(self, request: web.Request) -> web.Response:
        state_now = self.health() if self.health is not None else {"status": "ok"}
        if self.state.draining:
            state_now = {**state_now, "status": "stopping"}
        return _json(state_now, 200 if state_now.get("status") == "ok" else 503)


async def _not_found(request: web.Request) -> web.Response:
    return _error(f"no route {request.method} {request.path}", 404)


@web.middleware
async def _echo_request_id(request: web.Request, handler) -> web.StreamResponse:  # aiohttp names it handler
    # Responses made before a job exists (unparsable bodies, unknown routes) still carry the caller's id.
    response = await handler(request)
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is not None and not response.prepared and REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = given
    return response


def _openai_errors(state: GatewayState):
    @web.middleware
    async def openai_errors(request: web.Request, handler) -> web.StreamResponse:  # aiohttp names it handler
        """Whatever goes wrong, the caller gets an OpenAI error body (aiohttp's own answers are plain text)."""
        if state.draining and request.path != "/health":
            response = _error("the worker is shutting down; retry on another worker", 503)
            response.force_close()
            return response
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(exc.reason or f"HTTP {exc.status}", exc.status)
        except Exception:
            log.exception("gateway error on %s %s", request.method, request.path)
            return _error("internal error in the gateway; see the worker log", 500)

    return openai_errors


@web.middleware
async def _error_dialect(request: web.Request, handler) -> web.StreamResponse:  # aiohttp names it handler
    """The errors made while answering a request take the dialect of the route its path falls under."""
    token = _dialect.set(routes.dialect(request.path))
    try:
        return await handler(request)
    finally:
        _dialect.reset(token)


def create_app(handler: Handler, health: Callable[[], dict] | None = None, state: GatewayState | None = None,
               body_timeout_s: float = BODY_TIMEOUT_S) -> web.Application:
    """The gateway's aiohttp application: every path of the route table, each call a job of `handler`; `/health`
    from `health()`; and an error body in the route's dialect for anything else."""
    jobs = _Jobs(handler, health, state or GatewayState(), body_timeout_s)
    app = web.Application(client_max_size=MAX_BODY_BYTES,
                          middlewares=[_error_dialect, _echo_request_id, _openai_errors(jobs.state)])
    for route in ROUTES:  # the job router's own table (routes.py)
        for path in route.http_paths():
            if route.method == "POST":
                app.router.add_post(path, jobs.post_route)
            else:
                app.router.add_get(path, jobs.get_route)
    app.router.add_get("/health", jobs.health_check)
    app.router.add_route("*", "/{tail:.*}", _not_found)
    return app


class _ClientFaultFilter(logging.Filter):
    """aiohttp logs a malformed request (a client's fault) as an ERROR with a traceback; one INFO line says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (HttpProcessingError, RequestPayloadError)):
            record.msg = f"{record.getMessage()}: {str(exc).splitlines()[-1].strip()}"
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


@dataclass
class HandlerModule:
    handler: Handler
    health: Callable[[], dict] | None = None
    # Validates the worker's configuration (raising on a bad value) and returns the gateway's part of it.
    options: Callable[[], dict] | None = None
    close: Callable[[], None] | None = None  # called once the gateway has stopped serving


def load_handler(spec: str) -> HandlerModule:
    """The job handler named by `module:function`, with the module's `health()`, `gateway_options()` and
    `close()`."""
    module_name, _, attribute = spec.partition(":")
    module = importlib.import_module(module_name)
    return HandlerModule(getattr(module, attribute or "handler"), getattr(module, "health", None),
                         getattr(module, "gateway_options", None), getattr(module, "close", None))


async def _preload(handler: Handler) -> None:
    """The first models call loads the model, so the first real request does not wait for it."""
    async for part in handler({"id": "preload", "input": {"openai_route": MODELS_ROUTE}}):
        if status_of(part):
            raise SystemExit(redact(f"llm-worker: {part['error']['message']}"))


async def serve(module: HandlerModule, host: str, port: int, preload: bool, header_timeout_s: float = HEADER_TIMEOUT_S,
                body_timeout_s: float = BODY_TIMEOUT_S) -> None:
    try:
        # Before serving, always: a bad setting must stop the gateway, not make every request fail later.
        options = module.options() if module.options is not None else {}
        if preload:
            # Its own task, so the job context it sets (the log lines' job id) ends with it.
            await asyncio.create_task(_preload(module.handler))
    except SystemExit:
        raise
    except Exception as exc:  # bad configuration and the like: one clear line, non-zero exit
        raise SystemExit(redact(f"llm-worker: {exc}")) from None
    grace = float(options.get("shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S))
    logging.getLogger("aiohttp.server").addFilter(_ClientFaultFilter())
    state = GatewayState()
    runner = web.AppRunner(create_app(module.handler, module.health, state, body_timeout_s),
                           handler_cancellation=True, access_log=None, keepalive_timeout=header_timeout_s,
                           shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.info("serving the OpenAI API on http://%s:%d/openai/v1", host, port)
    print(f"llm-worker gateway ready on http://{host}:{port}/openai/v1", flush=True)
    await stop.wait()
    await _drain(state, [site], grace, module)
    await runner.cleanup()


async def serve_behind(front, sites: list[web.TCPSite], stop: asyncio.Event) -> int:
    """Load-balancing mode (worker/load_balancing.py): the gateway answers the requests the front server takes
    on `sites`; the model loads meanwhile, its progress on /ping. Returns the exit status."""
    module = load_handler("worker.handler:handler")
    try:
        options = module.options() if module.options is not None else {}
    except Exception as exc:  # a bad setting: one clear line, non-zero exit
        print(redact(f"llm-worker: {exc}"), file=sys.stderr, flush=True)
        return 2
    logging.getLogger("aiohttp.server").addFilter(_ClientFaultFilter())
    state = GatewayState(max_running=options.get("max_concurrency"))
    app = create_app(module.handler, module.health, state)
    runner = web.AppRunner(app)
    await runner.setup()  # frozen and started, never bound: the front hands it its requests
    front.attach(app, lambda: {**(module.health() if module.health else {}),
                               **({"status": "stopping"} if state.draining else {})})

    async def load() -> None:
        try:
            await _preload(module.handler)
            log.info("model loaded: /ping answers 200")
        except SystemExit as exc:
            front.fail(str(exc.code).removeprefix("llm-worker: "))
        except Exception as exc:
            front.fail(redact(f"the model could not be loaded: {exc}"))

    loading = asyncio.create_task(load())
    await stop.wait()
    loading.cancel()
    await asyncio.gather(loading, return_exceptions=True)
    await _drain(state, sites, float(options.get("shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S)), module)
    await runner.cleanup()
    return 0


async def _drain(state: GatewayState, sites: list[web.TCPSite], grace: float, module: HandlerModule) -> None:
    """SIGTERM: take nothing new, give running requests `grace` seconds, cut what is left (logged), close."""
    loop = asyncio.get_running_loop()
    state.draining = True
    for site in sites:
        await site.stop()  # no new connections; requests on open ones get a 503
    running = len(state.running)
    log.info("shutdown: taking no new requests; %d running, waiting up to %.0f s for them", running, grace)
    deadline = loop.time() + grace
    while state.running and loop.time() < deadline:
        await asyncio.sleep(0.05)
    leftover = [r.task for r in state.running.values() if r.task is not None]
    for task in leftover:
        task.cancel()
    await asyncio.gather(*leftover, return_exceptions=True)
    if module.close is not None:
        await asyncio.to_thread(module.close)
    log.info("shutdown: done; %d of %d running requests finished, %d cut%s", running - len(state.cut), running,
             len(state.cut), (": " + ", ".join(state.cut)) if state.cut else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--handler", default="worker.handler:handler", help="module:function of the job handler")
    parser.add_argument("--lazy", action="store_true", help="load the model on the first request, not at start")
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S,
                        help="seconds a connection has to send a request's headers (and to stay idle)")
    parser.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S,
                        help="seconds a request has to send its body after the headers")
    args = parser.parse_args(argv)
    asyncio.run(serve(load_handler(args.handler), args.host, args.port, preload=not args.lazy,
                      header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout))


if __name__ == "__main__":
    main()
