"""Checks of request input before it reaches the models: JSON well-formedness and pydantic validation, each
problem turned into a 400 that names the offending field."""
from __future__ import annotations

import math
import re
from typing import Any, Iterator

from pydantic import BaseModel, ValidationError

from .errors import OpenAIError
from .protocol import ParamError

# Generous for tool JSON schemas (a few levels each), and far below the interpreter's recursion limit, which
# pydantic, the chat template and json.dumps all run into on deeper input.
MAX_DEPTH = 100
# Far wider than any id, seed or count the API takes; Python refuses to print ints past 4300 digits, so an
# error message naming a bigger one would itself fail.
MAX_INT_BITS = 128
# More values than any request within the per-request bounds needs (the largest is MAX_PROMPT_TOKENS_PER_REQUEST
# token ids, 262144 by default); counting stops here, so a body of millions of tiny values is refused after a
# bounded walk, before pydantic builds a model object for each of them.
MAX_JSON_VALUES = 2**19
_SURROGATE = re.compile("[\ud800-\udfff]")  # halves of UTF-16 pairs: a Python str holds them, UTF-8 cannot


def field_path(parts: tuple) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def check_json(value: Any, max_values: int = MAX_JSON_VALUES) -> None:
    """Reject input that no JSON text could carry or that would break the layers below: nesting deeper than
    MAX_DEPTH, more than `max_values` values, lone surrogates (text that cannot be encoded as UTF-8, so neither
    tokenized nor sent back), NaN and infinities, huge ints, non-string keys and non-JSON types. The one place
    these become a 400 naming the field. Iterative, depth-first with one iterator per open container, so the
    check needs memory in proportion to the nesting, not to the size of the body."""
    count = 0
    stack: list[tuple[Iterator, tuple]] = []

    def enter(item: dict | list, path: tuple) -> None:
        nonlocal count
        count += len(item)
        if count > max_values:
            raise OpenAIError(f"the request holds more than {max_values} JSON values, more than any request this "
                              f"worker accepts", status=413)
        if len(path) >= MAX_DEPTH:
            where = field_path(path[:1])
            raise OpenAIError(f"{where or 'the request'} is nested more than {MAX_DEPTH} levels deep",
                              param=where or None)
        if isinstance(item, dict):
            for key in item:
                if not isinstance(key, str) or _SURROGATE.search(key):
                    where = field_path(path)
                    raise OpenAIError(f"{where or 'the request'} has a key that is not a valid Unicode string: "
                                      f"{ascii(key)[:80]}", param=where or None)
        stack.append((iter(item.items() if isinstance(item, dict) else enumerate(item)), path))

    if isinstance(value, (dict, list)):
        enter(value, ())
    elif not _plain(value):
        raise OpenAIError(f"the request {_not_json(value)}")
    while stack:
        children, path = stack[-1]
        for key, child in children:
            # Plain values are settled here (a token-id prompt can hold many); containers are entered.
            if _plain(child):
                continue
            if isinstance(child, (dict, list)):
                enter(child, (*path, key))
                break
            where = field_path((*path, key))
            raise OpenAIError(f"{where} {_not_json(child)}", param=where)
        else:
            stack.pop()


def _plain(value: Any) -> bool:
    """A JSON scalar the layers below can take."""
    return (isinstance(value, str) and (value.isascii() or not _SURROGATE.search(value))
            or isinstance(value, int) and value.bit_length() <= MAX_INT_BITS  # bool too
            or isinstance(value, float) and math.isfinite(value) or value is None)


def _not_json(item: Any) -> str:
    if isinstance(item, str):
        char = _SURROGATE.search(item).group()
        return (f"contains a lone surrogate (U+{ord(char):04X}), which is not valid Unicode text; send text as "
                f"UTF-8")
    if isinstance(item, float):
        return f"is {item}, not a finite number (JSON has no NaN or infinity)"
    if isinstance(item, int):
        return f"is an integer too large to be valid here (more than {MAX_INT_BITS} bits)"
    return f"is a {type(item).__name__}, not a JSON value"


# Union member names that pydantic puts into error locations; a path without them reads like the request the
# caller wrote.
_MEMBER_NAMES = ("str", "int", "float", "bool", "function-after", "function-before", "function-wrap",
                 "NamedToolChoice")


def _clean_loc(loc: tuple) -> tuple:
    return tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in _MEMBER_NAMES)))


def explain(exc: ValidationError, prefix: tuple = ()) -> tuple[str | None, str]:
    """The parameter a validation error names and its message; `prefix` is where the validated value sits in
    the request (a Responses input item is validated on its own, under `("input", 2)`)."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    # For a field with several accepted forms, each form reports why it failed; the one that got furthest
    # into the value is the form the caller meant.
    same_field = [e for e in errors if _clean_loc(e["loc"])[:1] == _clean_loc(first["loc"])[:1]]
    depth = max(len(_clean_loc(e["loc"])) for e in same_field)
    chosen = [e for e in same_field if len(_clean_loc(e["loc"])) == depth]
    loc = (*prefix, *_clean_loc(chosen[0]["loc"]))
    param = field_path(loc) or None
    cause = (chosen[0].get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        param = field_path((*loc, cause.param)) if loc else cause.param
    messages: list[str] = []
    for error in chosen:
        where = field_path((*prefix, *_clean_loc(error["loc"])))
        text = error["msg"].removeprefix("Value error, ")
        text = f"{where}: {text}" if where else text
        if text not in messages:
            messages.append(text)
    return param, "; ".join(messages[:3])


def parse(model: type[BaseModel], body: Any, context: Any = None):
    """Validate a request body; a problem becomes a 400 naming the parameter. `context` reaches the models'
    validators (the per-request limits)."""
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    try:
        return model.model_validate(body, context=context)
    except ValidationError as exc:
        param, message = explain(exc)
        raise OpenAIError(message, param=param) from None
