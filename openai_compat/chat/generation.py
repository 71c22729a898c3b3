"""A chat request prepared and run: what chat-like endpoints build their replies from.

`ChatServing.generate` checks a ChatCompletionRequest, renders its conversation, plans its reply (grammar,
reasoning and tool-call parsers) and builds its SamplingParams, and returns a ChatGeneration. Running it gives
each choice's reply already taken apart, as results (`results()`) or as per-step deltas (`stream()`), in the
endpoint-neutral terms of chat_output: content, reasoning, tool calls, finish reason, logprobs. Chat
completions shape these into chat JSON; an endpoint that speaks another API (Responses, Anthropic Messages)
translates its request into a ChatCompletionRequest and shapes the same results into its own objects and events.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from engine import RequestOutput, SamplingParams, TokenLogprob

from ..chat_output import ChatOutputParser, MessageDelta, ParsedMessage
from ..protocol import ChatTokenLogprob
from ..serving import Choice, OpenAIServing, Prompt, accumulate
from .plan import ChatPlan
from .protocol import ChatCompletionRequest


@dataclass
class ChoiceResult:
    """One choice of a whole reply."""
    index: int
    message: ParsedMessage  # content, reasoning and tool calls
    logprobs: list[ChatTokenLogprob] | None  # None when the request asked for none
    finish_reason: str | None  # "tool_calls" when the reply ends in calls the model chose to make
    stop_reason: int | str | None
    completion_tokens: int
    token_ids: list[int]


@dataclass
class ChoiceDelta:
    """What one engine step added to one choice of a streamed reply (the deltas of a choice add up to its
    ChoiceResult). A step that added nothing to say yields no ChoiceDelta."""
    index: int
    delta: MessageDelta  # content, reasoning and tool-call pieces
    logprobs: list[ChatTokenLogprob] | None
    finish_reason: str | None  # set on the choice's last delta
    stop_reason: int | str | None
    token_ids: list[int]  # the tokens this step generated for the choice


class ChatGeneration:
    """A checked, rendered and planned chat request, not yet run. Nothing reaches the engine until `results()`
    is awaited or `stream()` iterated, and a generation runs once. Every check that can refuse the request has
    run when it is built, so an endpoint can answer with an error before it starts a stream."""

    def __init__(self, serving: OpenAIServing, request_id: str, request: ChatCompletionRequest, prompt: Prompt,
                 params: SamplingParams, plan: ChatPlan):
        self.serving = serving
        self.request_id = request_id
        self.request = request
        self.prompt = prompt
        self.params = params
        self.plan = plan
        self.completion_tokens = 0  # generated so far, over all choices
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when the request asked for them
        self.cached_prompt_tokens = 0  # prompt tokens the prefix cache served (known once the run ends)

    @property
    def n(self) -> int:
        """Choices returned (indexes 0..n-1)."""
        return self.params.n

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    def _logprobs(self, entries: list[TokenLogprob]) -> list[ChatTokenLogprob]:
        return self.serving.token_logprobs(entries, self.params.logprobs, self.request.return_tokens_as_token_ids)

    def _metrics(self, output: RequestOutput) -> None:
        if output.metrics is not None:
            self.cached_prompt_tokens = output.metrics.cached_prompt_tokens

    async def results(self) -> list[ChoiceResult]:
        """Run to the end; each choice's reply, in index order."""
        choices: dict[int, Choice] = {}
        async for output in self.serving.run(self.request_id, self.prompt, self.params):
            accumulate(choices, output)
            if output.prompt_logprobs is not None:
                self.prompt_logprobs = output.prompt_logprobs
            self._metrics(output)
        results = []
        for index in sorted(choices):
            c = choices[index]
            parsed = self.plan.parser().parse(c.text)
            results.append(ChoiceResult(
                index, parsed, self._logprobs(c.logprobs) if self.params.logprobs is not None else None,
                self.plan.finish_reason(c.finish_reason, bool(parsed.tool_calls)), c.stop_reason, len(c.token_ids),
                c.token_ids))
        self.completion_tokens = sum(r.completion_tokens for r in results)
        return results

    async def stream(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Run, yielding what each engine step added to the choices (steps that added nothing to say are
        skipped). `completion_tokens` counts the tokens generated up to the yielded step."""
        parsers: dict[int, ChatOutputParser] = {}
        async for output in self.serving.run(self.request_id, self.prompt, self.params):
            self._metrics(output)
            step = []
            for delta in output.deltas:
                self.completion_tokens += len(delta.token_ids)
                parser = parsers.setdefault(delta.index, self.plan.parser())
                piece = parser.feed(delta.text, final=delta.finish_reason is not None)
                logprobs = None
                if self.params.logprobs is not None and delta.logprobs:
                    logprobs = self._logprobs(delta.logprobs)
                if not piece and logprobs is None and delta.finish_reason is None and not (
                        self.request.return_token_ids and delta.token_ids):
                    continue
                step.append(ChoiceDelta(delta.index, piece, logprobs,
                                        self.plan.finish_reason(delta.finish_reason, parser.called_tools),
                                        delta.stop_reason, list(delta.token_ids)))
            if step:
                yield step
