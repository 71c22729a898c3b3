"""One chat choice's output taken apart: thinking (reasoning parser), then tool calls and content (tool
parser) in the answer. The same scans serve whole responses and streams, so a stream's deltas add up to the
whole response."""
from __future__ import annotations

from dataclasses import dataclass, field

from .chat.protocol import DeltaToolCall, ToolCallOut
from .reasoning import ReasoningParser, Split
from .tool_parsers import ToolCallStream, ToolParser, final_content, tool_calls_of


@dataclass
class ParsedMessage:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = field(default_factory=list)


@dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, max_calls: int | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls
        self.text = ""
        self._reasoning_sent = 0
        self._content_sent = 0
        self._stream = ToolCallStream(tools, max_calls)

    def _split(self, text: str, final: bool) -> Split:
        return self.reasoning.split(text, final) if self.reasoning is not None else Split(None, text)

    def parse(self, text: str) -> ParsedMessage:
        """A whole output."""
        split = self._split(text, True)
        if self.tools is None:
            return ParsedMessage(split.content, split.reasoning)
        scan = self.tools.scan(split.content, True)
        calls = tool_calls_of(scan, self.tools)
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        return ParsedMessage(final_content(scan), split.reasoning, calls)

    def feed(self, delta: str, final: bool) -> MessageDelta:
        """The next piece of a stream, given the text generated since the last call."""
        self.text += delta
        split = self._split(self.text, final)
        out = MessageDelta()
        if split.reasoning and len(split.reasoning) > self._reasoning_sent:
            out.reasoning = split.reasoning[self._reasoning_sent:]
            self._reasoning_sent = len(split.reasoning)
        if self.tools is None:
            if len(split.content) > self._content_sent:
                out.content = split.content[self._content_sent:]
                self._content_sent = len(split.content)
            return out
        out.content, out.tool_calls = self._stream.deltas(self.tools.scan(split.content, final))
        return out

    @property
    def called_tools(self) -> bool:
        return self._stream.called
