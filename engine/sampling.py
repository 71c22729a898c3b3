"""Sampling parameters and the batched sampler that turns one step's logits into next tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .structured import GrammarMatcher, GrammarSpec

_GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. Values are validated by the caller (the serving layer)."""

    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1  # sequences returned
    best_of: int | None = None  # sequences generated (the n with the highest cumulative logprob are returned)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # alternatives per prompt token; None: none
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    grammar: "GrammarSpec | None" = None  # structured output: tokens are masked to those the grammar allows

    @property
    def greedy(self) -> bool:
        # Below this, sampling is argmax in all but name, and dividing logits by the temperature overflows
        # float32 into inf and NaN (vLLM draws the same line).
        return self.temperature < _GREEDY_BELOW

    @property
    def num_sequences(self) -> int:
        return max(self.n, self.best_of or 1)

    @property
    def needs_logprobs(self) -> bool:
        """Logprobs are computed for the caller, or to rank best_of candidates."""
        return self.logprobs is not None or self.num_sequences > self.n


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


class SequenceSamplingState:
    """Per-sequence sampling state: its random generator and the token counts penalties need."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], index: int, vocab_size: int, device):
        self.params = params
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            # Distinct but reproducible streams for the n choices of one seeded request.
            self.generator = torch.Generator(device=device).manual_seed(params.seed + index)
        self.output_counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        if params.presence_penalty or params.frequency_penalty:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [i for i in prompt_ids if 0 <= i < vocab_size]
            if ids:
                self.seen[torch.tensor(ids, device=device)] = True
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab_size}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None

    def record(self, token_id: int) -> None:
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True

    @property
    def is_plain(self) -> bool:
        """True when the row can be sampled without any per-row processing (the common greedy case)."""
        p = self.params
        return (p.greedy and self.output_counts is None and self.seen is None and self.bias_ids is None
                and p.min_tokens == 0)


class Sampler:
    """Samples one token per row of a [rows, vocab] logits tensor, each row with its own parameters."""

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int):
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, states: list[SequenceSamplingState], num_generated: list[int],
               matchers: "list[GrammarMatcher | None] | None" = None) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits[:, : self.vocab_size].float()
        raw_logits = logits  # logprobs are reported from the model's own distribution (vLLM's default)
        # ---- structured output: mask the rows that have a grammar (a copy; the model's logits stay intact)
        constrained = [i for i, m in enumerate(matchers or ()) if m is not None]
        if constrained:
            from .structured import allocate_bitmask, apply_bitmask
            bitmask = allocate_bitmask(len(constrained), self.vocab_size)
            for slot, row in enumerate(constrained):
                matchers[row].fill_bitmask(bitmask, slot)
            logits = logits.clone()
            apply_bitmask(logits, bitmask, constrained)
        # ----
        rows = len(states)
        tokens: list[int] = [0] * rows
        logprobs: list[TokenLogprob | None] = [None] * rows

        plain = [i for i, s in enumerate(states) if s.is_plain]
        if plain:
            index = torch.tensor(plain, device=logits.device)
            chosen = logits.index_select(0, index).argmax(dim=-1).tolist() if len(plain) < rows else \
                logits.argmax(dim=-1).tolist()
            for row, token in zip(plain, chosen):
                tokens[row] = token
        for row, state in enumerate(states):
            if not state.is_plain:
                tokens[row] = self._sample_row(logits[row], state, num_generated[row])

        wanted = [i for i, s in enumerate(states) if s.params.needs_logprobs]
        if wanted:
            index = torch.tensor(wanted, device=logits.device)
            chosen_ids = torch.tensor([tokens[i] for i in wanted], device=logits.device)
            for row, entry in zip(wanted, self.logprobs_of(raw_logits.index_select(0, index), chosen_ids,
                                                             [states[i].params.logprobs or 0 for i in wanted])):
                logprobs[row] = entry
        for row, state in enumerate(states):
            state.record(tokens[row])
        for row in constrained:  # structured output: advance each grammar by its sampled token
            matchers[row].accept(tokens[row])
        return tokens, logprobs

    @staticmethod
    def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_counts: list[int]) -> list[TokenLogprob]:
        """Raw model logprobs (before penalties and temperature, as vLLM reports them)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen_lp = logp.gather(1, chosen.view(-1, 1)).view(-1).tolist()
        k = max(top_counts)
        top_vals = top_ids = None
        if k > 0:
            top_vals, top_ids = logp.topk(k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out = []
        for i, token in enumerate(chosen.tolist()):
            top = list(zip(top_ids[i][: top_counts[i]], top_vals[i][: top_counts[i]])) if k else []
            out.append(TokenLogprob(token, chosen_lp[i], top))
        return out

    def _sample_row(self, logits: torch.Tensor, state: SequenceSamplingState, generated: int) -> int:
        p = state.params
        logits = logits.clone()
        if state.bias_ids is not None:
            logits.index_add_(0, state.bias_ids, state.bias_values)
        if generated < p.min_tokens:
            blocked = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < logits.numel()]
            if blocked:
                logits[torch.tensor(blocked, device=logits.device)] = float("-inf")
        if state.seen is not None:
            penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(state.seen, penalized, logits)
        if state.output_counts is not None:
            counts = state.output_counts
            logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        if p.greedy:
            return int(logits.argmax())

        # An extreme (valid) repetition penalty or temperature can push logits to +inf, and inf - inf makes
        # softmax NaN; the largest finite value keeps the order and the arithmetic sound.
        logits = (logits / p.temperature).clamp(max=torch.finfo(logits.dtype).max)
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Drop a token when the mass before it already reaches top_p; the best token always stays.
            drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
            drop_sorted[0] = False
            logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=state.generator))
