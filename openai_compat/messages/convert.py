"""A Messages request as the chat request it stands for, so it runs through the chat path unchanged: the same
chat template, tool-call and reasoning parsers, grammars and batching.

- `system` becomes a leading system message; `role: "system"` messages stay system messages.
- Text blocks become text parts (joined by newlines, as chat joins them).
- An assistant message's `tool_use` blocks become its `tool_calls` (`input` as the arguments), its `thinking`
  blocks its `reasoning_content` (which the template renders or drops, as it does for chat), and
  `redacted_thinking` blocks are dropped (their text is encrypted for Anthropic's models only).
- A user message's `tool_result` blocks become `tool` messages, in order, with the text blocks around them as
  user messages; `is_error: true` results read `Error: <content>` (chat has no error flag).
- A final assistant message is continued, not answered (`continue_final_message`), as Anthropic continues it.
- `tools` become functions (`input_schema` as the parameters, `strict` kept); `tool_choice` `auto`, `any`,
  `tool`, `none` become `auto`, `required`, a named function, `none`; `disable_parallel_tool_use` becomes
  `parallel_tool_calls: false`.
- `thinking` sets the template's `enable_thinking` switch when it has one (see `thinking_kwargs`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..chat.protocol import ChatCompletionRequest
from ..errors import OpenAIError
from ..serving import OpenAIServing
from ..validation import parse
from .protocol import AnthropicRequest, MessagesRequest, ThinkingConfig

THINKING_SWITCH = "enable_thinking"  # the template variable Qwen3, SmolLM3 and others turn thinking on and off by


@dataclass(frozen=True)
class Thinking:
    """What the served model can do about thinking."""
    parsed: bool  # a reasoning parser takes thinking out of its replies
    switch: bool  # its chat template turns thinking on and off by THINKING_SWITCH

    @classmethod
    def of(cls, serving: OpenAIServing) -> "Thinking":
        template = serving.engine.tokenizer.chat_template or ""
        parser = serving.reasoning_format()
        return cls(parsed=parser is not None, switch=THINKING_SWITCH in template)


def thinking_kwargs(thinking: ThinkingConfig | None, model: Thinking) -> dict[str, Any] | None:
    """The template variables a `thinking` setting stands for. What the model cannot do is a 400: enabling
    thinking needs a reasoning parser (else no thinking block could come back), and disabling it needs the
    template's switch when the model thinks (else it would think anyway)."""
    if thinking is None or thinking.type == "adaptive":
        return None  # the template's default
    if thinking.type == "enabled":
        if not model.parsed:
            raise OpenAIError("thinking cannot be enabled: the served model has no reasoning parser (set "
                              "REASONING_PARSER for a model that thinks), so no thinking could be returned",
                              param="thinking.type")
        return {THINKING_SWITCH: True} if model.switch else None
    if model.switch:
        return {THINKING_SWITCH: False}
    if model.parsed:
        raise OpenAIError(f"thinking cannot be disabled: the served model thinks and its chat template has no "
                          f"{THINKING_SWITCH} switch", param="thinking.type")
    return None  # a model that does not think


def chat_request(request: AnthropicRequest, model: Thinking) -> ChatCompletionRequest:
    """The chat request a Messages (or count_tokens) request stands for."""
    body: dict[str, Any] = {"model": request.model, "messages": _messages(request)}
    if request.messages[-1].role == "assistant":
        body.update(add_generation_prompt=False, continue_final_message=True)
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": tool.name, "parameters": tool.input_schema,
            **({"description": tool.description} if tool.description is not None else {}),
            **({"strict": tool.strict} if tool.strict is not None else {})}} for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
                               else {"auto": "auto", "any": "required", "none": "none"}[choice.type])
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    kwargs = thinking_kwargs(request.thinking, model)
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    if isinstance(request, MessagesRequest):
        body.update(max_tokens=request.max_tokens, stream=request.stream)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(request, name) is not None:
                body[name] = getattr(request, name)
        if request.stop_sequences:
            body["stop"] = request.stop_sequences
    try:
        return parse(ChatCompletionRequest, body)
    except OpenAIError as exc:  # the request's own checks should have caught it: say what could not be mapped
        raise OpenAIError(f"the request could not be run as a chat request: {exc.message}") from None


def _text_parts(blocks) -> list[dict[str, Any]]:
    """Text blocks as chat text parts, image blocks as chat image parts (in place)."""
    return [{"type": "image_url", "image_url": {"url": block.image_url}} if block.type == "image"
            else {"type": "text", "text": block.text} for block in blocks]


def image_paths(request: AnthropicRequest) -> list[str]:
    """Where each image block is in the request (in order, as the chat request has them), for errors."""
    return [f"messages[{i}].content[{j}]" for i, message in enumerate(request.messages)
            if isinstance(message.content, list) for j, block in enumerate(message.content) if block.type == "image"]


def _messages(request: AnthropicRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if request.system is not None:
        out.append({"role": "system", "content": request.system if isinstance(request.system, str)
                    else _text_parts(request.system)})
    for message in request.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_assistant(message.content))
        else:
            out.extend(_user(message.role, message.content))
    return out


def _assistant(blocks) -> dict[str, Any]:
    texts = [block for block in blocks if block.type == "text"]
    calls = [{"id": block.id, "type": "function",
              "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}}
             for block in blocks if block.type == "tool_use"]
    thinking = [block.thinking for block in blocks if block.type == "thinking"]
    entry: dict[str, Any] = {"role": "assistant", "content": _text_parts(texts) if texts or not calls else None}
    if calls:
        entry["tool_calls"] = calls
    if thinking:
        entry["reasoning_content"] = "\n".join(thinking)
    return entry


def _user(role: str, blocks) -> list[dict[str, Any]]:
    """A user message's blocks in order: runs of text blocks as user messages, each tool result as a tool
    message. An empty content list stays one empty message."""
    out: list[dict[str, Any]] = []
    texts: list = []
    for block in blocks:
        if block.type == "tool_result":
            if texts:
                out.append({"role": role, "content": _text_parts(texts)})
                texts = []
            content = block.result_text
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": f"Error: {content}" if block.is_error else content})
        else:
            texts.append(block)
    if texts or not out:
        out.append({"role": role, "content": _text_parts(texts)})
    return out
