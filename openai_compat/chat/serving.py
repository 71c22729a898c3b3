"""`/v1/chat/completions`, and the seam chat-like endpoints share.

`ChatServing.generate` turns a ChatCompletionRequest into a ChatGeneration (generation.py): checked, rendered
with the chat template (render.py), planned (plan.py: grammar, reasoning and tool-call parsers) and given its
SamplingParams. Running it yields each choice's reply taken apart; this module shapes that into a chat
completion or a stream of chat completion chunks. An endpoint for another chat-like API (Responses, Anthropic
Messages) maps its request to a ChatCompletionRequest, calls `generate`, and shapes the same results itself.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from ..errors import OpenAIError
from ..protocol import ChatTokenLogprob, UsageInfo, prompt_logprobs_json, random_id
from ..serving import OpenAIServing, Prompt
from ..streaming import StreamChunks
from .generation import ChatGeneration, ChoiceDelta, ChoiceResult
from .plan import plan_chat
from .protocol import (ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                       ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage, DeltaMessage)
from .render import render_chat


class ChatServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def generate(self, request: ChatCompletionRequest, endpoint: str = "chat completions",
                       id_prefix: str = "chatcmpl", image_paths: list[str] | None = None) -> ChatGeneration:
        """Everything before the engine runs: the model and the request's size checked (errors say `endpoint`
        when the model cannot generate), the conversation rendered, the reply planned, the SamplingParams built
        and checked. The generation's id is `<id_prefix>-<random hex>`."""
        serving = self.serving
        await serving.ready_for(request.model)
        serving.check_generation(request, endpoint, 1)
        prompt = await render_chat(serving, request, image_paths=image_paths)
        kept = serving.truncated(request, prompt.token_ids)
        if len(kept) < len(prompt.token_ids):
            if prompt.images is not None:
                raise OpenAIError("truncate_prompt_tokens cannot cut a prompt with images (its image tokens would "
                                  "lose their pictures)", param="truncate_prompt_tokens")
            prompt = Prompt(kept)
        plan = await plan_chat(serving, request, prompt)
        (params,) = serving.sampling_params(request, [len(prompt.token_ids)], plan.grammar, plan.with_special_tokens)
        request_id = f"{id_prefix}-{request.request_id}" if request.request_id else random_id(id_prefix)
        return ChatGeneration(serving, request_id, request, prompt, params, plan)

    def response_role(self, request: ChatCompletionRequest) -> str:
        """Without a generation prompt the model continues the last message, so the reply keeps its role (vLLM)."""
        return self.serving.config.response_role if request.add_generation_prompt else request.messages[-1].role

    # ---------------------------------------------------------------- chat completions

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionStreamResponse]:
        generation = await self.generate(request)
        if request.stream:
            return self._stream(generation)
        return await self._full(generation)

    def _echo_prefix(self, request: ChatCompletionRequest) -> str:
        """echo repeats the last message only when the reply continues it (same role), as vLLM does."""
        last = request.messages[-1]
        if not request.echo or last.content is None or last.role != self.response_role(request):
            return ""
        return last.text

    async def _full(self, generation: ChatGeneration) -> ChatCompletionResponse:
        request = generation.request
        results = await generation.results()
        echo = self._echo_prefix(request)
        role = self.response_role(request)
        prompt_logprobs = None
        if request.prompt_logprobs is not None and generation.prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs_json(generation.prompt_logprobs, request.prompt_logprobs,
                                                   self.serving.token_text, request.return_tokens_as_token_ids)
        ids = request.return_token_ids
        return ChatCompletionResponse(
            id=generation.request_id, model=self.serving.served_model_name,
            choices=[_choice(result, role, echo, ids) for result in results],
            usage=UsageInfo.of(generation.prompt_tokens, generation.completion_tokens),
            prompt_logprobs=prompt_logprobs, prompt_token_ids=generation.prompt.token_ids if ids else None)

    async def _stream(self, generation: ChatGeneration) -> AsyncIterator[ChatCompletionStreamResponse]:
        request = generation.request
        chunks = StreamChunks(ChatCompletionStreamResponse, generation.request_id, self.serving.served_model_name,
                              request, generation.prompt_tokens)
        echo = self._echo_prefix(request)
        role = self.response_role(request)
        ids = request.return_token_ids
        for index in range(generation.n):
            first = chunks.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(
                role=role, content=""), logprobs=None, finish_reason=None)], 0)
            if ids and index == 0:  # the prompt's ids go out once, on the first chunk (vLLM's place)
                first.prompt_token_ids = generation.prompt.token_ids
            yield first
        if echo:  # the echoed message follows the role chunks, in chunks of its own (vLLM's order)
            for index in range(generation.n):
                yield chunks.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=echo))], 0)
        async for step in generation.stream():
            yield chunks.chunk([_stream_choice(delta, ids) for delta in step], generation.completion_tokens)
        if (last := chunks.usage(generation.completion_tokens)) is not None:
            yield last


def _logprobs(entries: list[ChatTokenLogprob] | None) -> ChatChoiceLogprobs | None:
    return ChatChoiceLogprobs(content=entries) if entries is not None else None


def _choice(result: ChoiceResult, role: str, echo: str, with_ids: bool) -> ChatCompletionChoice:
    parsed = result.message
    content = echo + parsed.content if parsed.content is not None else (echo or None)
    message = ChatResponseMessage(role=role, content=content, reasoning_content=parsed.reasoning,
                                  reasoning=parsed.reasoning, tool_calls=parsed.tool_calls)
    return ChatCompletionChoice(index=result.index, message=message, logprobs=_logprobs(result.logprobs),
                                finish_reason=result.finish_reason, stop_reason=result.stop_reason,
                                token_ids=result.token_ids if with_ids else None)


def _stream_choice(delta: ChoiceDelta, with_ids: bool) -> ChatCompletionStreamChoice:
    piece = delta.delta
    fields: dict[str, Any] = {}
    if piece.reasoning:
        fields.update(reasoning_content=piece.reasoning, reasoning=piece.reasoning)
    if piece.content:
        fields["content"] = piece.content
    if piece.tool_calls:
        fields["tool_calls"] = piece.tool_calls
    return ChatCompletionStreamChoice(index=delta.index, delta=DeltaMessage(**fields),
                                      logprobs=_logprobs(delta.logprobs), finish_reason=delta.finish_reason,
                                      stop_reason=delta.stop_reason, token_ids=delta.token_ids if with_ids else None)
