"""`/v1/chat/completions`: a conversation rendered with the chat template, generated under the grammar its tools
and response format ask for, and the reply taken apart (thinking, tool calls, content) into a chat completion
or a stream of chunks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from engine import SamplingParams, TokenLogprob
from engine.structured import AnswerGate, GrammarSpec

from .. import reasoning, tool_parsers
from ..chat_output import ChatOutputParser
from ..errors import OpenAIError
from ..protocol import UsageInfo, random_id
from ..serving import Choice, OpenAIServing, Prompt, accumulate
from ..streaming import StreamChunks
from ..structured import forced_tool_constraint, strict_tools_constraint
from .protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage, DeltaMessage,
                       NamedToolChoice)
from .render import render_chat


class ChatServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionStreamResponse]:
        await self.serving.ready()
        self.serving.check_model(request.model)
        self.serving.check_generation(request, "chat completions", 1)
        prompt = await render_chat(self.serving, request)
        plan = await self._plan(request, prompt)
        (params,) = self.serving.sampling_params(request, [len(prompt.token_ids)], plan.grammar,
                                                 plan.with_special_tokens)
        response_id = random_id("chatcmpl")
        if request.stream:
            return self._stream(request, response_id, prompt, params, plan)
        return await self._full(request, response_id, prompt, params, plan)

    async def _plan(self, request: ChatCompletionRequest, prompt: Prompt) -> "ChatPlan":
        """How the reply is generated and read: its grammar, and the reasoning and tool-call parsers."""
        template = self.serving.engine.tokenizer.chat_template
        reasoning_name = reasoning.parser_name_for(self.serving.config.reasoning_parser, template)
        reasoning_parser = reasoning.make_parser(reasoning_name, prompt.text or "") if reasoning_name else None
        choice = request.effective_tool_choice
        tool_parser: tool_parsers.ToolParser | None = None
        parser_name = None
        if isinstance(choice, NamedToolChoice):
            tool_parser = tool_parsers.NamedFunctionParser(choice.function.name)
        elif choice == "required":
            tool_parser = tool_parsers.RequiredParser()
        elif choice == "auto" and request.tools:
            parser_name = (tool_parsers.parser_name_for(self.serving.config.tool_call_parser, template)
                           if self.serving.config.enable_auto_tool_choice else None)
            if parser_name is None:
                raise OpenAIError(
                    "tool_choice \"auto\" needs a tool-call parser, and "
                    + ("ENABLE_AUTO_TOOL_CHOICE is false" if not self.serving.config.enable_auto_tool_choice else
                       "this model's chat template has no tool-call format the worker recognises (set "
                       "TOOL_CALL_PARSER)")
                    + "; tool_choice \"required\" or a named function works on any model, and \"none\" "
                      "passes the tools to the template only", param="tool_choice")
            tool_parser = tool_parsers.PARSERS[parser_name]()
        constraint = (forced_tool_constraint(request)
                      or strict_tools_constraint(request, tool_parser, parser_name, self.serving.engine.tokenizer)
                      or request.constraint())
        grammar = None
        if constraint is not None:
            gate = self._answer_gate(reasoning_parser) if reasoning_parser is not None else None
            grammar = await self.serving.grammars.compile(self.serving.engine.tokenizer, constraint, gate)
        special = any(p is not None and p.needs_special_tokens for p in (reasoning_parser, tool_parser))
        return ChatPlan(grammar, reasoning_parser, tool_parser, 1 if request.parallel_tool_calls is False else None,
                        special, calls_finish=not isinstance(choice, NamedToolChoice))

    def _answer_gate(self, parser: reasoning.ReasoningParser) -> AnswerGate:
        tokenizer = self.serving.engine.tokenizer
        opener, closer, inside = parser.answer_gate()
        return AnswerGate(closer=tuple(tokenizer.encode(closer, add_special_tokens=False)),
                          opener=tokenizer.token_id(opener) if opener else None, inside=inside)

    def _response_role(self, request: ChatCompletionRequest) -> str:
        """Without a generation prompt the model continues the last message, so the reply keeps its role (vLLM)."""
        return self.serving.config.response_role if request.add_generation_prompt else request.messages[-1].role

    def _echo_prefix(self, request: ChatCompletionRequest) -> str:
        """echo repeats the last message only when the reply continues it (same role), as vLLM does."""
        last = request.messages[-1]
        if not request.echo or last.content is None or last.role != self._response_role(request):
            return ""
        return last.text

    def _logprobs(self, entries: list[TokenLogprob], top_n: int) -> ChatChoiceLogprobs:
        return ChatChoiceLogprobs(content=self.serving.token_logprobs(entries, top_n))

    async def _full(self, request, response_id: str, prompt: Prompt, params: SamplingParams,
                    plan: "ChatPlan") -> ChatCompletionResponse:
        choices: dict[int, Choice] = {}
        async for output in self.serving.run(response_id, prompt, params):
            accumulate(choices, output)
        echo = self._echo_prefix(request)
        result = []
        for index in sorted(choices):
            c = choices[index]
            parsed = plan.parser().parse(c.text)
            content = echo + parsed.content if parsed.content is not None else (echo or None)
            message = ChatResponseMessage(role=self._response_role(request), content=content,
                                          reasoning_content=parsed.reasoning, reasoning=parsed.reasoning,
                                          tool_calls=parsed.tool_calls)
            result.append(ChatCompletionChoice(
                index=index, message=message,
                logprobs=self._logprobs(c.logprobs, params.logprobs) if params.logprobs is not None else None,
                finish_reason=_tool_finish(c.finish_reason, plan.calls_finish and bool(parsed.tool_calls)),
                stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return ChatCompletionResponse(id=response_id, model=self.serving.served_model_name, choices=result,
                                      usage=UsageInfo.of(len(prompt.token_ids), completion_tokens))

    async def _stream(self, request, response_id: str, prompt: Prompt, params: SamplingParams,
                      plan: "ChatPlan") -> AsyncIterator[ChatCompletionStreamResponse]:
        chunks = StreamChunks(ChatCompletionStreamResponse, response_id, self.serving.served_model_name, request,
                              len(prompt.token_ids))
        generated = 0
        echo = self._echo_prefix(request)
        role = self._response_role(request)
        for index in range(params.n):
            yield chunks.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(
                role=role, content=""), logprobs=None, finish_reason=None)], 0)
        if echo:  # the echoed message follows the role chunks, in chunks of its own (vLLM's order)
            for index in range(params.n):
                yield chunks.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=echo))], 0)
        parsers: dict[int, ChatOutputParser] = {}
        async for output in self.serving.run(response_id, prompt, params):
            choices = []
            for delta in output.deltas:
                generated += len(delta.token_ids)
                parser = parsers.setdefault(delta.index, plan.parser())
                piece = parser.feed(delta.text, final=delta.finish_reason is not None)
                logprobs = None
                if params.logprobs is not None and delta.logprobs:
                    logprobs = self._logprobs(delta.logprobs, params.logprobs)
                if not piece and logprobs is None and delta.finish_reason is None:
                    continue
                fields: dict[str, Any] = {}
                if piece.reasoning:
                    fields.update(reasoning_content=piece.reasoning, reasoning=piece.reasoning)
                if piece.content:
                    fields["content"] = piece.content
                if piece.tool_calls:
                    fields["tool_calls"] = piece.tool_calls
                choices.append(ChatCompletionStreamChoice(
                    index=delta.index, delta=DeltaMessage(**fields), logprobs=logprobs,
                    finish_reason=_tool_finish(delta.finish_reason, plan.calls_finish and parser.called_tools),
                    stop_reason=delta.stop_reason))
            if choices:
                yield chunks.chunk(choices, generated)
        if (last := chunks.usage(generated)) is not None:
            yield last


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


def _tool_finish(reason: str | None, called: bool) -> str | None:
    """A reply that ends in tool calls finishes with "tool_calls" (a cut-off one keeps "length")."""
    return "tool_calls" if called and reason == "stop" else reason
