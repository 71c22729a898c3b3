"""Request and response bodies of `/v1/chat/completions`: messages, tools, the reply and its stream chunks."""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator

from ..errors import context_exceeded
from ..protocol import (ChatTokenLogprob, OmitsNone, ParamError, RequestLimits, StreamChunk, UsageInfo, limits_of,
                        random_id)
from ..sampling import OpenAIRequest


def check_messages_size(value: Any, limits: RequestLimits | None) -> None:
    """Raw `messages` that could not fit the context whatever the template: every message renders to at least
    one token, and its content text to at least one token per `max_token_chars` characters."""
    if limits is None or not isinstance(value, list):
        return
    max_chars = limits.context_tokens * limits.max_token_chars
    if len(value) > limits.context_tokens:
        raise ValueError(context_exceeded(limits.context_tokens, f"there are {len(value)} messages, and each takes "
                                          f"at least one token", "the number of messages"))
    chars = 0
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += len(content)  # the newline that joins each text part to the next
            if chars <= max_chars:
                chars += sum(len(part["text"]) for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
        if chars > max_chars:
            break
    if chars > max_chars:
        raise ValueError(context_exceeded(
            limits.context_tokens, f"the messages have {chars} characters of content, which is more than "
            f"{limits.context_tokens} tokens for this model's tokenizer (no token spans more than "
            f"{limits.max_token_chars} characters)", "the length of the messages"))


ContentType = Literal["text", "image_url", "input_audio", "file", "refusal", "video_url", "audio_url", "input_image"]


class ContentPart(BaseModel):
    """One part of a message's content. Every OpenAI part type parses (so the 400 for a non-text part can say
    that this model takes text only); one model rather than a union keeps validation errors at the field."""
    model_config = ConfigDict(extra="allow")
    type: ContentType
    text: str | None = None

    @model_validator(mode="after")
    def _text(self) -> "ContentPart":
        if self.type == "text" and self.text is None:
            raise ParamError("text", "a text content part needs a text string")
        return self


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the name newer clients (and this worker's replies) give reasoning_content
    # Fields of the reply objects the official SDK returns, which clients send back as they dumped them:
    # `refusal` is the assistant's text; the others are accepted empty and refused with a value nothing here uses.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @field_validator("annotations", "audio", "function_call")
    @classmethod
    def _empty(cls, value, info: ValidationInfo):
        if value:
            reason = {"annotations": "citations of a hosted search", "audio": "audio output",
                      "function_call": "the deprecated function_call (send tool_calls)"}[info.field_name]
            raise ValueError(f"{info.field_name} is accepted only empty: {reason} cannot be used here")
        return None

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.reasoning is not None:
            if self.reasoning_content is not None and self.reasoning_content != self.reasoning:
                raise ParamError("reasoning", "reasoning and reasoning_content differ; send one of them")
            self.reasoning_content = self.reasoning
        if self.refusal and self.content is None:
            self.content = self.refusal
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if part.type == "text")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None
    # Reaches the chat template as `reasoning_effort` (as vLLM passes it; gpt-oss templates read it) unless
    # chat_template_kwargs sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None  # text is all a text model can answer in

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_size(cls, value, info: ValidationInfo):
        check_messages_size(value, limits_of(info))
        return value

    @model_validator(mode="after")
    def _chat_consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message",
                             "add_generation_prompt and continue_final_message cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ParamError("continue_final_message",
                             "continue_final_message needs the last message to be an assistant message")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise ParamError("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                                            f"among the tools")
        if self.forces_tool_call:
            constraint = self.constraint()
            if constraint is not None:
                raise ParamError(constraint.param, f"{constraint.param} cannot be combined with tool_choice "
                                                   f"{'required' if choice == 'required' else 'naming a function'}")
        return self

    prompt_param: ClassVar[str] = "messages"
    logprobs_param: ClassVar[str] = "top_logprobs"

    @property
    def max_tokens_param(self) -> str:
        # max_completion_tokens wins over the deprecated max_tokens (as in vLLM); errors name the one used.
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or ()]

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: `auto` when tools are given, else `none`."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forces_tool_call(self) -> bool:
        """`required` or a named function: the reply is generated as tool calls, under a grammar."""
        return self.tools is not None and (self.tool_choice == "required"
                                           or isinstance(self.tool_choice, NamedToolChoice))


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None = None
    # A reasoning model's thinking: `reasoning_content` as vLLM names it, `reasoning` as newer clients read it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _reasoning_when_present(self, handler):
        data = handler(self)
        if self.reasoning_content is None:
            data.pop("reasoning_content", None)
            data.pop("reasoning", None)
        return data


class ChatCompletionChoice(OmitsNone):
    omitted_when_none = frozenset({"token_ids"})
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OmitsNone):
    omitted_when_none = frozenset({"prompt_logprobs", "prompt_token_ids"})
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class DeltaToolCall(BaseModel):
    """A piece of one tool call: the first piece has its id, type and name, later ones more arguments text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class DeltaMessage(BaseModel):
    """Only what changed: the opening delta has the role, later ones the new content, the last may be empty."""
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class ChatCompletionStreamChoice(OmitsNone):
    omitted_when_none = frozenset({"token_ids"})
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the tokens this chunk adds


class ChatCompletionStreamResponse(StreamChunk):
    omitted_when_none = frozenset({"prompt_token_ids"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk
