"""A chat request's conversation rendered with the model's chat template, into the prompt the model continues.
Chat completions, /tokenize with messages and the legacy messages form all render here."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from engine import IMAGE_DETAILS, ChatTemplateError, ImageError, ImagePlacementError, in_own_thread, load_image

from ..errors import OpenAIError
from ..serving import OpenAIServing, Prompt
from .protocol import ChatCompletionRequest


async def render_chat(serving: OpenAIServing, request: ChatCompletionRequest, add_special_tokens: bool = False,
                      image_paths: list[str] | None = None, count_only: bool = False) -> Prompt:
    """The token ids of a chat request's conversation, rendered with the chat template (which writes the
    special tokens itself; `add_special_tokens` adds the tokenizer's, as /tokenize may ask). An endpoint that
    mapped its request onto chat gives `image_paths`, where its image parts were in its own request (in order),
    so errors name them there. `count_only`: the prompt is only counted, its images are not encoded."""
    if request.chat_template is not None:
        raise OpenAIError("a chat template in the request is not accepted; set CUSTOM_CHAT_TEMPLATE on the "
                          "worker instead", param="chat_template")
    vision = serving.engine.vision
    messages = []
    image_urls: list[tuple[str, str, str | None]] = []  # (the part's path, its URL, its detail), in prompt order
    for i, message in enumerate(request.messages):
        entry: dict[str, Any] = {"role": message.role}
        parts = []
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            param = f"messages[{i}].content[{j}]"
            if part.type in IMAGE_PART_TYPES and image_paths is not None:
                param = image_paths[len(image_urls)]
            if part.type in IMAGE_PART_TYPES and vision is not None:
                image_urls.append((param, *image_part_source(part, param)))
                parts.append({"type": "image"})
            elif part.type != "text":
                raise OpenAIError(f"content part type {part.type} is not supported: this model takes text only",
                                  param=param)
            else:
                parts.append({"type": "text", "text": part.text})
        # A vision model's template takes content as parts ({"type": "image"} where an image goes), as
        # transformers' processors pass it; a text model's takes the text parts joined.
        entry["content"] = parts if vision is not None and isinstance(message.content, list) else message.text
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

    pictures = await load_images(serving, image_urls)

    def render_messages(conversation: list[dict[str, Any]]) -> str:
        return tokenizer.render_chat(conversation, add_generation_prompt=request.add_generation_prompt,
                                     continue_final_message=request.continue_final_message,
                                     tools=tools, documents=request.documents,
                                     template_kwargs=template_kwargs)

    def render() -> tuple[list[int], str, Any]:
        try:
            text = render_messages(messages)
        except ChatTemplateError:
            # A few templates (Functionary v3.2) write the arguments as they are and want the text the client
            # sent, vLLM's other form; if that fails too, the first error is the one reported.
            as_sent = _with_arguments_as_sent(messages, request)
            if as_sent is None:
                raise
            try:
                text = render_messages(as_sent)
            except ChatTemplateError:
                text = None
            if text is None:
                raise
        serving.check_prompt_chars(text, "messages")
        if pictures:  # the processor expands each image's placeholder into the model's image tokens
            ids, images = vision.prepare(text, pictures, add_special_tokens, encode=not count_only)
            return ids, text, images
        return tokenizer.encode(text, add_special_tokens=add_special_tokens), text, None

    try:
        # An image's encoder pass is parallel torch work: on a thread that ends with it (engine/threads.py).
        ids, text, images = await (in_own_thread(render) if pictures else asyncio.to_thread(render))
    except ChatTemplateError as exc:
        raise OpenAIError(str(exc), param="messages") from exc
    except ImagePlacementError as exc:
        raise OpenAIError(str(exc), param="messages") from exc
    if not ids:  # the template dropped everything: nothing for the model to continue from
        raise OpenAIError("the chat template rendered these messages to an empty prompt", param="messages")
    return Prompt(ids, text, images)


IMAGE_PART_TYPES = ("image_url", "input_image")


def image_part_source(part, param: str) -> tuple[str, str | None]:
    """The URL and `detail` of an image part: `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`
    (OpenAI's chat form) or `{"type": "input_image", "image_url": "...", "detail": ...}` (the Responses form).
    `detail: low` shrinks the picture to at most 512 pixels a side before the processor sees it; auto and high
    leave the resolution to the processor (engine/vision/images.py at_detail)."""
    value = getattr(part, "image_url", None)
    extra = set(part.model_extra or ()) - {"image_url", "detail"}
    if extra or part.text is not None:
        raise OpenAIError(f"unknown field {sorted(extra)[0] if extra else 'text'} in an image part",
                          param=f"{param}.{sorted(extra)[0] if extra else 'text'}")
    detail = getattr(part, "detail", None)
    if isinstance(value, dict):
        if set(value) - {"url", "detail"}:
            name = sorted(set(value) - {"url", "detail"})[0]
            raise OpenAIError(f"unknown field {name} in image_url", param=f"{param}.image_url.{name}")
        detail, value = value.get("detail", detail), value.get("url")
    if detail not in (None, *IMAGE_DETAILS):
        raise OpenAIError("detail must be auto, low or high", param=f"{param}.image_url.detail")
    if not isinstance(value, str) or not value:
        raise OpenAIError("an image part needs image_url with a url: a data: URL or an http(s) URL",
                          param=f"{param}.image_url")
    return value, detail


async def load_images(serving: OpenAIServing, image_urls: list[tuple[str, str, str | None]]) -> list:
    """The pictures of a request's image parts, fetched and decoded concurrently; a bad one is a 400 naming
    its part, and more than LIMIT_MM_PER_PROMPT is a 400 before anything is fetched."""
    limits = serving.config.media
    if limits.max_images is not None and len(image_urls) > limits.max_images:
        raise OpenAIError(f"the request has {len(image_urls)} images; at most {limits.max_images} are accepted per "
                          f"prompt (LIMIT_MM_PER_PROMPT)", param=image_urls[limits.max_images][0])

    async def one(param: str, url: str, detail: str | None):
        try:
            return await load_image(url, limits, detail)
        except ImageError as exc:
            raise OpenAIError(f"{param}: {exc}", param=param) from None

    return list(await asyncio.gather(*(one(*source) for source in image_urls)))


def _with_arguments_as_sent(messages: list[dict[str, Any]], request: ChatCompletionRequest
                            ) -> list[dict[str, Any]] | None:
    """The conversation with each call's arguments as the text the client sent (None: it has no calls)."""
    if not any(m.tool_calls for m in request.messages):
        return None
    return [{**entry, "tool_calls": [call.model_dump() for call in message.tool_calls]} if message.tool_calls
            else entry for entry, message in zip(messages, request.messages)]


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
