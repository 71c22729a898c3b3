"""Tool-call parsers: find the tool calls a model wrote in its own format and turn them into OpenAI
`tool_calls`, for whole outputs and for streams.

Every parser scans the output text so far and reports the content around the calls and each call's name and
arguments; while streaming, text that may be the start of a call marker is held back. `formats.FORMATS` lists
every format under vLLM's TOOL_CALL_PARSER names; with the setting unset, `recognition.recognise` finds the one
the chat template writes.
"""
from .base import CallSchema, ToolParser
from .formats import FORMATS, PARSERS
from .json_formats import (HarmonyToolParser, HermesParser, Llama3JsonParser, MistralParser, NamedFunctionParser,
                           PythonicParser, RequiredParser)
from .recognition import recognise
from .stream import ToolCallStream, final_content, tool_calls_of

__all__ = ["CallSchema", "ToolParser", "FORMATS", "PARSERS", "HarmonyToolParser", "HermesParser",
           "Llama3JsonParser", "MistralParser", "NamedFunctionParser", "PythonicParser", "RequiredParser",
           "recognise", "ToolCallStream", "final_content", "tool_calls_of"]
