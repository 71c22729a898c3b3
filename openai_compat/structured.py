"""Structured outputs for the OpenAI layer: the grammar a request asks for (response_format, vLLM's guided_*
and structured_outputs, or a tool_choice that forces a call), compiled off the event loop into the
GrammarSpec the engine enforces. Any problem with the constraint is a 400 naming the parameter."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from engine import AnswerGate, GrammarCompiler, GrammarError, GrammarSpec

from .errors import OpenAIError
from .chat.protocol import ChatCompletionRequest, NamedToolChoice
from .protocol import Constraint
from .tool_parsers import CallSchema, ToolParser


def forced_tool_constraint(request: ChatCompletionRequest) -> Constraint | None:
    """The grammar for tool_choice `required` (a JSON list of calls to the given tools) or a named function
    (its arguments), so the calls always parse and match the tools' schemas, on any model."""
    if not request.forces_tool_call:
        return None
    tools = request.tools or []
    choice = request.tool_choice
    if isinstance(choice, NamedToolChoice):
        index = request.tool_names.index(choice.function.name)
        return Constraint("json_schema", json.dumps(tool_schema(tools[index].function.parameters)),
                          f"tools[{index}].function.parameters")
    defs: dict[str, Any] = {}
    options = []
    for index, tool in enumerate(tools):
        key = f"tool{index}"
        # Each tool's schema moves under the root's $defs, so its own "#/..." references are rebased there.
        defs[key] = _rebase_refs(tool_schema(tool.function.parameters), f"#/$defs/{key}")
        options.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                         "parameters": {"$ref": f"#/$defs/{key}"}},
                        "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}, "$defs": defs}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return Constraint("json_schema", json.dumps(schema), "tools")


def strict_tools_constraint(request: ChatCompletionRequest, parser: ToolParser | None, parser_name: str | None,
                            tokenizer) -> Constraint | None:
    """tool_choice `auto` with tools marked `strict`: the model still chooses between answering and calling, but
    a call it starts is generated under the tool's schema (a grammar in the model's own call format that leaves
    the answer free, or under the request's JSON schema when it sets one). A format or an answer constraint that
    cannot be combined this way is a 400, never an unenforced `strict`."""
    tools = request.tools or []
    if parser is None or request.effective_tool_choice != "auto" or not any(t.function.strict for t in tools):
        return None
    answer = request.constraint()
    if answer is not None and answer.kind != "json_schema":
        raise OpenAIError(f"{answer.param} cannot be combined with strict tools under tool_choice \"auto\" (a JSON "
                          f"schema answer can)", param=answer.param)
    calls = [CallSchema(t.function.name, tool_schema(t.function.parameters) if t.function.strict
                        else {"type": "object"}) for t in tools]
    marker = parser.marker
    grammar = parser.call_grammar(calls, f"%json {answer.text}" if answer is not None else None,
                                  tokenizer.special_token_id(marker) if marker else None)
    if grammar is None:
        raise OpenAIError(f"strict tools under tool_choice \"auto\" cannot be enforced in this model's tool-call "
                          f"format ({parser_name}{' with ' + answer.param if answer is not None else ''}): use "
                          f"tool_choice \"required\" or a named function (enforced on any model), or strict: false",
                          param="tools")
    return Constraint("grammar", grammar, "tools")


def tool_schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    """A tool's arguments schema (a tool without one takes an empty object)."""
    return schema if schema is not None else {"type": "object", "properties": {}}


def _rebase_refs(node: Any, base: str) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            else:
                out[key] = _rebase_refs(value, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(item, base) for item in node]
    return node


class GrammarCache:
    """Compiles constraints for the served model's tokenizer (the compiler is built on first use and again
    when the model is reloaded); compiled grammars are cached by the constraint."""

    def __init__(self):
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._tokenizer = None

    def _compiler_for(self, tokenizer) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None or self._tokenizer is not tokenizer:
                self._compiler = GrammarCompiler.for_tokenizer(tokenizer)
                self._tokenizer = tokenizer
            return self._compiler

    async def compile(self, tokenizer, constraint: Constraint, gate: AnswerGate | None = None) -> GrammarSpec:
        def build() -> GrammarSpec:
            return self._compiler_for(tokenizer).compile(constraint.kind, constraint.text,
                                                         constraint.whitespace_pattern)

        try:
            spec = await asyncio.to_thread(build)
        except GrammarError as exc:
            raise OpenAIError(f"{constraint.param}: {exc}", param=constraint.param) from None
        return spec.with_gate(gate)
