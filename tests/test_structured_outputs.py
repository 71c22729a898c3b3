"""Structured outputs and tool calls through the real gateway, with the official `openai` client, on the
embedded model: every constrained output parses and validates, forced tool calls match the tools' schemas, a
whole tool loop runs with the client's own helpers, and constraints that cannot be enforced are 400s.

Outputs are kept short (bounded strings and arrays) because the model runs on a shared CPU.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from conftest import MODEL, start_gateway, stop_gateway

ASK = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False},
    "optional_fields": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 10}, "subtitle": {"type": "string", "maxLength": 10},
        "draft": {"type": "boolean"}}, "required": ["title"], "additionalProperties": False},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                                       "maximum": 9},
                                                                 "y": {"type": "integer", "minimum": -9,
                                                                       "maximum": 9}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                      "maximum": 100},
                                                                     {"type": "null"}]}},
               "required": ["value"], "additionalProperties": False},
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                   "required": ["zone"], "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, messages=ASK, **kwargs):
    kwargs.setdefault("max_tokens", 80)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def bad_request(call, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.response.json()["error"]
    assert (error["code"], error["param"]) == (400, param), error
    return error["message"]


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


# ---------------------------------------------------------------- structured outputs


def test_json_schema_outputs_parse_and_validate(client):
    def ask(name):
        return name, chat(client, response_format=json_schema_format(SCHEMAS[name], strict=name != "any_of"))

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        for name, reply in pool.map(ask, SCHEMAS):
            choice = reply.choices[0]
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_streamed_json_schema_output_validates(client):
    schema = SCHEMAS["nested"]
    chunks = list(chat(client, response_format=json_schema_format(schema), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert text == chat(client, response_format=json_schema_format(schema)).choices[0].message.content


def test_json_object_and_structured_outputs_object(client):
    reply = chat(client, response_format={"type": "json_object"}, max_tokens=60,
                 extra_body={"guided_whitespace_pattern": r"[ ]?"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # an open-ended object may run past max_tokens; what was written is still a JSON object's start
        assert reply.choices[0].message.content.startswith("{")
    reply = chat(client, extra_body={"structured_outputs": {"json": SCHEMAS["array_enum"]}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS["array_enum"])


def test_guided_choice_regex_and_grammar(client):
    reply = chat(client, [{"role": "user", "content": "Is the sky green?"}], extra_body={"guided_choice": [
        "yes", "no", "maybe (but only on Tuesdays)"]})
    assert reply.choices[0].message.content in ("yes", "no", "maybe (but only on Tuesdays)")
    assert reply.choices[0].finish_reason == "stop"
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}-[0-9]{2}-[0-9]{2}"
    completion = client.completions.create(model=MODEL, prompt="Name and birthday:", max_tokens=30,
                                           temperature=0, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, completion.choices[0].text), completion.choices[0].text
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    reply = chat(client, [{"role": "user", "content": "What is 6 times 7?"}], extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", reply.choices[0].message.content)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Name and birthday:", max_tokens=30, temperature=0, stream=True,
        extra_body={"structured_outputs": {"regex": pattern}}) if c.choices)
    assert streamed == completion.choices[0].text


def test_max_tokens_cutting_a_structure_is_length(client):
    reply = chat(client, response_format=json_schema_format(SCHEMAS["nested"]), max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})}, "response_format",
     ["uniqueItems"]),
    ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "guided_json", ["not"]),
    ({"guided_json": "{not json"}, "guided_json", ["JSON"]),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "guided_json",
     ["missing"]),
    ({"guided_regex": "(unclosed"}, "guided_regex", ["unclosed"]),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar", ["undefined_rule"]),
    ({"guided_choice": []}, "guided_choice", ["at least one"]),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", ["only one"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", ["json_schema"]),
    ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs.bogus", ["bogus"]),
])
def test_constraints_that_cannot_be_enforced_are_400(client, body, param, words):
    message = bad_request(lambda: chat(client, max_tokens=5, extra_body=body), param)
    for word in words:
        assert word in message, message
    assert chat(client, max_tokens=2).choices[0].finish_reason == "length"  # still serving


# ---------------------------------------------------------------- tool calls


def test_required_tool_choice_gives_valid_calls(client):
    reply = chat(client, WEATHER_Q, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                 parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id and call.type == "function"


def test_named_tool_choice_streams_what_the_whole_response_carries(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = chat(client, WEATHER_Q, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice).choices[0]
    [call] = whole.message.tool_calls
    # OpenAI (and vLLM) finish a forced, named call with "stop"; "required" and "auto" calls with "tool_calls"
    assert call.function.name == "get_time" and whole.finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])

    chunks = [c for c in chat(client, WEATHER_Q, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice, stream=True)
              if c.choices]
    pieces = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].id and pieces[0].type == "function" and pieces[0].function.name == "get_time"
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in pieces[1:])
    assert len(pieces) > 2  # arguments arrive in pieces
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


class GetWeather(BaseModel):
    city: str
    unit: str


def test_tool_loop_with_the_clients_helpers(client):
    tools = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    first = client.chat.completions.parse(model=MODEL, messages=messages, tools=tools, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=60, temperature=0)
    message = first.choices[0].message
    [call] = message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)  # the client validated the arguments

    messages += [message.model_dump(exclude_none=True, exclude={"parsed", "refusal"}) | {"tool_calls": [
                     {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                      "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    # create, not parse: parse() raises on finish_reason "length", and a free-text answer may run that long.
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="none",
                                           max_tokens=20, temperature=0)
    answer = final.choices[0]
    assert answer.message.tool_calls in (None, []) and answer.message.content
    assert answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),  # no parser for this model's template
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "if": {"required": ["a"]}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_tool_choice_problems_are_400(client, body, param):
    bad_request(lambda: chat(client, WEATHER_Q, max_tokens=5, extra_body=body), param)


# ---------------------------------------------------------------- batching


def test_sixteen_streams_mixing_constrained_and_free(client):
    """Constrained and unconstrained rows share the engine's steps; every constrained output validates."""
    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "ok": {"type": "boolean"}},
             "required": ["n", "ok"], "additionalProperties": False}
    choices = ["red", "green", "blue"]

    def run(i):
        kind = ("schema", "choice", "regex", "free")[i % 4]
        body = {"schema": {"response_format": json_schema_format(small)},
                "choice": {"extra_body": {"guided_choice": choices}},
                "regex": {"extra_body": {"guided_regex": r"[0-9]{2}:[0-9]{2}"}}, "free": {}}[kind]
        stream = chat(client, [{"role": "user", "content": f"Request {i}: answer briefly."}], max_tokens=16,
                      temperature=0.8, seed=i, stream=True, **body)
        chunks = [c for c in stream if c.choices]
        return kind, "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for kind, text, finish in results:
        if kind == "schema":
            jsonschema.validate(json.loads(text), small)
        elif kind == "choice":
            assert text in choices
        elif kind == "regex":
            assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", text)
        if kind != "free":
            assert finish == "stop", (kind, text)


