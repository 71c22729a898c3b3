"""Tool calls in each model family's own format, proven on the families' real chat templates
(tests/chat_templates/, sources in SOURCES.md) rendered by the worker's tokenizer:

- the format is recognised from how the template writes a call;
- what the template writes for a call (one call, parallel calls, every JSON type, text before the call, a call
  cut off) parses back into the same calls, whole and streamed;
- the reply the worker gives, sent back with the tool's result, renders through the same template (call ids in
  the form it accepts);
- through the real gateway and the official client, a model made to write a family's call text returns it as
  OpenAI `tool_calls`, streamed and not.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from openai_compat import reasoning, tool_parsers
from openai_compat.chat_output import ChatOutputParser
from test_tool_parsers import stream

TEMPLATES = Path(__file__).parent / "chat_templates"

IM = ("<|im_start|>assistant\n", "<|im_end|>")
LLAMA = ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
DEEPSEEK = ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")
EOS = "EOS"  # the tokenizer's own end-of-sequence token, which these templates write
MISTRAL = ("[/INST]", EOS)

# Each template: the format it writes (vLLM's TOOL_CALL_PARSER name), and where the assistant's turn starts and
# ends in a rendered conversation (the end marker is a stop token: it is not part of the model's output).
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", *IM),
    "Qwen-Qwen3-0.6B": ("hermes", *IM),
    "Qwen-QwQ-32B": ("hermes", *IM),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", *IM),
    "ibm-granite-granite-4.0": ("hermes", "<|start_of_role|>assistant<|end_of_role|>", "<|end_of_text|>"),
    "Qwen3-Coder": ("qwen3_coder", *IM),
    "Qwen3.5-4B": ("qwen3_coder", *IM),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("qwen3_coder", *IM),
    "GLM-4.6": ("glm45", "<|assistant|>", "<|observation|>"),
    "GLM-4.7-Flash": ("glm45", "<|assistant|>", "<|observation|>"),
    "inclusionai-ling-3.0-flash": ("glm45", "<role>ASSISTANT</role>", "<|role_end|>"),
    "ByteDance-Seed-OSS": ("seed_oss", "<seed:bos>assistant\n", "<seed:eos>"),
    "MiniMax-M2": ("minimax_m2", "]~b]ai\n", "[e~["),
    "MiniMax-M1": ("minimax", "<beginning_of_sentence>ai name=assistant\n", "<end_of_sentence>"),
    "unsloth-Apriel-1.5": ("minimax", "<|assistant|>\n", "<|end|>"),
    "moonshotai-Kimi-K2": ("kimi_k2", "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek_v3", *DEEPSEEK),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_v31", *DEEPSEEK),
    "deepseek-ai-DeepSeek-V3.2": ("deepseek_v32", DEEPSEEK[0] + "</think>", DEEPSEEK[1]),
    "deepseek-ai-DeepSeek-V4": ("deepseek_v4", DEEPSEEK[0] + "</think>", DEEPSEEK[1]),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", *MISTRAL),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral", *MISTRAL),
    "unsloth-mistral-Devstral-Small-2507": ("mistral", *MISTRAL),
    "openai-gpt-oss-120b": ("openai", "<|start|>assistant", "<|call|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3_json", *LLAMA),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3_json", *LLAMA),
    "meetkai-functionary-medium-v3.1": ("functionary_v3_1", LLAMA[0], "<|eom_id|>"),
    "meetkai-functionary-medium-v3.2": ("functionary_v3_2", LLAMA[0] + ">>>", "<|eot_id|>"),
    "NVIDIA-Nemotron-Nano-v2": ("nemotron_json", "<SPECIAL_11>Assistant\n", "<SPECIAL_12>"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("command_r", "<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
    "google-gemma-4-31B-it": ("gemma4", "<|turn>model\n", "<|tool_response>"),
    "upstage-Solar-Open-100B": ("solar_open", "<|begin|>assistant", "<|calls|>"),
    "openbmb-MiniCPM5-1B": ("minicpm", *IM),
    "tencent-Hy3": ("hunyuan", "<｜hy_Assistant:opensource｜>", "<｜hy_eos:opensource｜>"),
    "GigaChat3.1-10B-A1.8B": ("gigachat3", "assistant<|role_sep|>\n", "<|message_sep|>"),
    "LFM2.5-8B-A1B": ("lfm2", *IM),
    "GigaChat3-10B-A1.8B": ("gigachat3", "assistant<|role_sep|>\n", "<|message_sep|>\n\nfunction result"),
    "Apertus-8B-Instruct": ("apertus", "<|assistant_start|>", "<|tools_suffix|>"),
    "MiniMax-M3": ("minimax_m3", "]~b]ai\n", "[e~["),
    "Salesforce-xLAM-2-llama": ("xlam", *LLAMA),
    "muse-glimmer": ("muse_glimmer", "<|start|>assistant", "<|eot|>"),
    "Kimi-K3": ("kimi_k3", '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', "<|close|>message<|sep|>"),
}
# Templates that show no past calls: recognised from the format their tools prompt asks for.
BY_TOOLS_PROMPT = {"ibm-granite-granite-3.3-2B-Instruct": "granite"}
# Templates whose format cannot be recognised: tool_choice "auto" stays a 400 naming TOOL_CALL_PARSER.
UNRECOGNISED = {
    "microsoft-Phi-3.5-mini-instruct": "neither shows past calls nor names a call format",
    "CohereForAI-c4ai-command-r-plus-tool_use": "cannot render tools",
    "Kimi-K2-Instruct": "does not render a conversation with a tool call",  # list.append, refused by the sandbox
}
# Families whose template writes one call per assistant turn.
ONE_CALL_PER_TURN = {"openai-gpt-oss-120b", "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
                     "google-gemma-4-31B-it", "upstage-Solar-Open-100B", "GigaChat3.1-10B-A1.8B",
                     "GigaChat3-10B-A1.8B"}

# Families whose calls end with the marker that ends the model's part of the turn (the tool results follow).
KEEPS_END = {"Apertus-8B-Instruct", "upstage-Solar-Open-100B", "openai-gpt-oss-120b"}
# Families whose template leaves out a null argument (MiniMax-M3: "omit the field entirely").
DROPS_NULLS = {"MiniMax-M3"}

EVERY_TYPE = {"city": "Paris", "days": 3, "ratio": 0.25, "metric": True, "tags": ["sun", "rain"],
              "limits": {"low": -2, "high": 31}, "note": None, "code": "007"}
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
    "metric": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}},
    "limits": {"type": "object", "properties": {"low": {"type": "integer"}, "high": {"type": "integer"}}},
    "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "string"}},
    "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone.",
                                           "parameters": {"type": "object",
                                                          "properties": {"zone": {"type": "string"}}}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_folder)


def template_tokenizer(hf_tokenizer, family: str):
    from engine.tokenizer import Tokenizer
    return Tokenizer(hf_tokenizer, (TEMPLATES / f"{family}.jinja").read_text(), frozenset(), len(hf_tokenizer))


def render(tokenizer):
    return tokenizer.render_chat


def tool_parser(name: str):
    schemas = [tool_parsers.CallSchema(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    return tool_parsers.PARSERS[name](schemas)


def output_parser(tokenizer, name: str) -> ChatOutputParser:
    """The worker's parsers for this template's replies: its reasoning parser, then the tool-call parser."""
    thinking = reasoning.recognise(None, tokenizer.chat_template, render(tokenizer))
    prompt = tokenizer.render_chat(QUESTION, tools=TOOLS, add_generation_prompt=True)
    return ChatOutputParser(reasoning.make_parser(thinking, prompt) if thinking else None, tool_parser(name))


def written_reply(tokenizer, family: str, calls: list[tuple[str, dict]], content: str = "") -> str:
    """What the template writes as the assistant's turn for these calls: the model's output for them."""
    _, start, end = FAMILIES[family]
    end = tokenizer.hf.eos_token if end == EOS else end
    turn = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls, 1)]}
    results = [{"role": "tool", "tool_call_id": f"call{i:05d}", "content": "done"} for i in range(1, len(calls) + 1)]
    try:
        text = tokenizer.render_chat(QUESTION + [turn] + results, tools=TOOLS, add_generation_prompt=False)
    except Exception:  # Functionary v3.2 takes the arguments as the text a client sends
        for call in turn["tool_calls"]:
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
        text = tokenizer.render_chat(QUESTION + [turn] + results, tools=TOOLS, add_generation_prompt=False)
    asked = text.rindex(QUESTION[0]["content"])
    begin = text.rindex(start, asked, text.index("get_", asked)) + len(start)
    stop = text.find(end, begin)
    if stop != -1 and family in KEEPS_END:
        stop += len(end)
    reply = text[begin:] if stop == -1 else text[begin:stop]
    # Where the generation prompt opens a thinking block, the model closes it before it answers.
    thinking = output_parser(tokenizer, FAMILIES[family][0]).reasoning
    if thinking is not None and getattr(thinking, "starts_inside", False) and thinking.CLOSE not in reply:
        reply = thinking.CLOSE + reply
    return reply


def parsed(parser: ChatOutputParser, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    whole = parser.parse(text)
    return whole.content, [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]


@pytest.mark.parametrize("family", sorted(FAMILIES) + sorted(BY_TOOLS_PROMPT))
def test_the_format_is_recognised_from_the_template(hf_tokenizer, family):
    expected = FAMILIES[family][0] if family in FAMILIES else BY_TOOLS_PROMPT[family]
    name, why = tool_parsers.recognise(render(template_tokenizer(hf_tokenizer, family)))
    assert name == expected, why


@pytest.mark.parametrize("family", sorted(UNRECOGNISED))
def test_an_unrecognisable_template_says_why(hf_tokenizer, family):
    name, why = tool_parsers.recognise(render(template_tokenizer(hf_tokenizer, family)))
    assert name is None and UNRECOGNISED[family] in why


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_calls_a_template_writes_parse_back_whole_and_streamed(hf_tokenizer, family):
    tokenizer = template_tokenizer(hf_tokenizer, family)
    name = FAMILIES[family][0]
    cases = [[("get_weather", EVERY_TYPE)]]
    if family not in ONE_CALL_PER_TURN:
        cases.append([("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})])
    for calls in cases:
        text = written_reply(tokenizer, family, calls)
        content, got = parsed(output_parser(tokenizer, name), text)
        if family in DROPS_NULLS:
            calls = [(n, {k: v for k, v in a.items() if v is not None}) for n, a in calls]
        assert got == calls, text
        assert not (content or "").strip("\n "), (content, text)
        whole = output_parser(tokenizer, name).parse(text)
        for piece in (1, 4, 13):
            streamed = stream(output_parser(tokenizer, name), text, piece)
            assert streamed["calls"] == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
            assert (streamed["content"] or "") == (whole.content or "")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_text_before_a_call_is_content(hf_tokenizer, family):
    tokenizer = template_tokenizer(hf_tokenizer, family)
    name = FAMILIES[family][0]
    text = written_reply(tokenizer, family, [("get_time", {"zone": "CET"})], content="Let me look that up.")
    if "Let me look that up." not in text:
        pytest.skip("this template does not write text beside a call")
    content, got = parsed(output_parser(tokenizer, name), text)
    assert got == [("get_time", {"zone": "CET"})]
    assert "Let me look that up." in content and "get_time" not in content
    assert stream(output_parser(tokenizer, name), text, 3)["content"] == content


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_call_cut_off_keeps_its_name_and_what_was_written(hf_tokenizer, family):
    """max_tokens ends the reply inside a call's arguments: the call is reported as far as it was written
    (finish_reason "length" tells the client), the same whole and streamed."""
    tokenizer = template_tokenizer(hf_tokenizer, family)
    name = FAMILIES[family][0]
    text = written_reply(tokenizer, family, [("get_weather", {"city": "Paris", "code": "007"})])
    cut = text[:text.index("Paris") + 3]
    whole = output_parser(tokenizer, name).parse(cut)
    if name in ("hermes", "minimax", "gigachat3", "nemotron_json", "command_r", "llama3_json", "openai",
                "mistral", "lfm2", "gemma4"):
        # Formats whose calls are one JSON text: what was written is kept, as a call or as content.
        kept = (whole.content or "") + "".join(c.function.arguments for c in whole.tool_calls)
        assert "Par" in kept
    else:
        assert [c.function.name for c in whole.tool_calls] == ["get_weather"], cut
        assert "Par" in whole.tool_calls[0].function.arguments
    streamed = stream(output_parser(tokenizer, name), cut, 2)
    assert streamed["calls"] == [(c.function.name, c.function.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_workers_reply_renders_back_through_the_template(hf_tokenizer, family):
    """A client sends back the assistant turn the worker produced (ids included) with the tool's result; the
    template renders the next turn."""
    tokenizer = template_tokenizer(hf_tokenizer, family)
    name = FAMILIES[family][0]
    text = written_reply(tokenizer, family, [("get_weather", {"city": "Paris", "days": 3})])
    reply = output_parser(tokenizer, name).parse(text)
    (call,) = reply.tool_calls
    if name == "mistral":
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)
    if name == "kimi_k2":
        assert call.id == "functions.get_weather:0"
    # As vLLM passes them: the arguments as a mapping, else (Functionary v3.2) as the text the client sent.
    sent = call.model_dump()
    as_mapping = {**sent, "function": {**sent["function"], "arguments": json.loads(call.function.arguments)}}
    for form in (as_mapping, sent):
        conversation = QUESTION + [{"role": "assistant", "content": reply.content or "", "tool_calls": [form]},
                                   {"role": "tool", "tool_call_id": call.id, "name": "get_weather",
                                    "content": "22 C and sunny"}]
        try:
            prompt = tokenizer.render_chat(conversation, tools=TOOLS, add_generation_prompt=True)
            break
        except Exception as exc:
            error = exc
    else:
        raise AssertionError(f"the reply does not render back: {error}")
    assert "22 C and sunny" in prompt and "get_weather" in prompt


def test_arguments_written_as_text_are_typed_by_the_schema():
    parser = tool_parser("qwen3_coder")
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=ratio>\n1e-2\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n"
            "<parameter=tags>\n['a', 'b']\n</parameter>\n<parameter=note>\nNone\n</parameter>\n"
            "<parameter=days_text>\nabc\n</parameter>\n<parameter=extra>\n{\"k\": [1]}\n</parameter>\n"
            "</function>\n</tool_call>")
    (call,) = ChatOutputParser(None, parser).parse(text).tool_calls
    assert json.loads(call.function.arguments) == {
        "city": "123", "days": 3, "ratio": 0.01, "metric": False, "tags": ["a", "b"], "note": None,
        "days_text": "abc", "extra": {"k": [1]}}
    # A value that does not read as its schema's type stays the text the model wrote.
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    (call,) = ChatOutputParser(None, parser).parse(text).tool_calls
    assert json.loads(call.function.arguments) == {"days": "three"}


@pytest.mark.parametrize("name,text", [
    ("qwen3_coder", "Use <tool_call> to call tools, like <tool_call>this</tool_call>."),
    ("glm45", "A <tool_call>tag with no call in it</tool_call> stays text."),
    ("kimi_k2", "Nothing to call."),
    ("deepseek_v31", "The answer is 42."),
    ("functionary_v3_1", "Write <function=x> in your code."),
])
def test_text_that_is_not_a_call_stays_content(name, text):
    whole = ChatOutputParser(None, tool_parser(name)).parse(text)
    assert (whole.content, whole.tool_calls) == (text, [])
    assert stream(ChatOutputParser(None, tool_parser(name)), text, 2) == {"content": text, "reasoning": None,
                                                                          "calls": []}


def test_functionary_v32_text_for_the_user_is_content():
    text = 'all\nLet me check.>>>get_time\n{"zone": "CET"}'
    whole = ChatOutputParser(None, tool_parser("functionary_v3_2")).parse(text)
    assert whole.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == [
        ("get_time", {"zone": "CET"})]


# ---------------------------------------------------------------- through the gateway, with the official client

# Families the gateway test drives end to end, with what each model would write for a call of get_time.
GATEWAY_FAMILIES = {
    "Qwen3-Coder": "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
    "GLM-4.6": "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>",
    "moonshotai-Kimi-K2": ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0'
                           '<|tool_call_argument_begin|>{"zone": "CET"}<|tool_call_end|><|tool_calls_section_end|>'),
    "unsloth-mistral-Devstral-Small-2507": '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
    "Kimi-K3": ('<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
                '<|open|>call tool="get_time" index="1"<|sep|><|open|>argument key="zone" type="string"<|sep|>CET'
                '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'),
    "MiniMax-M3": ("</mm:think>]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name=\"get_time\">]<]minimax[>[<zone>CET"
                   "]<]minimax[>[</zone>]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>"),
}

# What a family's requests add: a thinking model answers without thinking (the 135M model would think to the end).
GATEWAY_EXTRA = {"Kimi-K3": {"chat_template_kwargs": {"thinking": False}}}


def _literal_regex(text: str) -> str:
    """`text` as a regex that matches only itself (escaping only what the grammar engine's regex treats as
    syntax)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in text)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(GATEWAY_FAMILIES))
