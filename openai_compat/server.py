"""A local stand-in for the platform's OpenAI route: `/openai/v1/...` over HTTP, each call run as a job.

    python -m openai_compat.server [--host 127.0.0.1] [--port 8000] [--handler handler:handler] [--lazy]

Like https://api.runpod.ai/v2/<endpoint>/openai/v1, every call becomes
`{"input": {"openai_route": "/v1/...", "openai_input": <body>}}` for the same handler function the platform
calls, and what the handler yields goes back to the client: a JSON body, or server-sent events relayed as
they are produced. Error bodies set the HTTP status from their `code`. A client that disconnects cancels its
job, which takes the request out of the engine. vLLM's extra routes (tokenizer, embeddings, pooling, score,
rerank, metrics, stats) are served the same way, under the prefixes and at the root where vLLM has them.

An `X-Request-Id` header becomes the job id: it comes back in the response's header and every log line
written while serving the request carries it (`job=<id>`).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import uuid
from typing import Any, AsyncIterator, Callable

from aiohttp import web

import worker_logging

from .errors import error_body, status_of
from .jobs import CHAT_ROUTE, COMPLETIONS_ROUTE, MODELS_ROUTE
from .streaming import sse

log = logging.getLogger("openai_compat.server")

Handler = Callable[[dict[str, Any]], AsyncIterator[Any]]

MAX_BODY_BYTES = 64 * 2**20  # room for a full context of token ids or text many times over
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
# POST routes beyond chat and completions, under /openai/v1 and /v1, and where vLLM also has them at the root.
_PREFIXED_POSTS = ("/embeddings", "/tokenize", "/detokenize", "/pooling", "/score", "/rerank")
_ROOT_POSTS = ("/tokenize", "/detokenize", "/pooling", "/score", "/rerank", "/v2/rerank")
_GETS = ("/metrics", "/stats")


def _reject_constant(name: str) -> None:
    # Python's json reads NaN and Infinity, which JSON does not have; a client sending them has a bug.
    raise ValueError(f"{name} is not a JSON value (JSON numbers are finite)")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(body, ensure_ascii=False), status=status, content_type="application/json",
                        headers=headers)


def _request_id(request: web.Request) -> str:
    """The caller's X-Request-Id, or a new id."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return f"local-{uuid.uuid4().hex[:12]}"
    if not (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable() and " " not in given):
        raise ValueError(f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII "
                         f"characters")
    return given


