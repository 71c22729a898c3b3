"""Request and response bodies of Anthropic's Messages API: `/v1/messages` (a message, or its stream events)
and `/v1/messages/count_tokens`.

Requests are validated here, before anything runs, and every problem is a 400 naming the field
(`messages[1].content[0].tool_use_id`, `tools[0].type`, ...). Content blocks and tools of every Anthropic type
parse far enough for the 400 to say why this worker cannot take them (images and documents: the model reads
text; server tools: the worker runs none). Fields that change nothing here (`metadata`, `service_tier`,
`cache_control`) are accepted; any other field the models below do not name is a 400, never silently dropped.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..errors import context_exceeded
from ..protocol import ParamError, RequestLimits, limits_of
from ..sampling import MAX_STOP_STRINGS

# Anthropic's limits on thinking: the budget is at least this, and less than max_tokens.
MIN_THINKING_BUDGET = 1024

# What each content block type may carry (besides `type`), and what it must.
BLOCK_FIELDS = {
    "text": {"text", "cache_control", "citations"},
    "tool_use": {"id", "name", "input", "cache_control", "caller", "toolset_name"},
    "tool_result": {"tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"thinking", "signature"},
    "redacted_thinking": {"data"},
    "image": {"source", "cache_control"},
}
REQUIRED_BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                         "thinking": ("thinking",), "redacted_thinking": ("data",), "image": ("source",)}
# Which blocks each role's messages may hold.
ROLE_BLOCKS = {"user": ("text", "tool_result", "image"), "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
               "system": ("text",)}
MEDIA_BLOCKS = frozenset({"image", "document", "search_result", "container_upload"})
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _text_chars(value: Any) -> int:
    """Characters of a text or of a list of text blocks (raw JSON)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(len(b["text"]) for b in value if isinstance(b, dict) and isinstance(b.get("text"), str))
    return 0


def check_conversation_size(messages: Any, limits: RequestLimits | None) -> None:
    """Raw `messages` that could not fit the context whatever the template (as chat's check_messages_size):
    every message, tool call and tool result renders to at least one token, and text to at least one token per
    `max_token_chars` characters (each block's joining newline counted). A walk over the raw JSON, stopping
    once over, so a huge conversation is refused before a model is built for each of its blocks."""
    if limits is None or not isinstance(messages, list):
        return
    max_chars = limits.context_tokens * limits.max_token_chars
    turns, chars = len(messages), 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        chars += _text_chars(content)
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict):
                turns += block.get("type") in ("tool_use", "tool_result")
                chars += 1 + (_text_chars(block.get("content")) if block.get("type") == "tool_result" else 0)
        if turns > limits.context_tokens or chars > max_chars:
            break
    if turns > limits.context_tokens:
        raise ValueError(context_exceeded(limits.context_tokens, f"there are at least {turns} messages, tool calls "
                                          f"and tool results, and each takes at least one token",
                                          "the number of messages"))
    if chars > max_chars:
        raise ValueError(context_exceeded(
            limits.context_tokens, f"the messages have at least {chars} characters of text, which is more than "
            f"{limits.context_tokens} tokens for this model's tokenizer (no token spans more than "
            f"{limits.max_token_chars} characters)", "the length of the messages"))


def _unsupported_block(kind: str) -> str:
    if kind in MEDIA_BLOCKS:
        return f"{kind} blocks are not supported: the served model reads text only"
    if kind.endswith(("tool_result", "tool_use")):
        return f"{kind} blocks are not supported: this worker runs none of Anthropic's server tools"
    return (f"unknown content block type {kind!r}; this worker takes text, tool_use, tool_result, thinking and "
            f"redacted_thinking blocks")


def _check_block_type(value: Any, supported) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind not in supported:
        raise ParamError("type", _unsupported_block(kind))
    return value


