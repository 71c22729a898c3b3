"""What every generating (and pooling) endpoint shares: OpenAIServing holds the engine, the serving
configuration, the metrics and the grammar cache, and does the checks and steps any endpoint runs through: the
model loaded and named, the request's size and sampling parameters against the model, prompt text and token
ids against the context and vocabulary, a generation run (timed, logged, metered), logprobs shaped as chat
reports them.

Each endpoint family's serving (chat/, completions/, pooling/, tokenization/, legacy/) takes one OpenAIServing
and keeps its own request shapes and outputs.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from engine import (AdapterError, AnswerGate, AsyncEngine, GenerationError, GrammarFailure, GrammarSpec, ImageInputs,
                    RequestOutput, SamplingParams, TokenLogprob, redact)

from . import reasoning, tool_parsers
from .config import ServingConfig
from .errors import OpenAIError, context_exceeded
from .metrics import ServingMetrics
from .protocol import ChatTokenLogprob, RequestLimits, TopLogprob, token_name
from .sampling import SamplingFields
from .structured import GrammarCache

log = logging.getLogger("openai_compat")

MIN_LOGPROB = -9999.0  # what vLLM reports for -inf


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # for echo; decoded from the ids when the prompt came as ids
    images: ImageInputs | None = None  # a vision model's image inputs for this prompt (chat/render.py)


@dataclass
class Choice:
    """One choice assembled from a whole run's deltas."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def accumulate(choices: dict[int, Choice], output: RequestOutput) -> None:
    """Add one engine output's deltas to the choices they belong to."""
    for delta in output.deltas:
        c = choices.setdefault(delta.index, Choice())
        c.text += delta.text
        c.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            c.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServingConfig):
        self.engine = engine
        self.config = config
        self.metrics = ServingMetrics(engine, lambda: self.served_model_name)
        self.grammars = GrammarCache()
        self._tool_format: tuple[str | None, str] | None = None
        self._reasoning_format: tuple[str | None] | None = None

    # ---------------------------------------------------------------- the model

    async def ready(self) -> None:
        """Load the model (first call only)."""
        try:
            await self.engine.start()
        except Exception as exc:
            raise OpenAIError(redact(f"the model could not be loaded: {exc}"), status=500) from exc
        self.tool_format()
        self.reasoning_format()

    def reasoning_format(self) -> str | None:
        """The reasoning parser's name (REASONING_PARSER's): the setting, else the one for the thinking markers
        the chat template writes. Decided once, when the model has loaded, and logged."""
        if self._reasoning_format is None:
            tokenizer = self.engine.tokenizer
            render = tokenizer.render_chat if tokenizer.has_chat_template else None
            self._reasoning_format = (reasoning.recognise(self.config.reasoning_parser, tokenizer.chat_template,
                                                          render),)
            log.info("reasoning parser: %s", self._reasoning_format[0] or "none (thinking, if any, stays in content)")
        return self._reasoning_format[0]

    def tool_format(self) -> str | None:
        """The tool-call format (TOOL_CALL_PARSER's name) of tool_choice "auto": the setting, else the one the
        chat template writes (None: unknown). Decided once, when the model has loaded, and logged with why."""
        if self._tool_format is None:
            tokenizer = self.engine.tokenizer
            if self.config.tool_call_parser:
                self._tool_format = (self.config.tool_call_parser, "TOOL_CALL_PARSER names it")
            elif not tokenizer.has_chat_template:
                self._tool_format = (None, "the model has no chat template")
            else:
                self._tool_format = tool_parsers.recognise(tokenizer.render_chat)
            name, why = self._tool_format
            log.info("tool-call format: %s (%s)", name or "none recognised; set TOOL_CALL_PARSER", why)
        return self._tool_format[0]

    async def ready_for(self, model: str | None) -> None:
        """Load the model and check that the request names it, one of its LoRA adapters, or no model."""
        await self.ready()
        self.check_model(model)

    @property
    def served_model_name(self) -> str:
        return self.config.served_model_name or self.engine.model_name

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name and self.adapter_of(name) is None:
            raise OpenAIError(f"The model `{name}` does not exist.", status=404, param="model")

    def adapter_of(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (engine/lora/), or None for the base model."""
        if name is None or name == self.served_model_name or not self.engine.lora_enabled:
            return None
        return name if name in self.engine.lora_names() else None

    def check_generates(self, endpoint: str) -> None:
        """Embedding and cross-encoder models have no language-model head: generation routes are a 400."""
        task = self.engine.task
        if task != "generate":
            kind = "an embedding" if task == "embed" else "a classification (cross-encoder)"
            raise OpenAIError(f"the served model {self.served_model_name} is {kind} model with no language-model "
                              f"head, so it cannot do {endpoint}; it serves /v1/embeddings, /pooling, /score, "
                              f"/rerank and /tokenize")

    def request_limits(self) -> RequestLimits:
        """What one request may carry (the model must be loaded)."""
        return RequestLimits(max_prompts=self.config.max_prompts_per_request,
                             max_prompt_tokens=self.config.max_prompt_tokens_per_request,
                             context_tokens=self.engine.max_model_len,
                             max_token_chars=self.engine.tokenizer.max_token_chars)

    # ---------------------------------------------------------------- a generation request

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
                        with_special_tokens: bool = False, model: str | None = None) -> list[SamplingParams]:
        """The SamplingParams of each prompt of a request, checked against the model; the request maps its own
        fields (`to_sampling_params`). What does not depend on the prompt is checked and built once (a logit_bias
        can name every token of the vocabulary), so this is linear in the request's size. The caller has run
        `check_generation`. The LoRA adapter is the one the request's `model` (or `model`, for requests that
        name it elsewhere) names."""
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
        self.check_in_vocabulary(request.allowed_token_ids or (), "allowed_token_ids")
        self._check_speculation(request)
        if grammar is not None and request.beam_search:
            raise OpenAIError("structured outputs cannot be combined with beam search (beams are scored, not "
                              "masked)", param="use_beam_search")
        first = request.to_sampling_params(budgets[0], self.engine.generation_defaults, grammar, with_special_tokens,
                                           self.bad_words_ids(request.bad_words or ()))
        adapter = self.adapter_of(model if model is not None else getattr(request, "model", None))
        if adapter is not None:
            first = dataclasses.replace(first, lora_name=adapter)
        unsupported = self.engine.check_supported(first)
        if unsupported is not None:
            raise OpenAIError(unsupported, param="use_beam_search")
        return [first] + [dataclasses.replace(first, max_tokens=m) for m in budgets[1:]]

    def bad_words_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """Each bad word as the token sequences it may be generated as: alone (as at the start of a text) and
        after a space, where a tokenizer spells it differently (vLLM bans both)."""
        encode = self.engine.tokenizer.encode
        found: list[tuple[int, ...]] = []
        for word in words:
            bare = tuple(encode(word.lstrip(), False))
            spaced = tuple(encode(" " + word.lstrip(), False))
            for ids in (bare, spaced):
                if ids and ids not in found:
                    found.append(ids)
        return tuple(found)

    def truncated(self, request: SamplingFields, ids: list[int]) -> list[int]:
        """The prompt cut to its last truncate_prompt_tokens tokens, when the request asks (as vLLM keeps the
        end of a prompt, nearest the reply)."""
        keep = request.truncate_prompt_tokens
        return ids[-keep:] if keep is not None and len(ids) > keep else ids

    def _max_tokens(self, request: SamplingFields, prompt_len: int) -> int:
        """The completion budget of one prompt: what was asked for, or the rest of the context."""
        limit = self.engine.max_model_len
        max_tokens, max_tokens_param = request.max_tokens_asked, request.max_tokens_param
        self.check_prompt_len(prompt_len, request.prompt_param)
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
            async for output in self.engine.generate(request_id, prompt.token_ids, params, prompt.images):
                recorder.output(output)
                for delta in output.deltas:
                    outputs[delta.index] = outputs.get(delta.index, "") + delta.text
                if output.finished and output.metrics is not None:
                    _log_finished(request_id, output.metrics)
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("request=%s outputs=%r", request_id, [outputs[i] for i in sorted(outputs)])
                yield output
        except GenerationError as exc:
            cause = exc.__cause__
            if isinstance(cause, AdapterError):  # the request's adapter was unloaded while it waited for a slot
                raise OpenAIError(str(cause), status=404, param="model") from exc
            if isinstance(cause, GrammarFailure) and cause.too_complex:
                raise OpenAIError(f"the output constraint cannot be followed: {cause}. The grammar engine gave up "
                                  f"on it; a schema that recurses without a way to end does this") from exc
            raise OpenAIError(f"generation failed: {exc}", status=500) from exc

    def run_prompts(self, request_id: str, prompts: list[Prompt], params: list[SamplingParams]
                    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of several prompts as they come, each tagged with its prompt's index (one prompt runs
        under `request_id`, several under `request_id-<index>`)."""
        if len(prompts) == 1:
            return _tagged(0, self.run(request_id, prompts[0], params[0]))
        return _merge([_tagged(i, self.run(f"{request_id}-{i}", p, sp))
                       for i, (p, sp) in enumerate(zip(prompts, params))])

    # ---------------------------------------------------------------- prompts

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

    def check_prompt_len(self, prompt_len: int, param: str) -> None:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise OpenAIError(context_exceeded(limit, f"your prompt has {prompt_len} tokens, leaving no room for a "
                                                      f"completion", "the length of the prompt"), param=param)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        self.check_prompt_len(len(ids), param)  # before walking (and decoding) millions of ids
        self.check_in_vocabulary(ids, param)

    def check_in_vocabulary(self, ids, param: str) -> None:
        vocab = self.engine.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param=param)

    # ---------------------------------------------------------------- logprobs

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.token_text(token_id)

    def token_logprobs(self, entries: list[TokenLogprob], top_n: int, as_ids: bool = False
                       ) -> list[ChatTokenLogprob]:
        """Generated tokens' logprobs as chat reports them, each with its `top_n` most likely alternatives;
        `as_ids` names tokens `token_id:<id>` (return_tokens_as_token_ids)."""
        content = []
        for entry in entries:
            text = token_name(self.token_text(entry.token_id), entry.token_id, as_ids)
            top = [TopLogprob(token=(t := token_name(self.token_text(tid), tid, as_ids)), logprob=max(lp, MIN_LOGPROB),
                              bytes=list(t.encode("utf-8"))) for tid, lp in entry.top[:top_n]]
            content.append(ChatTokenLogprob(token=text, logprob=max(entry.logprob, MIN_LOGPROB),
                                            bytes=list(text.encode("utf-8")), top_logprobs=top))
        return content


def _log_finished(request_id: str, m) -> None:
    admitted = m.admitted or m.arrival
    first = m.first_token or admitted
    done = m.finished or first
    decode_s = done - first
    log.info("request done request=%s prompt_tokens=%d cached_tokens=%d output_tokens=%d queue_s=%.3f "
             "prefill_s=%.3f decode_s=%.3f total_s=%.3f decode_tok_s=%.1f", request_id, m.prompt_tokens,
             m.cached_prompt_tokens, m.output_tokens, admitted - m.arrival, first - admitted, decode_s,
             done - m.arrival, (m.output_tokens - 1) / decode_s if decode_s > 0 else 0.0)


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
