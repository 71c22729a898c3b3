"""Tool calls written as JSON: Hermes/Qwen `<tool_call>{json}</tool_call>` and the other families that wrap
JSON call objects (or a list of them) in their own tags, Llama 3 JSON (`{"name", "parameters"}`, optionally after
`<|python_tag|>`, several separated by `;`), Mistral `[TOOL_CALLS]` (a JSON list, or `name[ARGS]{json}`),
pythonic lists (`[f(a=1), g(b="x")]`, Llama 4, LFM2 and others) and gpt-oss harmony messages to `functions.NAME`
(with the harmony reasoning parser). Arguments are the exact JSON text the model wrote, so the pieces a stream
sends add up to what the whole response carries.
"""
from __future__ import annotations

import ast
import json

from ..output_scan import (PartialCall, Scan, held_back, scan_json_calls, skip_ws, valid_call,
                           value_end)
from . import forced
from .base import CallSchema, ToolParser, alphanumeric_id, json_text


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


def _cut_off(calls: list[PartialCall]) -> bool:
    """The reply ended (max_tokens) inside its last call's arguments, after whole calls: the calls stay calls,
    as a stream has already sent them, the last one as far as it was written."""
    return bool(calls) and calls[-1].name is not None and not calls[-1].complete and all(
        valid_call(c) for c in calls[:-1])


class TaggedJsonParser(ToolParser):
    """JSON call objects (one, several, or a JSON list) between a family's opening and closing tags, any number
    of times, with text around them. A closing tag of None: the calls run to the next opening tag or the end."""
    OPEN: str = ""
    ALSO_OPEN: tuple[str, ...] = ()  # other openings the family's versions write
    CLOSE: str | None = None
    NAME_KEYS: tuple[str, ...] | None = ("name",)  # None: `{"NAME": {...}}`, the name as the one key
    ARGUMENT_KEYS: tuple[str, ...] = ("arguments", "parameters")
    ID_KEY: str | None = None  # the key of a call id some families write first in each call (Command R7B)
    # How the family writes several calls (for forced calls): "lines" (one tag per call, or one object per line),
    # "list" (a JSON list), or "either" where families that share the tags differ (MiniMax-M1, Apriel).
    LAYOUT = "lines"

    @property
    def marker(self) -> str:  # type: ignore[override]
        return self.OPEN

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        at = 0
        openers = (self.OPEN, *self.ALSO_OPEN)
        while True:
            # The first opening, and the longest of those that start there (```json before ```).
            start, opener = min(((i, -len(o), o) for o in openers if (i := text.find(o, at)) != -1),
                                default=(-1, 0, ""))[::2]
            segment = text[at:] if start == -1 else text[at:start]
            if start == -1 and not final:
                segment = segment[:len(segment) - held_back(segment, openers)]
            if at == 0 or segment.strip():  # whitespace between and after calls is not content
                content.append(segment)
            if start == -1:
                break
            body_start = start + len(opener)
            close = text.find(self.CLOSE, body_start) if self.CLOSE else min(
                (i for o in openers if (i := text.find(o, body_start)) != -1), default=-1)
            closer = len(self.CLOSE) if self.CLOSE else 0  # a next opening tag stays for the next round
            body = text[body_start:] if close == -1 else text[body_start:close]
            finished = close != -1 or final
            found, all_calls = scan_json_calls(body, 0, finished, name_keys=self.NAME_KEYS,
                                               argument_keys=self.ARGUMENT_KEYS)
            cut = final and close == -1 and _cut_off(found)
            if finished and not cut and (not found or not all_calls or not all(valid_call(c) for c in found)):
                # Not calls after all: the text stays content, as the model wrote it.
                content.append(text[start:] if close == -1 else text[start:close + closer])
            else:
                calls.extend(found)
            if close == -1:
                break
            at = close + closer
        return Scan("".join(content), calls)

    def forced_grammar(self, calls, single, specials):
        string = forced.json_value({"type": "string"})

        def one_call(_, call):
            if self.NAME_KEYS is None:  # the name is the object's one key
                return f'{json.dumps("{" + json.dumps(call.name) + ": ")} {forced.json_value(call.parameters)} "}}"'
            lead = f'({json.dumps(json.dumps(self.ID_KEY) + ": ")} {string} ", ")? ' if self.ID_KEY else ""
            head = json.dumps(self.NAME_KEYS[0]) + ": " + json.dumps(call.name) + ", " + \
                json.dumps(self.ARGUMENT_KEYS[0]) + ": "
            # Some families write the call's id after its arguments (Apriel, Mistral Nemo).
            return (f'"{{" {lead}{json.dumps(head)} {forced.json_value(call.parameters)} '
                    f'(", \\"id\\": " {string})? "}}"')
        rules, call = forced.call_rules(calls, one_call)
        space, gap = forced.SPACE, forced.LIST_SPACE
        listed = f'"[" {gap} {call} {gap} "]"' if single else \
            f'"[" {gap} {call} ("," {gap} {call})* {gap} "]"'
        inline = call if single else f"{call} ({space} {call})*"
        body = {"list": listed, "lines": call if self.CLOSE else inline, "either": f"({listed} | {inline})"}[
            self.LAYOUT]
        opener = forced.literal(self.OPEN, specials)
        if self.ALSO_OPEN:  # the model writes the opening its version was trained on
            opener = "(" + " | ".join(forced.literal(o, specials) for o in (self.OPEN, *self.ALSO_OPEN)) + ")"
        closer = forced.literal(self.CLOSE, specials) if self.CLOSE else ""
        group = forced.seq(opener, space, body, space if self.CLOSE else "", closer)
        if single or self.CLOSE is None or self.LAYOUT != "lines":
            return f"start: {group}\n{rules}"
        return f"start: {group} ({space} {group})*\n{rules}"  # a tag per call (Hermes)


