"""The tokenizer API, in vLLM's shapes: `/tokenize` (a prompt, or chat messages through the chat template)
and `/detokenize` (token ids back to text)."""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field, model_validator

from .protocol import ChatCompletionRequest, ChatMessage, ParamError, RequestModel, TokenId
from .serving import OpenAIServing
from .validation import parse


class TokenizeRequest(RequestModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template), as vLLM's two tokenize forms."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # Text prompts get the tokenizer's special tokens by default; chat templates write their own.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give either prompt (a string) or messages (a list), not both or neither")
        if self.prompt is not None:
            chat_only = [name for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                                           "chat_template", "tools", "documents") if name in self.model_fields_set]
            if chat_only:
                raise ParamError(chat_only[0], f"{chat_only[0]} applies to messages, not to a prompt")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizationServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        serving = self.serving
        await serving.ready()
        serving.check_model(request.model)
        if request.messages is not None:
            fields = {"messages": request.messages, "add_generation_prompt": request.add_generation_prompt,
                      "continue_final_message": request.continue_final_message,
                      "chat_template_kwargs": request.chat_template_kwargs, "chat_template": request.chat_template,
                      "tools": request.tools, "documents": request.documents}
            chat = parse(ChatCompletionRequest, fields)  # its consistency checks, errors naming the same fields
            ids = (await serving.chat_prompt(chat, add_special_tokens=bool(request.add_special_tokens))).token_ids
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = await serving.tokenize(request.prompt, add_special)
        tokenizer = serving.engine.tokenizer
        strs = None
        if request.return_token_strs:
            strs = await asyncio.to_thread(tokenizer.token_strings, ids)
        return TokenizeResponse(count=len(ids), max_model_len=serving.engine.max_model_len, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        serving = self.serving
        await serving.ready()
        serving.check_model(request.model)
        serving.check_in_vocabulary(request.tokens, "tokens")
        text = await asyncio.to_thread(serving.engine.tokenizer.decode, request.tokens, False)
        return DetokenizeResponse(prompt=text)
