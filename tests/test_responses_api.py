"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) through the real gateway with the official
`openai` client, and through the job router as the platform sends it, on the embedded model.

Responses run on the chat path, so greedy output must equal chat's for the same conversation, token for token;
every response and event must parse with the SDK's own types (validated, not merely constructed); streams add up
to the whole response; stored responses continue conversations in the worker that made them; and everything the
worker cannot do is a 400 naming the parameter. Outputs are kept to a few tokens (the model runs on a shared CPU).
"""
from __future__ import annotations

import asyncio
import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import Field, TypeAdapter

from api_helpers import bad_request, error_of
from conftest import MODEL, run_job, start_gateway, stop_gateway

QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful assistant. Answer in one sentence."
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                               "required": ["city", "unit"], "additionalProperties": False}}
TIME_TOOL = {"type": "function", "name": "get_time", "description": "Current time in a time zone",
             "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                            "required": ["zone"], "additionalProperties": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)


def create(client, **kwargs) -> Response:
    """responses.create, greedy and short, with the raw body validated against the SDK's Response type."""
    kwargs.setdefault("max_output_tokens", 12)
    kwargs.setdefault("temperature", 0)
    raw = client.responses.with_raw_response.create(model=MODEL, **kwargs)
    Response.model_validate(raw.http_response.json())  # validation, where the client only constructs
    return raw.parse()