def test_the_gateway_returns_a_familys_calls_as_tool_calls(family):
    """The family's template as CUSTOM_CHAT_TEMPLATE, the model made to write the family's call text: the
    official client gets OpenAI tool_calls (streamed and not), and sending the reply back with the tool's result
    renders the next turn."""
    from openai import OpenAI

    from conftest import start_gateway, stop_gateway
    log: list[str] = []
    process, url = start_gateway({"CUSTOM_CHAT_TEMPLATE": (TEMPLATES / f"{family}.jinja").read_text()}, log=log)
    try:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        extra = GATEWAY_EXTRA.get(family, {})
        assert any(f"tool-call format: {FAMILIES[family][0]} (its chat template writes a call as" in line
                   for line in log), "".join(log[-20:])
        request = dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", messages=QUESTION, tools=TOOLS,
                       max_tokens=120, temperature=0,
                       extra_body={"structured_outputs": {"regex": _literal_regex(GATEWAY_FAMILIES[family])},
                                   **extra})
        reply = client.chat.completions.create(**request)
        (call,) = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "CET"})
        assert reply.choices[0].finish_reason == "tool_calls" and not reply.choices[0].message.content
        streamed: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**request, stream=True):
            for delta in chunk.choices[0].delta.tool_calls or ():
                entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [("get_time", {"zone": "CET"})]
        assert finish == "tool_calls"
        # The next turn: the reply as the client got it, ids included, and the tool's result.
        follow = client.chat.completions.create(
            model=request["model"], tools=TOOLS, max_tokens=2, temperature=0, extra_body=extra,
            messages=QUESTION + [reply.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": call.id, "content": "14:05"}])
        assert follow.choices[0].finish_reason in ("length", "stop")
        # Forced calls are generated in the family's own format: the text the model wrote holds its marker.
        zones = [{"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
            "additionalProperties": False}}}]
        for choice, finish in (("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}},
                                                           "stop")):
            forced = client.chat.completions.create(
                model=request["model"], messages=QUESTION, tools=zones, tool_choice=choice, max_tokens=120,
                temperature=0, parallel_tool_calls=False, extra_body={"return_token_ids": True, **extra})
            calls = forced.choices[0].message.tool_calls
            assert calls and {c.function.name for c in calls} == {"get_time"}, forced
            assert all(json.loads(c.function.arguments)["zone"] in ("CET", "UTC") for c in calls)
            assert forced.choices[0].finish_reason == finish
            import requests
            written = requests.post(url.removesuffix("/openai/v1") + "/v1/detokenize", timeout=60,
                                    json={"tokens": forced.choices[0].model_extra["token_ids"]}).json()["prompt"]
            assert NATIVE_MARKER[family] in written, written
        if FAMILIES[family][0] == "mistral":
            # Anthropic's Messages API keeps the id in the form the template takes back on the next turn.
            import anthropic
            claude = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0,
                                         timeout=300)
            anthropic_tools = [{"name": "get_time", "input_schema": zones[0]["function"]["parameters"]}]
            used = claude.messages.create(model=request["model"], max_tokens=60, messages=QUESTION,
                                          tools=anthropic_tools, tool_choice={"type": "tool", "name": "get_time"})
            (block,) = [b for b in used.content if b.type == "tool_use"]
            assert re.fullmatch(r"[A-Za-z0-9]{9}", block.id), block.id
            after = claude.messages.create(
                model=request["model"], max_tokens=2, tools=anthropic_tools, tool_choice={"type": "none"},
                # This SDK no longer names temperature; greedy keeps the random model's reply the same each run.
                extra_body={"temperature": 0},
                messages=QUESTION + [{"role": "assistant", "content": [b.model_dump() for b in used.content]},
                                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id,
                                                                   "content": "14:05"}]}])
            assert after.stop_reason == "max_tokens"
    finally:
        stop_gateway(process)


