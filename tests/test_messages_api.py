"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the real gateway with the
official `anthropic` client, and through the real handler as the platform sends it, on the embedded model.

A Messages request runs on the chat path, so its greedy reply is the chat reply to the same conversation, its
prompt the chat prompt (input_tokens = prompt_tokens), and its tool calls the chat path's grammar-forced calls.
Every failure on these routes, the gateway's own included, has Anthropic's error body and raises the SDK's
error class. Replies are kept to a few tokens (the model runs on a shared CPU); this SDK version leaves
temperature out of its signature, so the greedy setting goes in `extra_body`.
"""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

from conftest import MODEL, run_job

GREEDY = {"temperature": 0}
SYSTEM = "You are a terse geography tutor."
CONVERSATION = [{"role": "user", "content": "Name a big city in Italy."},
                {"role": "assistant", "content": "Rome."},
                {"role": "user", "content": "What is the capital of France?"}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
TIME = {"name": "get_time", "description": "Current time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                         "required": ["zone"], "additionalProperties": False}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
              "message_stop"}


def root_of(gateway_url: str) -> str:
    return gateway_url.removesuffix("/openai/v1")


@pytest.fixture(scope="session")
def claude(gateway_url):
    """The official client as a user points it at the platform: base URL `.../openai` (it adds `/v1/messages`)."""
    return anthropic.Anthropic(base_url=root_of(gateway_url) + "/openai", api_key="unused", max_retries=0,
                               timeout=300)


def create(claude, messages=CONVERSATION, **kwargs):
    kwargs.setdefault("max_tokens", 20)
    return claude.messages.create(model=MODEL, messages=messages, extra_body=GREEDY, **kwargs)


def without_ids(message) -> dict:
    """A message as the SDK parsed it, without the ids that differ between two runs (and without the null fields
    the SDK's stream accumulator sets, such as `stop_details`, which a parsed response leaves unset)."""
    data = {key: value for key, value in message.to_dict().items() if value is not None}
    data.pop("id")
    for block in data["content"]:
        if block["type"] == "tool_use":
            block.pop("id")
    return data


def anthropic_error(info: pytest.ExceptionInfo, status: int, kind: str, *words: str) -> str:
    """The SDK raised for a status whose wire body is Anthropic's error; its message names `words`."""
    error = info.value
    assert error.status_code == status
    body = error.response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    message = body["error"]["message"]
    for word in words:
        assert word in message, (word, message)
    assert "Traceback" not in message
    return message


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event of an Anthropic stream."""
    events = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        assert set(lines) == {"event", "data"}, frame
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"], frame
        events.append((lines["event"], data))
    return events


def check_event_order(names: list[str]) -> None:
    """message_start, then each block's start, deltas and stop, then message_delta and message_stop."""
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    open_block = False
    for name in names[1:-2]:
        if name == "content_block_start":
            assert not open_block, names
            open_block = True
        elif name in ("content_block_delta", "content_block_stop"):
            assert open_block, names
            open_block = name == "content_block_delta"
        else:
            raise AssertionError(names)
    assert not open_block, names


# ---------------------------------------------------------------- replies


def test_greedy_reply_is_the_chat_reply(claude, client, gateway_url):
    message = create(claude, system=SYSTEM)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                                                 *CONVERSATION], max_tokens=20, temperature=0)
    choice = chat.choices[0]
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == choice.message.content and "Paris" in choice.message.content
    assert (message.stop_reason, message.stop_sequence, choice.finish_reason) == ("end_turn", None, "stop")
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                         chat.usage.completion_tokens)
    # The same route from the gateway's root (`/v1/messages`), and system as text blocks.
    at_root = anthropic.Anthropic(base_url=root_of(gateway_url), api_key="unused", max_retries=0, timeout=300)
    again = create(at_root, system=[{"type": "text", "text": SYSTEM}])
    assert without_ids(again) == without_ids(message)


