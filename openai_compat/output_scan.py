"""Scanning a model's output as it grows, shared by the tool-call and reasoning parsers: JSON call objects read
as far as they are written (a call is complete once its object closes), and how much of the text's end may be the
start of a marker and so is held back from a stream until the next piece arrives."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_WHITESPACE = " \t\r\n"


@dataclass
class PartialCall:
    name: str | None  # None until the whole name has been written
    arguments: str  # the JSON text of the arguments so far
    complete: bool = False
    id: str | None = None  # the call's id, where the format writes one


@dataclass
class Scan:
    content: str  # text outside tool calls that can be sent now
    calls: list[PartialCall] = field(default_factory=list)


# ---------------------------------------------------------------- JSON scanning


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at text[i] == '"', or None if it is not finished."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at text[i] (no leading whitespace), or None if it is not finished
    (a number or literal at the very end of the text counts as unfinished)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n;":
        j += 1
    return j if j < len(text) else None


def scan_call_object(text: str, i: int, final: bool, name_keys=("name",),
                     argument_keys=("arguments", "parameters")) -> tuple[PartialCall | None, int | None]:
    """Read a call object `{"name": ..., "arguments": {...}}` starting at text[i] == '{'. Returns the call so far
    (None if nothing is known yet) and the index after the object (None while unfinished)."""
    name: str | None = None
    arguments = ""
    args_done = False
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return PartialCall(name, arguments if args_done or arguments else "{}", True), j + 1
        if text[j] != '"':
            return None, None  # not an object of the expected shape
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            return None, None
        j = skip_ws(text, j + 1)
        end = value_end(text, j)
        if end is None and final and j < len(text):
            end = len(text.rstrip(_WHITESPACE))
        if key in name_keys:
            if end is None:
                break
            try:
                name = json.loads(text[j:end])
            except ValueError:
                return None, None
        elif key in argument_keys:
            if end is None:
                arguments = text[j:]
                break
            arguments, args_done = text[j:end], True
        elif end is None:
            break
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
    if name is None and not arguments:
        return None, None
    return PartialCall(name, arguments), None


def scan_keyed_call(text: str, i: int, final: bool) -> tuple[PartialCall | None, int | None]:
    """Read a call written as `{"NAME": {...arguments}}` (Apertus) starting at text[i] == '{', as
    scan_call_object does."""
    j = skip_ws(text, i + 1)
    if j >= len(text):
        return None, None
    if text[j] != '"':
        return None, None
    key_end = _string_end(text, j)
    if key_end is None:
        return None, None
    name = json.loads(text[j:key_end])
    j = skip_ws(text, key_end)
    if j >= len(text):
        return None, None
    if text[j] != ":":
        return None, None
    j = skip_ws(text, j + 1)
    end = value_end(text, j)
    if end is None:
        return PartialCall(name, text[j:].rstrip(_WHITESPACE) if final else text[j:]), None
    k = skip_ws(text, end)
    if k < len(text) and text[k] == "}":
        return PartialCall(name, text[j:end], True), k + 1
    if k >= len(text):
        return PartialCall(name, text[j:end]), None
    return None, None  # a second key: not this shape


def valid_call(call: PartialCall) -> bool:
    if not call.complete or not isinstance(call.name, str) or not call.name:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters may be the start of a marker (held back until the next delta)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                longest = max(longest, size)
                break
    return longest


def scan_json_calls(text: str, i: int, final: bool, separators: str = ",;", name_keys=("name",),
                    argument_keys=("arguments", "parameters")) -> tuple[list[PartialCall], bool]:
    """Call objects one after another from text[i] (optionally in a JSON list), separated by `,` or `;`.
    `name_keys` None: each call is an object whose one key is the function's name. Returns the calls and whether
    everything from i on was read as calls."""
    calls: list[PartialCall] = []
    j = skip_ws(text, i)
    in_list = j < len(text) and text[j] == "["
    if in_list:
        j = skip_ws(text, j + 1)
    while j < len(text):
        if text[j] == "]" and in_list:
            return calls, skip_ws(text, j + 1) == len(text)
        if text[j] != "{":
            return calls, False
        call, end = scan_keyed_call(text, j, final) if name_keys is None else \
            scan_call_object(text, j, final, name_keys, argument_keys)
        if call is None:
            return calls, False
        calls.append(call)
        if end is None:
            return calls, not final
        j = skip_ws(text, end)
        if j < len(text) and text[j] in separators:
            j = skip_ws(text, j + 1)
    return calls, not (final and in_list)


# ---------------------------------------------------------------- parsers