NATIVE_MARKER = {"Qwen3-Coder": "<function=get_time>", "GLM-4.6": "<tool_call>get_time",
                 "moonshotai-Kimi-K2": "functions.get_time:", "unsloth-mistral-Devstral-Small-2507": "[TOOL_CALLS]",
                 "MiniMax-M3": '<invoke name="get_time">', "Kimi-K3": '<|open|>call tool="get_time"'}


# ---------------------------------------------------------------- forced calls in the family's own format

# Formats whose forced calls (tool_choice "required", a named function) fall back to the JSON list any model can
# write (none now).
NO_NATIVE_FORCING: set[str] = set()


@pytest.fixture(scope="module")
def llg_tokenizer(hf_tokenizer):
    import llguidance.hf
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=len(hf_tokenizer), eos_token=[hf_tokenizer.eos_token_id])


def accepts(hf_tokenizer, llg_tokenizer, grammar: str, text: str) -> bool:
    import llguidance
    compiled = llguidance.grammar_from("lark", grammar)
    assert not llguidance.LLMatcher.validate_grammar(compiled, llg_tokenizer), grammar
    matcher = llguidance.LLMatcher(llg_tokenizer, compiled, log_level=0)
    ok = matcher.consume_tokens(hf_tokenizer.encode(text, add_special_tokens=False)) and not matcher.is_error()
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forced_calls_are_generated_in_the_familys_own_format(hf_tokenizer, llg_tokenizer, family):
    """The grammar of a forced call accepts the call as the family's template writes it (what the model was
    trained to write), refuses arguments outside the schema, and the family's parser reads back what it
    accepts."""
    tokenizer = template_tokenizer(hf_tokenizer, family)
    name = FAMILIES[family][0]
    parser = tool_parser(name)
    schemas = [tool_parsers.CallSchema(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    grammar = parser.forced_grammar(schemas[1:], single=True, specials={})
    if name in NO_NATIVE_FORCING:
        assert grammar is None
        return
    text = answer_part(tokenizer, name, written_reply(tokenizer, family, [("get_time", {"zone": "CET"})]))
    assert accepts(hf_tokenizer, llg_tokenizer, grammar, text), (grammar, text)
    assert not accepts(hf_tokenizer, llg_tokenizer, grammar, text.replace("get_time", "get_weather"))
    (call,) = ChatOutputParser(None, parser).parse(text).tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "CET"})
    # Parallel calls, each under its own tool's schema.
    several = parser.forced_grammar(schemas, single=False, specials={})
    assert several is not None  # get_weather's objects, arrays and optional fields too
    if family not in ONE_CALL_PER_TURN:
        calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "CET"})]
        text = answer_part(tokenizer, name, written_reply(tokenizer, family, calls))
        assert accepts(hf_tokenizer, llg_tokenizer, several, text), (several, text)
        assert parsed(ChatOutputParser(None, parser), text)[1] == calls
        assert not accepts(hf_tokenizer, llg_tokenizer, several, text.replace("2", "two", 1))


