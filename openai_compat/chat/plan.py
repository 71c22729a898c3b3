"""How a chat reply is generated and read: the grammar it is generated under (a forced or strict tool call, or
the request's response format / structured outputs), and the reasoning and tool-call parsers that take it
apart."""
from __future__ import annotations

from dataclasses import dataclass

from engine import AnswerGate, GrammarSpec

from .. import reasoning, tool_parsers
from ..chat_output import ChatOutputParser
from ..errors import OpenAIError
from ..serving import OpenAIServing, Prompt
from ..protocol import Constraint
from ..structured import forced_tool_constraint, strict_tools_constraint, tool_schema
from .protocol import ChatCompletionRequest, NamedToolChoice


@dataclass
class ChatPlan:
    grammar: GrammarSpec | None
    reasoning_parser: reasoning.ReasoningParser | None
    tool_parser: tool_parsers.ToolParser | None
    max_calls: int | None
    with_special_tokens: bool
    # A reply that ends in tool calls finishes with "tool_calls", except for a named tool_choice, where OpenAI
    # (and vLLM) report "stop": the caller forced the call.
    calls_finish: bool = True

    def parser(self) -> ChatOutputParser:
        """A parser for one choice (parsers keep the state of a stream)."""
        return ChatOutputParser(self.reasoning_parser, self.tool_parser, self.max_calls)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """A reply that ends in tool calls finishes with "tool_calls" (a cut-off one keeps "length")."""
        return "tool_calls" if self.calls_finish and called and reason == "stop" else reason


async def plan_chat(serving: OpenAIServing, request: ChatCompletionRequest, prompt: Prompt) -> ChatPlan:
    """The plan for a chat request whose conversation rendered to `prompt`."""
    config = serving.config
    tokenizer = serving.engine.tokenizer
    reasoning_name = serving.reasoning_format()
    reasoning_parser = reasoning.make_parser(reasoning_name, prompt.text or "") if reasoning_name else None
    choice = request.effective_tool_choice
    tool_parser: tool_parsers.ToolParser | None = None
    parser_name = None
    native = None
    if request.forces_tool_call:
        native = _native_forced_calls(serving, request)
    if native is not None:
        tool_parser = native[0]
    elif isinstance(choice, NamedToolChoice):
        tool_parser = tool_parsers.NamedFunctionParser(choice.function.name)
    elif choice == "required":
        tool_parser = tool_parsers.RequiredParser()
    elif choice == "auto" and request.tools:
        parser_name = serving.tool_format() if config.enable_auto_tool_choice else None
        if parser_name is None:
            raise OpenAIError(
                "tool_choice \"auto\" needs a tool-call parser, and "
                + ("ENABLE_AUTO_TOOL_CHOICE is false" if not config.enable_auto_tool_choice else
                   "this model's chat template has no tool-call format the worker recognises (set "
                   "TOOL_CALL_PARSER)")
                + "; tool_choice \"required\" or a named function works on any model, and \"none\" "
                  "passes the tools to the template only", param="tool_choice")
        tool_parser = tool_parsers.PARSERS[parser_name](_call_schemas(request))
    constraint = ((native[1] if native is not None else forced_tool_constraint(request))
                  or strict_tools_constraint(request, tool_parser, parser_name, tokenizer)
                  or request.constraint())
    grammar = None
    if constraint is not None:
        gate = _answer_gate(tokenizer, reasoning_parser) if reasoning_parser is not None and not (
            native is not None and native[0].forced_from_start) else None
        grammar = await serving.grammars.compile(tokenizer, constraint, gate)
    special = any(p is not None and p.needs_special_tokens for p in (reasoning_parser, tool_parser))
    return ChatPlan(grammar, reasoning_parser, tool_parser, 1 if request.parallel_tool_calls is False else None,
                    special, calls_finish=not isinstance(choice, NamedToolChoice))


def _native_forced_calls(serving: OpenAIServing, request: ChatCompletionRequest
                         ) -> tuple[tool_parsers.ToolParser, Constraint] | None:
    """tool_choice "required" or a named function, in the model's own call format (the one it was trained to
    write) when the worker knows it and can write the tools' schemas in it: the family's parser and the grammar.
    None: the calls are forced in the JSON form any model can write."""
    name = serving.tool_format()
    if name is None or name not in tool_parsers.PARSERS:
        return None
    schemas = _call_schemas(request)
    choice = request.tool_choice
    named = isinstance(choice, NamedToolChoice)
    forced = [s for s in schemas if s.name == choice.function.name] if named else schemas
    parser = tool_parsers.PARSERS[name](schemas)
    grammar = parser.forced_grammar(forced, single=named or request.parallel_tool_calls is False,
                                    specials=serving.engine.tokenizer.special_tokens())
    return (parser, Constraint("grammar", grammar, "tools")) if grammar is not None else None


def _call_schemas(request: ChatCompletionRequest) -> list[tool_parsers.CallSchema]:
    return [tool_parsers.CallSchema(t.function.name, tool_schema(t.function.parameters)) for t in request.tools or ()]


def _answer_gate(tokenizer, parser: reasoning.ReasoningParser) -> AnswerGate:
    """Where the constrained answer starts: after the thinking the reasoning parser recognises."""
    opener, closer, inside = parser.answer_gate()
    return AnswerGate(closer=tuple(tokenizer.encode(closer, add_special_tokens=False)),
                      opener=tokenizer.token_id(opener) if opener else None, inside=inside)
