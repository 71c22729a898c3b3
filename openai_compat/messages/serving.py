"""`/v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API on the chat path.

A request becomes the chat request it stands for (convert.py) and runs through `ChatServing.generate`, so the
prompt, sampling, grammars, tool-call and reasoning parsers are chat's. The reply's pieces become content
blocks as they come: thinking, text, and one tool_use block per call, each opened, filled and closed in the
order the model wrote them. The stream's events are read off that as it happens; the non-streamed message is
the same blocks once the reply is done, so a client that accumulates the stream gets exactly the message a
non-streamed request returns.
"""
from __future__ import annotations

from typing import AsyncIterator

from pydantic_core import from_json

from ..chat.generation import ChatGeneration, ChoiceDelta
from ..chat.render import render_chat
from ..chat.serving import ChatServing
from ..chat.protocol import DeltaToolCall
from ..errors import OpenAIError
from ..protocol import random_id
from .convert import Thinking, chat_request, image_paths
from .protocol import (ContentBlockDeltaEvent, ContentBlockStartEvent, ContentBlockStopEvent, CountTokensRequest,
                       CountTokensResponse, InputJSONDelta, Message, MessageDeltaEvent, MessagesRequest,
                       MessageStartEvent, MessageStopEvent, OutputUsage, StopInfo, StreamEvent, TextContent,
                       TextDelta, ThinkingContent, ThinkingDelta, ToolUseContent, Usage)

ENDPOINT = "Anthropic messages"


class MessagesServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat
        self.serving = chat.serving

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens, rendered exactly as /v1/messages renders it."""
        await self.serving.ready_for(request.model)
        _check_images(self.serving, request)
        prompt = await render_chat(self.serving, chat_request(request, Thinking.of(self.serving)),
                                   image_paths=image_paths(request), count_only=True)
        return CountTokensResponse(input_tokens=len(prompt.token_ids))

    async def create_message(self, request: MessagesRequest) -> Message | AsyncIterator[StreamEvent]:
        await self.serving.ready_for(request.model)
        _check_images(self.serving, request)
        chat = chat_request(request, Thinking.of(self.serving))
        try:
            generation = await self.chat.generate(chat, endpoint=ENDPOINT, id_prefix="msg",
                                                  image_paths=image_paths(request))
        except OpenAIError as exc:
            raise _in_messages_terms(exc) from None
        omit = request.thinking is not None and request.thinking.display == "omitted"
        reply = Reply(self.serving.served_model_name, generation, omit_thinking=omit)
        if request.stream:
            return reply.events()
        async for _ in reply.events():
            pass
        return reply.message()


def _check_images(serving, request) -> None:
    """Image blocks need a vision model: for a text model the 400 names the block's type, as for the other
    media blocks."""
    paths = image_paths(request)
    if paths and serving.engine.vision is None:
        raise OpenAIError("image blocks are not supported: the served model reads text only",
                          param=f"{paths[0]}.type")


def _in_messages_terms(exc: OpenAIError) -> OpenAIError:
    """A chat-path refusal, naming the Messages request's fields rather than the chat request's."""
    if exc.param == "tool_choice":  # auto without a tool-call parser for this model
        return OpenAIError('tool_choice {"type": "auto"} (the default when tools are given) needs a tool-call '
                           "parser for the served model: its chat template has no format the worker recognises "
                           '(set TOOL_CALL_PARSER), or ENABLE_AUTO_TOOL_CHOICE is false; {"type": "any"} and '
                           '{"type": "tool"} work on any model (their calls are generated under a grammar), and '
                           '{"type": "none"} only shows the tools to the model', param="tool_choice")
    if exc.param is not None and exc.param.startswith("tools[") and ".function." in exc.param:
        param = exc.param.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        return OpenAIError(exc.message.replace(exc.param, param), exc.status, param, exc.type)
    return exc


def _tool_input(arguments: str) -> dict:
    """A call's input from its arguments text; a call cut off by max_tokens keeps what was complete (as the
    `anthropic` SDK reads a stream's partial JSON)."""
    if not arguments.strip():
        return {}
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class Reply:
    """One reply's content blocks, built from the generation's deltas as they come. At most one block is open
    at a time: a piece of another kind (thinking, text, a new call) closes it and opens the next."""

    def __init__(self, model: str, generation: ChatGeneration, omit_thinking: bool = False):
        self.model = model
        self.generation = generation
        self.id = "msg_" + generation.request_id.removeprefix("msg-")
        self.omit_thinking = omit_thinking
        self.blocks: list[TextContent | ThinkingContent | ToolUseContent] = []
        self._open: object = None  # "thinking", "text", or the chat index of the call whose block is open
        self._arguments: dict[int, str] = {}  # block index -> a tool_use block's arguments text so far
        self._call_block: dict[int, int] = {}  # chat call index -> its block index
        self.stop = StopInfo(stop_reason="end_turn")

    def message(self) -> Message:
        content = [ToolUseContent(id=b.id, name=b.name, input=_tool_input(self._arguments[i]))
                   if isinstance(b, ToolUseContent) else b for i, b in enumerate(self.blocks)]
        return Message(id=self.id, model=self.model, content=content, stop_reason=self.stop.stop_reason,
                       stop_sequence=self.stop.stop_sequence, usage=self._usage())

    def _usage(self) -> Usage:
        return Usage(input_tokens=self.generation.prompt_tokens, output_tokens=self.generation.completion_tokens)

    async def events(self) -> AsyncIterator[StreamEvent]:
        yield MessageStartEvent(message=Message(id=self.id, model=self.model, content=[], stop_reason=None,
                                                usage=Usage(input_tokens=self.generation.prompt_tokens,
                                                            output_tokens=0)))
        async for step in self.generation.stream():
            for delta in step:
                for event in self._feed(delta):
                    yield event
        yield MessageDeltaEvent(delta=self.stop, usage=OutputUsage(output_tokens=self.generation.completion_tokens))
        yield MessageStopEvent()

    def _feed(self, delta: ChoiceDelta) -> list[StreamEvent]:
        piece = delta.delta
        events: list[StreamEvent] = []
        if piece.reasoning:
            events += self._switch_to("thinking", lambda: ThinkingContent(thinking=""))
            if not self.omit_thinking:
                self.blocks[-1].thinking += piece.reasoning
                events.append(ContentBlockDeltaEvent(index=len(self.blocks) - 1,
                                                     delta=ThinkingDelta(thinking=piece.reasoning)))
        if piece.content:
            events += self._switch_to("text", lambda: TextContent(text=""))
            self.blocks[-1].text += piece.content
            events.append(ContentBlockDeltaEvent(index=len(self.blocks) - 1, delta=TextDelta(text=piece.content)))
        for call in piece.tool_calls:
            events += self._call(call)
        if delta.finish_reason is not None:
            events += self._close()
            self.stop = self._stop_info(delta)
        return events

    def _switch_to(self, kind: object, make) -> list[StreamEvent]:
        """Open a block of `kind` unless one is open; the open block of another kind closes first."""
        if self._open == kind:
            return []
        events = self._close()
        self.blocks.append(make())
        self._open = kind
        return events + [ContentBlockStartEvent(index=len(self.blocks) - 1, content_block=make())]

    def _call(self, call: DeltaToolCall) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        function = call.function
        if call.index not in self._call_block:  # a call's first piece has its name
            events += self._close()
            # Anthropic's spelling of a generated id; an id in a form the model's template needs back (Mistral's,
            # Kimi's) is kept, since the client returns it with the tool's result.
            own = call.id and not call.id.startswith("chatcmpl-tool-")
            block = ToolUseContent(id=call.id if own else random_id("toolu").replace("-", "_"), input={},
                                   name=function.name if function is not None and function.name else "")
            self.blocks.append(block)
            self._open = call.index
            self._call_block[call.index] = index = len(self.blocks) - 1
            self._arguments[index] = ""  # the block's input stays {} until the message is made
            events.append(ContentBlockStartEvent(index=index, content_block=block))
        index = self._call_block[call.index]
        arguments = function.arguments if function is not None else None
        if arguments:
            self._arguments[index] += arguments
            events.append(ContentBlockDeltaEvent(index=index, delta=InputJSONDelta(partial_json=arguments)))
        return events

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        self._open = None
        return [ContentBlockStopEvent(index=len(self.blocks) - 1)]

    def _stop_info(self, delta: ChoiceDelta) -> StopInfo:
        if delta.finish_reason == "length":
            return StopInfo(stop_reason="max_tokens")
        if self._call_block:
            return StopInfo(stop_reason="tool_use")
        if isinstance(delta.stop_reason, str):  # the stop sequence that ended the reply
            return StopInfo(stop_reason="stop_sequence", stop_sequence=delta.stop_reason)
        return StopInfo(stop_reason="end_turn")
