"""Replays hostile request shapes against a running gateway and prints what each got and how long a concurrent
small request (GET /health) waited meanwhile. The shapes cover the OpenAI routes and Anthropic's Messages API.

    python bench/adversarial.py [--url http://127.0.0.1:8000] [--timeout 60]

Loopback only (it refuses any other host), bounded (each shape has a timeout; the whole run stops by itself),
and it sends each shape once. A healthy worker answers every shape with an error body (OpenAI's, or Anthropic's
on /v1/messages) or a result, and /health never waits long.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from urllib.parse import urlsplit

import httpx

TOKEN = 42  # any id in the vocabulary


def shapes(model: str) -> list[tuple[str, str, bytes, dict]]:
    """(name, path, body, extra headers) of every shape; `model` is the served model's id."""
    completions, chat, messages = "/openai/v1/completions", "/openai/v1/chat/completions", "/v1/messages"
    responses = "/openai/v1/responses"

    def body(value) -> bytes:
        return json.dumps(value).encode()

    return [
        ("100k one-token prompts", completions, body({"prompt": [[TOKEN]] * 100_000, "max_tokens": 1}), {}),
        ("200k one-token prompts", completions, body({"prompt": [[TOKEN]] * 200_000, "max_tokens": 1}), {}),
        ("4 MiB of one-token prompts", completions,
         body({"prompt": [[TOKEN]] * (4 * 2**20 // 5), "max_tokens": 1}), {}),
        ("n=32 x 256 prompts", completions, body({"prompt": [[TOKEN]] * 256, "n": 32, "max_tokens": 1}), {}),
        ("300k token ids in one prompt", completions, body({"prompt": [TOKEN] * 300_000, "max_tokens": 1}), {}),
        ("maximal legal prompt list (256 x 1024 ids)", completions,
         body({"prompt": [[TOKEN] * 1024] * 256, "max_tokens": 1}), {}),
        ("16 MiB of small messages", chat,
         body({"messages": [{"role": "user", "content": "hi"}] * (16 * 2**20 // 34), "max_tokens": 1}), {}),
        ("16 MiB message", chat, body({"messages": [{"role": "user", "content": "hi " * (16 * 2**20 // 3)}]}), {}),
        ("500k content parts", chat, body({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]
                                                         * 500_000}]}), {}),
        ("corrupt gzip body", completions, b"this is not gzip", {"Content-Encoding": "gzip"}),
        *messages_shapes(model, messages, body),
        *responses_shapes(responses, body),
    ]


def messages_shapes(model: str, path: str, body) -> list[tuple[str, str, bytes, dict]]:
    """Anthropic's Messages API: conversations and tools shaped to cost the most per byte."""
    def ask(**fields) -> bytes:
        return body({"model": model, "max_tokens": 1, **fields})

    user = {"role": "user", "content": "hi"}
    deep_input = {"a": 1}
    for _ in range(89):  # just inside the nesting limit: it reaches conversion and the chat template
        deep_input = {"a": deep_input}
    deep_list: list = [{"type": "text", "text": "x"}]
    for _ in range(150):
        deep_list = [deep_list]
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": deep_input}]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}
    tool = {"name": "f", "input_schema": {"type": "object"}}
    broken = {"$ref": {"type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}, "required": ["x"]},
              "regex": {"type": "object", "properties": {"x": {"type": "string", "pattern": "(["}}},
              "enum": {"type": "object", "properties": {"x": {"enum": list(range(100_000))}}},
              "self-ref": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
                           "$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}},
                                           "required": ["n"]}}}}
    return [
        # Each within the bounds on JSON values, so it reaches the Messages request's own checks.
        ("120k small Messages turns", path, ask(messages=[user] * 120_000), {}),
        ("120k text blocks in one turn", path,
         ask(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 120_000}]), {}),
        ("80k tool_result blocks", path,
         ask(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]
                        * 80_000}]), {}),
        ("tool_use input nested 90 deep", path,
         ask(messages=[user, call, result], tools=[tool], tool_choice={"type": "none"}), {}),
        ("tool_result content nested 150 deep", path,
         ask(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                      "content": deep_list}]}]), {}),
        ("5000 tools, tool_choice any", path,
         ask(messages=[user], tools=[{**tool, "name": f"f{i}", "input_schema": {
             "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}} for i in range(5000)],
             tool_choice={"type": "any"}), {}),
        *[(f"broken tool schema ({name})", path,
           ask(messages=[user], tools=[{"name": "f", "input_schema": schema}], tool_choice={"type": "any"}), {})
          for name, schema in broken.items()],
        ("count_tokens of 120k turns", path + "/count_tokens", body({"model": model, "messages": [user] * 120_000}),
         {}),
    ]


def responses_shapes(path: str, body) -> list[tuple[str, str, bytes, dict]]:
    """The Responses API: item lists, nesting and tool schemas."""
    return [
        ("200k input items", path, body({"input": [{"role": "user", "content": "hi"}] * 200_000}), {}),
        ("100k function_call items", path,
         body({"input": [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
                         for i in range(100_000)]}), {}),
        ("8000 items, each missing its text", path,
         body({"input": [{"role": "user", "content": [{"type": "input_text"}]}] * 8000}), {}),
        ("500k parts in one item", path,
         body({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * 500_000}]}), {}),
        ("an item nested just within the limit", path,
         body({"input": [{"role": "user", "content": nested_list(96)}]}), {}),
        ("an item nested 100k levels deep", path,
         b'{"input": [{"role": "user", "content": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}", {}),
        ("tool schema: a $ref loop", path,
         body({"input": "hi", "max_output_tokens": 1, "tool_choice": "required",
               "tools": [{"type": "function", "name": "f", "parameters": {"$ref": "#/$defs/a", "$defs": {
                   "a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}]}), {}),
        ("tool schema: 45 levels of nested objects", path,
         body({"input": "hi", "max_output_tokens": 1, "tool_choice": "required",
               "tools": [{"type": "function", "name": "f", "parameters": nested_schema(45)}]}), {}),
        ("2000 forced tools", path,
         body({"input": "hi", "max_output_tokens": 1, "tool_choice": "required",
               "tools": [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}}
                         for i in range(2000)]}), {}),
        ("a strict tool's schema is not an object", path,
         body({"input": "hi", "max_output_tokens": 1, "tool_choice": "required",
               "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}, "strict": True}]}), {}),
    ]


def nested_list(depth: int):
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


async def watch_health(client: httpx.AsyncClient, base: str, stop: asyncio.Event, waits: list[float]) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            await client.get(base + "/health", timeout=30)
        except httpx.HTTPError:
            pass
        waits.append(time.monotonic() - started)
        await asyncio.sleep(0.05)


def summarize(response: httpx.Response | Exception) -> str:
    if isinstance(response, Exception):
        return f"{type(response).__name__}: {response}"[:150]
    try:
        error = response.json().get("error")  # OpenAI's body, or Anthropic's on /v1/messages
    except ValueError:
        return f"{response.status_code} (not JSON) {response.text[:100]!r}"
    if error:
        return f"{response.status_code} {error.get('message', '')[:110]}"
    return f"{response.status_code} ok"


async def replay(base: str, timeout: float) -> None:
    async with httpx.AsyncClient() as client:
        model = (await client.get(base + "/openai/v1/models", timeout=timeout)).json()["data"][0]["id"]
        for name, path, body, headers in shapes(model):
            stop, waits = asyncio.Event(), []
            watcher = asyncio.create_task(watch_health(client, base, stop, waits))
            started = time.monotonic()
            try:
                result = await client.post(base + path, content=body, timeout=timeout,
                                           headers={"Content-Type": "application/json", **headers})
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                result = exc
            took = time.monotonic() - started
            stop.set()
            await watcher
            print(f"{name:<48} {len(body) / 2**20:6.1f} MiB {took:6.2f} s  health max {max(waits):.3f} s "
                  f"median {statistics.median(waits):.3f} s  -> {summarize(result)}", flush=True)
        await raw_edges(base, timeout)


async def raw_edges(base: str, timeout: float) -> None:
    """Connection-level shapes, over a plain socket."""
    host, port = urlsplit(base).hostname, urlsplit(base).port or 80

    async def exchange(name: str, data: bytes, wait: float) -> None:
        started = time.monotonic()
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(data)
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.read(400), wait)
            got = answer.split(b"\r\n", 1)[0].decode(errors="replace") or "connection closed"
        except asyncio.TimeoutError:
            got = f"still open after {wait:.0f} s"
        writer.close()
        print(f"{name:<48} {time.monotonic() - started:6.2f} s  -> {got}", flush=True)

    await exchange("Content-Length 100000000, no body", b"POST /openai/v1/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\nContent-Length: 100000000\r\n\r\n", timeout)
    await exchange("declared body never sent", b"POST /openai/v1/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n", timeout)
    await exchange("partial headers", b"POST /openai/v1/completions HTTP/1.1\r\nHost: x\r\n", timeout)
    await exchange("malformed header", b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", timeout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (not its /openai/v1 path)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any one shape may take")
    args = parser.parse_args()
    base = args.url.rstrip("/").removesuffix("/openai/v1")
    host = urlsplit(base).hostname or ""
    if not socket.gethostbyname(host).startswith("127."):
        print(f"refusing {host}: this script only talks to a gateway on this machine", file=sys.stderr)
        return 2
    asyncio.run(asyncio.wait_for(replay(base, args.timeout), timeout=30 * args.timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