def chat(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def texts(response) -> list[str]:
    return [part.text for item in response.output if item.type == "message" for part in item.content]


def shape(response) -> list:
    """A response's output without its ids (and the client's parsed extras), for comparing two runs."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("id", "call_id", "parsed", "parsed_arguments")}
        return [strip(v) for v in value] if isinstance(value, list) else value
    return strip([item.model_dump() for item in response.output])


def counts(usage) -> tuple[int, int, int]:
    """Usage without the cached-token count, which a repeated prompt changes."""
    return usage.input_tokens, usage.output_tokens, usage.total_tokens


def stream_events(client, **kwargs) -> tuple[list, Response | None]:
    """Every event of a `responses.stream()` (each validated as the SDK's event union) and the final response."""
    kwargs.setdefault("max_output_tokens", 12)
    kwargs.setdefault("temperature", 0)
    with client.responses.stream(model=MODEL, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    for event in events:
        EVENTS.validate_python(event.model_dump(exclude={"snapshot", "parsed"}, exclude_unset=True, warnings=False))
    return events, final


# ---------------------------------------------------------------- the chat path, same prompt, same text


def test_greedy_text_equals_chat_completions(client):
    response = create(client, instructions=SYSTEM, input=QUESTION, max_output_tokens=20)
    reply = chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                 max_tokens=20)
    assert texts(response) == [reply.choices[0].message.content]
    assert response.output_text == reply.choices[0].message.content
    assert response.status == "completed" and response.incomplete_details is None
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert (response.usage.input_tokens, response.usage.output_tokens) == (reply.usage.prompt_tokens,
                                                                           reply.usage.completion_tokens)
    assert response.usage.total_tokens == reply.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # The request is echoed as OpenAI echoes it.
    assert (response.instructions, response.max_output_tokens, response.temperature) == (SYSTEM, 20, 0)
    assert (response.tool_choice, response.tools, response.parallel_tool_calls) == ("auto", [], True)
    assert response.text.format.type == "text" and response.store is True and response.metadata == {}
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    assert message.content[0].annotations == []


def test_string_input_and_item_lists_are_one_conversation(client):
    forms = [QUESTION,
             [{"role": "user", "content": QUESTION}],
             [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]]
    responses = [create(client, input=form) for form in forms]
    assert len({r.output_text for r in responses}) == 1
    assert len({r.usage.input_tokens for r in responses}) == 1
    # Roles reach the template as chat's do: a developer message is not the system turn in SmolLM2's template;
    # instructions are (a system message first).
    developer = create(client, input=[{"role": "developer", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    reply = chat(client, [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert developer.output_text == reply.choices[0].message.content
    assert developer.usage.input_tokens == reply.usage.prompt_tokens
    system = create(client, input=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    instructed = create(client, instructions=SYSTEM, input=QUESTION)
    assert system.usage.input_tokens == instructed.usage.input_tokens
    assert system.output_text == instructed.output_text


def test_function_call_items_render_as_chat_tool_calls(client):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    result = '{"temperature": 21, "sky": "clear"}'
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": result}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                      "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result}]
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    response = create(client, input=items, tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=16)
    reply = chat(client, messages, tools=[chat_tool], tool_choice="none", max_tokens=16)
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    assert response.output_text == reply.choices[0].message.content
    # An output for a call that never came is the caller's mistake, named by its path.
    error = bad_request(lambda: create(client, input=[items[0], items[2]]), "input[1].call_id")
    assert "call_1" in error["message"]


# ---------------------------------------------------------------- streams


def test_stream_events_come_in_order_and_add_up_to_the_whole_response(client):
    kwargs = {"instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 16}
    whole = create(client, **kwargs)
    events, final = stream_events(client, **kwargs)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) > 1 and "".join(d.delta for d in deltas) == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    assert events[-1].response.id == events[0].response.id == final.id
    assert shape(final) == shape(whole) and counts(final.usage) == counts(whole.usage)
    assert final.status == "completed"


def test_stream_ends_without_done_and_with_event_lines(gateway_url):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", gateway_url + "/responses", json=body, timeout=300) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    assert "[DONE]" not in text
    frames = [frame for frame in text.split("\n\n") if frame]
    for frame in frames:
        event_line, data_line = frame.split("\n")
        assert event_line == f"event: {json.loads(data_line.removeprefix('data: '))['type']}"
    assert frames[-1].startswith("event: response.incomplete")  # 3 tokens do not finish the answer


def test_tool_calls_are_function_call_items_whole_and_streamed(client):
    kwargs = {"input": "What is the weather in Paris?", "tools": [WEATHER_TOOL, TIME_TOOL],
              "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 60}
    whole = create(client, **kwargs)
    [call] = whole.output
    assert (call.type, call.status) == ("function_call", "completed") and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.call_id != call.id
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.name]
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    assert whole.status == "completed" and whole.tool_choice == "required" and whole.parallel_tool_calls is False
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]

    events, final = stream_events(client, **kwargs)
    kinds = [e.type for e in events]
    pieces = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(pieces),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.name == call.name
    assert "".join(p.delta for p in pieces) == call.arguments == events[-3].arguments
    assert shape(final) == shape(whole)

    named = create(client, **{**kwargs, "tool_choice": {"type": "function", "name": "get_time"}})
    [call] = named.output
    assert call.name == "get_time" and named.tool_choice.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME_TOOL["parameters"])


# ---------------------------------------------------------------- formats, budgets, usage


def test_json_schema_format_gives_matching_json(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "country": {"type": "string", "maxLength": 12}},
              "required": ["city", "country"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    response = create(client, input="Name a city as JSON.", text={"format": fmt}, max_output_tokens=40)
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "place"
    assert response.text.format.schema_ == schema
    json_object = create(client, input="Describe Paris as JSON.", text={"format": {"type": "json_object"}},
                         max_output_tokens=30)
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)
    else:
        assert json_object.output_text.lstrip().startswith("{")


def test_max_output_tokens_cut_is_incomplete(client):
    response = create(client, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[-1].status == "incomplete"
    events, final = stream_events(client, input=QUESTION, max_output_tokens=3)
    assert final is None and events[-1].type == "response.incomplete"  # the SDK's final response is for completed
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert shape(events[-1].response) == shape(response)


def test_usage_counts_the_prompt_the_cache_and_the_output(client):
    long_system = "You answer questions about geography. " * 20
    first = create(client, instructions=long_system, input=QUESTION, max_output_tokens=4)
    second = create(client, instructions=long_system, input=QUESTION, max_output_tokens=4)
    tokenized = httpx.post(f"{client.base_url}tokenize", timeout=60, json={
        "model": MODEL, "messages": [{"role": "system", "content": long_system},
                                     {"role": "user", "content": QUESTION}]}).json()
    assert first.usage.input_tokens == second.usage.input_tokens == tokenized["count"]
    assert first.usage.output_tokens == 4 and first.usage.total_tokens == tokenized["count"] + 4
    # The second prompt's prefix came from the cache the first one filled.
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_logprobs_when_included(client):
    response = create(client, input=QUESTION, max_output_tokens=4, top_logprobs=2,
                      include=["message.output_text.logprobs"])
    [part] = response.output[0].content
    assert len(part.logprobs) == 4 and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob - 1e-6
               for lp in part.logprobs)


# ---------------------------------------------------------------- stored responses


def test_store_retrieve_and_previous_response_id(client, gateway_url):
    first = create(client, input="My name is Ada. Say hello.", max_output_tokens=10)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    raw = httpx.get(gateway_url.removesuffix("/openai/v1") + f"/v1/responses/{first.id}", timeout=60)
    assert raw.status_code == 200 and raw.json()["id"] == first.id  # also under /v1, as the route table mounts it

    second = create(client, previous_response_id=first.id, input="What is my name?", max_output_tokens=10)
    assert second.previous_response_id == first.id
    conversation = [{"role": "user", "content": "My name is Ada. Say hello."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    reply = chat(client, conversation, max_tokens=10)
    assert second.usage.input_tokens == reply.usage.prompt_tokens
    assert second.output_text == reply.choices[0].message.content
    # A continuation of the continuation carries both earlier turns; instructions are not carried over.
    third = create(client, previous_response_id=second.id, input="Thanks.", instructions=SYSTEM,
                   max_output_tokens=4)
    reply = chat(client, [{"role": "system", "content": SYSTEM}, *conversation,
                          {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}],
                 max_tokens=4)
    assert third.usage.input_tokens == reply.usage.prompt_tokens

    unstored = create(client, input="Hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    status, error = error_of(lambda: client.responses.retrieve(unstored.id))
    assert (status, error["type"]) == (404, "NotFoundError")


def test_unknown_ids_are_a_400_and_a_404_that_say_why(client):
    error = bad_request(lambda: create(client, input="Hi", previous_response_id="resp_unknown"),
                        "previous_response_id")
    assert "worker" in error["message"] and "whole conversation" in error["message"]
    status, error = error_of(lambda: client.responses.retrieve("resp_unknown"))
    assert (status, error["type"]) == (404, "NotFoundError") and "worker" in error["message"]


# ---------------------------------------------------------------- what the worker cannot do is a 400


@pytest.mark.parametrize("tool", ["web_search", "web_search_preview", "file_search", "code_interpreter",
                                  "computer_use_preview", "mcp", "image_generation", "local_shell"])
def test_built_in_tools_are_refused_by_name(client, tool):
    error = bad_request(lambda: create(client, input="Hi", tools=[WEATHER_TOOL, {"type": tool}]), "tools[1].type")
    assert tool in error["message"] and "built-in" in error["message"]


@pytest.mark.parametrize("extra, param, words", [
    ({"input": [{"role": "user", "content": "Hi"}, {"type": "telepathy"}]}, "input[1].type", ("telepathy",)),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type", ("built-in",)),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", ("item itself",)),
    ({"input": [{"content": "Hi"}]}, "input[0].type", ("type",)),
    ({"input": ["Hi"]}, "input[0]", ("object",)),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role", ("role",)),
    ({"input": [{"role": "user", "content": "Hi", "mood": "sad"}]}, "input[0].mood", ("mood",)),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", ("text",)),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     ("text only",)),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", ("required",)),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output", ("output",)),
    ({"input": "Hi", "frobnicate": True}, "frobnicate", ("unsupported",)),
    ({"input": "Hi", "n": 2}, "n", ("unsupported",)),
    ({"input": "Hi", "tool_choice": "required"}, "tool_choice", ("needs tools",)),
    ({"input": "Hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     ("nope",)),
    ({"input": "Hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice.type",
     ("built-in",)),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "if": {}}}],
      "tool_choice": "required"}, "tools", ("if",)),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", ("schema",)),
    ({"input": "Hi", "reasoning": {"summary": "auto"}}, "reasoning.summary", ("summarise",)),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include[0]", ("encrypted",)),
    ({"input": "Hi", "truncation": "auto"}, "truncation", ("auto",)),
    ({"input": "Hi", "background": True}, "background", ("background",)),
    ({"input": "Hi", "max_output_tokens": 10**6}, "max_output_tokens", ("max_output_tokens",)),
    ({"input": "Hi", "metadata": {"k": "v" * 600}}, "metadata", ("512",)),
    ({"input": [], "store": False}, "input", ("empty",)),
])
def test_malformed_and_unsupported_requests_name_the_parameter(gateway_url, extra, param, words):
    response = httpx.post(gateway_url + "/responses", json={"model": MODEL, "max_output_tokens": 2, **extra},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "BadRequestError", 400), error
    for word in words:
        assert word in error["message"], error


# ---------------------------------------------------------------- the platform's job route


def test_job_route_whole_and_streamed(worker):
    body = {"input": QUESTION, "instructions": SYSTEM, "max_output_tokens": 8, "temperature": 0}
    (whole,) = run_job({"openai_route": "/v1/responses", "openai_input": body})
    Response.model_validate(whole)
    assert whole["output"][0]["content"][0]["text"]

    parts = run_job({"openai_route": "/v1/responses", "openai_input": {**body, "stream": True}})
    assert all(isinstance(part, str) for part in parts) and "[DONE]" not in "".join(parts)
    events = [json.loads(line.removeprefix("data: ")) for part in parts for line in part.split("\n")
              if line.startswith("data: ")]
    for event in events:
        EVENTS.validate_python(event)
    assert events[0]["type"] == "response.created" and events[-1]["type"] == f"response.{whole['status']}"
    streamed = events[-1]["response"]
    assert streamed["output"][0]["content"] == whole["output"][0]["content"]
    assert [streamed["usage"][k] for k in ("input_tokens", "output_tokens", "total_tokens")] == \
        [whole["usage"][k] for k in ("input_tokens", "output_tokens", "total_tokens")]

    # Stored in this worker: retrievable through the job route with the id in the path.
    (again,) = run_job({"openai_route": f"/v1/responses/{whole['id']}"})
    assert again == whole
    (also,) = run_job({"openai_route": f"/openai/v1/responses/{streamed['id']}"})
    assert also["id"] == streamed["id"]


def test_a_response_lives_only_in_the_worker_that_made_it(client, worker):
    made_by_gateway = create(client, input="Hi", max_output_tokens=2)
    # The in-process worker is another worker: it never saw that response.
    (body,) = run_job({"openai_route": f"/v1/responses/{made_by_gateway.id}"})
    assert body["error"]["code"] == 404
    (body,) = run_job({"openai_route": "/v1/responses", "openai_input": {
        "input": "Hello again", "previous_response_id": made_by_gateway.id, "max_output_tokens": 2}})
    assert (body["error"]["code"], body["error"]["param"]) == (400, "previous_response_id")


# ---------------------------------------------------------------- reasoning and agents, on a parsing worker

# SmolLM2's template, with OpenAI's reasoning effort shown to the model as a system line when the request sets one
# (as gpt-oss's template does), so that the effort's arrival at the template is visible in the prompt's length.
EFFORT_TEMPLATE = (
    "{% if reasoning_effort is defined %}{{ '<|im_start|>system\\nReasoning: ' + reasoning_effort + "
    "'<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def parsing_url():
    """A gateway parsing Hermes tool calls and <think> reasoning, as on a worker serving Qwen3 (the embedded model is
    made to write those formats with a grammar), with a template that shows the reasoning effort."""
    process, url = start_gateway({"TOOL_CALL_PARSER": "hermes", "REASONING_PARSER": "qwen3",
                                  "CUSTOM_CHAT_TEMPLATE": EFFORT_TEMPLATE})
    yield url
    stop_gateway(process)


THINKING = {"structured_outputs": {"regex": r"<think>[a-z ]{1,12}</think>\nParis"}}


@pytest.mark.slow
def test_reasoning_comes_back_as_reasoning_items(parsing_url):
    client = openai.OpenAI(base_url=parsing_url, api_key="unused", max_retries=0, timeout=300)
    whole = create(client, input=QUESTION, extra_body=THINKING, max_output_tokens=20)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.summary == [] and reasoning.status == "completed"
    [thought] = reasoning.content
    assert thought.type == "reasoning_text" and thought.text and "<think>" not in thought.text
    assert message.type == "message" and whole.output_text == "\nParis"
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens

    events, final = stream_events(client, input=QUESTION, extra_body=THINKING, max_output_tokens=20)
    thinking = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(thinking) == thought.text
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert shape(final) == shape(whole)

    # Earlier reasoning goes back in as an item; the template renders the turn as chat would.
    again = create(client, previous_response_id=whole.id, input="And of Italy?", max_output_tokens=2)
    by_hand = create(client, input=[{"role": "user", "content": QUESTION}, *[i.model_dump() for i in whole.output],
                                    {"role": "user", "content": "And of Italy?"}], max_output_tokens=2)
    assert again.usage.input_tokens == by_hand.usage.input_tokens


@pytest.mark.slow
def test_reasoning_effort_reaches_the_chat_template(parsing_url):
    client = openai.OpenAI(base_url=parsing_url, api_key="unused", max_retries=0, timeout=300)
    plain = create(client, input=QUESTION, max_output_tokens=1)
    effort = create(client, input=QUESTION, reasoning={"effort": "high"}, max_output_tokens=1)
    assert effort.usage.input_tokens > plain.usage.input_tokens
    assert effort.reasoning.effort == "high"


@pytest.mark.slow
def test_openai_agents_tool_loop(parsing_url):
    """The openai-agents SDK drives a tool loop over the Responses API: a forced call with parsed arguments, the
    tool's result sent back as a function_call_output item, and a final answer (gibberish, on a 135M model)."""
    import agents
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny, 21 C in {city}"

    bodies: list[dict] = []

    async def record(request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/responses"):
            bodies.append(json.loads(request.content))

    async def run():
        async with httpx.AsyncClient(event_hooks={"request": [record]}, timeout=300) as http:
            client = openai.AsyncOpenAI(base_url=parsing_url, api_key="unused", http_client=http, max_retries=0)
            agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                                 model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                                 # One call: forced calls are written in Hermes' own tags, after which a
                                 # 135M model that does not know the format goes on calling to max_tokens.
                                 model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                     max_tokens=30, parallel_tool_calls=False))
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = asyncio.run(run())
    assert len(calls) == 1 and isinstance(calls[0], str) and calls[0]
    assert bodies[0]["tool_choice"] == "required" and bodies[0]["tools"][0]["name"] == "get_weather"
    second = bodies[1]["input"]
    [call] = [item for item in second if item.get("type") == "function_call"]
    [output] = [item for item in second if item.get("type") == "function_call_output"]
    assert json.loads(call["arguments"]) == {"city": calls[0]}
    assert output["call_id"] == call["call_id"] and output["output"] == f"Sunny, 21 C in {calls[0]}"
    assert isinstance(result.final_output, str)
