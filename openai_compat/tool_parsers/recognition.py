"""Which tool-call format a chat template writes, found by how it writes one: the template renders a
conversation with a known call, and the format whose parser reads exactly that call back from the assistant's
turn is the one. Templates that build their markers in pieces (gpt-oss) are recognised like any other.

A template that does not show past calls but describes its format in the tools prompt is recognised by the
marker that prompt names. Anything else is unknown: TOOL_CALL_PARSER names the format."""
from __future__ import annotations

import json
from typing import Callable

from .base import CallSchema
from .formats import FORMATS

_ARGUMENTS = {"city": "Paris", "days": 3}
_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
PROBE_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                  "parameters": _SCHEMA}}]
_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
_CALL_ID = "call00001"  # nine letters and digits: what Mistral's templates accept


def _conversation(arguments) -> list[dict]:
    call = {"id": _CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return _QUESTION + [{"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": _CALL_ID, "name": "get_weather", "content": "22 C"}]


Render = Callable[..., str]  # (messages, tools=..., add_generation_prompt=...) -> prompt text


def _written_call(render: Render) -> str | None:
    """The assistant's turn as the template writes it for the probe call (None if it cannot render one)."""
    try:
        prompt = render(_QUESTION, tools=PROBE_TOOLS, add_generation_prompt=True)
    except Exception:
        return None
    for arguments in (_ARGUMENTS, json.dumps(_ARGUMENTS)):  # some templates want the arguments as a string
        try:
            full = render(_conversation(arguments), tools=PROBE_TOOLS, add_generation_prompt=False)
        except Exception:
            continue
        same = 0
        while same < min(len(prompt), len(full)) and prompt[same] == full[same]:
            same += 1
        # The two may share the start of different tags (`<|channel|>` and `<|tool_call|>`): the turn starts with
        # the tag.
        opened = max(full.rfind("<", 0, same), full.rfind("[", 0, same))
        if opened != -1 and not any(c in full[opened:same] for c in ">]"):
            same = opened
        return full[same:]
    return None


def _reads_probe(parser_class, text: str) -> bool:
    """Whether the parser reads the probe call from the turn, or from its start up to a tag (the tokens that
    end a turn are not part of a model's output)."""
    parser = parser_class([CallSchema("get_weather", _SCHEMA)])
    ends = [i for i, c in enumerate(text) if c in "<[" and i > 0] + [len(text)]
    for end in ends:
        try:
            calls = parser.scan(text[:end], True).calls
            if calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == _ARGUMENTS:
                return True
        except (ValueError, TypeError):
            continue
    return False


def recognise(render: Render) -> tuple[str | None, str]:
    """The format's name (None if unknown) and why, in words for the start-up log."""
    written = _written_call(render)
    if written is not None and "Paris" in written:
        for fmt in FORMATS:
            if _reads_probe(fmt.parser, written):
                return fmt.names[0], f"its chat template writes a call as {_excerpt(written)}"
    try:
        prompt = render(_QUESTION, tools=PROBE_TOOLS, add_generation_prompt=True)
    except Exception as exc:
        return None, f"its chat template cannot render tools ({str(exc).splitlines()[0][:200]})"
    if written is not None and "Paris" in written:
        return None, f"its chat template writes a call in no format the worker reads: {_excerpt(written)}"
    for fmt in FORMATS:
        marker = fmt.parser().marker
        if marker and len(marker) > 3 and marker in prompt:
            return fmt.names[0], f"its chat template's tools prompt names {marker!r}"
    if "[func_name1(" in prompt:
        return "pythonic", "its chat template's tools prompt asks for a pythonic list of calls"
    if written is None:
        return None, "its chat template does not render a conversation with a tool call"
    if "Paris" not in written:
        return None, "its chat template neither shows past calls nor names a call format in its tools prompt"
    return None, f"its chat template writes a call in no format the worker reads: {_excerpt(written)}"


def _excerpt(text: str, size: int = 120) -> str:
    text = text.strip()
    return repr(text if len(text) <= size else text[:size] + "...")
