"""Tool-call parsers: find the tool calls a model wrote in its own format and turn them into OpenAI
`tool_calls`, for whole outputs and for streams.

Every parser scans the output text so far and reports the content around the calls and each call's name and
arguments. Arguments are the exact JSON text the model wrote for them, so the pieces a stream sends add up to
what the whole response carries. While streaming, text that may be the start of a call marker is held back.

Formats: Hermes/Qwen `<tool_call>{json}</tool_call>`, Llama 3 JSON (`{"name", "parameters"}`, optionally after
`<|python_tag|>`, several separated by `;`), Mistral `[TOOL_CALLS]` (a JSON list, or `name[ARGS]{json}`),
pythonic lists (`[f(a=1), g(b="x")]`, Llama 4 and others) and gpt-oss harmony messages to `functions.NAME`
(with the harmony reasoning parser). The parser is named by TOOL_CALL_PARSER
(vLLM's names) or recognised from the chat template.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass

from .chat.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallOut
from .output_scan import (PartialCall, Scan, held_back, scan_call_object, scan_json_calls, skip_ws, valid_call,
                          value_end)
from .protocol import random_id

@dataclass(frozen=True)
class CallSchema:
    """A tool a constrained reply may call: its name and the JSON schema its arguments must match."""
    name: str
    parameters: dict


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal


def _call_rules(calls: list[CallSchema], key: str, before: str = "", after: str = "") -> tuple[str, str]:
    """Lark rules, one per tool, for `{"name": NAME, key: ARGUMENTS}` in this format's own words around it (the
    arguments under the tool's schema); returns the rules and the alternative that names them."""
    rules = []
    for i, call in enumerate(calls):
        head = json.dumps({"name": call.name})[:-1] + ", " + json.dumps(key) + ": "
        rules.append(f"call_{i}: {_literal(before + head)} %json {json.dumps(call.parameters)} {_literal('}' + after)}")
    return "\n".join(rules), "(" + " | ".join(f"call_{i}" for i in range(len(calls))) + ")"


def _marker(text: str, special_id: int | None) -> str:
    """A format's marker in Lark: its special token by id, or its text."""
    return f"<[{special_id}]>" if special_id is not None else _literal(text)


def _opener(text: str, special_id: int | None) -> str:
    """The rule `opener`: free text up to a format's marker. A special-token marker can never be part of text; a
    text marker ends the text at its first occurrence (a lazy lexeme), so every call the parser would find is
    generated under the grammar."""
    if special_id is not None:
        return f"opener: TEXT <[{special_id}]>"
    return f"opener[lazy]: TEXT {_literal(text)}"


_FREE_TEXT = "TEXT: /(.|\\n)*/"


class ToolParser:
    needs_special_tokens = False  # the format's markers are special tokens, so decode with them
    marker: str | None = None  # the text that opens this format's calls, if any

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def call_grammar(self, calls: list[CallSchema], answer: str | None, special_id: int | None) -> str | None:
        """A Lark grammar (llguidance's) for a reply that is either an answer (free text, or `answer`: a Lark
        expression such as `%json {...}`) or tool calls in this format, each calling one of `calls` with
        arguments that match its schema. `special_id` is the marker's token id when the tokenizer has it as one
        special token. None when the format cannot be put into such a grammar."""
        return None


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with text around them."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    marker = OPEN

    def call_grammar(self, calls, answer, special_id):
        rules, call = _call_rules(calls, "arguments", "\n", "\n" + self.CLOSE)
        if answer is not None:
            return (f"start: answer | calls\nanswer: {answer}\ncalls: (opener {call} /\\n?/)+\n"
                    f"opener: {_marker(self.OPEN, special_id)}\n{rules}")
        return (f"%llguidance {{}}\nstart: (opener {call})* TEXT\n{_opener(self.OPEN, special_id)}\n{_FREE_TEXT}\n"
                f"{rules}")

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        at = 0
        while True:
            start = text.find(self.OPEN, at)
            segment = text[at:] if start == -1 else text[at:start]
            if start == -1 and not final:
                segment = segment[:len(segment) - held_back(segment, (self.OPEN,))]
            if at == 0 or segment.strip():  # whitespace between and after calls is not content
                content.append(segment)
            if start == -1:
                break
            body_start = start + len(self.OPEN)
            close = text.find(self.CLOSE, body_start)
            body = text[body_start:] if close == -1 else text[body_start:close]
            finished = close != -1 or final
            j = skip_ws(body, 0)
            call = scan_call_object(body, j, finished)[0] if j < len(body) else None
            if finished and (call is None or not valid_call(call)):
                # Not a call after all: the text stays content, as the model wrote it.
                content.append(text[start:] if close == -1 else text[start:close + len(self.CLOSE)])
            elif call is not None:
                calls.append(call)
            if close == -1:
                break
            at = close + len(self.CLOSE)
        return Scan("".join(content), calls)


