"""Grammars for forced tool calls (tool_choice "required" or a named function) in a family's own format: the
model writes calls the way it was trained to, and every value follows the tool's schema.

A grammar is built from pieces: literal text (where the tokenizer has a marker as one special token, that token
by id, since a special token is never spelt out by text tokens), JSON values under a schema (llguidance's
`%json`), and values written as text (`<parameter=KEY>value</parameter>`), each held to its schema's type.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .base import CallSchema

Specials = dict[str, int]  # the tokenizer's special tokens: text -> id


def literal(text: str, specials: Specials) -> str:
    """Lark for `text`: special tokens by id, the rest as string literals, where line breaks may be left out
    (templates of one family lay their calls out differently: GLM-4.6 puts each tag on its own line, GLM-4.7
    does not)."""
    out = []
    for piece in re.split(r"(\n+)", text):
        if piece.startswith("\n"):  # as many line breaks as written, or fewer
            out.append(SPACE if len(piece) == 1 else f"/\\n{{0,{len(piece)}}}/")
        elif piece:
            out.append(_exact(piece, specials))
    return seq(*out)


SPACE = r"/\n?/"  # a line break or none: a model that does not know the format cannot loop on whitespace
LIST_SPACE = r"/\n? {0,4}/"  # inside a JSON list of calls, as Command R7B indents it


def _exact(text: str, specials: Specials) -> str:
    names = sorted((t for t in specials if t and t in text), key=len, reverse=True)
    if not names:
        return json.dumps(text)
    pieces = re.split("(" + "|".join(re.escape(t) for t in names) + ")", text)
    return " ".join(f"<[{specials[p]}]>" if p in specials else json.dumps(p) for p in pieces if p)


def seq(*parts: str) -> str:
    """Lark pieces one after another (empty ones left out: Lark has no empty literal)."""
    return " ".join(p for p in parts if p)


# JSON as templates write it (`tojson`): single spaces after `,` and `:`, no other whitespace, which also keeps a
# small model from spending its budget on newlines.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_value(schema: dict[str, Any]) -> str:
    return f"%json {json.dumps({**schema, 'x-guidance': {**_JSON_LAYOUT, **(schema.get('x-guidance') or {})}})}"


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


_INTEGER = r"/-?(0|[1-9][0-9]*)/"
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"


def text_value(schema: dict[str, Any], stop: str) -> tuple[str, bool] | None:
    """Lark for a value written as text, and whether it is a string; None when the schema cannot be held this
    way. Strings may hold anything but the first character of the text that ends them."""
    if "$ref" in json.dumps(schema):
        return None
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + ")", True
    if "const" in schema and isinstance(schema["const"], str):
        return json.dumps(schema["const"]), True
    types = _types(schema)
    if types == {"string"}:
        if any(k in schema for k in ("pattern", "format", "minLength", "maxLength")):
            return None  # text constraints need the JSON form
        return f"/[^{re.escape(stop[:1])}]*/", True
    if types == {"integer"} and not any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum",
                                                                "exclusiveMaximum", "multipleOf")):
        return _INTEGER, False
    if types == {"number"} and not any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum",
                                                               "exclusiveMaximum", "multipleOf")):
        return _NUMBER, False
    if types == {"boolean"}:
        return '("true" | "false")', False
    # Objects, arrays, unions, bounded numbers: as JSON, which the parser reads back typed.
    return json_value(schema), False


def call_rules(calls: list[CallSchema], one_call) -> tuple[str, str] | None:
    """Rules `call_I` for each tool, from `one_call(index, call)` (its Lark, or None when the tool cannot be
    written in this format), and the alternative naming them."""
    rules = []
    for i, call in enumerate(calls):
        body = one_call(i, call)
        if body is None:
            return None
        rules.append(f"call_{i}: {body}")
    return "\n".join(rules), "(" + " | ".join(f"call_{i}" for i in range(len(calls))) + ")"


def properties(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], bool]] | None:
    """(key, schema, required) for each of an object schema's properties, in order; None when the arguments are
    not a set of named properties that can be written out one by one."""
    if not isinstance(schema, dict) or _types(schema) - {"object"} or not isinstance(schema.get("properties"), dict):
        return None
    if "$ref" in json.dumps(schema) or any(k in schema for k in ("anyOf", "oneOf", "allOf", "patternProperties")):
        return None
    required = set(schema.get("required") or ())
    return [(key, value if isinstance(value, dict) else {}, key in required)
            for key, value in schema["properties"].items()]


def ordered_fields(pieces: list[tuple[str, bool]], sep: str) -> str:
    """Lark for fields written in this order, `sep` between two, each (rule, required) left out where it is not
    required: the first one written carries no separator, whichever it is."""
    def rest(i: int) -> str:
        return seq(*(f"{sep} {rule}" if needed else f"({sep} {rule})?" for rule, needed in pieces[i:]))

    def first(i: int) -> str:
        if i == len(pieces):
            return ""
        rule, needed = pieces[i]
        with_it = seq(rule, rest(i + 1))
        if needed:
            return with_it
        without = first(i + 1)
        return f"({with_it} | {without})" if without else f"({with_it})?"
    return first(0)


class Notation:
    """How a family writes values that are not JSON (Python literals, Gemma 4's notation): Lark for each kind."""
    true, false, null = "True", "False", "None"
    item_sep, field_sep = '", "', '", "'

    def string(self, schema: dict[str, Any]) -> str | None:
        raise NotImplementedError

    def quoted(self, value: str) -> str:  # one enum string
        raise NotImplementedError

    def key(self, name: str) -> str:
        raise NotImplementedError

    def value(self, schema: dict[str, Any]) -> str | None:
        """Lark for a value under `schema`; None where this notation cannot hold it (a reference, bounds)."""
        if not isinstance(schema, dict) or "$ref" in json.dumps(schema):
            return None
        options = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(options, list) and options:
            rules = [self.value(o) for o in options]
            return None if None in rules else "(" + " | ".join(rules) + ")"
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "(" + " | ".join(self.quoted(v) for v in enum) + ")"
        if isinstance(enum, list) and enum and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in enum):
            return "(" + " | ".join(json.dumps(json.dumps(v)) for v in enum) + ")"
        if isinstance(enum, list) or "const" in schema:
            return None
        types = _types(schema)
        if len(types) > 1:
            rules = [self.value({**schema, "type": t}) for t in sorted(types)]
            return None if None in rules else "(" + " | ".join(rules) + ")"
        bounded = any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                            "multipleOf", "minItems", "maxItems", "uniqueItems"))
        kind = next(iter(types), None)
        if kind == "string":
            return self.string(schema)
        if kind in ("integer", "number"):  # bounds held by the JSON engine: numbers are written alike
            return json_value(schema) if bounded else _INTEGER if kind == "integer" else _NUMBER
        if kind == "boolean":
            return f'("{self.true}" | "{self.false}")'
        if kind == "null":
            return f'"{self.null}"'
        if kind == "array":
            items = self.value(schema["items"]) if isinstance(schema.get("items"), dict) else None
            if items is None or bounded:
                return None
            return f'("[" "]" | "[" {items} ({self.item_sep} {items})* "]")'
        if kind == "object":
            fields = properties(schema)
            if fields is None:
                return None
            pieces = []
            for name, field, needed in self.ordered(fields):
                rule = self.value(field)
                if rule is None:
                    return None
                pieces.append((seq(self.key(name), rule), needed))
            return seq('"{"', ordered_fields(pieces, self.field_sep), '"}"')
        return None

    def ordered(self, fields):  # the order the family writes an object's fields in
        return fields


