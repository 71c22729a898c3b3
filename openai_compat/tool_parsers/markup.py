"""Tool calls written as markup: a call head that names the function, then its arguments either as one JSON
object (DeepSeek, Kimi-K2, Functionary, Mistral v11) or as one tagged parameter after another whose values are
text (Qwen3-Coder, GLM, MiniMax-M2, Seed-OSS, DeepSeek-V3.2), optionally grouped in a section.

One engine reads them all from a `Markup` that says how a family writes a call. Parameter values written as
text are typed by the tool's schema. While streaming, a call's arguments grow one finished parameter at a time
(`{"city": "Paris"`, then `, "days": 3`, then `}`), so the pieces add up to the whole response. A call cut off
(by max_tokens) keeps its name and the arguments as far as they were written, unclosed.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

import regex

from ..output_scan import PartialCall, Scan, held_back, skip_ws, value_end
from . import forced
from .base import CallSchema, ToolParser, _types, json_text, typed_value

# What a forced call writes where a family's call has its place in the reply or an id the model makes up.
_PLACES = {"{index}": "/[0-9]+/", "{id}": "/[A-Za-z0-9_-]{1,40}/"}
# The type names Kimi-K3 writes on a parameter, by the schema's type.
_TYPE_WORDS = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean",
               "object": "object", "array": "array", "null": "null"}


@dataclass(frozen=True)
class Params:
    # Regex at a parameter's start, with group `key`, and where the family says whether the value is text:
    # `string` ("true" or "false", DeepSeek's DSML) or `type` (the JSON type's name, Kimi-K3).
    head: str
    close: str  # the text that ends its value (`{key}` in it: the parameter's name)
    # Values whose objects and arrays are nested markup (MiniMax-M3): (text, the value's schema) -> the value,
    # and for forced calls (the value's schema, specials) -> its Lark, None where the form cannot hold it.
    nested: Callable[[str, dict | None], object] | None = None
    nested_rule: Callable[[dict, dict[str, int]], str | None] | None = None


@dataclass(frozen=True)
class Markup:
    head: str  # regex at a call's start, with group `name` (and `id` or `index` where the family writes one)
    marker: str  # the text every call (or its section) starts with: where content ends
    section: tuple[str, str] | None = None  # the text around a group of calls
    params: Params | None = None  # None: the arguments are one JSON value after the head
    close: str | None = None  # the text after a call (None: the call ends with its section)
    # Arguments in a family's own notation, converted to JSON once the call is closed (Gemma 4).
    convert: Callable[[str], str | None] | None = None
    content_names: frozenset[str] = field(default_factory=frozenset)  # heads that open content (`>>>all`)
    # How the family writes a call, for forced calls: `{name}`, `{index}` (the call's place in the reply) and
    # `{args}` (the JSON object, or the parameters, each written as `write_param` with `{key}`, `{value}` and
    # optionally `{string}`: "true" for a string value). None: forced calls use the JSON form.
    write: str | None = None
    write_param: str | None = None
    one_per_section: bool = False  # a section per call (Qwen3-Coder, GLM) rather than one for all
    call_separator: str | None = None  # forced calls: what a family writes between two calls (else a line break)
    # Forced arguments in the family's own notation (Gemma 4): specials -> a forced.Notation; None: JSON.
    notation: Callable[[dict[str, int]], "forced.Notation"] | None = None


class MarkupParser(ToolParser):
    spec: Markup

    def __init__(self, tools=None):
        super().__init__(tools)
        self._head = regex.compile(self.spec.head, regex.DOTALL)
        self._param = regex.compile(self.spec.params.head, regex.DOTALL) if self.spec.params else None

    @property
    def marker(self) -> str:  # type: ignore[override]
        return self.spec.section[0] if self.spec.section else self.spec.marker

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        if self.spec.section is None:
            self._calls(text, 0, len(text), final, calls, content)
            return Scan("".join(content), calls)
        opener, closer = self.spec.section
        at = 0
        while True:
            start = text.find(opener, at)
            segment = text[at:] if start == -1 else text[at:start]
            if start == -1 and not final:
                segment = segment[:len(segment) - held_back(segment, (opener,))]
            if at == 0 or segment.strip():  # whitespace between sections is not content
                content.append(segment)
            if start == -1:
                break
            body = start + len(opener)
            end = text.find(closer, body)
            closed = end != -1
            found: list[PartialCall] = []
            if not self._calls(text, body, end if closed else len(text), closed or final, found, None):
                content.append(text[start:end + len(closer)] if closed else text[start:])  # not calls: as written
            calls.extend(found)
            if not closed:
                break
            at = end + len(closer)
        return Scan("".join(content), calls)

    def _calls(self, text: str, pos: int, end: int, closed: bool, out: list[PartialCall],
               content: list[str] | None) -> bool:
        """Read calls from text[pos:end] into `out`. In a section (`content` None) only calls and whitespace may
        appear; False when the closed section holds anything else. Outside sections, the text between calls goes
        to `content`. `closed`: nothing more will be written in this span."""
        spec = self.spec
        while True:
            if content is None:
                start = pos
            else:
                start = text.find(spec.marker, pos, end)
                if start == -1:
                    segment = text[pos:end]
                    content.append(segment if closed else segment[:len(segment) - held_back(segment,
                                                                                              (spec.marker,))])
                    return True
                content.append(text[pos:start])
            head = self._head.match(text, start, end, partial=not closed)
            # A name that ends where the text does may still grow (in formats where nothing closes it).
            unfinished = head is not None and (head.partial or (not closed and head.end() == end
                                                                and spec.close is None))
            if head is None or unfinished:
                if content is None:
                    if unfinished or not text[start:end].strip():
                        return True  # a head still being written, or nothing yet
                    return bool(out) if closed else True  # a closed section of anything else is not calls
                if unfinished:
                    return True  # maybe a head: held back until it is finished
                content.append(spec.marker)
                pos = start + len(spec.marker)
                continue
            name = head.group("name").strip()
            groups = head.groupdict()
            call_id = groups.get("id")
            if groups.get("index") is not None:
                call_id = f"functions.{name}:{groups['index']}"
            pos = head.end()
            if name in spec.content_names:  # `>>>all`: what follows, up to the next call, is content
                following = text.find(spec.marker, pos, end)
                if content is not None:
                    if following == -1 and not closed:
                        return True
                    content.append(text[pos:end if following == -1 else following])
                pos = end if following == -1 else following
                if pos >= end:
                    return True
                continue
            if spec.convert is not None:
                close_at = text.find(spec.close, pos, end) if spec.close else -1
                if close_at == -1:
                    if closed:
                        out.append(PartialCall(name, text[pos:end].strip(), False, call_id))
                    return True
                arguments = spec.convert(text[pos:close_at])
                if arguments is None:
                    return False
                out.append(PartialCall(name, arguments, True, call_id))
                pos = close_at + len(spec.close)
                continue
            if self._param is None:
                j = skip_ws(text, pos)
                if j >= end and not closed:
                    return True  # a call once its arguments start
                if j < end and text[j] != "{":  # arguments are a JSON object: this was no call
                    if content is None:
                        return bool(out) if closed else True
                    content.append(text[start:j])
                    pos = j
                    continue
                pos, complete = self._json_arguments(text, pos, end, closed, name, call_id, out)
            else:
                pos, complete = self._text_arguments(text, pos, end, closed, name, call_id, out)
            if not complete:
                return True

    def _json_arguments(self, text, pos, end, closed, name, call_id, out) -> tuple[int, bool]:
        j = skip_ws(text, pos)
        stop = value_end(text[:end], j) if j < end else None
        if stop is None:
            arguments = text[j:end]
            out.append(PartialCall(name, arguments.rstrip() if closed else arguments, False, call_id))
            return end, False
        out.append(PartialCall(name, text[j:stop], True, call_id))
        if self.spec.close is not None:
            k = skip_ws(text, stop)
            if text.startswith(self.spec.close, k, end):
                return k + len(self.spec.close), True
            if not closed and self.spec.close.startswith(text[k:end]):
                return end, False  # the close is still being written: nothing after the call is known yet
        return stop, True

    def _text_arguments(self, text, pos, end, closed, name, call_id, out) -> tuple[int, bool]:
        spec = self.spec
        parts: list[str] = []
        complete = False
        while True:
            k = skip_ws(text, pos)
            if spec.close is not None and text.startswith(spec.close, k, end):
                pos, complete = k + len(spec.close), True
                break
            param = self._param.match(text, k, end, partial=not closed)
            if param is None or param.partial:
                if spec.close is None and closed:
                    complete = True  # the call ends with its section
                pos = end
                break
            key = param.group("key").strip()
            value_start = param.end()
            closer = spec.params.close.replace("{key}", key)
            value_stop = self._value_stop(text, key, closer, value_start, end)
            if value_stop == -1:
                if closed:  # cut off inside a value: as far as it was written
                    parts.append(f"{json_text(key)}: {json_text(text[value_start:end])[:-1]}")
                pos = end
                break
            value = text[value_start:value_stop].removeprefix("\n").removesuffix("\n")
            kind = param.groupdict().get("string") or param.groupdict().get("type")
            if kind in ("true", "string"):
                typed = value
            elif spec.params.nested is not None:
                typed = spec.params.nested(value, self.property_schema(name, key))
            elif kind is not None:
                typed = typed_value(value, {"type": ["object", "array", "number", "integer", "boolean",
                                                     "null"]})
            else:
                typed = typed_value(value, self.property_schema(name, key))
            parts.append(f"{json_text(key)}: {json_text(typed)}")
            pos = value_stop + len(closer)
        out.append(PartialCall(name, "{" + ", ".join(parts) + ("}" if complete else ""), complete, call_id))
        return pos, complete

    def _value_stop(self, text: str, key: str, closer: str, start: int, end: int) -> int:
        """Where a parameter's value ends (-1: not yet written). In nested markup, the same name may open
        inside the value: each opening takes its own close."""
        if self.spec.params.nested is None:
            return text.find(closer, start, end)
        opener = closer.replace("</", "<", 1)
        depth, at = 1, start
        while True:
            stop = text.find(closer, at, end)
            if stop == -1:
                return -1
            depth += text.count(opener, at, stop) - 1
            if depth == 0:
                return stop
            at = stop + len(closer)

    def forced_grammar(self, calls, single, specials):
        spec = self.spec
        if spec.write is None:
            return None
        head, _, tail = spec.write.partition("{args}")

        def words(text: str, call: CallSchema) -> str:
            pieces = re.split(r"(\{index\}|\{id\})", text.replace("{name}", call.name))
            return forced.seq(*(_PLACES.get(p) or forced.literal(p, specials) for p in pieces))

        def one_call(_, call: CallSchema) -> str | None:
            if spec.write_param is None:
                arguments = forced.json_value(call.parameters) if spec.notation is None else \
                    spec.notation(specials).value(call.parameters)
                return None if arguments is None else forced.seq(words(head, call), arguments, words(tail, call))
            props = forced.properties(call.parameters)
            if props is None:
                return None
            before, _, after = spec.write_param.partition("{value}")
            parts = []

            def param(key: str, schema: dict) -> str | None:
                value = forced.text_value(schema, after.lstrip("\n") or "<")
                if value is None:
                    return None
                rule, is_string = value
                if "{string}" in before and not is_string:
                    rule = forced.json_value(schema)
                if spec.params.nested is not None and rule.startswith("%json"):
                    # Objects and arrays in the nested form, where the family has a rule for it.
                    rule = spec.params.nested_rule(schema, specials) if spec.params.nested_rule else None
                    if rule is None:
                        return None
                opening = before.replace("{key}", key).replace("{string}", "true" if is_string else "false")
                if "{type}" in opening:
                    types = _types(schema)
                    kind = _TYPE_WORDS.get(next(iter(types))) if len(types) == 1 else None
                    if kind is None:
                        return None  # no one type to name
                    opening = opening.replace("{type}", kind)
                # Line breaks next to a text value are the value's (the parser takes one off each side).
                closing = after.replace("{key}", key)
                if not rule.startswith("%json"):
                    opening, closing = opening.rstrip("\n"), closing.lstrip("\n")
                    if not is_string:
                        rule = forced.seq(forced.SPACE, rule, forced.SPACE)
                return forced.seq(forced.literal(opening, specials), rule, forced.literal(closing, specials))

            for key, schema, required in props:
                piece = param(key, schema)
                if piece is None and "{type}" in before:  # a union: each type under its own name
                    options = schema.get("anyOf") or schema.get("oneOf") or []
                    pieces = [param(key, option) if isinstance(option, dict) else None for option in options]
                    piece = None if not pieces or None in pieces else "(" + " | ".join(pieces) + ")"
                if piece is None:
                    return None
                parts.append(piece if required else f"({piece})?")
            if not parts:
                return None
            return forced.seq(words(head, call), *parts, words(tail, call))

        built = forced.call_rules(calls, one_call)
        if built is None:
            return None
        rules, call = built
        between = forced.literal(spec.call_separator, specials) if spec.call_separator else forced.SPACE
        many = "" if single else f" ({between} {call})*"
        if spec.section is None or spec.write.find("{args}") > spec.write.find(spec.section[0]) >= 0:
            return f"start: {call}{many}\n{rules}"  # no section, or each call writes its own
        opener, closer = (forced.literal(t, specials) for t in spec.section)
        if spec.one_per_section:
            group = forced.seq(opener, call, closer)
            return f"start: {group}" + ("" if single else f" ({forced.SPACE} {group})*") + f"\n{rules}"
        calls_rule = call if single else f"{call} ({forced.SPACE} {call})*"
        return "start: " + forced.seq(opener, calls_rule, forced.SPACE, closer) + f"\n{rules}"


def markup_parser(spec: Markup, doc: str, special: bool = False) -> type[MarkupParser]:
    """A parser class for one family's markup."""
    return type("MarkupParser", (MarkupParser,), {"spec": spec, "__doc__": doc, "needs_special_tokens": special})


