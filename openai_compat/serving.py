"""The OpenAI endpoints: request model in, response object or stream of chunk objects out.

Turns a validated request into prompts (chat template, tokenization, FIM for `suffix`) and SamplingParams,
checks them against the model, runs them on the engine and assembles OpenAI responses from the engine's
per-step deltas.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine import AsyncEngine, ChatTemplateError, GenerationError, RequestOutput, SamplingParams, TokenLogprob
from engine.structured import AnswerGate, GrammarSpec
from engine.redaction import redact

from . import reasoning, tool_parsers
from .chat_output import ChatOutputParser
from .config import ServingConfig
from .errors import OpenAIError, context_exceeded
from .metrics import ServingMetrics
from .protocol import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
    ChatCompletionStreamChoice, ChatCompletionStreamResponse, ChatResponseMessage, ChatTokenLogprob,
    CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, CompletionStreamResponse,
    DeltaMessage, ModelCard, ModelList, NamedToolChoice, RequestLimits, SamplingFields, TopLogprob, UsageInfo, random_id,
)
from .streaming import StreamChunks
from .structured import GrammarCache, forced_tool_constraint, strict_tools_constraint

log = logging.getLogger("openai_compat")

_FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
_MIN_LOGPROB = -9999.0  # what vLLM reports for -inf


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # for echo; decoded from the ids when the prompt came as ids


@dataclass
class _Choice:
    """One choice being assembled from deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServingConfig):
        self.engine = engine
        self.config = config
        self.metrics = ServingMetrics(engine, lambda: self.served_model_name)
        self.grammars = GrammarCache()

    # ---------------------------------------------------------------- shared

    async def ready(self) -> None:
        """Load the model (first call only)."""
        try:
            await self.engine.start()
        except Exception as exc:
            raise OpenAIError(redact(f"the model could not be loaded: {exc}"), status=500) from exc

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.engine.model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise OpenAIError(f"The model `{name}` does not exist.", status=404, param="model")

    def check_generates(self, endpoint: str) -> None:
        """Embedding and cross-encoder models have no language-model head: generation routes are a 400."""
        task = self.engine.task
        if task != "generate":
            kind = "an embedding" if task == "embed" else "a classification (cross-encoder)"
            raise OpenAIError(f"the served model {self.served_model_name} is {kind} model with no language-model "
                              f"head, so it cannot do {endpoint}; it serves /v1/embeddings, /pooling, /score, "
                              f"/rerank and /tokenize")

    async def list_models(self) -> ModelList:
        await self.ready()
        name = self.served_model_name
        return ModelList(data=[ModelCard(id=name, root=self.engine.model_name, max_model_len=self.engine.max_model_len)])

    def request_limits(self) -> RequestLimits:
        """What one request may carry (the model must be loaded)."""
        return RequestLimits(max_prompts=self.config.max_prompts_per_request,
                             max_prompt_tokens=self.config.max_prompt_tokens_per_request,
                             context_tokens=self.engine.max_model_len,
                             max_token_chars=self.engine.tokenizer.max_token_chars)

    def check_generation(self, request: SamplingFields, endpoint: str, num_prompts: int) -> None:
        """What a generation request is checked for before any work on its prompts (once per request)."""
        self.check_generates(endpoint)
        self._check_sequences(request, num_prompts)

    def _check_sequences(self, request: SamplingFields, num_prompts: int) -> None:
        """Bound the sequences one request generates: every prompt runs max(n, best_of) of them."""
        sequences = max(request.n, request.best_of or 1)
        param = "best_of" if (request.best_of or 0) > request.n else "n"
        if sequences > self.engine.config.max_num_seqs:
            raise OpenAIError(f"n and best_of must be at most {self.engine.config.max_num_seqs} (MAX_NUM_SEQS)",
                              param=param)
        limit = self.config.max_sequences_per_request
        if sequences * num_prompts > limit:
            raise OpenAIError(f"{param}={sequences} for each of {num_prompts} prompts is {sequences * num_prompts} "
                              f"sequences; a request may generate at most {limit} (MAX_SEQUENCES_PER_REQUEST)",
                              param=param)

    def sampling_params(self, request: SamplingFields, prompt_lens: list[int], grammar: GrammarSpec | None = None,
                        with_special_tokens: bool = False) -> list[SamplingParams]:
        """The SamplingParams of each prompt of a request, checked against the model; the request maps its own
        fields (`to_sampling_params`). What does not depend on the prompt is checked and built once (a logit_bias
        can name every token of the vocabulary), so this is linear in the request's size. The caller has run
        `check_generation`."""
        max_logprobs = self.engine.config.max_logprobs
        for name, value in ((request.logprobs_param, request.logprobs_asked),
                            ("prompt_logprobs", request.prompt_logprobs_asked)):
            if value is not None and value > max_logprobs:
                raise OpenAIError(f"{name} must be at most {max_logprobs}, got {value}", param=name)
        budgets = [self._max_tokens(request, n) for n in prompt_lens]
        sequences = max(request.n, request.best_of or 1)
        for prompt_len, budget in zip(prompt_lens, budgets):
            too_large = self.engine.check_fits(prompt_len, budget, sequences)
            if too_large is not None:
                raise OpenAIError(f"This request cannot be served: {too_large}. Please reduce "
                                  f"{request.max_tokens_param}, n or the prompt.", param=request.max_tokens_param)
        self.check_in_vocabulary(request.stop_token_ids or (), "stop_token_ids")
        self.check_in_vocabulary(request.token_bias(), "logit_bias")
        self._check_speculation(request)
        if grammar is not None and request.beam_search:
            raise OpenAIError("structured outputs cannot be combined with beam search (beams are scored, not "
                              "masked)", param="use_beam_search")
        first = request.to_sampling_params(budgets[0], self.engine.generation_defaults, grammar, with_special_tokens)
        unsupported = self.engine.check_supported(first)
        if unsupported is not None:
            raise OpenAIError(unsupported, param="use_beam_search")
        return [first] + [dataclasses.replace(first, max_tokens=m) for m in budgets[1:]]

    def _max_tokens(self, request: SamplingFields, prompt_len: int) -> int:
        """The completion budget of one prompt: what was asked for, or the rest of the context."""
        limit = self.engine.max_model_len
        max_tokens, max_tokens_param = request.max_tokens_asked, request.max_tokens_param
        self._check_prompt_len(prompt_len, request.prompt_param)
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise OpenAIError(context_exceeded(limit, f"you requested {prompt_len + max_tokens} tokens ({prompt_len} "
                                                      f"in the prompt, {max_tokens} for the completion)",
                                               f"the length of the prompt or {max_tokens_param}"),
                              param=max_tokens_param)
        if request.min_tokens > max_tokens:
            raise OpenAIError(f"min_tokens ({request.min_tokens}) must be at most max_tokens ({max_tokens})",
                              param="min_tokens")
        return max_tokens

    async def grammar(self, request: SamplingFields, gate: AnswerGate | None = None) -> GrammarSpec | None:
        """The compiled constraint the request sets (response_format, guided_*, structured_outputs), if any."""
        constraint = request.constraint()
        if constraint is None:
            return None
        return await self.grammars.compile(self.engine.tokenizer, constraint, gate)

    def _check_speculation(self, request: SamplingFields) -> None:
        spec = self.engine.config.speculative
        for name in ("num_assistant_tokens", "assistant_confidence_threshold"):
            if getattr(request, name) is None:
                continue
            if spec is None:
                raise OpenAIError(f"{name} needs speculative decoding, which this worker does not run "
                                  f"(SPECULATIVE_CONFIG is not set)", param=name)
            if name == "assistant_confidence_threshold" and spec.method != "draft_model":
                raise OpenAIError("assistant_confidence_threshold needs a draft model; this worker speculates "
                                  "by n-gram prompt lookup", param=name)

    async def run(self, request_id: str, prompt: Prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one prompt; logs the request's timings when it ends (texts at DEBUG only)."""
        if log.isEnabledFor(logging.DEBUG):
            text = prompt.text if prompt.text is not None else self.engine.tokenizer.decode(prompt.token_ids, False)
            log.debug("request=%s prompt=%r", request_id, text)
        outputs: dict[int, str] = {}
        recorder = self.metrics.request(len(prompt.token_ids))
        try:
            async for output in self.engine.generate(request_id, prompt.token_ids, params):
                recorder.output(output)
                for delta in output.deltas:
                    outputs[delta.index] = outputs.get(delta.index, "") + delta.text
                if output.finished and output.metrics is not None:
                    _log_finished(request_id, output.metrics)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("request=%s outputs=%r", request_id, [outputs[i] for i in sorted(outputs)])
                yield output
        except GenerationError as exc:
            raise OpenAIError(f"generation failed: {exc}", status=500) from exc

    async def tokenize(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        self.check_prompt_chars(text, param)
        return await asyncio.to_thread(self.engine.tokenizer.encode, text, add_special_tokens)

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Refuse a text that cannot fit the context before tokenizing it: tokenizing runs at about a million
        characters a second, so a few megabytes would hold the request (and a CPU core) for seconds."""
        limit = self.engine.max_model_len
        per_token = self.engine.tokenizer.max_token_chars
        if len(text) > limit * per_token:
            raise OpenAIError(context_exceeded(limit, f"your prompt is {len(text)} characters long, which is more than "
                                                      f"{limit} tokens for this model's tokenizer (no token spans "
                                                      f"more than {per_token} characters)", "the length of the prompt"),
                              param=param)

    def _check_prompt_len(self, prompt_len: int, param: str) -> None:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise OpenAIError(context_exceeded(limit, f"your prompt has {prompt_len} tokens, leaving no room for a "
                                                      f"completion", "the length of the prompt"), param=param)

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        self._check_prompt_len(len(ids), param)  # before walking (and decoding) millions of ids
        self.check_in_vocabulary(ids, param)

    def check_in_vocabulary(self, ids, param: str) -> None:
        vocab = self.engine.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)

    # ---------------------------------------------------------------- logprobs

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.token_text(token_id)

    def _chat_logprobs(self, entries: list[TokenLogprob], top_n: int) -> ChatChoiceLogprobs:
        content = []
        for entry in entries:
            text = self._token_text(entry.token_id)
            top = [TopLogprob(token=(t := self._token_text(tid)), logprob=max(lp, _MIN_LOGPROB),
                              bytes=list(t.encode("utf-8"))) for tid, lp in entry.top[:top_n]]
            content.append(ChatTokenLogprob(token=text, logprob=max(entry.logprob, _MIN_LOGPROB),
                                            bytes=list(text.encode("utf-8")), top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def _completion_logprobs(self, entries: list[TokenLogprob | None], token_ids: list[int], offset: int
                             ) -> CompletionLogprobs:
        """OpenAI's legacy logprobs; `entries[i]` is None for a token with no logprob (the first prompt token)."""
        result = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = self._token_text(token_id)
            result.tokens.append(text)
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(max(entry.logprob, _MIN_LOGPROB))
            top = {self._token_text(tid): max(lp, _MIN_LOGPROB) for tid, lp in entry.top}
            top.setdefault(text, max(entry.logprob, _MIN_LOGPROB))  # the sampled token is always listed
            result.top_logprobs.append(top)
        return result

    # ---------------------------------------------------------------- chat

    async def chat_prompt(self, request: ChatCompletionRequest, add_special_tokens: bool = False) -> Prompt:
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
        tokenizer = self.engine.tokenizer

        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None

        def render() -> tuple[list[int], str]:
            text = tokenizer.render_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                         continue_final_message=request.continue_final_message,
                                         tools=tools, documents=request.documents,
                                         template_kwargs=request.chat_template_kwargs)
            self.check_prompt_chars(text, "messages")
            return tokenizer.encode(text, add_special_tokens=add_special_tokens), text

        try:
            ids, text = await asyncio.to_thread(render)
        except ChatTemplateError as exc:
            raise OpenAIError(str(exc), param="messages") from exc
        if not ids:  # the template dropped everything: nothing for the model to continue from
            raise OpenAIError("the chat template rendered these messages to an empty prompt", param="messages")
        return Prompt(ids, text)

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionStreamResponse]:
        await self.ready()
        self.check_model(request.model)
        self.check_generation(request, "chat completions", 1)
        prompt = await self.chat_prompt(request)
        plan = await self._chat_plan(request, prompt)
        (params,) = self.sampling_params(request, [len(prompt.token_ids)], plan.grammar, plan.with_special_tokens)
        response_id = random_id("chatcmpl")
        if request.stream:
            return self._chat_stream(request, response_id, prompt, params, plan)
        return await self._chat_full(request, response_id, prompt, params, plan)

    async def _chat_plan(self, request: ChatCompletionRequest, prompt: Prompt) -> "_ChatPlan":
        """How the reply is generated and read: its grammar, and the reasoning and tool-call parsers."""
        template = self.engine.tokenizer.chat_template
        reasoning_name = reasoning.parser_name_for(self.config.reasoning_parser, template)
        reasoning_parser = reasoning.make_parser(reasoning_name, prompt.text or "") if reasoning_name else None
        choice = request.effective_tool_choice
        tool_parser: tool_parsers.ToolParser | None = None
        parser_name = None
        if isinstance(choice, NamedToolChoice):
            tool_parser = tool_parsers.NamedFunctionParser(choice.function.name)
        elif choice == "required":
            tool_parser = tool_parsers.RequiredParser()
        elif choice == "auto" and request.tools:
            parser_name = (tool_parsers.parser_name_for(self.config.tool_call_parser, template)
                           if self.config.enable_auto_tool_choice else None)
            if parser_name is None:
                raise OpenAIError(
                    "tool_choice \"auto\" needs a tool-call parser, and "
                    + ("ENABLE_AUTO_TOOL_CHOICE is false" if not self.config.enable_auto_tool_choice else
                       "this model's chat template has no tool-call format the worker recognises (set "
                       "TOOL_CALL_PARSER)")
                    + "; tool_choice \"required\" or a named function works on any model, and \"none\" "
                      "passes the tools to the template only", param="tool_choice")
            tool_parser = tool_parsers.PARSERS[parser_name]()
        constraint = (forced_tool_constraint(request)
                      or strict_tools_constraint(request, tool_parser, parser_name, self.engine.tokenizer)
                      or request.constraint())
        grammar = None
        if constraint is not None:
            gate = self._answer_gate(reasoning_parser) if reasoning_parser is not None else None
            grammar = await self.grammars.compile(self.engine.tokenizer, constraint, gate)
        special = any(p is not None and p.needs_special_tokens for p in (reasoning_parser, tool_parser))
        return _ChatPlan(grammar, reasoning_parser, tool_parser, 1 if request.parallel_tool_calls is False else None,
                         special, calls_finish=not isinstance(choice, NamedToolChoice))

    def _answer_gate(self, parser: reasoning.ReasoningParser) -> AnswerGate:
        tokenizer = self.engine.tokenizer
        opener, closer, inside = parser.answer_gate()
        return AnswerGate(closer=tuple(tokenizer.encode(closer, add_special_tokens=False)),
                          opener=tokenizer.token_id(opener) if opener else None, inside=inside)

    def _response_role(self, request: ChatCompletionRequest) -> str:
        """Without a generation prompt the model continues the last message, so the reply keeps its role (vLLM)."""
        return self.config.response_role if request.add_generation_prompt else request.messages[-1].role

    def _echo_prefix(self, request: ChatCompletionRequest) -> str:
        """echo repeats the last message only when the reply continues it (same role), as vLLM does."""
        last = request.messages[-1]
        if not request.echo or last.content is None or last.role != self._response_role(request):
            return ""
        return last.text

    async def _chat_full(self, request, response_id: str, prompt: Prompt, params: SamplingParams,
                         plan: "_ChatPlan") -> ChatCompletionResponse:
        choices: dict[int, _Choice] = {}
        async for output in self.run(response_id, prompt, params):
            _accumulate(choices, output)
        echo = self._echo_prefix(request)
        result = []
        for index in sorted(choices):
            c = choices[index]
            parsed = plan.parser().parse(c.text)
            content = echo + parsed.content if parsed.content is not None else (echo or None)
            message = ChatResponseMessage(role=self._response_role(request), content=content,
                                          reasoning_content=parsed.reasoning, reasoning=parsed.reasoning,
                                          tool_calls=parsed.tool_calls)
            result.append(ChatCompletionChoice(
                index=index, message=message,
                logprobs=self._chat_logprobs(c.logprobs, params.logprobs) if params.logprobs is not None else None,
                finish_reason=_tool_finish(c.finish_reason, plan.calls_finish and bool(parsed.tool_calls)),
                stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return ChatCompletionResponse(id=response_id, model=self.served_model_name, choices=result,
                                      usage=UsageInfo.of(len(prompt.token_ids), completion_tokens))

    async def _chat_stream(self, request, response_id: str, prompt: Prompt, params: SamplingParams,
                           plan: "_ChatPlan") -> AsyncIterator[ChatCompletionStreamResponse]:
        chunks = StreamChunks(ChatCompletionStreamResponse, response_id, self.served_model_name, request,
                              len(prompt.token_ids))
        generated = 0
        echo = self._echo_prefix(request)
        role = self._response_role(request)
        for index in range(params.n):
            yield chunks.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(
                role=role, content=""), logprobs=None, finish_reason=None)], 0)
        if echo:  # the echoed message follows the role chunks, in chunks of its own (vLLM's order)
            for index in range(params.n):
                yield chunks.chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(content=echo))], 0)
        parsers: dict[int, ChatOutputParser] = {}
        async for output in self.run(response_id, prompt, params):
            choices = []
            for delta in output.deltas:
                generated += len(delta.token_ids)
                parser = parsers.setdefault(delta.index, plan.parser())
                piece = parser.feed(delta.text, final=delta.finish_reason is not None)
                logprobs = None
                if params.logprobs is not None and delta.logprobs:
                    logprobs = self._chat_logprobs(delta.logprobs, params.logprobs)
                if not piece and logprobs is None and delta.finish_reason is None:
                    continue
                fields: dict[str, Any] = {}
                if piece.reasoning:
                    fields.update(reasoning_content=piece.reasoning, reasoning=piece.reasoning)
                if piece.content:
                    fields["content"] = piece.content
                if piece.tool_calls:
                    fields["tool_calls"] = piece.tool_calls
                choices.append(ChatCompletionStreamChoice(
                    index=delta.index, delta=DeltaMessage(**fields), logprobs=logprobs,
                    finish_reason=_tool_finish(delta.finish_reason, plan.calls_finish and parser.called_tools),
                    stop_reason=delta.stop_reason))
            if choices:
                yield chunks.chunk(choices, generated)
        if (last := chunks.usage(generated)) is not None:
            yield last

    # ---------------------------------------------------------------- completions

    def _completion_prompts(self, request: CompletionRequest) -> list[Prompt]:
        """Token ids (and text, for echo) of every prompt. Tokenizing and decoding are the heavy part of preparing
        a request, so the caller runs this on a worker thread; it is linear in the prompts' size."""
        tokenizer = self.engine.tokenizer
        items = request.prompts
        prompts = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if request.suffix is not None:
                    prompts.append(Prompt(self._fim_ids(item, request.suffix), item))
                    continue
                self.check_prompt_chars(item, param)
                ids = tokenizer.encode(item, request.add_special_tokens)
                if not ids:
                    raise OpenAIError("the prompt is empty after tokenization", param=param)
                prompts.append(Prompt(ids, item))
            else:
                if request.suffix is not None:
                    raise OpenAIError("suffix needs a text prompt", param="suffix")
                self._check_token_ids(item, param)
                prompts.append(Prompt(item, tokenizer.decode(item, skip_special_tokens=False)))
        total = sum(len(p.token_ids) for p in prompts)
        if total > self.config.max_prompt_tokens_per_request:
            raise OpenAIError(f"the prompts have {total} tokens together; a request may carry at most "
                              f"{self.config.max_prompt_tokens_per_request} (MAX_PROMPT_TOKENS_PER_REQUEST)",
                              param="prompt")
        return prompts

    def _fim_ids(self, prefix: str, suffix: str) -> list[int]:
        """Fill-in-the-middle prompt for models trained with FIM tokens; others cannot honour `suffix`."""
        tokenizer = self.engine.tokenizer
        markers = [tokenizer.token_id(t) for t in _FIM_TOKENS]
        if any(m is None for m in markers):
            raise OpenAIError("suffix is not supported by this model (its tokenizer has no fill-in-the-middle "
                              "tokens)", param="suffix")
        fim_prefix, fim_suffix, fim_middle = markers
        self.check_prompt_chars(prefix, "prompt")
        self.check_prompt_chars(suffix, "suffix")
        return ([fim_prefix] + tokenizer.encode(prefix, False) + [fim_suffix] + tokenizer.encode(suffix, False)
                + [fim_middle])

    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | AsyncIterator[CompletionStreamResponse]:
        await self.ready()
        self.check_model(request.model)
        self.check_generation(request, "completions", len(request.prompts))
        prompts = await asyncio.to_thread(self._completion_prompts, request)
        grammar = await self.grammar(request)
        params = await asyncio.to_thread(self.sampling_params, request, [len(p.token_ids) for p in prompts], grammar)
        response_id = random_id("cmpl")
        if request.stream:
            return self._completion_stream(request, response_id, prompts, params)
        return await self._completion_full(request, response_id, prompts, params)

    def _merged(self, response_id: str, prompts: list[Prompt], params: list[SamplingParams]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(prompts) == 1:
            return _tagged(0, self.run(response_id, prompts[0], params[0]))
        return _merge([_tagged(i, self.run(f"{response_id}-{i}", p, sp))
                       for i, (p, sp) in enumerate(zip(prompts, params))])

    async def _completion_full(self, request: CompletionRequest, response_id: str, prompts: list[Prompt],
                               params: list[SamplingParams]) -> CompletionResponse:
        n = request.n
        choices: list[dict[int, _Choice]] = [{} for _ in prompts]
        prompt_logprobs: list[list | None] = [None] * len(prompts)
        async for i, output in self._merged(response_id, prompts, params):
            _accumulate(choices[i], output)
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
        result = []
        for i, prompt in enumerate(prompts):
            for index in sorted(choices[i]):
                c = choices[i][index]
                echo = prompt.text if request.echo else ""
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(c.logprobs, c.token_ids, len(echo))
                    if request.echo:
                        head = self._completion_logprobs(prompt_logprobs[i] or [None] * len(prompt.token_ids),
                                                         prompt.token_ids, 0)
                        logprobs = _join_logprobs(head, logprobs)
                result.append(CompletionChoice(index=i * n + index, text=echo + c.text, logprobs=logprobs,
                                               finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for per_prompt in choices for c in per_prompt.values())
        return CompletionResponse(id=response_id, model=self.served_model_name, choices=result,
                                  usage=UsageInfo.of(prompt_tokens, completion_tokens))

    async def _completion_stream(self, request: CompletionRequest, response_id: str, prompts: list[Prompt],
                                 params: list[SamplingParams]) -> AsyncIterator[CompletionStreamResponse]:
        chunks = StreamChunks(CompletionStreamResponse, response_id, self.served_model_name, request,
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
        async for i, output in self._merged(response_id, prompts, params):
            choices = []
            if request.echo and request.logprobs is not None and output.prompt_logprobs is not None:
                heads[i] = self._completion_logprobs(output.prompt_logprobs, prompts[i].token_ids, 0)
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
                    logprobs = self._completion_logprobs(delta.logprobs, delta.token_ids, offsets.get(index, 0))
                if head is not None:
                    logprobs = _join_logprobs(head, logprobs or CompletionLogprobs())
                offsets[index] = offsets.get(index, 0) + len(delta.text)
                if not text and logprobs is None and delta.finish_reason is None:
                    continue
                choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                finish_reason=delta.finish_reason, stop_reason=delta.stop_reason))
            if choices:
                yield chunks.chunk(choices, generated)
        if (last := chunks.usage(generated)) is not None:
            yield last


@dataclass
class _ChatPlan:
    grammar: GrammarSpec | None
    reasoning_parser: reasoning.ReasoningParser | None
    tool_parser: tool_parsers.ToolParser | None
    max_calls: int | None
    with_special_tokens: bool
    # A reply that ends in tool calls finishes with "tool_calls", except for a named tool_choice, where OpenAI
    # (and vLLM) report "stop": the caller forced the call.
    calls_finish: bool = True

    def parser(self) -> ChatOutputParser:
        """A parser for one choice (parsers keep the state of a stream)."""
        return ChatOutputParser(self.reasoning_parser, self.tool_parser, self.max_calls)


def _tool_finish(reason: str | None, called: bool) -> str | None:
    """A reply that ends in tool calls finishes with "tool_calls" (a cut-off one keeps "length")."""
    return "tool_calls" if called and reason == "stop" else reason


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


def _log_finished(request_id: str, m) -> None:
    admitted = m.admitted or m.arrival
    first = m.first_token or admitted
    done = m.finished or first
    decode_s = done - first
    log.info("request done request=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d queue_s=%.3f "
             "prefill_s=%.3f decode_s=%.3f total_s=%.3f decode_tok_s=%.1f", request_id, m.prompt_tokens,
             m.cached_prompt_tokens, m.output_tokens, admitted - m.arrival, first - admitted, decode_s,
             done - m.arrival, (m.output_tokens - 1) / decode_s if decode_s > 0 else 0.0)


def _accumulate(choices: dict[int, _Choice], output: RequestOutput) -> None:
    for delta in output.deltas:
        c = choices.setdefault(delta.index, _Choice())
        c.text += delta.text
        c.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            c.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason


def _join_logprobs(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=head.text_offset + tail.text_offset,
                              token_logprobs=head.token_logprobs + tail.token_logprobs,
                              tokens=head.tokens + tail.tokens, top_logprobs=head.top_logprobs + tail.top_logprobs)


async def _tagged(tag: int, source: AsyncIterator) -> AsyncIterator[tuple[int, Any]]:
    async for item in source:
        yield tag, item


async def _merge(sources: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they arrive. Closing the merge closes every source."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(source: AsyncIterator) -> None:
        try:
            async for item in source:
                await queue.put((item, None))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((None, exc))
        finally:
            await queue.put((done, None))

    tasks = [asyncio.create_task(pump(s)) for s in sources]
    remaining = len(tasks)
    try:
        while remaining:
            item, exc = await queue.get()
            if exc is not None:
                if isinstance(exc, asyncio.CancelledError):
                    continue
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