_PYTHON_STRING = r"/'([^'\\\n]|\\.)*'/"


class PythonNotation(Notation):
    """Python literals, as pythonic calls write their arguments: strings in either quote, True/False/None."""

    def string(self, schema):
        if any(k in schema for k in ("pattern", "format", "minLength", "maxLength")):
            return json_value(schema)  # held by the JSON engine: a JSON string is a Python one
        return f"({json_value({'type': 'string'})} | {_PYTHON_STRING})"

    def quoted(self, value):  # Python's repr quotes with ' (LFM2's template writes it so), JSON with ": either
        return " | ".join(json.dumps(q) for q in dict.fromkeys((repr(value), json.dumps(value))))

    def key(self, name):
        return "(" + " | ".join(json.dumps(q + ": ") for q in dict.fromkeys((repr(name), json.dumps(name)))) + ")"


def python_value(schema: dict[str, Any]) -> str | None:
    """Lark for a keyword argument's value in a pythonic call (`f(city="Paris", tags=["a"])`); None where the
    schema cannot be held in Python literals here."""
    return PythonNotation().value(schema)
    types = _types(schema)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        # Python's repr quotes with ' (LFM2's template writes it so), JSON with ": either.
        return "(" + " | ".join(json.dumps(q) for v in enum for q in (repr(v), json.dumps(v))) + ")"
    if isinstance(enum, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in enum):
        return json_value(schema)
    if types == {"string"} and not any(k in schema for k in ("pattern", "format", "minLength", "maxLength")):
        return f"({json_value(schema)} | {_PYTHON_STRING})"
    if types and types <= {"string", "integer", "number"}:
        return json_value(schema)
    if types == {"boolean"}:
        return '("True" | "False")'
    if types == {"null"}:
        return '"None"'
    return None