# ---------------------------------------------------------------- Gemma 4's argument notation

_GEMMA_QUOTE = '<|"|>'
_GEMMA_WORDS = {"None": "null", "True": "true", "False": "false"}  # as its template writes Python values


class GemmaNotation(forced.Notation):
    """Gemma 4's notation as its template writes arguments: bare keys in sorted order, strings between `<|"|>`
    quotes, true/false, None, no spaces."""
    true, false, null = "true", "false", "None"
    item_sep = field_sep = '","'

    quote_text = _GEMMA_QUOTE

    def __init__(self, specials: dict[str, int]):
        self.quote = forced.literal(self.quote_text, specials)

    def string(self, schema):
        if any(k in schema for k in ("pattern", "format", "minLength", "maxLength")):
            return None
        return f"{self.quote} /[^<]*/ {self.quote}"

    def quoted(self, value):
        return f"{self.quote} {json.dumps(value)} {self.quote}"

    def key(self, name):
        return json.dumps(name + ":")

    def ordered(self, fields):
        return sorted(fields, key=lambda field: field[0])


class FunctionGemmaNotation(GemmaNotation):
    """FunctionGemma's: Gemma 4's notation with `<escape>` around strings."""
    quote_text = "<escape>"


def function_gemma_arguments(body: str) -> str | None:
    return gemma_arguments(body, "<escape>")