# ---------------------------------------------------------------- auto parsing, end to end


@pytest.fixture(scope="module")
def parsing_client():
    """A gateway with Hermes tool parsing and <think> reasoning parsing switched on by env, as on a worker
    serving Qwen3; the embedded model is made to write those formats with a grammar."""
    process, url = start_gateway({"TOOL_CALL_PARSER": "hermes", "REASONING_PARSER": "qwen3"})
    yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
    stop_gateway(process)


HERMES_OUTPUT = (r'<think>[a-z ]{1,12}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": '
                 r'\{"city": "Paris", "unit": "celsius"\}\}\n</tool_call>')


@pytest.mark.slow
def test_auto_tool_choice_and_reasoning_parse_the_models_output(parsing_client):
    body = {"guided_regex": HERMES_OUTPUT}
    whole = chat(parsing_client, WEATHER_Q, tools=[WEATHER_TOOL], extra_body=body).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content is None
    message = whole.message.model_dump()
    assert message["reasoning_content"] == message["reasoning"] and message["reasoning_content"]
    [call] = whole.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                         {"city": "Paris", "unit": "celsius"})

    chunks = [c for c in chat(parsing_client, WEATHER_Q, tools=[WEATHER_TOOL], stream=True, extra_body=body)
              if c.choices]
    deltas = [c.choices[0].delta.model_dump() for c in chunks]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    pieces = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
