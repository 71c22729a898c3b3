"""Request and response bodies of the tokenizer routes, in vLLM's shapes: `/tokenize` (a prompt, or chat
messages through the chat template) and `/detokenize` (token ids back to text)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_validator

from ..chat.protocol import ChatMessage
from ..protocol import ParamError, RequestModel, TokenId


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