def answer_part(tokenizer, name: str, text: str) -> str:
    """The part of a reply a forced call's grammar covers: after the thinking, from the first call on."""
    if tool_parser(name).forced_from_start:  # the grammar covers the whole reply: a call is a message of its own
        return text
    parser = output_parser(tokenizer, name)
    if parser.reasoning is not None:
        text = parser.parse(text).content or text
    if name == "functionary_v3_2":  # the reply starts with the first call's name: the prompt wrote its marker
        return text.strip()
    marker = tool_parser(name).marker or "get_"
    return text[text.index(marker):].strip() if marker in text else text.strip()


def test_forced_pythonic_calls_take_keyword_arguments_in_python_literals(hf_tokenizer, llg_tokenizer):
    zone = {"type": "object", "properties": {"zone": {"type": "string"}, "hours": {"type": "integer"},
                                            "dst": {"type": "boolean"}}, "required": ["zone"]}
    parser = tool_parsers.PARSERS["pythonic"]([tool_parsers.CallSchema("get_time", zone)])
    grammar = parser.forced_grammar([tool_parsers.CallSchema("get_time", zone)], single=False, specials={})
    text = "[get_time(zone=\"CET\", hours=2, dst=True), get_time(zone='UTC')]"
    assert accepts(hf_tokenizer, llg_tokenizer, grammar, text)
    assert parsed(ChatOutputParser(None, parser), text)[1] == [
        ("get_time", {"zone": "CET", "hours": 2, "dst": True}), ("get_time", {"zone": "UTC"})]
    for wrong in ("[get_time(hours=2)]", "[get_time(zone=\"CET\", dst=true)]", "[get_weather(zone=\"CET\")]"):
        assert not accepts(hf_tokenizer, llg_tokenizer, grammar, wrong), wrong