class TextBlock(BaseModel):
    """A text block: of `system`, of a message, or of a tool result's content."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # a caching hint: the engine caches prompt prefixes by itself
    citations: list[dict[str, Any]] | None = None  # what earlier replies cited; not part of the prompt

    @model_validator(mode="before")
    @classmethod
    def _type(cls, value):
        return _check_block_type(value, ("text",))


class ContentBlock(BaseModel):
    """One block of a message's content. One model rather than a union, so a validation error names the field
    (`messages[0].content[2].input`) rather than every union member that failed."""
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None
    source: dict[str, Any] | None = None  # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}

    @model_validator(mode="before")
    @classmethod
    def _type(cls, value):
        return _check_block_type(value, BLOCK_FIELDS)

    @property
    def image_url(self) -> str:
        """An image block's source as the URL chat's image part takes (a data: URL for base64 data)."""
        if self.source["type"] == "url":
            return self.source["url"]
        return f"data:{self.source['media_type']};base64,{self.source['data']}"

    @model_validator(mode="after")
    def _fields(self) -> "ContentBlock":
        given = set(self.model_fields_set) | set(self.model_extra or {})
        unknown = sorted(given - BLOCK_FIELDS[self.type] - {"type"})
        if unknown:
            raise ParamError(unknown[0], f"a {self.type} block has no field(s) {', '.join(unknown)}")
        for name in REQUIRED_BLOCK_FIELDS[self.type]:
            if getattr(self, name) is None:
                raise ParamError(name, f"a {self.type} block needs {name}")
        extra = self.model_extra or {}
        # Fields of the SDK's own reply blocks, sent back as dumped: a direct call (or none) is what this worker
        # makes; a server tool's call or an MCP toolset's tool cannot have come from it.
        if extra.get("caller") not in (None, {"type": "direct"}):
            raise ParamError("caller", "only a direct caller ({\"type\": \"direct\"}) is supported: server tools "
                                       "and their callers do not exist here")
        if extra.get("toolset_name") is not None:
            raise ParamError("toolset_name", "MCP toolsets are not supported, so a tool_use block cannot name one")
        if self.type == "image":
            _check_image_source(self.source)
        return self

    @property
    def result_text(self) -> str:
        """A tool_result's content as one string (text blocks joined by newlines)."""
        if isinstance(self.content, list):
            return "\n".join(block.text for block in self.content)
        return self.content or ""


def _check_image_source(source: dict[str, Any]) -> None:
    kind = source.get("type")
    fields = {"base64": {"type", "media_type", "data"}, "url": {"type", "url"}}.get(kind)
    if fields is None:
        raise ParamError("source.type", "an image source is base64 (media_type and data) or url (url); file "
                                        "sources are not supported (there is no Files API here)")
    unknown = sorted(set(source) - fields)
    if unknown:
        raise ParamError(f"source.{unknown[0]}", f"a {kind} image source has no field {unknown[0]}")
    for name in sorted(fields - {"type"}):
        if not isinstance(source.get(name), str) or not source[name]:
            raise ParamError(f"source.{name}", f"a {kind} image source needs {name} as a string")
    if kind == "base64" and source["media_type"] not in IMAGE_MEDIA_TYPES:
        raise ParamError("source.media_type", f"media_type must be one of {', '.join(IMAGE_MEDIA_TYPES)}")


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    @model_validator(mode="after")
    def _blocks_of_role(self) -> "InputMessage":
        allowed = ROLE_BLOCKS[self.role]
        for j, block in enumerate(self.content if isinstance(self.content, list) else ()):
            if block.type not in allowed:
                where = "user" if block.type == "tool_result" else "assistant"
                raise ParamError(f"content[{j}].type", f"{block.type} blocks belong in {where} messages, not in "
                                                       f"{self.role} messages")
        return self


class Tool(BaseModel):
    """A custom tool: the model calls it with `input` matching `input_schema`."""
    model_config = ConfigDict(extra="allow")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # true: every call is generated under input_schema
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, value):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "function":
            raise ParamError("type", "tools take Anthropic's shape here: name, description and input_schema at "
                                     "the top level, not OpenAI's function object")
        if isinstance(kind, str) and kind != "custom":
            raise ParamError("type", f"tool type {kind!r} is not supported: this worker provides none of "
                                     f"Anthropic's server tools (web search, web fetch, code execution, ...) or "
                                     f"schema-less client tools (bash, text editor, computer use, ...); define a "
                                     f"custom tool with name, description and input_schema")
        return value

    @model_validator(mode="after")
    def _schema(self) -> "Tool":
        unknown = sorted(self.model_extra or {})
        if unknown:
            raise ParamError(unknown[0], f"unsupported tool field(s): {', '.join(unknown)}")
        if self.input_schema.get("type") != "object":
            raise ParamError("input_schema.type", 'input_schema must be a JSON schema of "type": "object"')
        return self


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ParamError("name", 'tool_choice of type "tool" needs the tool\'s name' if self.type == "tool"
                             else f'tool_choice of type "{self.type}" takes no name')
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ParamError("disable_parallel_tool_use", 'tool_choice of type "none" takes no '
                                                          'disable_parallel_tool_use')
        return self