class Llama3JsonParser(ToolParser):
    """The whole reply is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), several
    separated by `;`; anything else is content."""
    TAG = "<|python_tag|>"
    marker = TAG

    def call_grammar(self, calls, answer, special_id):
        if answer is not None:
            return None  # a JSON answer and a JSON call start alike; llguidance cannot choose between them
        rules, call = _call_rules(calls, "parameters")
        tag = f"<[{special_id}]>? " if special_id is not None else ""
        # Free text may not start with "{": the parser reads such a reply as calls.
        return f"start: {tag}{call} (/; ?/ {call})* | TEXT\nTEXT: /(\\s*[^{{\\s](.|\\n)*)?/\n{rules}"

    def scan(self, text: str, final: bool) -> Scan:
        stripped = text.lstrip()
        start = len(text) - len(stripped)
        if stripped.startswith(self.TAG):
            start += len(self.TAG)
        elif not stripped.startswith("{"):
            if not final and (self.TAG.startswith(stripped) or not stripped):
                return Scan("")
            return Scan(text)
        calls, all_calls = scan_json_calls(text, start, final, separators=";")
        if final and (not calls or not all_calls or not all(valid_call(c) for c in calls)):
            return Scan(text)
        return Scan("", calls)


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` followed by a JSON list of calls, or by `name[ARGS]{json}` (newer tokenizers)."""
    needs_special_tokens = True
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
    marker = MARKER

    def call_grammar(self, calls, answer, special_id):
        rules, call = _call_rules(calls, "arguments")
        array = f'"[" {call} (", " {call})* "]"'
        if answer is not None:
            return f"start: answer | {_marker(self.MARKER, special_id)} {array}\nanswer: {answer}\n{rules}"
        return (f"%llguidance {{}}\nstart: TEXT | opener {array}\n{_opener(self.MARKER, special_id)}\n"
                f"{_FREE_TEXT}\n{rules}")

    def scan(self, text: str, final: bool) -> Scan:
        start = text.find(self.MARKER)
        if start == -1:
            return Scan(text if final else text[:len(text) - held_back(text, (self.MARKER,))])
        content = text[:start]
        rest = text[start + len(self.MARKER):]
        if self.ARGS in rest or (rest.strip() and rest.lstrip()[0] not in "[{"):
            calls = []
            for piece in rest.split(self.MARKER):
                name, sep, args = piece.partition(self.ARGS)
                if not sep:
                    if final:
                        return Scan(text)
                    break
                j = skip_ws(args, 0)
                end = value_end(args, j)
                complete = end is not None or final
                calls.append(PartialCall(name.strip(), args[j:end] if end is not None else args[j:].rstrip()
                                         if final else args[j:], complete))
        else:
            calls, all_calls = scan_json_calls(rest, 0, final)
            if final and not all_calls:
                return Scan(text)
        if final and (not calls or not all(valid_call(c) for c in calls)):
            return Scan(text)
        return Scan(content, calls)


class PythonicParser(ToolParser):
    """A Python list of calls with keyword arguments: `[get_weather(city="Paris"), ...]`. Calls are sent when
    the list is complete."""

    def scan(self, text: str, final: bool) -> Scan:
        stripped = text.strip()
        if not stripped.startswith("["):
            return Scan(text if final or stripped else "")
        if not final:
            return Scan("")
        try:
            tree = ast.parse(stripped, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return Scan(text)
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return Scan(text)
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                calls.append(PartialCall(node.func.id, json.dumps(arguments, ensure_ascii=False), True))
            return Scan("", calls)
        except (SyntaxError, ValueError, TypeError):
            return Scan(text)


class HarmonyToolParser(ToolParser):
    """gpt-oss: the harmony reasoning parser hands over each message addressed to a function as
    `<|start|>HEADER<|message|>ARGUMENTS<|call|>`, HEADER naming `to=functions.NAME`."""
    needs_special_tokens = True
    START, MESSAGE, CALL = "<|start|>", "<|message|>", "<|call|>"

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        for i, part in enumerate(text.split(self.START)):
            header, sep, body = part.partition(self.MESSAGE)
            name = header.split("to=functions.", 1)[1].split()[0].split("<|")[0] if sep and \
                "to=functions." in header else None
            if name is None:
                content.append(part if i == 0 else self.START + part)
                continue
            complete = body.endswith(self.CALL)
            calls.append(PartialCall(name, body.removesuffix(self.CALL).lstrip(), complete or final))
        return Scan("".join(content), calls)


class NamedFunctionParser(ToolParser):
    """tool_choice naming a function: the reply is that function's arguments, generated under its schema."""

    def __init__(self, name: str):
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        args = text.strip() if final else text.lstrip()
        return Scan("", [PartialCall(self.name, args, final)])


class RequiredParser(ToolParser):
    """tool_choice `required`: the reply is a JSON list of `{"name", "parameters"}`, generated under a grammar
    built from the tools' schemas."""

    def scan(self, text: str, final: bool) -> Scan:
        calls, _ = scan_json_calls(text, 0, final)
        return Scan("", calls)


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen": HermesParser, "qwen2_5": HermesParser, "qwen3": HermesParser,
    "llama3_json": Llama3JsonParser, "llama": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser, "llama4_pythonic": PythonicParser, "olmo3": PythonicParser,
    "openai": HarmonyToolParser,
}


def parser_name_for(setting: str | None, chat_template: str | None) -> str | None:
    """TOOL_CALL_PARSER if set, else the format the chat template writes tool calls in (None: unknown)."""
    if setting:
        return setting
    template = chat_template or ""
    if "<|channel|>" in template and "to=functions." in template:
        return "openai"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|eot_id|>" in template):
        return "llama3_json"
    if "[func_name1(" in template:
        return "pythonic"
    return None


# ---------------------------------------------------------------- results


def tool_calls_of(scan: Scan) -> list[ToolCallOut]:
    return [ToolCallOut(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in scan.calls]


def final_content(scan: Scan) -> str | None:
    """Content next to tool calls is kept only when it is more than whitespace."""
    return scan.content if scan.content.strip() else None


class ToolCallStream:
    """Turns successive scans of a growing output into OpenAI stream deltas: content as it comes (once it is
    more than whitespace), each call's id, type and name once its name is complete, then its arguments in
    pieces. `max_calls` (1 when parallel_tool_calls is false) drops calls past the first."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    def deltas(self, scan: Scan) -> tuple[str, list[DeltaToolCall]]:
        content = ""
        if scan.content.strip() and len(scan.content) > self.content_sent:
            content = scan.content[self.content_sent:]
            self.content_sent = len(scan.content)
        pieces: list[DeltaToolCall] = []
        calls = scan.calls if self.max_calls is None else scan.calls[:self.max_calls]
        for index, call in enumerate(calls):
            if call.name is None:
                break
            new = call.arguments[self._args_sent[index]:] if index < len(self._ids) else call.arguments
            if index == len(self._ids):  # the call's first piece carries its id, type and name
                self._ids.append(random_id("chatcmpl-tool"))
                self._args_sent.append(len(call.arguments))
                pieces.append(DeltaToolCall(index=index, id=self._ids[index], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=new)))
            elif new:
                self._args_sent[index] = len(call.arguments)
                pieces.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=new)))
        return content, pieces

    @property
    def called(self) -> bool:
        return bool(self._ids)
