"""A scan's calls as OpenAI `tool_calls`: whole, or as the deltas of a stream."""
from __future__ import annotations

from ..chat.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCallOut
from ..output_scan import Scan
from .base import ToolParser


def tool_calls_of(scan: Scan, parser: ToolParser) -> list[ToolCallOut]:
    return [ToolCallOut(id=parser.call_id(i, c), function=FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in enumerate(scan.calls)]


def final_content(scan: Scan) -> str | None:
    """Content next to tool calls is kept only when it is more than whitespace."""
    return scan.content if scan.content.strip() else None


class ToolCallStream:
    """Turns successive scans of a growing output into OpenAI stream deltas: content as it comes (once it is
    more than whitespace), each call's id, type and name once its name is complete, then its arguments in
    pieces. `max_calls` (1 when parallel_tool_calls is false) drops calls past the first."""

    def __init__(self, parser: ToolParser | None, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    def deltas(self, scan: Scan) -> tuple[str, list[DeltaToolCall]]:
        content = ""
        if scan.content.strip() and len(scan.content) > self.content_sent:
            content = scan.content[self.content_sent:]
            self.content_sent = len(scan.content)
        pieces: list[DeltaToolCall] = []
        calls = scan.calls if self.max_calls is None else scan.calls[:self.max_calls]
        for index, call in enumerate(calls):
            if call.name is None:
                break
            new = call.arguments[self._args_sent[index]:] if index < len(self._ids) else call.arguments
            if index == len(self._ids):  # the call's first piece carries its id, type and name
                self._ids.append(self.parser.call_id(index, call))
                self._args_sent.append(len(call.arguments))
                pieces.append(DeltaToolCall(index=index, id=self._ids[index], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=new)))
            elif new:
                self._args_sent[index] = len(call.arguments)
                pieces.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=new)))
        return content, pieces

    @property
    def called(self) -> bool:
        return bool(self._ids)