def gemma_arguments(body: str, quote: str = _GEMMA_QUOTE) -> str | None:
    """`{city:<|"|>Paris<|"|>,days:3}` as JSON: keys are bare words and strings sit between `<|"|>` quotes
    (FunctionGemma's `<escape>`)."""
    out: list[str] = []
    i = 0
    while i < len(body):
        if body.startswith(quote, i):
            stop = body.find(quote, i + len(quote))
            if stop == -1:
                return None
            out.append(json_text(body[i + len(quote):stop]))
            i = stop + len(quote)
        elif body[i] in "{}[],:":
            out.append(body[i])
            i += 1
        elif body[i].isspace():
            i += 1
        else:
            j = i
            while j < len(body) and body[j] not in "{}[],:" and not body.startswith(quote, j):
                j += 1
            word = body[i:j].strip()
            following = skip_ws(body, j)
            is_key = following < len(body) and body[following] == ":"
            out.append(json_text(word) if is_key else _GEMMA_WORDS.get(word, word))
            i = j
    text = "".join(out)
    try:
        return text if isinstance(json.loads(text), dict) else None
    except ValueError:
        return None


# ---------------------------------------------------------------- MiniMax-M3's nested values

MINIMAX_NS = "]<]minimax[>["  # the token before each of MiniMax-M3's tags
_MINIMAX_TAG = regex.compile(regex.escape(MINIMAX_NS) + r"<(/?)([^<>/\s]+)>")