def create_app(handler: Handler, health: Callable[[], dict] | None = None) -> web.Application:
    async def run_job(request: web.Request, route: str, body: Any) -> web.StreamResponse:
        try:
            job_id = _request_id(request)
        except ValueError as exc:
            return _json(error_body(str(exc), param=REQUEST_ID_HEADER), 400)
        worker_logging.current_job.set(job_id)
        id_header = {REQUEST_ID_HEADER: job_id}
        job = {"id": job_id, "input": {"openai_route": route, "openai_input": body}}
        parts = handler(job)
        try:
            try:
                first = await parts.__anext__()
            except StopAsyncIteration:
                return _json(error_body("the handler produced no output", 500), 500, id_header)
            if isinstance(first, dict) and first.get("object") == "metrics" and route.endswith("/metrics"):
                return web.Response(text=first["text"], headers={"Content-Type": first["content_type"], **id_header})
            if not isinstance(first, (str, list)):  # a whole response or an error
                return _json(first, status_of(first) or 200, id_header)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   **id_header})
            await response.prepare(request)
            part = first
            while True:
                # RAW_OPENAI_OUTPUT=0 yields lists of chunk dicts; the wire format is SSE either way.
                text = part if isinstance(part, str) else "".join(sse(chunk) for chunk in part)
                await response.write(text.encode("utf-8"))
                try:
                    part = await parts.__anext__()
                except StopAsyncIteration:
                    break
            if not isinstance(first, str):
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            await parts.aclose()  # on disconnect or cancellation this aborts the generation

    async def post(request: web.Request, route: str) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _json(error_body(f"the request body is larger than the {MAX_BODY_BYTES // 2**20} MiB limit",
                                    413), 413)
        try:
            body = json.loads(raw, parse_constant=_reject_constant)
        except RecursionError:
            return _json(error_body("the request body is nested too deeply to parse"), 400)
        except ValueError as exc:  # also broken UTF-8, NaN and integers too long to convert
            # What follows a ';' is advice for Python programmers (sys.set_int_max_str_digits), not the caller.
            return _json(error_body(f"the request body is not valid JSON: {str(exc).split(';')[0]}"), 400)
        return await run_job(request, route, body)

    async def models(request: web.Request) -> web.StreamResponse:
        return await run_job(request, MODELS_ROUTE, {})

    async def chat(request: web.Request) -> web.StreamResponse:
        return await post(request, CHAT_ROUTE)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await post(request, COMPLETIONS_ROUTE)

    async def health_check(request: web.Request) -> web.Response:
        state = health() if health is not None else {"status": "ok"}
        return _json(state, 200 if state.get("status") == "ok" else 503)

    async def not_found(request: web.Request) -> web.Response:
        return _json(error_body(f"no route {request.method} {request.path}", 404), 404)

    def job_route(path: str) -> str:
        return path.removeprefix("/openai")  # as the platform forwards /openai/v1/<path>

    async def post_extra(request: web.Request) -> web.StreamResponse:
        return await post(request, job_route(request.path))

    async def get_extra(request: web.Request) -> web.StreamResponse:
        return await run_job(request, job_route(request.path), None)

    @web.middleware
    async def echo_request_id(request: web.Request, handler) -> web.StreamResponse:  # noqa: F811 - aiohttp's name
        # Responses made before a job exists (unparsable bodies, unknown routes) still carry the caller's id.
        response = await handler(request)
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is not None and not response.prepared and REQUEST_ID_HEADER not in response.headers:
            response.headers[REQUEST_ID_HEADER] = given
        return response

    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[echo_request_id])
    for prefix in ("/openai/v1", "/v1"):
        app.router.add_get(f"{prefix}/models", models)
        app.router.add_post(f"{prefix}/chat/completions", chat)
        app.router.add_post(f"{prefix}/completions", completions)
        for path in _PREFIXED_POSTS:
            app.router.add_post(prefix + path, post_extra)
        for path in _GETS:
            app.router.add_get(prefix + path, get_extra)
    for path in _ROOT_POSTS:
        app.router.add_post(path, post_extra)
    for path in _GETS:
        app.router.add_get(path, get_extra)
    app.router.add_get("/health", health_check)
    app.router.add_route("*", "/{tail:.*}", not_found)
    return app


def load_handler(spec: str) -> tuple[Handler, Callable[[], dict] | None]:
    """The job handler named by `module:function`, and the module's `health()` when it has one."""
    module_name, _, attribute = spec.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute or "handler"), getattr(module, "health", None)


async def serve(handler: Handler, health: Callable[[], dict] | None, host: str, port: int, preload: bool) -> None:
    if preload:  # the first models call loads the model, so the first real request does not wait for it
        try:
            async for part in handler({"id": "preload", "input": {"openai_route": MODELS_ROUTE}}):
                if status_of(part):
                    raise SystemExit(f"llm-worker: {part['error']['message']}")
        except SystemExit:
            raise
        except Exception as exc:  # bad configuration and the like: one clear line, non-zero exit
            raise SystemExit(f"llm-worker: {exc}") from None
        worker_logging.current_job.set("-")  # request tasks copy this context; the preload job is over
    runner = web.AppRunner(create_app(handler, health), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("serving the OpenAI API on http://%s:%d/openai/v1", host, port)
    print(f"llm-worker gateway ready on http://{host}:{port}/openai/v1", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--handler", default="handler:handler", help="module:function of the job handler")
    parser.add_argument("--lazy", action="store_true", help="load the model on the first request, not at start")
    args = parser.parse_args(argv)
    handler, health = load_handler(args.handler)
    try:
        asyncio.run(serve(handler, health, args.host, args.port, preload=not args.lazy))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
