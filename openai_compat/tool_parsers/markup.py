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
from dataclasses import dataclass, field
from typing import Callable

import regex

from ..output_scan import PartialCall, Scan, held_back, skip_ws, value_end
from . import forced
from .base import CallSchema, ToolParser, json_text, typed_value


@dataclass(frozen=True)
class Params:
    head: str  # regex at a parameter's start, with group `key` (and `string`: "true" when the value is text)
    close: str  # the text that ends its value


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
            value_stop = text.find(spec.params.close, value_start, end)
            if value_stop == -1:
                if closed:  # cut off inside a value: as far as it was written
                    parts.append(f"{json_text(key)}: {json_text(text[value_start:end])[:-1]}")
                pos = end
                break
            value = text[value_start:value_stop].removeprefix("\n").removesuffix("\n")
            if param.groupdict().get("string") == "true":
                typed = value
            elif param.groupdict().get("string") == "false":
                typed = typed_value(value, {"type": ["object", "array", "number", "integer", "boolean",
                                                     "null"]})
            else:
                typed = typed_value(value, self.property_schema(name, key))
            parts.append(f"{json_text(key)}: {json_text(typed)}")
            pos = value_stop + len(spec.params.close)
        out.append(PartialCall(name, "{" + ", ".join(parts) + ("}" if complete else ""), complete, call_id))
        return pos, complete


    def forced_grammar(self, calls, single, specials):
        spec = self.spec
        if spec.write is None:
            return None
        head, _, tail = spec.write.partition("{args}")

        def words(text: str, call: CallSchema) -> str:
            pieces = text.replace("{name}", call.name).split("{index}")
            return ' /[0-9]+/ '.join(forced.literal(p, specials) or '""' for p in pieces) if len(pieces) > 1 \
                else forced.literal(pieces[0], specials)

        def one_call(_, call: CallSchema) -> str | None:
            if spec.write_param is None:
                return forced.seq(words(head, call), forced.json_value(call.parameters), words(tail, call))
            props = forced.properties(call.parameters)
            if props is None:
                return None
            before, _, after = spec.write_param.partition("{value}")
            parts = []
            for key, schema, required in props:
                value = forced.text_value(schema, after.lstrip("\n") or "<")
                if value is None:
                    return None
                rule, is_string = value
                if "{string}" in before and not is_string:
                    rule = forced.json_value(schema)
                opening = before.replace("{key}", key).replace("{string}", "true" if is_string else "false")
                # Line breaks next to a text value are the value's (the parser takes one off each side).
                closing = after
                if not rule.startswith("%json"):
                    opening, closing = opening.rstrip("\n"), after.lstrip("\n")
                    if not is_string:
                        rule = forced.seq(forced.SPACE, rule, forced.SPACE)
                piece = forced.seq(forced.literal(opening, specials), rule, forced.literal(closing, specials))
                parts.append(piece if required else f"({piece})?")
            if not parts:
                return None
            return forced.seq(words(head, call), *parts, words(tail, call))

        built = forced.call_rules(calls, one_call)
        if built is None:
            return None
        rules, call = built
        many = "" if single else f" ({forced.SPACE} {call})*"
        if spec.section is None:
            return f"start: {call}{many}\n{rules}"
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


def gemma_arguments(body: str) -> str | None:
    """`{city:<|"|>Paris<|"|>,days:3}` as JSON: keys are bare words and strings sit between `<|"|>` quotes."""
    out: list[str] = []
    i = 0
    while i < len(body):
        if body.startswith(_GEMMA_QUOTE, i):
            stop = body.find(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
            if stop == -1:
                return None
            out.append(json_text(body[i + len(_GEMMA_QUOTE):stop]))
            i = stop + len(_GEMMA_QUOTE)
        elif body[i] in "{}[],:":
            out.append(body[i])
            i += 1
        elif body[i].isspace():
            i += 1
        else:
            j = i
            while j < len(body) and body[j] not in "{}[],:" and not body.startswith(_GEMMA_QUOTE, j):
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
