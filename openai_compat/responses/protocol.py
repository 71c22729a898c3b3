"""Request, response and stream-event bodies of the Responses API (`/v1/responses`).

The request is checked here as far as it can be without the model: every input item and tool on its own (errors
name the path, `input[2].call_id`, `tools[0].type`), built-in tools and unknown item types refused by name, and any
parameter the worker cannot honour refused rather than ignored. serving.py maps what remains onto a chat request.
Response objects and events have the fields the official `openai` client's types require.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from ..errors import context_exceeded
from ..protocol import ChatTokenLogprob, ParamError, StructuredOutputs, limits_of
from ..validation import explain

# Parameters OpenAI defines that change nothing for a self-hosted model: accepted and ignored.
IGNORED_FIELDS = frozenset({"service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"})

# OpenAI's built-in tools, run on OpenAI's side; this worker has none of them.
BUILTIN_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "computer", "computer_use", "computer_use_preview", "mcp", "image_generation", "local_shell",
    "shell", "apply_patch", "custom", "tool_search", "namespace",
})
# Input items that only built-in tools (or server-side state) produce.
UNSERVED_ITEMS = frozenset({
    "web_search_call", "file_search_call", "computer_call", "computer_call_output", "code_interpreter_call",
    "image_generation_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
    "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "custom_tool_call",
    "custom_tool_call_output", "apply_patch_call", "apply_patch_call_output", "tool_search_call",
    "tool_search_output", "compaction", "additional_tools",
})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

ItemStatus = Literal["in_progress", "completed", "incomplete"]


# ---------------------------------------------------------------- input items


class ContentPart(BaseModel):
    """One part of a message's content, or of a function call's output. Media parts parse so that the 400 can
    say that this model takes text only."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["input_text", "output_text", "refusal", "input_image", "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None  # output_text (accepted, not rendered)
    logprobs: list[Any] | None = None  # output_text (accepted, not rendered)
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None
    input_audio: Any = None

    @model_validator(mode="after")
    def _text(self) -> "ContentPart":
        if self.type in ("input_file", "input_audio"):
            raise ValueError(f"content part type {self.type} is not supported: this model takes text only")
        if self.type == "input_image":  # a vision model takes it (chat's image part); a text model refuses it
            if self.file_id is not None:
                raise ParamError("file_id", "an input_image by file_id is not supported (there is no Files API "
                                            "here): send image_url, a data: or http(s) URL")
            if not isinstance(self.image_url, str) or not self.image_url:
                raise ParamError("image_url", "an input_image part needs image_url, a data: or http(s) URL")
            if self.detail not in (None, "auto", "low", "high"):
                raise ParamError("detail", "detail must be auto, low or high")
            return self
        if self.type == "refusal":
            if self.refusal is None:
                raise ParamError("refusal", "a refusal part needs a refusal string")
        elif self.text is None:
            raise ParamError("text", f"an {self.type} part needs a text string")
        return self

    @property
    def plain(self) -> str:
        return self.refusal if self.type == "refusal" else self.text


def _joined(content: str | list[ContentPart]) -> str:
    """Text parts joined by newlines, as chat joins a message's text parts."""
    return content if isinstance(content, str) else "\n".join(part.plain for part in content
                                                               if part.type != "input_image")


class MessageItem(BaseModel):
    """A message: `{"role", "content"}` (type optional) or an earlier output message."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @property
    def text(self) -> str:
        return _joined(self.content)

    @property
    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(part.type == "input_image" for part in self.content)

    def chat_parts(self) -> list[dict]:
        """The content as chat content parts, images in place (for a message with images)."""
        return [{"type": "image_url", "image_url": {"url": part.image_url, **({"detail": part.detail}
                                                                             if part.detail else {})}}
                if part.type == "input_image" else {"type": "text", "text": part.plain} for part in self.content]


class FunctionCallItem(BaseModel):
    """A call the model made earlier: becomes an assistant message's tool call."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(BaseModel):
    """What a call returned: becomes a tool message."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None

    @property
    def text(self) -> str:
        return _joined(self.output)


class SummaryText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["summary_text"]
    text: str


class ReasoningText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """Thinking from an earlier turn: goes to the next assistant message as its reasoning, which the chat
    template renders or drops as it does chat's `reasoning_content`. Encrypted content cannot be read here."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None

    @property
    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n".join(part.text for part in parts)


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]
ITEM_TYPES: dict[str, type[BaseModel]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                          "function_call_output": FunctionCallOutputItem,
                                          "reasoning": ReasoningItem}


