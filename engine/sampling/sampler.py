"""Sampling parameters and the batched sampler that turns one step's logits into next tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.cpu import native_kernels

if TYPE_CHECKING:
    from engine.sampling.structured import GrammarSpec

_GREEDY_BELOW = 1e-5
_ARGMAX_CHUNK = 1024
_DRAW_CHUNK = 1024


def argmax(x: torch.Tensor, cpu_fast_path: bool = True) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a [rows, vocab] tensor; on the CPU path (not under DEVICE=cuda-sim, which runs what
    CUDA runs) the chunked argmax below."""
    if not cpu_fast_path or x.device.type != "cpu" or x.shape[-1] // _ARGMAX_CHUNK < 2:
        return x.argmax(dim=-1)
    return chunked_argmax(x)


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)`, the same indices (first of equal maxima), faster on CPU, whose argmax runs
    unvectorised: each chunk's maximum (a vectorised reduction), the first chunk holding the row's maximum, then
    argmax within that chunk only. At least two chunks wide."""
    vocab = x.shape[-1]
    chunks = vocab // _ARGMAX_CHUNK
    maxima = x[:, :chunks * _ARGMAX_CHUNK].unflatten(1, (chunks, _ARGMAX_CHUNK)).amax(dim=-1)
    if chunks * _ARGMAX_CHUNK < vocab:
        maxima = torch.cat([maxima, x[:, chunks * _ARGMAX_CHUNK:].amax(dim=-1, keepdim=True)], dim=1)
    # The last window ends at the vocabulary's end; a maximum it shares with the chunk before would have
    # chosen that chunk, so its first maximum is the row's.
    start = (maxima.argmax(dim=-1) * _ARGMAX_CHUNK).clamp_(max=vocab - _ARGMAX_CHUNK)
    window = x.gather(1, start.view(-1, 1) + torch.arange(_ARGMAX_CHUNK, device=x.device))
    return window.argmax(dim=-1) + start


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [rows, vocab] (non-negative, any total), where the row's uniform in [0, 1) falls
    when its probabilities are laid end to end: one random number a row. (The exponential race needs one per token,
    and drawing a vocabulary's worth of random numbers a row took a large share of a decode step on CPU.)
    Two levels keep the running sums exact enough: the masses of chunks of _DRAW_CHUNK tokens and their running sum
    in float64, then the running sum within the chosen chunk only. A token of probability 0 is never drawn."""
    rows, vocab = probs.shape
    chunks = -(-vocab // _DRAW_CHUNK)
    if chunks * _DRAW_CHUNK != vocab:
        probs = torch.nn.functional.pad(probs, (0, chunks * _DRAW_CHUNK - vocab))
    blocks = probs.view(rows, chunks, _DRAW_CHUNK)
    ends = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)  # [rows, chunks]
    target = uniforms.view(rows, 1).to(torch.float64) * ends[:, -1:]
    # The first chunk whose end passes the target (a chunk of mass 0 ends where the one before it does, so never).
    chunk = torch.searchsorted(ends, target, right=True).clamp_(max=chunks - 1)  # [rows, 1]
    start = torch.where(chunk > 0, ends.gather(1, (chunk - 1).clamp_(min=0)), 0.0)
    inner = blocks.gather(1, chunk.view(rows, 1, 1).expand(rows, 1, _DRAW_CHUNK)).view(rows, _DRAW_CHUNK)
    at = torch.searchsorted(inner.cumsum(dim=-1, dtype=torch.float64), target - start, right=True)
    at = at.clamp_(max=_DRAW_CHUNK - 1)
    # Where rounding carried the target past the chunk's last token of mass, its likeliest token instead.
    at = torch.where(inner.gather(1, at) > 0, at, inner.argmax(dim=-1, keepdim=True))
    return (chunk * _DRAW_CHUNK + at).view(rows)


def _temperature_only(params: "SamplingParams", vocab: int) -> bool:
    """No top-k, min-p or top-p: the row's distribution is the softmax of its logits over its temperature."""
    return not 0 < params.top_k < vocab and params.min_p <= 0.0 and params.top_p >= 1.0


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
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens may be generated; None: any
    # Token sequences never generated: the last token of each is banned wherever the tokens before it were just
    # generated (a one-token sequence is banned everywhere), as vLLM's bad_words.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None  # alternatives per prompt token; None: none
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    grammar: "GrammarSpec | None" = None  # structured output: tokens are masked to those the grammar allows
    # Beam search (engine/core/beam_search.py): num_sequences beams, the n best finished ones returned.
    beam_search: bool = False
    length_penalty: float = 1.0  # a finished beam scores sum(logprobs) / generated_tokens ** length_penalty
    early_stopping: bool | str = False  # True | False | "never", as transformers
    num_beam_groups: int = 1  # diverse (group) beam search when > 1
    diversity_penalty: float = 0.0  # subtracted per earlier group that chose the same token at a step
    # Speculative decoding (speculative.py), OVMS's per-request controls: draft length, or the draft model's
    # confidence below which it stops drafting.
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    # Scheduling: waiting requests are admitted lowest priority value first (then by arrival), and the running
    # request with the highest value gives way first when the KV cache is full (vLLM's priority scheduling).
    priority: int = 0
    # Prefix-cache isolation: cached blocks are shared only between requests with the same salt (tenants).
    cache_salt: str | None = None
    # The LoRA adapter it runs with (engine/lora/), by name; None: the base model.
    lora_name: str | None = None

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
        return self.logprobs is not None or (self.num_sequences > self.n and not self.beam_search)


def bad_word_ends(words, generated: list[int]) -> list[int]:
    """The tokens a bad word would end with next: each word's last token where its other tokens were just
    generated (a one-token word: always)."""
    ends = []
    for word in words:
        head = len(word) - 1
        if head == 0 or (len(generated) >= head and generated[-head:] == list(word[:-1])):
            ends.append(word[-1])
    return ends


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs report it, as vLLM)


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
        # Structured output: the grammar's state for this sequence (advanced by every token it samples).
        self.matcher = params.grammar.new_matcher() if params.grammar is not None else None
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= t < vocab_size}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None
        self.banned: torch.Tensor | None = None  # True for every token outside allowed_token_ids
        if params.allowed_token_ids is not None:
            self.banned = torch.ones(vocab_size, dtype=torch.bool, device=device)
            allowed = [i for i in params.allowed_token_ids if 0 <= i < vocab_size]
            if allowed:
                self.banned[torch.tensor(allowed, device=device)] = False
        self.bad_words = [w for w in params.bad_words_ids if w and 0 <= w[-1] < vocab_size]
        self._context = max((len(w) for w in self.bad_words), default=1) - 1
        self.recent: list[int] = []  # the last generated tokens bad words are matched against

    def record(self, token_id: int) -> None:
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True
        if self._context:
            self.recent.append(token_id)
            del self.recent[:-self._context]

    def adjusts_logits(self, generated: int) -> bool:
        """True when this row's logits need a per-row treatment (bias, allowed tokens, bad words, penalties,
        min_tokens) before choosing."""
        return (self.output_counts is not None or self.seen is not None or self.bias_ids is not None
                or self.banned is not None or bool(self.bad_words) or generated < self.params.min_tokens)



class Sampler:
    """Samples one token per row of a [rows, vocab] logits tensor, each row with its own parameters.

    The whole batch is processed with tensor operations (rows that share a treatment share the operation) and
    everything the caller needs leaves the device in one transfer, so a step costs one synchronisation however
    many rows it samples. A random draw takes one uniform number per row (`draw`), so each seeded row draws from
    its own generator and its tokens do not depend on the rows beside it.
    """

    def __init__(self, eos_token_ids: frozenset[int], vocab_size: int, cpu_fast_paths: bool = True):
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.cpu_fast_paths = cpu_fast_paths  # the platform's (engine/devices.py): False on the CUDA path

    def sample(self, logits: torch.Tensor, states: list[SequenceSamplingState],
               num_generated: list[int]) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits[:, : self.vocab_size].float()
        device = logits.device
        rows = len(states)
        wanted = [i for i, s in enumerate(states) if s.params.needs_logprobs]
        raw_logp = torch.log_softmax(logits[wanted], dim=-1) if wanted else None  # as vLLM reports them

        adjusted = [i for i, s in enumerate(states) if s.adjusts_logits(num_generated[i])]
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        if adjusted or constrained:
            logits = logits.clone()
            for i in adjusted:
                logits[i] = self._adjust_row(logits[i], states[i], num_generated[i])
        if constrained:  # structured output: only the tokens each row's grammar allows next
            from engine.sampling.structured import allocate_bitmask, apply_bitmask
            bitmask = allocate_bitmask(len(constrained), self.vocab_size)
            for slot, row in enumerate(constrained):
                states[row].matcher.fill_bitmask(bitmask, slot)
            apply_bitmask(logits, bitmask, constrained, self.cpu_fast_paths)

        tokens = torch.empty(rows, dtype=torch.long, device=device)
        greedy = [i for i, s in enumerate(states) if s.params.greedy]
        if len(greedy) == rows:
            tokens = argmax(logits, self.cpu_fast_paths)
        elif greedy:
            tokens[greedy] = argmax(logits[greedy], self.cpu_fast_paths)
        drawn = [i for i, s in enumerate(states) if not s.params.greedy]
        if len(drawn) == rows:  # every row: no copy of the rows
            tokens = self._draw(logits, states)
        elif drawn:
            tokens[drawn] = self._draw(logits[drawn], [states[i] for i in drawn])

        # One transfer for the chosen tokens and every logprob asked for.
        parts = [tokens.double()]
        top_k = 0
        if wanted:
            chosen = raw_logp.gather(1, tokens[wanted].view(-1, 1)).view(-1)
            parts.append(chosen.double())
            top_k = max(states[i].params.logprobs or 0 for i in wanted)
            if top_k:
                top_vals, top_ids = raw_logp.topk(top_k, dim=-1)
                parts += [top_vals.double().flatten(), top_ids.double().flatten()]
        flat = torch.cat(parts).tolist()
        token_list = [int(t) for t in flat[:rows]]
        logprobs: list[TokenLogprob | None] = [None] * rows
        if wanted:
            n = len(wanted)
            chosen_lp = flat[rows:rows + n]
            vals = flat[rows + n:rows + n + n * top_k]
            ids = flat[rows + n + n * top_k:]
            for j, row in enumerate(wanted):
                k = states[row].params.logprobs or 0
                top = [(int(ids[j * top_k + c]), vals[j * top_k + c]) for c in range(k)]
                logprobs[row] = TokenLogprob(token_list[row], chosen_lp[j], top)
        for state, token in zip(states, token_list):
            state.record(token)
        for row in constrained:  # last, so a retried row never feeds its grammar the same step twice
            states[row].matcher.accept(token_list[row])
        return token_list, logprobs

    @staticmethod
    def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, top_counts: list[int]) -> list[TokenLogprob]:
        """Raw model logprobs (before penalties and temperature, as vLLM reports them)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen_col = logp.gather(1, chosen.view(-1, 1))
        ranks = ((logp > chosen_col).sum(dim=-1) + 1).tolist()
        chosen_lp = chosen_col.view(-1).tolist()
        k = max(top_counts)
        top_vals = top_ids = None
        if k > 0:
            top_vals, top_ids = logp.topk(k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out = []
        for i, token in enumerate(chosen.tolist()):
            top = list(zip(top_ids[i][: top_counts[i]], top_vals[i][: top_counts[i]])) if k else []
            out.append(TokenLogprob(token, chosen_lp[i], top, ranks[i]))
        return out

    def _adjust_row(self, logits: torch.Tensor, state: SequenceSamplingState, generated: int) -> torch.Tensor:
        """Logit bias, min_tokens and the penalties: per-row treatments (rare), still without synchronising."""
        p = state.params
        if state.bias_ids is not None:
            logits.index_add_(0, state.bias_ids, state.bias_values)
        if state.banned is not None:
            logits = logits.masked_fill(state.banned, float("-inf"))
        if state.bad_words:
            ends = bad_word_ends(state.bad_words, state.recent)
            if ends:
                logits[torch.tensor(ends, device=logits.device)] = float("-inf")
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
        return logits

    def distribution(self, logits: torch.Tensor, state: SequenceSamplingState, generated: int) -> torch.Tensor:
        """The probabilities one row's token is drawn from (penalties, temperature, top-k, min-p, top-p applied):
        speculative decoding's rejection sampling needs them."""
        row = logits[: self.vocab_size].float()
        if state.adjusts_logits(generated):
            row = self._adjust_row(row.clone(), state, generated)
        return self._probabilities(row.view(1, -1), [state])[0]

    def _draw(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        """One draw per row, each with its own uniform number: rows with temperature alone through the native
        kernel where the CPU kernels are active (engine/cpu/native_kernels.py: one call, softmax included), the
        others (top-k, min-p, top-p) through PyTorch. Which path a row takes depends on its own parameters only, so
        a seeded row's tokens do not depend on the rows beside it."""
        device = logits.device
        rows, vocab = logits.shape
        uniforms = torch.empty(rows, dtype=torch.float64, device=device)
        unseeded = [row for row, state in enumerate(states) if state.generator is None]
        if len(unseeded) == rows:
            uniforms.uniform_()
        elif unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
        for row, state in enumerate(states):
            if state.generator is not None:
                uniforms[row] = torch.rand((), generator=state.generator, dtype=torch.float64, device=device)
        kernels = native_kernels.active() if self.cpu_fast_paths and device.type == "cpu" else None
        plain = [] if kernels is None else [row for row, state in enumerate(states)
                                            if _temperature_only(state.params, vocab)]
        if not plain:
            return draw(self._probabilities(logits, states), uniforms)
        scale = torch.tensor([1.0 / states[row].params.temperature for row in plain], dtype=torch.float32)
        if len(plain) == rows:
            return kernels.draw_tokens(logits, scale, uniforms)
        tokens = torch.empty(rows, dtype=torch.long, device=device)
        tokens[plain] = kernels.draw_tokens(logits[plain], scale, uniforms[plain])
        own = set(plain)
        rest = [row for row in range(rows) if row not in own]
        tokens[rest] = draw(self._probabilities(logits[rest], [states[row] for row in rest]), uniforms[rest])
        return tokens

    @staticmethod
    def _probabilities(logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        device = logits.device
        params = [s.params for s in states]
        temperature = torch.tensor([p.temperature for p in params], device=device).view(-1, 1)
        # An extreme (valid) repetition penalty or temperature can push logits to +inf, and inf - inf makes
        # softmax NaN; the largest finite value keeps the order and the arithmetic sound.
        logits = (logits / temperature).clamp(max=torch.finfo(logits.dtype).max)
        vocab = logits.shape[-1]
        if any(0 < p.top_k < vocab for p in params):
            ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
            kth = logits.topk(max(ks), dim=-1).values
            cut = kth.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).view(-1, 1))
            cut = cut.masked_fill(torch.tensor([k == 0 for k in ks], device=device).view(-1, 1), float("-inf"))
            logits = logits.masked_fill(logits < cut, float("-inf"))
        if any(p.min_p > 0.0 for p in params):
            probs = torch.softmax(logits, dim=-1)
            floor = torch.tensor([p.min_p for p in params], device=device).view(-1, 1) * probs.max(-1, True).values
            logits = logits.masked_fill(probs < floor, float("-inf"))
        nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if nucleus:
            part = logits[nucleus]
            sorted_logits, order = torch.sort(part, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the mass before it already reaches top_p; the best token always stays.
            top_p = torch.tensor([params[i].top_p for i in nucleus], device=device).view(-1, 1)
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
            drop_sorted[:, 0] = False
            logits[nucleus] = part.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted),
                                               float("-inf"))
        return torch.softmax(logits, dim=-1)