def minimax_m3_value(text: str, schema: dict | None):
    """A MiniMax-M3 parameter value: text typed by the schema, or nested tags: `<item>` for each element of an
    array, `<KEY>` for each field of an object (fields that are null are not written). Text that is neither
    stays as written."""
    types = _types(schema)
    if not text:
        return [] if types == {"array"} else {} if types == {"object"} else typed_value(text, schema)
    elements = _minimax_elements(text)
    if elements is None:
        return typed_value(text, schema)
    schema = schema or {}
    if all(tag == "item" for tag, _ in elements) and (types <= {"array"} or "array" in types):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else None
        return [minimax_m3_value(inner, items) for _, inner in elements]
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    return {tag: minimax_m3_value(inner, properties.get(tag)) for tag, inner in elements}


def _minimax_elements(text: str) -> list[tuple[str, str]] | None:
    """The top-level `NS<tag>inner NS</tag>` elements of `text`, or None when it is not only elements."""
    elements: list[tuple[str, str]] = []
    stack: list[tuple[str, int]] = []
    at = 0
    for tag in _MINIMAX_TAG.finditer(text):
        closing, name = tag.group(1) == "/", tag.group(2)
        if not stack and text[at:tag.start()].strip():
            return None  # text between elements
        if not closing:
            stack.append((name, tag.end()))
            continue
        if not stack or stack[-1][0] != name:
            return None
        _, inner_start = stack.pop()
        if not stack:
            elements.append((name, text[inner_start:tag.start()]))
            at = tag.end()
    if stack or not elements or text[at:].strip():
        return None
    return elements


