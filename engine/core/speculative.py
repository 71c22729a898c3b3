"""Speculative decoding: proposers of draft tokens, and the verification of a step's proposals.

A proposer guesses the next K tokens of a decoding sequence; the engine computes the sequence's last token and
the K guesses in one pass (a prefill chunk over cached tokens, logits at every position) and keeps the longest
prefix the target model agrees with, plus one token of its own. Greedy requests get exactly the tokens plain
decoding gives. Sampled requests use rejection sampling: the proposers here are deterministic (a draft is one
token per position, a point mass), so a guess x is kept with probability p(x) under the request's own sampling
distribution, and on rejection the token is drawn from p with x removed; the result is distributed as plain
sampling (Leviathan et al., 2023). Draws use the sequence's generator, so a seeded request is reproducible.

- `NgramProposer` (prompt lookup): the longest suffix of the tokens so far (prompt_lookup_max down to
  prompt_lookup_min tokens) that occurred before; the tokens that followed its latest earlier occurrence.
- `DraftModelProposer`: a smaller model with the same vocabulary drafts greedily, with its own cache per
  sequence; it stops early when its top probability falls below the request's assistant_confidence_threshold.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from engine.core.speculation_control import DraftLength, LoadSwitch

MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """SPECULATIVE_CONFIG, in vLLM's --speculative-config terms."""
    method: str  # "ngram" | "draft_model"
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model: any source MODEL_NAME takes
    revision: str | None = None
    # vLLM's switch: no speculation while this many sequences or more decode. Ours, `adaptive` (on by default),
    # measures where speculation pays instead (engine/core/speculation_control.py).
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @staticmethod
    def parse(text: str) -> "SpeculativeConfig":
        """Validate the JSON object; a ValueError says what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("must be a JSON object such as {\"method\": \"ngram\", \"num_speculative_tokens\": 4}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                 "revision", "disable_by_batch_size", "adaptive"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unsupported key(s) {', '.join(unknown)}; supported: {', '.join(sorted(known))}")
        model = data.get("model")
        method = data.get("method")
        if method is None:
            method = "ngram" if model in (None, "[ngram]", "ngram") else "draft_model"
        if model in ("[ngram]", "ngram"):
            model = None
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"method must be \"ngram\" or \"draft_model\", got {method!r}")
        if method == "draft_model" and not isinstance(model, str):
            raise ValueError("a draft_model needs \"model\": a model source, as MODEL_NAME takes")
        if method == "ngram" and model is not None:
            raise ValueError("method \"ngram\" takes no model")

        def integer(name: str, default: int | None) -> int:
            value = data.get(name, default)
            if value is None:
                raise ValueError(f"{name} is required")
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"{name} must be an integer from 1 to {MAX_SPECULATIVE_TOKENS}, got {value!r}")
            return value

        k = integer("num_speculative_tokens", None)
        lookup_max = integer("prompt_lookup_max", 4)
        lookup_min = integer("prompt_lookup_min", min(lookup_max, 1))
        if lookup_min > lookup_max:
            raise ValueError(f"prompt_lookup_min ({lookup_min}) must not exceed prompt_lookup_max ({lookup_max})")
        if method == "draft_model" and ("prompt_lookup_max" in data or "prompt_lookup_min" in data):
            raise ValueError("prompt_lookup_max/prompt_lookup_min apply to method \"ngram\" only")
        revision = data.get("revision")
        if revision is not None and not isinstance(revision, str):
            raise ValueError("revision must be a string")
        disable = data.get("disable_by_batch_size")
        if disable is not None and (isinstance(disable, bool) or not isinstance(disable, int) or disable < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer, got {disable!r}")
        adaptive = data.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {adaptive!r}")
        return SpeculativeConfig(method, k, lookup_max, lookup_min, model, revision, disable, adaptive)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.lookup_max = config.prompt_lookup_max
        self.lookup_min = config.prompt_lookup_min

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self._one(seq.tokens, k) for seq, k in zip(seqs, ks)]

    def _one(self, tokens: list[int], k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            suffix = tokens[length - n:]
            first = suffix[0]
            # Latest earlier occurrence of the suffix (not the suffix itself).
            for start in range(length - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
                    break
        return []

    def forget(self, key: int) -> None:
        pass


class DraftModelProposer:
    """Greedy drafts from a second model. Each sequence keeps the draft's cache of the tokens it has seen; after
    a rejection the cache is cut back to the tokens still shared."""

    def __init__(self, model, device: torch.device):
        from transformers import DynamicCache
        self._cache_type = DynamicCache
        self.model = model
        self.device = device
        self._state: dict[int, tuple[object, list[int]]] = {}  # id(seq) -> (cache, tokens it holds)

    @torch.inference_mode()
    def propose(self, seqs: list, ks: list[int], thresholds: list[float | None]) -> list[list[int]]:
        return [self._one(seq, k, threshold) for seq, k, threshold in zip(seqs, ks, thresholds)]

    def _one(self, seq, k: int, threshold: float | None) -> list[int]:
        tokens = seq.tokens
        cache, held = self._state.get(id(seq), (None, []))
        shared = 0
        limit = min(len(held), len(tokens) - 1)  # the last token is always fed, for its logits
        while shared < limit and held[shared] == tokens[shared]:
            shared += 1
        if cache is None or shared == 0:
            cache, shared = self._cache_type(), 0
        elif shared < len(held):
            cache.crop(shared - len(held))  # drop the tokens no longer shared
        held = list(tokens[:shared])
        feed = tokens[shared:]
        proposal: list[int] = []
        for _ in range(k):
            ids = torch.tensor([feed], device=self.device)
            positions = torch.arange(len(held), len(held) + len(feed), device=self.device).view(1, -1)
            logits = self.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                                logits_to_keep=1).logits[0, -1].float()
            held += feed
            probs = torch.softmax(logits, dim=-1)
            top, token = probs.max(dim=-1)
            if threshold is not None and float(top) < threshold:
                break
            token = int(token)
            proposal.append(token)
            feed = [token]
        # The cache holds `held` (the last proposal was never fed).
        self._state[id(seq)] = (cache, held)
        return proposal

    def forget(self, key: int) -> None:
        """Drop the draft cache of a sequence (by id) that no longer decodes."""
        self._state.pop(key, None)


class SpeculativeStats:
    def __init__(self):
        self.proposed = 0
        self.accepted = 0
        self.steps = 0


class Speculator:
    """Proposes drafts for a step's decoding sequences and turns a verified chunk's logits into tokens."""

    def __init__(self, config: SpeculativeConfig, draft_model=None, device: torch.device | None = None):
        self.config = config
        self.proposer = DraftModelProposer(draft_model, device) if config.method == "draft_model" \
            else NgramProposer(config)
        self.stats = SpeculativeStats()
        self.switch = LoadSwitch(config.disable_by_batch_size, config.adaptive)
        self.lengths = DraftLength()
        self._seen: set[int] = set()
        self._batch = 0

    def timed(self, speculated: bool, seconds: float, tokens: int) -> None:
        """The last step's wall time (drafting included) and tokens generated, for the load switch; the caller
        reports decode-only steps (a prompt chunk's cost says nothing of speculation's)."""
        self.switch.record(self._batch, speculated, seconds, tokens)

    def propose(self, groups, max_model_len: int, prompts_waiting: bool = False) -> bool:
        """Set `proposal` on every decoding sequence that speculates this step (others get none); returns whether
        any does (the load switch chose to speculate and a proposer had guesses)."""
        decoding, prefilling = [], False
        for group in groups:
            for seq in group.seqs:
                seq.proposal, seq.proposal_at = [], -1
                if seq.status.name == "DECODING":
                    decoding.append(seq)
                elif seq.status.name == "PREFILLING":
                    prefilling = True
        live = {id(seq) for seq in decoding}
        self.lengths.forget_except(live)
        self._batch = len(decoding)
        if self.config.adaptive and (prefilling or prompts_waiting):
            # A step with prompt chunks is compute-bound already, and guesses would take the chunks' budget.
            return False
        if not self.switch.choose(self._batch):
            return False
        seqs, ks, thresholds = [], [], []
        for seq in decoding:
            params = seq.group.params
            # Beams are scored together, and a grammar masks one token at a time: neither speculates.
            if params.beam_search or params.grammar is not None:
                continue
            k = params.num_assistant_tokens or self.config.num_speculative_tokens
            # Never past max_tokens (the verified chunk adds one token of its own) or the context.
            k = min(k, params.max_tokens - seq.num_generated - 1, max_model_len - len(seq.tokens))
            if k > 0 and self.config.adaptive:
                k = self.lengths.length(id(seq), k)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
                thresholds.append(params.assistant_confidence_threshold)
        if isinstance(self.proposer, DraftModelProposer):
            for gone in self._seen - live:
                self.proposer.forget(gone)
            self._seen = live
            proposals = self.proposer.propose(seqs, ks, thresholds)
        else:
            proposals = self.proposer.propose(seqs, ks)
        for seq, proposal in zip(seqs, proposals):
            seq.proposal, seq.proposal_at = proposal, len(seq.tokens)
        # A step where no sequence found anything to guess runs as a plain one, and is measured as one.
        return any(proposals)

    def verify(self, seq, proposal: list[int], logits: torch.Tensor, sampler):
        """Yield (token, logprob) for the tokens the target model keeps: each agreeing guess, then one token of
        its own (the correction at the first disagreement, or one past the last guess). The caller appends each
        before taking the next (the sampling state and num_generated move with it) and may stop early."""
        state = seq.sampling
        params = state.params
        self.stats.proposed += len(proposal)
        self.stats.steps += 1
        for i in range(len(proposal) + 1):
            guess = proposal[i] if i < len(proposal) else None
            generated = seq.num_generated
            if params.greedy or guess is None:
                tokens, logprobs = sampler.sample(logits[i:i + 1], [state], [generated])
                token, logprob = tokens[0], logprobs[0]
            else:
                p = sampler.distribution(logits[i], state, generated)
                u = torch.rand((), generator=state.generator, device=p.device) if state.generator is not None \
                    else torch.rand((), device=p.device)
                if float(u) < float(p[guess]):
                    token = guess
                else:
                    residual = p.clone()
                    residual[guess] = 0.0
                    token = int(torch.multinomial(residual / residual.sum(), 1, generator=state.generator))
                state.record(token)
                logprob = None
                if params.needs_logprobs:
                    logprob = sampler.logprobs_of(logits[i:i + 1], torch.tensor([token], device=logits.device),
                                                  [params.logprobs or 0])[0]
            self.stats.accepted += token == guess
            if token != guess and proposal:
                self.lengths.verified(id(seq), len(proposal), i)
            yield token, logprob
            if token != guess:
                break