def test_content_blocks_and_prefill_render_as_chat(claude, client):
    blocks = [{"role": "user", "content": [{"type": "text", "text": "Name a big city in Italy."},
                                           {"type": "text", "text": "One word."}]},
              {"role": "assistant", "content": [{"type": "text", "text": "The capital of France is"}]}]
    message = create(claude, blocks, max_tokens=3)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "Name a big city in Italy.\nOne word."},
                  {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens


def test_stream_events_add_up_to_the_message(claude, gateway_url):
    whole = create(claude, system=SYSTEM)
    with claude.messages.stream(model=MODEL, messages=CONVERSATION, system=SYSTEM, max_tokens=20,
                                extra_body=GREEDY) as stream:
        names = [event.type for event in stream if event.type in RAW_EVENTS]
        final = stream.get_final_message()
    check_event_order(names)
    assert names.count("content_block_start") == 1 and names.count("content_block_delta") > 3
    assert without_ids(final) == without_ids(whole)

    # On the wire: every event named by its type, no [DONE].
    body = {"model": MODEL, "messages": CONVERSATION, "system": SYSTEM, "max_tokens": 20, "stream": True, **GREEDY}
    response = httpx.post(root_of(gateway_url) + "/v1/messages", json=body, timeout=300)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    events = sse_events(response.text)
    check_event_order([name for name, _ in events])
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"output_tokens": whole.usage.output_tokens}
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == whole.content[0].text


def test_count_tokens_is_the_input_tokens_of_the_same_request(claude):
    for kwargs in ({}, {"system": SYSTEM}, {"tools": [WEATHER], "tool_choice": {"type": "any"}}):
        count = claude.messages.count_tokens(model=MODEL, messages=CONVERSATION, **kwargs)
        assert count.input_tokens == create(claude, max_tokens=1, **kwargs).usage.input_tokens, kwargs