def minimax_m3_rule(schema: dict, specials: dict[str, int]) -> str | None:
    """Lark for a MiniMax-M3 value as its template writes it: text for a scalar, `<item>` tags for an array's
    elements, a tag per field for an object (a null is left out, so `X or null` is an optional X). None where
    the schema has no such form (a union of two kinds, a reference)."""
    options = [o for o in (schema.get("anyOf") or schema.get("oneOf") or [schema]) if isinstance(o, dict)]
    options = [o for o in options if _types(o) != {"null"}]
    if len(options) != 1:
        return None
    schema = options[0]
    types = _types(schema)
    tag = lambda name, rule: forced.seq(forced.literal(f"{MINIMAX_NS}<{name}>", specials), rule,
                                        forced.literal(f"{MINIMAX_NS}</{name}>", specials))
    if types == {"array"}:
        items = minimax_m3_rule(schema.get("items") or {"type": "string"}, specials)
        return None if items is None else f"({tag('item', items)})*"
    if types == {"object"}:
        fields = forced.properties(schema)
        if fields is None:
            return None
        pieces = []
        for key, field_schema, required in fields:
            rule = minimax_m3_rule(field_schema, specials)
            if rule is None:
                return None
            pieces.append(tag(key, rule) if required else f"({tag(key, rule)})?")
        return forced.seq(*pieces) or '""'
    value = forced.text_value(schema, "]")
    return None if value is None or value[0].startswith("%json") else value[0]
