"""`/v1/completions`: text or token-id prompts (several per request, or fill-in-the-middle with `suffix`)
continued as they are, with OpenAI's legacy logprobs and echo, whole or streamed."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from engine import SamplingParams, TokenLogprob

from ..errors import OpenAIError
from ..protocol import UsageInfo, prompt_logprobs_json, random_id, token_name
from ..serving import MIN_LOGPROB, Choice, OpenAIServing, Prompt, accumulate
from ..streaming import StreamChunks
from .protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                       CompletionStreamResponse)

_FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


class CompletionServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        """Token ids (and text, for echo) of every prompt. Tokenizing and decoding are the heavy part of preparing
        a request, so the caller runs this on a worker thread; it is linear in the prompts' size."""
        tokenizer = self.serving.engine.tokenizer
        items = request.prompts
        prompts = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if request.suffix is not None:
                    prompts.append(Prompt(self._fim_ids(item, request.suffix), item))
                    continue
                self.serving.check_prompt_chars(item, param)
                ids = tokenizer.encode(item, request.add_special_tokens)
                if not ids:
                    raise OpenAIError("the prompt is empty after tokenization", param=param)
                kept = self.serving.truncated(request, ids)
                prompts.append(Prompt(ids, item) if kept is ids else
                               Prompt(kept, tokenizer.decode(kept, skip_special_tokens=False)))
            else:
                if request.suffix is not None:
                    raise OpenAIError("suffix needs a text prompt", param="suffix")
                item = self.serving.truncated(request, item)
                self.serving.check_token_ids(item, param)
                prompts.append(Prompt(item, tokenizer.decode(item, skip_special_tokens=False)))
        total = sum(len(p.token_ids) for p in prompts)
        if total > self.serving.config.max_prompt_tokens_per_request:
            raise OpenAIError(f"the prompts have {total} tokens together; a request may carry at most "
                              f"{self.serving.config.max_prompt_tokens_per_request} (MAX_PROMPT_TOKENS_PER_REQUEST)",
                              param="prompt")
        return prompts

    def _fim_ids(self, prefix: str, suffix: str) -> list[int]:
        """Fill-in-the-middle prompt for models trained with FIM tokens; others cannot honour `suffix`."""
        tokenizer = self.serving.engine.tokenizer
        markers = [tokenizer.token_id(t) for t in _FIM_TOKENS]
        if any(m is None for m in markers):
            raise OpenAIError("suffix is not supported by this model (its tokenizer has no fill-in-the-middle "
                              "tokens)", param="suffix")
        fim_prefix, fim_suffix, fim_middle = markers
        self.serving.check_prompt_chars(prefix, "prompt")
        self.serving.check_prompt_chars(suffix, "suffix")
        return ([fim_prefix] + tokenizer.encode(prefix, False) + [fim_suffix] + tokenizer.encode(suffix, False)
                + [fim_middle])

    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | AsyncIterator[CompletionStreamResponse]:
        await self.serving.ready_for(request.model)
        self.serving.check_generation(request, "completions", len(request.prompts))
        prompts = await asyncio.to_thread(self._prompts, request)
        grammar = await self.serving.grammar(request)
        params = await asyncio.to_thread(self.serving.sampling_params, request, [len(p.token_ids) for p in prompts],
                                         grammar)
        response_id = f"cmpl-{request.request_id}" if request.request_id else random_id("cmpl")
        if request.stream:
            return self._stream(request, response_id, prompts, params)
        return await self._full(request, response_id, prompts, params)

    async def _full(self, request: CompletionRequest, response_id: str, prompts: list[Prompt],
                    params: list[SamplingParams]) -> CompletionResponse:
        n = request.n
        choices: list[dict[int, Choice]] = [{} for _ in prompts]
        prompt_logprobs: list[list | None] = [None] * len(prompts)
        async for i, output in self.serving.run_prompts(response_id, prompts, params):
            accumulate(choices[i], output)
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
        result = []
        for i, prompt in enumerate(prompts):
            for index in sorted(choices[i]):
                c = choices[i][index]
                echo = prompt.text if request.echo else ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._logprobs(c.logprobs, c.token_ids, len(echo), request.return_tokens_as_token_ids)
                    if request.echo:
                        head = self._logprobs(prompt_logprobs[i] or [None] * len(prompt.token_ids),
                                              prompt.token_ids, 0, request.return_tokens_as_token_ids)
                        logprobs = _join_logprobs(head, logprobs)
                extra = {}
                if request.prompt_logprobs is not None and prompt_logprobs[i] is not None:
                    extra["prompt_logprobs"] = prompt_logprobs_json(
                        prompt_logprobs[i], request.prompt_logprobs, self.serving.token_text,
                        request.return_tokens_as_token_ids)
                if request.return_token_ids:
                    extra.update(prompt_token_ids=prompt.token_ids, token_ids=c.token_ids)
                result.append(CompletionChoice(index=i * n + index, text=echo + c.text, logprobs=logprobs,
                                               finish_reason=c.finish_reason, stop_reason=c.stop_reason, **extra))
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for per_prompt in choices for c in per_prompt.values())
        return CompletionResponse(id=response_id, model=self.serving.served_model_name, choices=result,
                                  usage=UsageInfo.of(prompt_tokens, completion_tokens))

    async def _stream(self, request: CompletionRequest, response_id: str, prompts: list[Prompt],
                      params: list[SamplingParams]) -> AsyncIterator[CompletionStreamResponse]:
        chunks = StreamChunks(CompletionStreamResponse, response_id, self.serving.served_model_name, request,
                              sum(len(p.token_ids) for p in prompts))
        n = request.n
        generated = 0
        offsets = {}  # text offset per choice, for logprobs
        if request.echo and request.logprobs is None:
            for i, prompt in enumerate(prompts):
                yield chunks.chunk([CompletionChoice(index=i * n + k, text=prompt.text, logprobs=None,
                                                     finish_reason=None) for k in range(n)])
                for k in range(n):
                    offsets[i * n + k] = len(prompt.text)
        heads: dict[int, CompletionLogprobs] = {}  # echo with logprobs: the prompt's part, per prompt
        echoed: set[int] = set()
        ids_sent: set[int] = set()
        async for i, output in self.serving.run_prompts(response_id, prompts, params):
            choices = []
            if request.echo and request.logprobs is not None and output.prompt_logprobs is not None:
                heads[i] = self._logprobs(output.prompt_logprobs, prompts[i].token_ids, 0,
                                          request.return_tokens_as_token_ids)
            for delta in output.deltas:
                index = i * n + delta.index
                generated += len(delta.token_ids)
                text, head = delta.text, None
                if i in heads and index not in echoed:
                    # The prompt goes out with the choice's first tokens, in one choice (vLLM's shape).
                    echoed.add(index)
                    text, head = prompts[i].text + text, heads[i]
                    offsets[index] = len(prompts[i].text)
                logprobs = None
                if request.logprobs is not None and delta.logprobs:
                    logprobs = self._logprobs(delta.logprobs, delta.token_ids, offsets.get(index, 0),
                                              request.return_tokens_as_token_ids)
                if head is not None:
                    logprobs = _join_logprobs(head, logprobs or CompletionLogprobs())
                offsets[index] = offsets.get(index, 0) + len(delta.text)
                extra = {}
                if request.return_token_ids:
                    extra["token_ids"] = list(delta.token_ids)
                    if index not in ids_sent:  # the prompt's ids go out once per choice, on its first chunk
                        ids_sent.add(index)
                        extra["prompt_token_ids"] = prompts[i].token_ids
                if not text and logprobs is None and delta.finish_reason is None and not extra.get("token_ids"):
                    continue
                choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                                                **extra))
            if choices:
                yield chunks.chunk(choices, generated)
        if (last := chunks.usage(generated)) is not None:
            yield last

    def _logprobs(self, entries: list[TokenLogprob | None], token_ids: list[int], offset: int,
                  as_ids: bool = False) -> CompletionLogprobs:
        """OpenAI's legacy logprobs; `entries[i]` is None for a token with no logprob (the first prompt token)."""
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = self.serving.token_text(token_id)
            result.tokens.append(token_name(text, token_id, as_ids))
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(max(entry.logprob, MIN_LOGPROB))
            top = {token_name(self.serving.token_text(tid), tid, as_ids): max(lp, MIN_LOGPROB)
                   for tid, lp in entry.top}
            # the sampled token is always listed
            top.setdefault(token_name(text, token_id, as_ids), max(entry.logprob, MIN_LOGPROB))
            result.top_logprobs.append(top)
        return result


def _join_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=head.text_offset + tail.text_offset,
                              token_logprobs=head.token_logprobs + tail.token_logprobs,
                              tokens=head.tokens + tail.tokens, top_logprobs=head.top_logprobs + tail.top_logprobs)
