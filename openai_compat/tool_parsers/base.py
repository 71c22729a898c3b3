"""What every tool-call parser shares: the tools a reply may call, the scan interface, call ids in the form a
family's template accepts back, and arguments written as text typed by the tool's schema."""
from __future__ import annotations

import ast
import json
import secrets
import string
from dataclasses import dataclass
from typing import Any

from ..output_scan import PartialCall, Scan
from ..protocol import random_id


@dataclass(frozen=True)
class CallSchema:
    """A tool a reply may call: its name and the JSON schema of its arguments."""
    name: str
    parameters: dict


class ToolParser:
    needs_special_tokens = False  # the format's markers are special tokens, so decode with them
    marker: str | None = None  # the text that opens this format's calls, if any
    # Whether a forced call's grammar covers the reply from its first token (a harmony call is a message of its
    # own, outside the answer channel) rather than the answer after the thinking.
    forced_from_start = False

    def __init__(self, tools: list[CallSchema] | None = None):
        self.tools = {t.name: t.parameters or {} for t in tools or ()}

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError

    def call_id(self, index: int, call: PartialCall) -> str:
        """The id of the reply's `index`-th call; the client sends it back with the call and its result."""
        return call.id or random_id("chatcmpl-tool")

    def call_grammar(self, calls: list[CallSchema], answer: str | None, special_id: int | None) -> str | None:
        """A Lark grammar (llguidance's) for a reply that is either an answer (free text, or `answer`: a Lark
        expression such as `%json {...}`) or tool calls in this format, each calling one of `calls` with
        arguments that match its schema. `special_id` is the marker's token id when the tokenizer has it as one
        special token. None when the format cannot be put into such a grammar."""
        return None

    def forced_grammar(self, calls: list[CallSchema], single: bool, specials: dict[str, int]) -> str | None:
        """A Lark grammar for a reply of calls only, in this format: one call when `single`, else one or more,
        each to one of `calls` with arguments under its schema (tool_choice "required" or a named function).
        `specials`: the tokenizer's special tokens by text. None: this format has no such grammar (the worker
        then forces its JSON list form)."""
        return None

    def property_schema(self, tool: str | None, key: str) -> dict | None:
        schema = self.tools.get(tool or "")
        properties = schema.get("properties") if isinstance(schema, dict) else None
        value = properties.get(key) if isinstance(properties, dict) else None
        return value if isinstance(value, dict) else None


def alphanumeric_id(size: int = 9) -> str:
    """Mistral's templates accept only 9-character alphanumeric call ids."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(size))


# ---------------------------------------------------------------- arguments written as text

def _types(schema: dict | None) -> set[str]:
    if not schema:
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    found: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or ():
            if isinstance(option, dict):
                found |= _types(option)
    if not found and isinstance(schema.get("enum"), list) and schema["enum"] and all(
            isinstance(v, str) for v in schema["enum"]):
        found = {"string"}
    return found


def _as_json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        pass
    try:  # Python literals (True, None, single quotes), as some models write them
        return True, ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def typed_value(text: str, schema: dict | None) -> Any:
    """A parameter value the model wrote as text, as the JSON value the tool's schema asks for. A value that
    does not read as the schema's type stays the text the model wrote (the client sees what was written)."""
    types = _types(schema)
    if types == {"string"}:
        return text
    stripped = text.strip()
    if types and types <= {"integer", "number"}:
        try:
            number = float(stripped)
        except ValueError:
            return text
        if "integer" in types and number.is_integer() and "." not in stripped and "e" not in stripped.lower():
            return int(stripped)
        return int(number) if types == {"integer"} and number.is_integer() else number
    if types == {"boolean"}:
        lowered = stripped.lower()
        return True if lowered == "true" else False if lowered == "false" else text
    if types == {"null"}:
        return None if stripped.lower() in ("null", "none") else text
    ok, value = _as_json(stripped)
    if not ok:
        return text
    if "string" in types and not isinstance(value, (dict, list)) and not (
            isinstance(value, bool) and "boolean" in types) and not (
            isinstance(value, (int, float)) and types & {"integer", "number"}) and not (
            value is None and "null" in types):
        return text
    return value


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
