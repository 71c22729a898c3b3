"""A chat request's conversation rendered with the model's chat template, into the prompt the model continues.
Chat completions, /tokenize with messages and the legacy messages form all render here."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from engine import ChatTemplateError

from ..errors import OpenAIError
from ..serving import OpenAIServing, Prompt
from .protocol import ChatCompletionRequest


async def render_chat(serving: OpenAIServing, request: ChatCompletionRequest, add_special_tokens: bool = False
                      ) -> Prompt:
    """The token ids of a chat request's conversation, rendered with the chat template (which writes the
    special tokens itself; `add_special_tokens` adds the tokenizer's, as /tokenize may ask)."""
    if request.chat_template is not None:
        raise OpenAIError("a chat template in the request is not accepted; set CUSTOM_CHAT_TEMPLATE on the "
                          "worker instead", param="chat_template")
    messages = []
    for i, message in enumerate(request.messages):
        entry: dict[str, Any] = {"role": message.role}
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type != "text":
                raise OpenAIError(f"content part type {part.type} is not supported: this model takes text only",
                                  param=f"messages[{i}].content[{j}]")
        entry["content"] = message.text
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, key) is not None:
                entry[key] = getattr(message, key)
        if message.tool_calls:
            entry["tool_calls"] = [_template_tool_call(call.model_dump()) for call in message.tool_calls]
        messages.append(entry)
    tokenizer = serving.engine.tokenizer

    tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
    template_kwargs = request.chat_template_kwargs
    if request.reasoning_effort is not None:
        template_kwargs = {"reasoning_effort": request.reasoning_effort, **(template_kwargs or {})}

    def render() -> tuple[list[int], str]:
        text = tokenizer.render_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                     continue_final_message=request.continue_final_message,
                                     tools=tools, documents=request.documents,
                                     template_kwargs=template_kwargs)
        serving.check_prompt_chars(text, "messages")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens), text

    try:
        ids, text = await asyncio.to_thread(render)
    except ChatTemplateError as exc:
        raise OpenAIError(str(exc), param="messages") from exc
    if not ids:  # the template dropped everything: nothing for the model to continue from
        raise OpenAIError("the chat template rendered these messages to an empty prompt", param="messages")
    return Prompt(ids, text)


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """Chat templates expect a call's arguments as a mapping (they serialise it themselves), as vLLM passes
    them; arguments that are not a JSON object stay text."""
    function = dict(call.get("function") or {})
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        arguments = None
    if isinstance(arguments, dict):
        function["arguments"] = arguments
    return {**call, "function": function}