def test_stop_sequence_and_max_tokens(claude):
    stopped = create(claude, stop_sequences=["zzz", " Paris"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " Paris")
    assert stopped.content[0].text == "The capital of France is"
    cut = create(claude, max_tokens=2)
    assert (cut.stop_reason, cut.stop_sequence, cut.usage.output_tokens) == ("max_tokens", None, 2)
    with claude.messages.stream(model=MODEL, messages=CONVERSATION, max_tokens=20, stop_sequences=[" Paris"],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(stopped)


# ---------------------------------------------------------------- tools


@pytest.mark.slow
@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_matches_the_schema_and_streams_as_json_deltas(claude, choice):
    message = create(claude, WEATHER_Q, max_tokens=40, tools=[TIME, WEATHER], tool_choice=choice)
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and all(block.type == "tool_use" for block in message.content)
    for call in calls:
        assert call.id.startswith("toolu_") and isinstance(call.input, dict)
        schema = {"get_weather": WEATHER_SCHEMA, "get_time": TIME["input_schema"]}[call.name]
        jsonschema.validate(call.input, schema)
    if choice["type"] == "tool":
        assert [call.name for call in calls] == ["get_weather"]

    with claude.messages.stream(model=MODEL, messages=WEATHER_Q, max_tokens=40, tools=[TIME, WEATHER],
                                tool_choice=choice, extra_body=GREEDY) as stream:
        events = [event for event in stream if event.type in RAW_EVENTS]
        final = stream.get_final_message()
    check_event_order([event.type for event in events])
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    assert deltas and all(delta.type == "input_json_delta" for delta in deltas)
    assert without_ids(final) == without_ids(message)


def test_disable_parallel_tool_use_makes_one_call(claude):
    message = create(claude, WEATHER_Q, max_tokens=60, tools=[WEATHER, TIME],
                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [block.type for block in message.content] == ["tool_use"]


@pytest.mark.parametrize("dump", [lambda b: b.model_dump(), lambda b: b.model_dump(exclude_none=True),
                                  lambda b: b.to_dict()], ids=["model_dump", "exclude_none", "to_dict"])
def test_the_sdks_own_reply_blocks_go_back_as_they_were_dumped(claude, dump):
    """An agent keeps its history as the SDK's reply objects dumped to JSON (fields newer than this worker's
    models included, empty: `caller`, `toolset_name`, `citations`) and sends them back with the tool's result."""
    reply = create(claude, WEATHER_Q, max_tokens=60, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    history = WEATHER_Q + [{"role": "assistant", "content": [dump(block) for block in reply.content]},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                         "content": "Sunny, 21 C"}]}]
    assert create(claude, history, max_tokens=2, tools=[WEATHER], tool_choice={"type": "none"}).stop_reason \
        == "max_tokens"
    # A value this worker cannot honour is still refused, naming the field.
    served = dict(history[1]["content"][-1], caller={"type": "code_execution_20250825", "tool_id": "srvtoolu_1"})
    with pytest.raises(anthropic.BadRequestError) as failure:
        create(claude, WEATHER_Q + [{"role": "assistant", "content": [served]}, history[2]], max_tokens=2,
               tools=[WEATHER], tool_choice={"type": "none"})
    assert "caller" in anthropic_error(failure, 400, "invalid_request_error", "direct caller")


def test_tool_result_turn_renders_like_the_chat_tool_message(claude, client):
    chat_tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                  "parameters": WEATHER_SCHEMA}}
    arguments = {"city": "Paris", "unit": "celsius"}
    for is_error, result in ((False, "18 degrees and sunny"), (True, "the weather service is down")):
        turns = [*WEATHER_Q,
                 {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                    "input": arguments}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": is_error,
                                               "content": [{"type": "text", "text": result}]}]}]
        message = create(claude, turns, tools=[WEATHER], tool_choice={"type": "none"})
        chat = client.chat.completions.create(
            model=MODEL, max_tokens=20, temperature=0, tools=[chat_tool], tool_choice="none",
            messages=[*WEATHER_Q,
                      {"role": "assistant", "content": "Let me check.", "tool_calls": [
                          {"id": "toolu_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
                      {"role": "tool", "tool_call_id": "toolu_1",
                       "content": f"Error: {result}" if is_error else result}])
        assert message.usage.input_tokens == chat.usage.prompt_tokens
        assert message.content[0].text == chat.choices[0].message.content
        assert message.stop_reason == "end_turn"


def test_auto_tool_choice_without_a_parser_is_a_400_that_says_what_works(claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        create(claude, WEATHER_Q, tools=[WEATHER])
    anthropic_error(info, 400, "invalid_request_error", "tool_choice", '{"type": "any"}')


# ---------------------------------------------------------------- errors raise the SDK's classes


def test_missing_max_tokens_is_a_bad_request(claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": WEATHER_Q})
    anthropic_error(info, 400, "invalid_request_error", "max_tokens", "required")


@pytest.mark.parametrize("kwargs, words", [
    ({"extra_body": {"frequency_penalty": 1}}, ("frequency_penalty", "unsupported")),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     ("messages[0].content[1].type", "image", "text only")),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]}, ("messages[0].content[0].type", "document")),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ("tools[0].type", "web_search_20250305")),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, ("tools[0].type", "bash_20250124")),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, ("tool_choice.name", "nope")),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]},
     ("messages[0].content[0].type", "assistant messages")),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, ("messages[0].content[0].content[0].type", "image")),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2000}, ("thinking", "reasoning parser")),
    ({"thinking": {"type": "enabled", "budget_tokens": 500}}, ("thinking.budget_tokens", "1024")),
    ({"messages": [{"role": "user", "content": "hello " * 9000}]}, ("maximum context length",)),
    ({"max_tokens": 9000}, ("maximum context length", "max_tokens")),
], ids=["unknown-field", "image", "document", "server-tool", "bash-tool", "named-tool-missing", "tool-use-in-user",
        "image-in-tool-result", "thinking-without-parser", "thinking-budget", "prompt-too-long", "max-tokens-too-big"])
def test_refusals_are_anthropic_bad_requests(claude, kwargs, words):
    kwargs = {"messages": WEATHER_Q, "max_tokens": 4, **kwargs}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, **kwargs)
    anthropic_error(info, 400, "invalid_request_error", *words)


def test_unknown_model_is_not_found(claude):
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.create(model="no-such-model", messages=WEATHER_Q, max_tokens=4)
    anthropic_error(info, 404, "not_found_error", "model", "no-such-model")
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.count_tokens(model="no-such-model", messages=WEATHER_Q)
    anthropic_error(info, 404, "not_found_error", "model")


def test_the_gateways_own_errors_take_anthropics_body(claude, gateway_url):
    root = root_of(gateway_url)
    for path in ("/v1/messages", "/openai/v1/messages", "/v1/messages/count_tokens"):
        response = httpx.post(root + path, content=b'{"model": ', headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert response.json()["type"] == "error" and "not valid JSON" in response.json()["error"]["message"]
    commas = httpx.post(root + "/v1/messages", content=b"[" + b"0," * 2**19 + b"0]", timeout=60)
    assert commas.status_code == 413 and commas.json()["error"]["type"] == "request_too_large"
    # A path under the Messages API that is no route: Anthropic's 404, through the SDK's own resource.
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.messages.batches.list()
    anthropic_error(info, 404, "not_found_error", "/v1/messages/batches")
    # The OpenAI routes keep OpenAI's body.
    openai_body = httpx.post(root + "/v1/chat/completions", content=b'{"model": ').json()
    assert set(openai_body) == {"error"} and openai_body["error"]["code"] == 400


# ---------------------------------------------------------------- the platform's path: jobs


def test_job_route_streamed_and_not(worker, claude):
    body = {"model": MODEL, "messages": CONVERSATION, "system": SYSTEM, "max_tokens": 20, **GREEDY}
    (whole,) = run_job({"openai_route": "/v1/messages", "openai_input": body})
    assert whole["type"] == "message" and whole["stop_reason"] == "end_turn"
    assert whole["content"] == [block.to_dict() for block in create(claude, system=SYSTEM).content]
    parts = run_job({"openai_route": "/v1/messages", "openai_input": {**body, "stream": True}})
    assert all(isinstance(part, str) for part in parts) and len(parts) > 1  # batches of SSE text
    events = sse_events("".join(parts))
    check_event_order([name for name, _ in events])
    assert "".join(data["delta"]["text"] for name, data in events
                   if name == "content_block_delta") == whole["content"][0]["text"]
    (count,) = run_job({"openai_route": "/openai/v1/messages/count_tokens",
                        "openai_input": {"model": MODEL, "messages": CONVERSATION, "system": SYSTEM}})
    assert count == {"input_tokens": whole["usage"]["input_tokens"]}


def test_job_route_errors_have_anthropics_body(worker):
    from worker import handler

    for route, body, kind in [("/v1/messages", {"model": MODEL, "messages": []}, "invalid_request_error"),
                              ("/v1/messages", {"model": MODEL, "messages": WEATHER_Q, "max_tokens": 1,
                                                "stream": True, "tools": [WEATHER]}, "invalid_request_error"),
                              ("/v1/messages", {"model": "nope", "messages": WEATHER_Q, "max_tokens": 1},
                               "not_found_error"),
                              ("/v1/messages/batches", {}, "not_found_error")]:
        (part,) = run_job({"openai_route": route, "openai_input": body})
        assert set(part) == {"type", "error"} and part["error"]["type"] == kind, part

    async def platform(job_input):
        return [p async for p in handler.platform_handler({"id": "platform", "input": job_input})]

    # The runpod SDK fails a job with its "error" text: the Anthropic body as JSON.
    (failed,) = asyncio.run(platform({"openai_route": "/v1/messages", "openai_input": {"model": MODEL}}))
    error = json.loads(failed["error"])
    assert error["type"] == "error" and "messages" in error["error"]["message"]


def test_a_failure_after_the_stream_started_is_an_error_event():
    from openai_compat.errors import OpenAIError
    from openai_compat.messages.protocol import ContentBlockDeltaEvent, TextDelta
    from openai_compat.streaming import BatchSize, job_stream

    async def events():
        yield ContentBlockDeltaEvent(index=0, delta=TextDelta(text="Hi"))
        raise OpenAIError("generation failed: the device is gone", status=500)

    async def collect(raw):
        return [part async for part in job_stream(events(), BatchSize(1, 1, 1), raw, "anthropic")]

    text = "".join(asyncio.run(collect(True)))
    assert "[DONE]" not in text
    assert sse_events(text)[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "generation failed: the device is gone"}})
    assert asyncio.run(collect(False))[-1] == [sse_events(text)[-1][1]]


