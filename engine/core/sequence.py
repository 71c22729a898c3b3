"""What the engine keeps per request (a group) and per generated sequence (one per `n`/`best_of` choice)."""
from __future__ import annotations

import contextvars
import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.detokenizer import StopStringMatcher
from engine.sampling.sampler import SamplingParams, SequenceSamplingState, TokenLogprob
from engine.tokenizer import Tokenizer


@dataclass
class SequenceDelta:
    """What one sequence produced since its last delta."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestMetrics:
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[SequenceDelta]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: RequestMetrics | None = None
    error: BaseException | None = None


class OutputSink(Protocol):
    """Where a request's outputs go. `deliver` is called on the engine thread and must not block."""

    def deliver(self, output: RequestOutput) -> None: ...


class Status(enum.IntEnum):
    WAITING = 0  # holds no blocks
    PREFILLING = 1  # computing its tokens into the cache
    FORK_PENDING = 2  # a further choice of a prompt still prefilling: it forks when the prompt is done
    DECODING = 3
    FINISHED = 4
    BEAM_PARKED = 5  # a beam whose next-token logits are in, waiting for its sibling beams' (beam_search.py)


class Sequence:
    def __init__(self, group: "SequenceGroup", index: int, tokenizer: Tokenizer, vocab_size: int, device):
        params = group.params
        self.group = group
        self.index = index
        self.tokens = list(group.prompt_ids)
        self.num_computed = 0  # tokens whose keys and values are in the cache
        self.blocks: list[int] = []
        self.block_keys: list[int] = []  # prefix-cache keys of its first full blocks
        self.state_slot: int | None = None  # its recurrent-state slot, for models that keep one (state_cache.py)
        self.status = Status.WAITING
        self.sampling = SequenceSamplingState(params, group.prompt_ids, index, vocab_size, device)
        self.detok = tokenizer.detokenizer(group.prompt_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.sent_chars = 0
        self.new_ids: list[int] = []
        self.new_logprobs: list[TokenLogprob] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.proposal: list[int] = []  # speculative tokens to verify this step (speculative.py)
        self.proposal_at = -1  # len(tokens) when they were proposed

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.group.prompt_ids)

    @property
    def cache_tokens(self) -> list[int]:
        """The tokens as the prefix cache keys them: a prompt's image positions by their image's content (two
        prompts with the same image tokens but different images never share a block)."""
        images = self.group.images
        if images is None or images.key_ids is None:
            return self.tokens
        return images.key_ids + self.tokens[len(images.key_ids):]

    @property
    def prefill_target(self) -> int:
        """Tokens to have in the cache before decoding: the whole prompt for a new sequence (its last position
        gives the first token); all but the last token for one resumed after preemption (the last is the next
        decode step's input)."""
        return len(self.tokens) - (1 if self.num_generated else 0)

    @property
    def finished(self) -> bool:
        return self.status == Status.FINISHED


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival=time.perf_counter()))
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    done: bool = False
    # The submitter's context (made on its thread): log lines about the request carry its job id.
    context: contextvars.Context = field(default_factory=contextvars.copy_context)
    beam: object | None = None  # beam_search.BeamState of a beam-search request
    images: object | None = None  # engine.vision.ImageInputs of a prompt with images (vision-language models)
    # Its LoRA adapter's slot (engine/lora/registry.py) while it holds one (admitted), and the adapter's
    # prefix-cache key; 0 and None for the base model.
    lora_slot: int = 0
    lora_key: str | None = None

    @property
    def holds_output(self) -> bool:
        """best_of > n: candidates are ranked when all finish, so nothing streams before that."""
        return self.params.num_sequences > self.params.n or self.params.beam_search

    @property
    def started(self) -> bool:
        """The prompt has been computed and the choices forked (from then on each sequence runs on its own)."""
        return any(s.num_generated for s in self.seqs)

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def enqueue(waiting, group: SequenceGroup) -> None:
    """Put `group` in a waiting queue (a deque or list) by priority (lowest value first), then arrival: with
    every priority equal, a new request goes last and a preempted one (older than everything waiting) first.
    Both loops admit from the front."""
    key = (group.params.priority, group.metrics.arrival)
    at = len(waiting)
    while at > 0 and (waiting[at - 1].params.priority, waiting[at - 1].metrics.arrival) > key:
        at -= 1
    waiting.insert(at, group)