def test_forced_pythonic_calls_take_lists_dicts_and_any_optional_keywords(hf_tokenizer, llg_tokenizer):
    """Arguments that are lists and dicts as Python literals, and tools whose keywords are all optional (the
    first one written takes no comma, whichever it is)."""
    parser = tool_parsers.PARSERS["pythonic"]([tool_parsers.CallSchema("get_weather", SCHEMA)])
    grammar = parser.forced_grammar([tool_parsers.CallSchema("get_weather", SCHEMA)], single=True, specials={})
    text = ("[get_weather(city='Paris', days=3, tags=['sun', \"rain\"], limits={'low': -2, \"high\": 31}, "
            "note=None)]")
    assert accepts(hf_tokenizer, llg_tokenizer, grammar, text), grammar
    assert parsed(ChatOutputParser(None, parser), text)[1] == [
        ("get_weather", {"city": "Paris", "days": 3, "tags": ["sun", "rain"], "limits": {"low": -2, "high": 31},
                         "note": None})]
    for wrong in ("[get_weather(city='Paris', tags=[1])]", "[get_weather(city='Paris', limits={'low': 'x'})]",
                  "[get_weather(days=3)]"):
        assert not accepts(hf_tokenizer, llg_tokenizer, grammar, wrong), wrong
    optional = {"type": "object", "properties": {"zone": {"type": "string"}, "hours": {"type": "integer"}}}
    grammar = parser.forced_grammar([tool_parsers.CallSchema("get_time", optional)], single=True, specials={})
    for text in ("[get_time()]", "[get_time(hours=2)]", "[get_time(zone='CET', hours=2)]"):
        assert accepts(hf_tokenizer, llg_tokenizer, grammar, text), text
    assert not accepts(hf_tokenizer, llg_tokenizer, grammar, "[get_time(, hours=2)]")