def test_chunk_dicts_are_framed_as_named_events_by_the_gateway(worker):
    """With RAW_OPENAI_OUTPUT=0 a job yields lists of event dicts; the gateway frames them as Anthropic does."""
    from aiohttp.test_utils import TestClient, TestServer

    from openai_compat.config import ServingConfig
    from openai_compat.jobs import JobRouter
    from worker.gateway import create_app
    from openai_compat.serving import OpenAIServing

    config = ServingConfig(raw_openai_output=False)
    router = JobRouter(OpenAIServing(worker.engine, config), config)

    async def handler(job):
        async for part in router.run(job["input"], job["id"]):
            yield part

    async def main():
        async with TestClient(TestServer(create_app(handler))) as http:
            response = await http.post("/v1/messages", json={"model": MODEL, "messages": CONVERSATION,
                                                             "max_tokens": 8, "stream": True, **GREEDY})
            return response.status, await response.text()

    status, text = asyncio.run(main())
    assert status == 200 and "[DONE]" not in text
    check_event_order([name for name, _ in sse_events(text)])


# ---------------------------------------------------------------- thinking


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% else %}<think>\n{% endif %}"
    "{% endif %}")


@pytest.mark.slow
def test_thinking_maps_to_the_templates_switch(monkeypatch, tmp_path):
    """A template with an enable_thinking switch and <think> parsing (as Qwen3's): enabled returns the thinking
    as a thinking block (the small model never closes it, so a stop sequence ends the reply), disabled closes
    the thinking in the prompt and the reply is text."""
    from api_helpers import Worker

    worker = Worker(monkeypatch, tmp_path, CUSTOM_CHAT_TEMPLATE=THINKING_TEMPLATE, REASONING_PARSER="qwen3")
    body = {"model": MODEL, "messages": CONVERSATION, "max_tokens": 1100, "stop_sequences": ["."], **GREEDY}
    enabled = worker.job({"openai_route": "/v1/messages", "openai_input": {
        **body, "thinking": {"type": "enabled", "budget_tokens": 1024}}})
    assert [block["type"] for block in enabled["content"]] == ["thinking"], enabled
    assert enabled["content"][0]["thinking"] and enabled["content"][0]["signature"] == ""
    assert enabled["stop_reason"] == "stop_sequence"
    omitted = worker.job({"openai_route": "/v1/messages", "openai_input": {
        **body, "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}})
    assert omitted["content"] == [{"type": "thinking", "thinking": "", "signature": ""}]
    disabled = worker.job({"openai_route": "/v1/messages", "openai_input": {**body, "thinking": {"type": "disabled"}}})
    assert [block["type"] for block in disabled["content"]] == ["text"], disabled
    for thinking, reply in (("enabled", enabled), ("disabled", disabled)):  # the switch is part of the prompt
        count = worker.job({"openai_route": "/v1/messages/count_tokens", "openai_input": {
            "model": MODEL, "messages": CONVERSATION, "thinking": {"type": thinking, "budget_tokens": 1024}
            if thinking == "enabled" else {"type": thinking}}})
        assert count["input_tokens"] == reply["usage"]["input_tokens"]
    assert disabled["usage"]["input_tokens"] > enabled["usage"]["input_tokens"]
