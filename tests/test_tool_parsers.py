"""Tool-call and reasoning parsers on recorded outputs of each format, whole and streamed.

A stream is fed in small pieces (as tokens arrive); its deltas must add up to exactly what the whole-output
parse gives: the same content, thinking, call names and argument texts.
"""
from __future__ import annotations

import json

import pytest

from openai_compat import reasoning, tool_parsers
from openai_compat.chat_output import ChatOutputParser

WEATHER = {"city": "Paris", "unit": "celsius"}

# Outputs as the models write them (chat-template special tokens that end the turn are not part of the text).
RECORDED = {
    "hermes": (
        'I will check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        "I will check the weather.\n", [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        None, [("get_weather", WEATHER)]),
    "llama3_json_python_tag": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    "mistral": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    "mistral_v11": (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    "pythonic": (
        '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]',
        None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
}
RECORDED.update({
    # Formats of vLLM's parser set whose templates tests/chat_templates/ does not hold, as the models write them.
    "longcat": ('<longcat_tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</longcat_tool_call>',
                None, [("get_time", {"zone": "CET"})]),
    "internlm": ('Let me check.<|action_start|><|plugin|>\n{"name": "get_time", "parameters": {"zone": "CET"}}'
                 '<|action_end|>', "Let me check.", [("get_time", {"zone": "CET"})]),
    "phi4_mini_json": ('functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                       '{"name": "get_time", "arguments": {"zone": "CET"}}]',
                       None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    "granite-20b-fc": ('<function_call> {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                       '\n<function_call> {"name": "get_time", "arguments": {"zone": "CET"}}',
                       None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    "jamba": ('<tool_calls>[{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_calls>', None,
              [("get_time", {"zone": "CET"})]),
    # Step-3 as its model card and vLLM's parser describe it (its template is not in llama.cpp's set).
    "step3": ('Checking.<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke '
              'name="get_weather"><steptml:parameter name="city">Paris</steptml:parameter><steptml:parameter '
              'name="unit">celsius</steptml:parameter></steptml:invoke><｜tool_call_end｜>\n<｜tool_call_begin｜>'
              'function<｜tool_sep｜><steptml:invoke name="get_time"><steptml:parameter name="zone">CET'
              '</steptml:parameter></steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>',
              "Checking.", [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    # FunctionGemma as its model card and vLLM's parser describe it (its template is not in llama.cpp's set).
    "functiongemma": ('<start_function_call>call:get_weather{city:<escape>Paris<escape>,unit:<escape>celsius<escape>}'
                      '<end_function_call><start_function_call>call:get_time{zone:<escape>CET<escape>}'
                      '<end_function_call>', None, [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    # dots and Inkling as vLLM's parsers describe them (no template of theirs in llama.cpp's set).
    "dots": ('I will check.<dots_function_call>\n<invoke name="get_weather">\n<parameter name="city">\nParis\n'
             '</parameter>\n<parameter name="unit">\ncelsius\n</parameter>\n</invoke>\n<invoke name="get_time">\n'
             '<parameter name="zone">\nCET\n</parameter>\n</invoke>\n</dots_function_call>',
             "I will check.", [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    "inkling": ('<|message_model|><|content_invoke_tool_json|>{"name": "get_time", "arguments": {"zone": "CET"}}'
                '<|end_message|>', None, [("get_time", {"zone": "CET"})]),
    # HY v4 as vLLM's parser describes it: Hunyuan 3's tags with the checkpoint's own suffix, or none.
    "hy_v4": ('Checking.<tool_calls:6124c78e>\n<tool_call:6124c78e>get_weather<tool_sep:6124c78e>\n'
              '<arg_key:6124c78e>city</arg_key:6124c78e>\n<arg_value:6124c78e>Paris</arg_value:6124c78e>\n'
              '<arg_key:6124c78e>unit</arg_key:6124c78e>\n<arg_value:6124c78e>celsius</arg_value:6124c78e>\n'
              '</tool_call:6124c78e></tool_calls:6124c78e>', "Checking.", [("get_weather", WEATHER)]),
    "hy_v4_unsuffixed": ('<tool_calls><tool_call>get_time<tool_sep><arg_key>zone</arg_key><arg_value>CET'
                         '</arg_value></tool_call></tool_calls>', None, [("get_time", {"zone": "CET"})]),
    # xLAM also writes its list in a ```json block, with text around it.
    "xlam_fenced": ('Here you go:\n```json\n[{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
                    '"celsius"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]\n```',
                    "Here you go:\n", [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
})
PARSER_OF = {"hermes": "hermes", "llama3_json": "llama3_json", "llama3_json_python_tag": "llama3_json",
             "mistral": "mistral", "mistral_v11": "mistral", "pythonic": "pythonic", "longcat": "longcat",
             "internlm": "internlm", "phi4_mini_json": "phi4_mini_json", "jamba": "jamba",
             "granite-20b-fc": "granite-20b-fc", "step3": "step3", "xlam_fenced": "xlam",
             "functiongemma": "functiongemma", "dots": "dots", "inkling": "inkling",
             "hy_v4": "hy_v4", "hy_v4_unsuffixed": "hy_v4"}


def stream(parser: ChatOutputParser, text: str, piece: int = 3) -> dict:
    """Feed `text` in pieces and reassemble the deltas as a client does."""
    content, thinking, calls = "", "", {}
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    for i, chunk in enumerate(pieces):
        delta = parser.feed(chunk, final=i == len(pieces) - 1)
        content += delta.content
        thinking += delta.reasoning
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": None, "arguments": "", "id": None})
            if call.id is not None:
                assert entry["id"] is None, "a call's id comes once, with its first piece"
                entry["id"], entry["name"] = call.id, call.function.name
            else:
                assert entry["id"] is not None, "the name comes before the arguments"
            entry["arguments"] += call.function.arguments or ""
    return {"content": content or None, "reasoning": thinking or None,
            "calls": [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]}


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_recorded_tool_calls_parse_whole_and_streamed(case):
    text, content, expected = RECORDED[case]
    parser = tool_parsers.PARSERS[PARSER_OF[case]]()
    whole = ChatOutputParser(None, parser).parse(text)
    assert whole.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == expected
    for piece in (1, 3, 7):
        streamed = stream(ChatOutputParser(None, parser), text, piece)
        assert streamed == {"content": whole.content, "reasoning": None,
                            "calls": [(c.function.name, c.function.arguments) for c in whole.tool_calls]}


@pytest.mark.parametrize("name,text", [
    ("hermes", "The weather in Paris is sunny."),
    ("hermes", "Use <tool_call> tags like <tool_call>not json</tool_call> to call tools."),
    ("llama3_json", "Paris is the capital of France."),
    ("llama3_json", '{"answer": 42'),
    ("mistral", "[TOOL_CALLS] this is not a call"),
    ("pythonic", "[1, 2, 3]"),
    ("xlam", "[1] is a footnote."),
    ("xlam", "```python\nprint(1)\n```"),
    ("step3", "<｜tool_calls_begin｜>not a call<｜tool_calls_end｜>"),
])
def test_text_that_is_not_a_call_stays_content(name, text):
    parser = tool_parsers.PARSERS[name]()
    whole = ChatOutputParser(None, parser).parse(text)
    assert (whole.content, whole.tool_calls) == (text, [])
    assert stream(ChatOutputParser(None, parser), text) == {"content": text, "reasoning": None, "calls": []}


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = RECORDED["hermes"][0]
    whole = ChatOutputParser(None, tool_parsers.HermesParser(), max_calls=1).parse(text)
    assert [c.function.name for c in whole.tool_calls] == ["get_weather"]
    assert [name for name, _ in stream(ChatOutputParser(None, tool_parsers.HermesParser(), 1), text)["calls"]] \
        == ["get_weather"]


# ---------------------------------------------------------------- reasoning

THINK = "<think>\nThe user wants the capital. It is Paris.\n</think>\n\nThe capital of France is Paris."


@pytest.mark.parametrize("prompt,text,thinking,answer", [
    ("<|im_start|>assistant\n", THINK, "\nThe user wants the capital. It is Paris.\n",
     "\n\nThe capital of France is Paris."),
    # DeepSeek-R1's template opens the block in the prompt; the output starts inside it.
    ("<｜Assistant｜><think>\n", "Paris, surely.\n</think>\n\nParis.", "Paris, surely.\n", "\n\nParis."),
    ("<|im_start|>assistant\n", "No thinking here.", None, "No thinking here."),
    ("<|im_start|>assistant\n<think>\n", "cut off while thinking", "cut off while thinking", ""),
])
def test_think_blocks_split_into_reasoning_and_content(prompt, text, thinking, answer):
    parser = reasoning.make_parser("qwen3", prompt)
    whole = ChatOutputParser(parser, None).parse(text)
    assert (whole.reasoning, whole.content) == (thinking, answer)
    for piece in (1, 4):
        streamed = stream(ChatOutputParser(parser, None), text, piece)
        assert (streamed["reasoning"], streamed["content"] or "") == (thinking, answer)


def test_harmony_channels_split_into_reasoning_and_content():
    text = ("<|channel|>analysis<|message|>User asks the capital. Answer Paris.<|end|><|start|>assistant"
            "<|channel|>final<|message|>The capital of France is Paris.")
    parser = reasoning.make_parser("openai_gptoss", "")
    whole = ChatOutputParser(parser, None).parse(text)
    assert (whole.reasoning, whole.content) == ("User asks the capital. Answer Paris.",
                                                "The capital of France is Paris.")
    for piece in (1, 5):
        streamed = stream(ChatOutputParser(parser, None), text, piece)
        assert (streamed["reasoning"], streamed["content"]) == (whole.reasoning, whole.content)


def test_tool_calls_are_parsed_in_the_answer_not_the_thinking():
    text = ('<think>Maybe <tool_call>{"name": "wrong", "arguments": {}}</tool_call>? No.</think>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    parser = ChatOutputParser(reasoning.make_parser("qwen3", ""), tool_parsers.HermesParser())
    whole = parser.parse(text)
    assert [c.function.name for c in whole.tool_calls] == ["get_weather"]
    assert "wrong" in whole.reasoning and whole.content is None
    streamed = stream(ChatOutputParser(reasoning.make_parser("qwen3", ""), tool_parsers.HermesParser()), text)
    assert streamed["calls"] == [("get_weather", '{"city": "Paris"}')] and streamed["reasoning"] == whole.reasoning


def test_gpt_oss_tool_call_after_analysis():
    text = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')
    make = lambda: ChatOutputParser(reasoning.make_parser("openai_gptoss", ""), tool_parsers.HarmonyToolParser())
    whole = make().parse(text)
    assert whole.reasoning == "Need the weather tool." and whole.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == [("get_weather",
                                                                                                WEATHER)]
    for piece in (1, 6):
        assert stream(make(), text, piece) == {"content": None, "reasoning": whole.reasoning, "calls": [
            ("get_weather", whole.tool_calls[0].function.arguments)]}


@pytest.mark.parametrize("template,expected", [
    ("{% if '</think>' in content %}", "think"), ("<|channel|>final<|message|>", "openai_gptoss"),
    ("{{ messages }}", None),
])
def test_reasoning_parser_is_recognised_from_the_chat_template(template, expected):
    assert reasoning.parser_name_for(None, template) == expected
    assert reasoning.parser_name_for("none", template) is None


@pytest.mark.parametrize("parser,text,expected", [
    (tool_parsers.RequiredParser(), '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, '
                                    '{"name": "get_time", "parameters": {"zone": "CET"}}]',
     [("get_weather", WEATHER), ("get_time", {"zone": "CET"})]),
    (tool_parsers.NamedFunctionParser("get_weather"), '{"city": "Paris", "unit": "celsius"}',
     [("get_weather", WEATHER)]),
])
def test_forced_tool_call_outputs_parse_whole_and_streamed(parser, text, expected):
    """What tool_choice "required" and a named function make the model write, under their grammars."""
    whole = ChatOutputParser(None, parser).parse(text)
    assert whole.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == expected
    for piece in (1, 4):
        assert stream(ChatOutputParser(None, parser), text, piece)["calls"] == [
            (c.function.name, c.function.arguments) for c in whole.tool_calls]


# ---------------------------------------------------------------- strict tools under tool_choice auto

STRICT_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
CALLS = [tool_parsers.CallSchema("get_weather", STRICT_WEATHER), tool_parsers.CallSchema("get_time", {"type": "object"})]
GOOD = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
BAD = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}'
OTHER = '{"name": "get_time", "arguments": {"zone": "CET"}}'
UNKNOWN = '{"name": "get_news", "arguments": {}}'


def _hermes(call: str) -> str:
    return f"<tool_call>\n{call}\n</tool_call>"


@pytest.fixture(scope="module")
def llg_tokenizer():
    import llguidance.hf
    from transformers import AutoTokenizer

    from engine import EngineConfig
    from engine.loader import model_folder
    hf = AutoTokenizer.from_pretrained(model_folder(EngineConfig()))
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=[hf.eos_token_id])


@pytest.mark.parametrize("name,text,accepted", [
    ("hermes", "Plain text, no call.", True),
    ("hermes", _hermes(GOOD), True),
    ("hermes", "Let me look. " + _hermes(GOOD) + "\n" + _hermes(OTHER), True),
    ("hermes", _hermes(BAD), False),
    ("hermes", "Let me look. " + _hermes(BAD), False),  # a call after text is still a call
    ("hermes", _hermes(GOOD) + " and " + _hermes(BAD), False),  # so is a second one
    ("hermes", _hermes(UNKNOWN), False),
    ("llama3_json", "Plain text, no call.", True),
    ("llama3_json", GOOD.replace("arguments", "parameters") + "; " + OTHER.replace("arguments", "parameters"), True),
    ("llama3_json", BAD.replace("arguments", "parameters"), False),
    ("llama3_json", "  " + BAD.replace("arguments", "parameters"), False),
    ("mistral", "Plain text, no call.", True),
    ("mistral", f"[TOOL_CALLS][{GOOD}, {OTHER}]", True),
    ("mistral", f"Sure. [TOOL_CALLS][{BAD}]", False),
])
def test_strict_call_grammar_leaves_text_free_and_holds_calls_to_their_schemas(llg_tokenizer, name, text, accepted):
    """The grammar tool_choice auto runs under when a tool is strict, in each format, on the embedded model's
    tokenizer: a reply may be any text, but every call the format's parser would find names a given tool and
    carries arguments that match its schema."""
    import llguidance
    hf, tokenizer = llg_tokenizer
    grammar = llguidance.grammar_from("lark", tool_parsers.PARSERS[name]().call_grammar(CALLS, None, None))
    assert not llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    ok = matcher.consume_tokens(hf.encode(text, add_special_tokens=False)) and not matcher.is_error()
    assert (ok and matcher.is_accepting()) == accepted
    # and what it accepts, the format's parser reads as the calls it holds
    if accepted and "{" in text:
        parser = tool_parsers.PARSERS[name]()
        names = [c.function.name for c in tool_parsers.tool_calls_of(parser.scan(text, True), parser)]
        assert names and set(names) <= {"get_weather", "get_time"}


def test_strict_call_grammar_takes_a_json_answer_or_calls(llg_tokenizer):
    """With a response_format JSON schema as well, the reply is an answer under that schema or calls."""
    import llguidance
    hf, tokenizer = llg_tokenizer
    answer = '%json {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    for name, call, bad_call in (("hermes", _hermes(GOOD), _hermes(BAD)),
                                 ("mistral", f"[TOOL_CALLS][{GOOD}]", f"[TOOL_CALLS][{BAD}]")):
        grammar = llguidance.grammar_from("lark", tool_parsers.PARSERS[name]().call_grammar(CALLS, answer, None))

        def accepts(text: str) -> bool:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            return (matcher.consume_tokens(hf.encode(text, add_special_tokens=False)) and not matcher.is_error()
                    and matcher.is_accepting())

        assert accepts(call) and accepts('{"n": 4}')
        assert not accepts(bad_call) and not accepts('{"n": "four"}') and not accepts("free text")
    # formats whose calls cannot be told from a JSON answer, or that are not JSON, cannot: the request is a 400
    assert tool_parsers.PARSERS["llama3_json"]().call_grammar(CALLS, answer, None) is None
    assert tool_parsers.PARSERS["pythonic"]().call_grammar(CALLS, None, None) is None


@pytest.mark.slow
@pytest.mark.parametrize("name,body", [("hermes", "\n{call}\n</tool_call>"), ("mistral", "[{call}]")])
def test_strict_call_grammar_opens_calls_at_a_special_token_marker(llg_tokenizer, name, body):
    """Where the tokenizer has the format's marker as one special token, the grammar names it by id (here the
    embedded tokenizer's `<|im_start|>`, id 1, stands in for it): text before it is free, the call after it is
    held to its schema."""
    import llguidance
    hf, tokenizer = llg_tokenizer
    grammar = llguidance.grammar_from("lark", tool_parsers.PARSERS[name]().call_grammar(CALLS, None, 1))

    def accepts(ids: list[int]) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()

    text = hf.encode("Sure.", add_special_tokens=False)
    assert accepts(text)
    assert accepts(text + [1] + hf.encode(body.format(call=GOOD), add_special_tokens=False))
    assert not accepts(text + [1] + hf.encode(body.format(call=BAD), add_special_tokens=False))