class HermesParser(TaggedJsonParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with text around them."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def call_grammar(self, calls, answer, special_id):
        rules, call = _call_rules(calls, "arguments", "\n", "\n" + self.CLOSE)
        if answer is not None:
            return (f"start: answer | calls\nanswer: {answer}\ncalls: (opener {call} /\\n?/)+\n"
                    f"opener: {_marker(self.OPEN, special_id)}\n{rules}")
        return (f"%llguidance {{}}\nstart: (opener {call})* TEXT\n{_opener(self.OPEN, special_id)}\n{_FREE_TEXT}\n"
                f"{rules}")


def tagged_json(open_: str, close: str | None, doc: str, name_keys=("name",), argument_keys=("arguments",
                "parameters"), special: bool = False, id_key: str | None = None, layout: str = "lines",
                also_open: tuple[str, ...] = ()) -> type[TaggedJsonParser]:
    return type("TaggedJsonParser", (TaggedJsonParser,), {
        "OPEN": open_, "ALSO_OPEN": also_open, "CLOSE": close, "NAME_KEYS": name_keys,
        "ARGUMENT_KEYS": argument_keys, "ID_KEY": id_key, "LAYOUT": layout, "__doc__": doc,
        "needs_special_tokens": special})


def _call_object(call: CallSchema, arguments_key: str) -> str:
    """Lark for `{"name": NAME, "<arguments_key>": {...}}`, laid out as forced.json_value writes JSON."""
    head = '{"name": ' + json.dumps(call.name) + ", " + json.dumps(arguments_key) + ": "
    return f'{json.dumps(head)} {forced.json_value(call.parameters)} "}}"'


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

    def forced_grammar(self, calls, single, specials):
        rules, call = forced.call_rules(calls, lambda _, c: _call_object(c, "parameters"))
        return f"start: {call}" + ("" if single else f' ("; " {call})*') + f"\n{rules}"

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
        if final and not _cut_off(calls) and (not calls or not all_calls or not all(valid_call(c) for c in calls)):
            return Scan(text)
        return Scan("", calls)


class XLamParser(ToolParser):
    """xLAM: the whole reply is a JSON list of calls, `[{"name": ..., "arguments": {...}}, ...]`, as its template
    writes them; a list (or one call) in a ```json block also counts, with the text around it as content."""
    marker = "```json"
    _FENCED = tagged_json("```json", "```", "A ```json block of calls.", also_open=("```",), layout="list")

    def __init__(self, tools=None):
        super().__init__(tools)
        self._fenced = self._FENCED(tools)

    def scan(self, text: str, final: bool) -> Scan:
        stripped = text.lstrip()
        if not stripped.startswith("["):
            if not final and not stripped:
                return Scan("")
            return self._fenced.scan(text, final)
        first = skip_ws(stripped, 1)
        if first < len(stripped) and stripped[first] != "{":  # `[` and then no call object: text, as written
            return Scan(text)
        calls, all_calls = scan_json_calls(text, len(text) - len(stripped), final)
        if final and not _cut_off(calls) and (not calls or not all_calls or not all(valid_call(c) for c in calls)):
            return Scan(text)
        return Scan("", calls)

    def forced_grammar(self, calls, single, specials):
        rules, call = forced.call_rules(calls, lambda _, c: _call_object(c, "arguments"))
        return f'start: "[" {call}' + ("" if single else f' (", " {call})*') + f' "]"\n{rules}'


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` followed by a JSON list of calls, or by `name[ARGS]{json}` (newer tokenizers)."""
    needs_special_tokens = True
    MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    marker = MARKER

    def call_id(self, index, call):
        return call.id or alphanumeric_id()  # its templates refuse any other form of id

    def forced_grammar(self, calls, single, specials):
        # The list Mistral Nemo writes (with the call's id) or the `NAME[ARGS]{...}` of newer Mistral models.
        string = forced.json_value({"type": "string"})
        marker, args = forced.literal(self.MARKER, specials), forced.literal(self.ARGS, specials)
        call_id = forced.literal(self.CALL_ID, specials)
        listed, named = [], []
        for i, c in enumerate(calls):
            head = json.dumps('{"name": ' + json.dumps(c.name) + ', "arguments": ')
            listed.append(f'list_{i}: {head} {forced.json_value(c.parameters)} (", \\"id\\": " {string})? "}}"')
            named.append(f"named_{i}: {json.dumps(c.name)} ({call_id} /[A-Za-z0-9]{{9}}/)? {args} "
                         f"{forced.json_value(c.parameters)}")
        one_listed = "(" + " | ".join(f"list_{i}" for i in range(len(calls))) + ")"
        one_named = "(" + " | ".join(f"named_{i}" for i in range(len(calls))) + ")"
        array = f'"[" {one_listed}' + ("" if single else f' (", " {one_listed})*') + ' "]"'
        names = one_named + ("" if single else f" ({marker} {one_named})*")
        return f"start: {marker} ({array} | {names})\n" + "\n".join(listed + named)

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
                head, sep, args = piece.partition(self.ARGS)
                if not sep:
                    if final:
                        return Scan(text)
                    break
                name, _, call_id = head.partition(self.CALL_ID)  # Mistral Small 3.2 writes the call's id
                j = skip_ws(args, 0)
                end = value_end(args, j)
                complete = end is not None
                calls.append(PartialCall(name.strip(), args[j:end] if end is not None else args[j:].rstrip()
                                         if final else args[j:], complete, call_id.strip() or None))
        else:
            calls, all_calls = scan_json_calls(rest, 0, final)
            if final and not all_calls and not _cut_off(calls):
                return Scan(text)
        if final and not _cut_off(calls) and (not calls or not all(valid_call(c) for c in calls)):
            return Scan(text)
        return Scan(content, calls)


class PythonicParser(ToolParser):
    """A Python list of calls with keyword arguments: `[get_weather(city="Paris"), ...]`, the whole reply or
    (LFM2) between OPEN and CLOSE tags. Calls are sent when the list is complete."""
    OPEN: str | None = None
    CLOSE: str | None = None

    @property
    def marker(self) -> str | None:  # type: ignore[override]
        return self.OPEN

    def scan(self, text: str, final: bool) -> Scan:
        if self.OPEN is None:
            stripped = text.strip()
            if not stripped.startswith("["):
                return Scan(text if final or stripped else "")
            if not final:
                return Scan("")
            calls = _python_calls(stripped)
            return Scan(text) if calls is None else Scan("", calls)
        start = text.find(self.OPEN)
        if start == -1:
            return Scan(text if final else text[:len(text) - held_back(text, (self.OPEN,))])
        body_start = start + len(self.OPEN)
        close = text.find(self.CLOSE, body_start)
        if close == -1 and not final:
            return Scan(text[:start])
        body = text[body_start:] if close == -1 else text[body_start:close]
        calls = _python_calls(body.strip())
        if calls is None:
            return Scan(text)
        after = "" if close == -1 else text[close + len(self.CLOSE):]
        return Scan(text[:start] + (after if after.strip() else ""), calls)


    def forced_grammar(self, calls, single, specials):
        def one_call(_, call):
            props = forced.properties(call.parameters)
            if props is None:
                return None
            required, optional = [], []
            for key, schema, needed in props:
                value = forced.python_value(schema)
                if value is None:
                    return None
                (required if needed else optional).append((f"{json.dumps(key + '=')} {value}", needed))
            # Keyword arguments in any order: the required ones first, then any of the others.
            args = forced.ordered_fields(required + optional, '", "')
            return forced.seq(json.dumps(call.name + "("), args, '")"')
        built = forced.call_rules(calls, one_call)
        if built is None:
            return None
        rules, call = built
        listed = f'"[" {call}' + ("" if single else f' (", " {call})*') + ' "]"'
        opener = forced.literal(self.OPEN, specials) if self.OPEN else ""
        closer = forced.literal(self.CLOSE, specials) if self.CLOSE else ""
        return f"start: {forced.seq(opener, listed, closer)}\n{rules}"


class LFM2Parser(PythonicParser):
    """LFM2: `<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>`."""
    OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
    needs_special_tokens = True


def _python_calls(text: str) -> list[PartialCall] | None:
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            calls.append(PartialCall(node.func.id, json_text(arguments), True))
        return calls
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


class HarmonyToolParser(ToolParser):
    """gpt-oss: the harmony reasoning parser hands over each message addressed to a function as
    `<|start|>HEADER<|message|>ARGUMENTS<|call|>`, HEADER naming `to=functions.NAME`."""
    needs_special_tokens = True
    forced_from_start = True
    START, MESSAGE, CALL = "<|start|>", "<|message|>", "<|call|>"

    def forced_grammar(self, calls, single, specials):
        """One call (its `<|call|>` ends the turn), in either header gpt-oss writes: the recipient before the
        channel, as its template has it, or after it with `<|constrain|>json`, as the model card shows."""
        def one_call(_, call):
            lit = lambda text: forced.literal(text, specials)
            header = (f"({lit(' to=functions.' + call.name + '<|channel|>commentary json')} | "
                      f"{lit('<|channel|>commentary to=functions.' + call.name + ' <|constrain|>json')})")
            return forced.seq(header, lit(self.MESSAGE), forced.json_value(call.parameters), lit(self.CALL))
        rules, call = forced.call_rules(calls, one_call)
        return f"start: {call}\n{rules}"

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
        super().__init__()
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