def _checked(model: type[BaseModel], value: Any, path: tuple) -> BaseModel:
    """`value` validated as `model`; a problem is a ParamError naming its full path in the request."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        param, message = explain(exc, path)
        raise ParamError(param, message) from None


def _item(value: Any, index: int) -> BaseModel:
    where = f"input[{index}]"
    if not isinstance(value, dict):
        raise ParamError(where, f"{where} must be an input item (an object), got {type(value).__name__}")
    kind = value.get("type")
    if kind is None and "role" in value:
        kind = "message"  # OpenAI's easy input message
    if not isinstance(kind, str):
        raise ParamError(f"{where}.type", f"{where}.type must be an item type string, such as \"message\"")
    model = ITEM_TYPES.get(kind)
    if model is None:
        supported = ", ".join(ITEM_TYPES)
        if kind in UNSERVED_ITEMS:
            why = "belongs to a built-in tool this worker does not run"
        elif kind == "item_reference":
            why = "refers to an item stored by OpenAI; send the item itself, or use previous_response_id"
        else:
            why = "is not an input item type"
        raise ParamError(f"{where}.type", f"{where}.type: {ascii(kind)[:80]} {why}; supported: {supported}")
    return _checked(model, value, ("input", index))


def check_input_size(items: Any, instructions: Any, limits) -> None:
    """Input that could not fit the context whatever the template: each item takes at least one token, and its
    text at least one token per `max_token_chars` characters (chat's check on messages, for items)."""
    if limits is None:
        return
    max_chars = limits.context_tokens * limits.max_token_chars

    def over(what: str, chars: int, param: str) -> ParamError:
        return ParamError(param, context_exceeded(
            limits.context_tokens, f"{what} has {chars} characters of text, which is more than "
            f"{limits.context_tokens} tokens for this model's tokenizer (no token spans more than "
            f"{limits.max_token_chars} characters)", f"the length of the {param}"))

    chars = len(instructions) if isinstance(instructions, str) else 0
    if chars > max_chars:
        raise over("the instructions", chars, "instructions")
    if isinstance(items, str):
        chars += len(items)
    elif isinstance(items, list):
        if len(items) > limits.context_tokens:
            raise ParamError("input", context_exceeded(
                limits.context_tokens, f"the input has {len(items)} items, and each takes at least one token",
                "the number of input items"))
        for item in items:
            if chars > max_chars:
                break
            for key in ("content", "output", "arguments"):
                value = item.get(key) if isinstance(item, dict) else None
                if isinstance(value, str):
                    chars += len(value)
                elif isinstance(value, list):
                    chars += len(value) + sum(len(part["text"]) for part in value
                                              if isinstance(part, dict) and isinstance(part.get("text"), str))
    if chars > max_chars:
        raise over("the input" if not instructions else "the input with its instructions", chars, "input")


# ---------------------------------------------------------------- tools, formats, reasoning


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: enforced by a grammar, as chat enforces it; absent or false: not


def _tool(value: Any, index: int) -> FunctionTool:
    where = f"tools[{index}]"
    if not isinstance(value, dict):
        raise ParamError(where, f"{where} must be a tool (an object), got {type(value).__name__}")
    kind = value.get("type")
    if kind == "function" and "function" in value and "name" not in value:
        raise ParamError(f"{where}.function", f"{where}: a Responses function tool is flat, {{\"type\": \"function\", "
                                              f"\"name\", \"description\", \"parameters\", \"strict\"}}, not chat's "
                                              f"{{\"type\": \"function\", \"function\": {{...}}}}")
    if isinstance(kind, str) and kind != "function":
        if kind in BUILTIN_TOOLS:
            raise ParamError(f"{where}.type", f"{where}.type: {kind} is a built-in tool of OpenAI's, which this "
                                              f"worker cannot run; only function tools are supported")
        raise ParamError(f"{where}.type", f"{where}.type: {ascii(kind)[:80]} is not a tool type this worker "
                                          f"supports; only function tools (\"type\": \"function\") are")
    return _checked(FunctionTool, value, ("tools", index))


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


def _tool_choice(value: Any) -> str | ToolChoiceFunction:
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ParamError("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                            f"{{\"type\": \"function\", \"name\": ...}}, got {ascii(value)[:80]}")
        return value
    if isinstance(value, dict) and isinstance(value.get("type"), str) and value["type"] != "function":
        kind = value["type"]
        if kind in BUILTIN_TOOLS or kind.startswith(("web_search", "computer")):
            raise ParamError("tool_choice.type", f"tool_choice.type: {kind} is a built-in tool of OpenAI's, which "
                                                 f"this worker cannot run")
        raise ParamError("tool_choice.type", f"tool_choice.type: {ascii(kind)[:80]} is not supported; name a "
                                             f"function ({{\"type\": \"function\", \"name\": ...}}) or use "
                                             f"\"none\", \"auto\" or \"required\"")
    if isinstance(value, dict):
        return _checked(ToolChoiceFunction, value, ("tool_choice",))
    raise ParamError("tool_choice", f"tool_choice must be a string or an object, got {type(value).__name__}")


class TextFormat(BaseModel):
    """`text.format`: one model rather than a union, so that errors name the field."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # enforced either way: the output always matches the schema

    @model_validator(mode="after")
    def _schema(self) -> "TextFormat":
        if self.type == "json_schema":
            if self.name is None:
                raise ParamError("name", "a json_schema format needs a name")
            if self.schema_ is None:
                raise ParamError("schema", "a json_schema format needs a schema")
        else:
            for name in ("name", "description", "schema_", "strict"):
                if getattr(self, name) is not None:
                    field = name.rstrip("_")
                    raise ParamError(field, f"{field} belongs to a json_schema format, not {self.type}")
        return self

    def echo(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; no effect here


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None

    @model_validator(mode="after")
    def _no_summaries(self) -> "ReasoningConfig":
        for name in ("summary", "generate_summary"):
            if getattr(self, name) is not None:
                raise ParamError(name, f"{name}: this worker does not summarise reasoning; a reasoning model's "
                                       f"thinking comes back whole as reasoning items' content (reasoning_text)")
        return self


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None  # no obfuscation padding is sent; the option changes nothing


# ---------------------------------------------------------------- the request


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted at the value that means what this worker does; anything else is a 400.
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    # vLLM's sampling extensions, as chat takes them (their values are checked as chat checks them).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _items_and_tools(cls, data: Any, info: ValidationInfo) -> Any:
        """Each input item, tool and tool choice checked on its own, so that errors name their full path."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        items = data.get("input")
        check_input_size(items, data.get("instructions"), limits_of(info))
        if isinstance(items, list):
            data["input"] = [_item(item, i) for i, item in enumerate(items)]
        tools = data.get("tools")
        if isinstance(tools, list):
            data["tools"] = [_tool(tool, i) for i, tool in enumerate(tools)]
        if data.get("tool_choice") is not None:
            data["tool_choice"] = _tool_choice(data["tool_choice"])
        return data

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value):
        if value is not None:
            if len(value) > MAX_METADATA_PAIRS:
                raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed")
            for key, text in value.items():
                if len(key) > MAX_METADATA_KEY or len(text) > MAX_METADATA_VALUE:
                    raise ValueError(f"keys may have at most {MAX_METADATA_KEY} characters and values at most "
                                     f"{MAX_METADATA_VALUE}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "ResponsesRequest":
        unknown = sorted(set(self.model_extra or {}) - IGNORED_FIELDS)
        if unknown:
            raise ParamError(unknown[0], f"unsupported parameter(s): {', '.join(unknown)}")
        for i, value in enumerate(self.include or ()):
            if value != LOGPROBS_INCLUDE:
                raise ParamError(f"include[{i}]", f"include[{i}]: {ascii(value)[:80]} cannot be included by this "
                                                  f"worker; it can include {LOGPROBS_INCLUDE}")
        if self.truncation == "auto":
            raise ParamError("truncation", "truncation \"auto\" is not supported: this worker never drops input to "
                                           "fit the context (a request over it is a 400); use \"disabled\"")
        if self.background:
            raise ParamError("background", "background responses are not supported: this worker answers within "
                                           "the request (stream it for early output)")
        if self.max_tool_calls is not None:
            raise ParamError("max_tool_calls", "max_tool_calls limits built-in tool calls, which this worker does "
                                               "not make; use parallel_tool_calls: false for one function call")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools")
        if isinstance(choice, ToolChoiceFunction) and choice.name not in [t.name for t in self.tools]:
            raise ParamError("tool_choice", f"tool_choice names function {choice.name!r}, which is not among "
                                            f"the tools")
        return self

    @property
    def input_items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None


# ---------------------------------------------------------------- the response


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: ItemStatus = "in_progress"


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus = "in_progress"


OutputItem = Union[OutputMessage, OutputFunctionCall, OutputReasoning]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # served from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    previous_response_id: str | None = None
    store: bool
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    max_tool_calls: int | None = None


# ---------------------------------------------------------------- stream events


class ResponseEvent(BaseModel):
    type: str
    sequence_number: int


class LifecycleEvent(ResponseEvent):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject


class OutputItemEvent(ResponseEvent):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(ResponseEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(ResponseEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class TextDoneEvent(ResponseEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class ReasoningDeltaEvent(ResponseEvent):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(ResponseEvent):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(ResponseEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(ResponseEvent):
    """A stream that fails after it began ends with this event."""
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None
