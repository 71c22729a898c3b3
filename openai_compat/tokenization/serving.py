"""The tokenizer routes: `/tokenize` (a prompt, or chat messages through the chat template) and `/detokenize`
(token ids back to text)."""
from __future__ import annotations

import asyncio

from ..chat.protocol import ChatCompletionRequest
from ..chat.render import render_chat
from ..serving import OpenAIServing
from ..validation import parse
from .protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse


class TokenizationServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        serving = self.serving
        await serving.ready_for(request.model)
        if request.messages is not None:
            fields = {"messages": request.messages, "add_generation_prompt": request.add_generation_prompt,
                      "continue_final_message": request.continue_final_message,
                      "chat_template_kwargs": request.chat_template_kwargs, "chat_template": request.chat_template,
                      "tools": request.tools, "documents": request.documents}
            chat = parse(ChatCompletionRequest, fields)  # its consistency checks, errors naming the same fields
            ids = (await render_chat(serving, chat, bool(request.add_special_tokens), count_only=True)).token_ids
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
        await serving.ready_for(request.model)
        serving.check_in_vocabulary(request.tokens, "tokens")
        text = await asyncio.to_thread(serving.engine.tokenizer.decode, request.tokens, False)
        return DetokenizeResponse(prompt=text)