def test_structured_output_applies_to_the_answer_after_thinking(parsing_client):
    # The grammar starts after </think>, so the thinking is free and the answer matches; SmolLM2 has no
    # <think> token, so here the grammar constrains from the first token and the reply has no thinking.
    reply = chat(parsing_client, response_format=json_schema_format(SCHEMAS["bounded_numbers"])).choices[0]
    jsonschema.validate(json.loads(reply.message.content), SCHEMAS["bounded_numbers"])
    assert reply.message.model_dump().get("reasoning_content") is None


STRICT_WEATHER_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
# Two earlier turns in the Hermes format, so that the small model calls the tool again (it copies the format).
FEW_SHOT_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
FEW_SHOT = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": FEW_SHOT_CALL},
            {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": FEW_SHOT_CALL},
            {"role": "user", "content": "Weather in Rome?"}]


@pytest.mark.slow
def test_strict_tools_under_auto_tool_choice_are_enforced(parsing_client):
    """tool_choice auto leaves the model free to answer or call, and a strict tool's calls match its schema.
    Measured without strict on these four seeds, the embedded model calls the tool every time and invents
    units three times ("miles", "mercury", "metric"); with strict, every call validates. (The model may answer
    in text instead on another CPU's rounding; every call it makes must validate, and it must make some.)"""
    calls = []
    for seed in range(4):
        reply = chat(parsing_client, FEW_SHOT, tools=[STRICT_WEATHER_TOOL], temperature=0.8, seed=seed,
                     max_tokens=60).choices[0]
        assert reply.finish_reason in ("tool_calls", "stop"), reply
        calls += reply.message.tool_calls or []
    assert len(calls) >= 2, calls
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    # A JSON answer schema combines (an answer under it, or calls); another kind of constraint cannot: a 400.
    reply = chat(parsing_client, FEW_SHOT, tools=[STRICT_WEATHER_TOOL], max_tokens=60,
                 response_format=json_schema_format({"type": "object", "properties": {"n": {"enum": [1, 2, 3]}},
                                                     "required": ["n"], "additionalProperties": False})).choices[0]
    if reply.message.tool_calls:
        jsonschema.validate(json.loads(reply.message.tool_calls[0].function.arguments),
                            WEATHER_TOOL["function"]["parameters"])
    else:
        assert json.loads(reply.message.content)["n"] in (1, 2, 3)
    message = bad_request(lambda: chat(parsing_client, FEW_SHOT, tools=[STRICT_WEATHER_TOOL], max_tokens=5,
                                       extra_body={"guided_regex": "a+"}), "guided_regex")
    assert "strict tools" in message


@pytest.mark.slow
def test_a_tool_schema_that_recurses_without_end_is_a_400_that_says_so(client):
    """A required property that refers to itself admits no finite value: the grammar engine gives up at the first
    tokens. That is the request's doing, so a short 400 instead of a 500 carrying the parser's state dump."""
    endless = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
               "$defs": {"n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": endless}}
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, WEATHER_Q, tools=[tool], tool_choice="required")
    message = info.value.response.json()["error"]["message"]
    assert "cannot be followed" in message and "<state>" not in message and len(message) < 600
    assert chat(client, WEATHER_Q, tools=[WEATHER_TOOL], tool_choice="required").choices[0].message.tool_calls