def test_forced_gemma4_calls_take_every_type_in_its_notation(hf_tokenizer, llg_tokenizer):
    """Gemma 4's forced calls are written as its template writes them (bare sorted keys, `<|"|>` strings,
    None), objects and arrays included, and a required argument left out is refused."""
    family = "google-gemma-4-31B-it"
    tokenizer = template_tokenizer(hf_tokenizer, family)
    parser = tool_parser("gemma4")
    schemas = [tool_parsers.CallSchema(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    grammar = parser.forced_grammar(schemas, single=False, specials={})
    calls = [("get_weather", EVERY_TYPE), ("get_time", {"zone": "CET"})]
    text = answer_part(tokenizer, "gemma4", written_reply(tokenizer, family, calls))
    assert text.count("<|tool_call>") == 2 and "note:None" in text
    assert accepts(hf_tokenizer, llg_tokenizer, grammar, text), (grammar, text)
    assert parsed(ChatOutputParser(None, parser), text)[1] == calls
    assert not accepts(hf_tokenizer, llg_tokenizer, grammar, '<|tool_call>call:get_weather{days:3}<tool_call|>')


@pytest.mark.slow
def test_the_gateway_forces_gpt_oss_calls_as_harmony_messages():
    """gpt-oss's template: tool_choice "required" and a named function are generated as a harmony message to
    the function (its grammar from the reply's first token: the answer channel a forced answer waits for is
    never opened by a call), and come back as tool_calls, streamed and not."""
    import requests
    from openai import OpenAI

    from conftest import start_gateway, stop_gateway
    process, url = start_gateway({"CUSTOM_CHAT_TEMPLATE": (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()})
    try:
        client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        zones = [{"type": "function", "function": {"name": "get_time", "description": "Time in a zone.", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"]}}}]
        for choice, finish in (("required", "tool_calls"), ({"type": "function", "function": {"name": "get_time"}},
                                                           "stop")):
            request = dict(model="HuggingFaceTB/SmolLM2-135M-Instruct", messages=QUESTION, tools=zones,
                           tool_choice=choice, max_tokens=60, temperature=0)
            reply = client.chat.completions.create(**request, extra_body={"return_token_ids": True})
            (call,) = reply.choices[0].message.tool_calls
            assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("CET", "UTC")
            assert reply.choices[0].finish_reason == finish
            written = requests.post(url.removesuffix("/openai/v1") + "/v1/detokenize", timeout=60,
                                    json={"tokens": reply.choices[0].model_extra["token_ids"]}).json()["prompt"]
            assert "to=functions.get_time" in written and written.endswith("<|call|>"), written
            arguments = "".join(d.function.arguments or "" for chunk in client.chat.completions.create(
                **request, stream=True) for d in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices)
            assert arguments == call.function.arguments
    finally:
        stop_gateway(process)


# vLLM's TOOL_CALL_PARSER names (its tool_parsers registry) that name a format under another of its names here.
VLLM_ALIASES = {"granite4": "hermes", "step3p5": "qwen3_coder", "mimo": "qwen3_coder", "ling3": "glm45",
                "glm47": "glm45", "cohere_command3": "command_r", "cohere_command4": "command_r", "minicpm5": "minicpm",
                "poolside_v1": "glm45", "hy_v3": "hunyuan", "llama4_json": "llama3_json", "llama4_pythonic": "pythonic",
                "olmo3": "pythonic", "qwen3_xml": "qwen3_coder", "jamba": "minimax", "hunyuan_a13b": "minimax",
                "ernie45": "hermes"}


@pytest.mark.parametrize("alias", sorted(VLLM_ALIASES))
def test_vllm_parser_names_name_the_same_format(alias):
    assert tool_parsers.PARSERS[alias] is tool_parsers.PARSERS[VLLM_ALIASES[alias]]


# Every name in vLLM's tool-parser registry (vllm/frontend/processing/tool_parsers/__init__.py, late 2026).
VLLM_NAMES = ("dots deepseek_v3 deepseek_v31 deepseek_v32 deepseek_v4 cohere_command3 cohere_command4 ernie45 glm45 "
              "glm47 ling3 granite-20b-fc granite granite4 hermes poolside_v1 hunyuan_a13b hy_v3 hy_v4 internlm jamba "
              "lfm2 kimi_k2 kimi_k3 llama3_json llama4_json llama4_pythonic longcat mimo minimax_m2 minimax_m3 "
              "minicpm5 mistral olmo3 muse_glimmer openai phi4_mini_json pythonic qwen3_coder qwen3_xml seed_oss step3 "
              "step3p5 inkling xlam gigachat3 functiongemma gemma4 apertus").split()


def test_every_vllm_parser_name_is_a_format_here():
    assert [name for name in VLLM_NAMES if name not in tool_parsers.PARSERS] == []