class ThinkingConfig(BaseModel):
    """`enabled` turns the model's thinking on (with a budget), `disabled` off, `adaptive` leaves it to the model
    (its chat template's default)."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks come back empty

    @model_validator(mode="after")
    def _budget(self) -> "ThinkingConfig":
        if self.type == "enabled":
            if self.budget_tokens is None:
                raise ParamError("budget_tokens", 'thinking of type "enabled" needs budget_tokens')
            if self.budget_tokens < MIN_THINKING_BUDGET:
                raise ParamError("budget_tokens", f"budget_tokens must be at least {MIN_THINKING_BUDGET}")
        elif self.budget_tokens is not None:
            raise ParamError("budget_tokens", f'thinking of type "{self.type}" takes no budget_tokens')
        if self.type == "disabled" and self.display is not None:
            raise ParamError("display", 'thinking of type "disabled" takes no display')
        return self


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: str | None = None  # an opaque id for abuse detection: nothing to do with it here


class AnthropicRequest(BaseModel):
    """What both routes take: the conversation (system, messages, tools) as the model will see it."""
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: dict[str, Any] | None = None  # a caching hint: the engine caches prompt prefixes by itself

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_size(cls, value, info: ValidationInfo):
        check_conversation_size(value, limits_of(info))
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "AnthropicRequest":
        unknown = sorted(self.model_extra or {})
        if unknown:
            raise ParamError(unknown[0], f"unsupported parameter(s): {', '.join(unknown)}")
        names = [tool.name for tool in self.tools or ()]
        if len(set(names)) < len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise ParamError(f"tools[{names.index(duplicate, names.index(duplicate) + 1)}].name",
                             f"tool names must be unique; {duplicate!r} appears twice")
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ParamError("tool_choice", f'tool_choice of type "{choice.type}" needs tools')
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ParamError("tool_choice.name", f"tool_choice names tool {choice.name!r}, which is not among the "
                                                 f"tools")
        last = self.messages[-1]
        if last.role == "assistant" and isinstance(last.content, list) and any(
                block.type == "tool_use" for block in last.content):
            raise ParamError(f"messages[{len(self.messages) - 1}]", "the conversation ends in tool_use blocks; "
                             "send their results in a user message of tool_result blocks")
        return self


class MessagesRequest(AnthropicRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)  # 0: off
    stream: bool = False
    metadata: Metadata | None = None
    # One tier here: both values get it, so neither changes anything.
    service_tier: Literal["auto", "standard_only"] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value):
        if value is not None and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        if value is not None and any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty")
        return value

    @model_validator(mode="after")
    def _budget_within_max_tokens(self) -> "MessagesRequest":
        thinking = self.thinking
        if thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens >= self.max_tokens:
            raise ParamError("thinking.budget_tokens", f"budget_tokens ({thinking.budget_tokens}) must be less than "
                                                       f"max_tokens ({self.max_tokens})")
        return self


class CountTokensRequest(AnthropicRequest):
    pass


# ---------------------------------------------------------------- responses


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic signs its models' thinking; nothing here verifies one, so none is made


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


OutputBlock = TextContent | ThinkingContent | ToolUseContent
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutputBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


# ---------------------------------------------------------------- stream events


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJSONDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputBlock


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJSONDelta


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopInfo(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class OutputUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopInfo
    usage: OutputUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (MessageStartEvent | ContentBlockStartEvent | ContentBlockDeltaEvent | ContentBlockStopEvent
               | MessageDeltaEvent | MessageStopEvent)
