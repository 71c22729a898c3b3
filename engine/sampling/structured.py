"""Constrained decoding: grammars compiled against the tokenizer, and per-sequence matchers that mask logits.

Built on llguidance (its JSON-schema compiler refuses keywords it cannot enforce instead of ignoring them, it
takes Lark/EBNF grammars and regexes directly, and it has no dependencies). Knows nothing of OpenAI requests:
the serving layer turns those into a kind and a text and compiles them here, off the engine thread.

A sequence's matcher is used by the sampler each step: `fill_bitmask` writes the tokens the grammar allows into
one row of a shared int32 bitmask ([rows, ceil(vocab / 32)], bit i of word j allows token 32 * j + i),
`apply_bitmask` puts -inf on the logits of every other token, and `accept` advances the matcher by the sampled
token. `is_terminated` tells the engine that the grammar is complete, so the sequence stops.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

KINDS = ("json_schema", "regex", "choice", "grammar")
_CACHE_ENTRIES = 256


class GrammarError(ValueError):
    """The constraint is malformed, or uses a feature that cannot be enforced; the message names it."""


class GrammarFailure(RuntimeError):
    """A grammar failed while a request generated under it. `too_complex`: the grammar engine gave up on it (a
    schema that recurses without end, say), which is the request's doing rather than the worker's."""

    def __init__(self, message: str, too_complex: bool):
        super().__init__(message)
        self.too_complex = too_complex


@dataclass(frozen=True)
class AnswerGate:
    """For reasoning models: the constraint applies to the answer, not the thinking. The answer starts after
    the token sequence `closer`; `inside`: the prompt already opened the thinking; `opener`: a token the model
    may take as its first token to open thinking (allowed next to the grammar's own first tokens)."""
    closer: tuple[int, ...]
    opener: int | None = None
    inside: bool = False


@dataclass(frozen=True, eq=False)
class GrammarSpec:
    """A compiled constraint, shared by every sequence that uses it."""
    kind: str
    text: str
    _template: object = field(repr=False)  # an llguidance matcher in its initial state, copied per sequence
    gate: AnswerGate | None = None

    def new_matcher(self) -> "GrammarMatcher":
        return GrammarMatcher(self._template.deep_copy(), self.gate)

    def with_gate(self, gate: AnswerGate | None) -> "GrammarSpec":
        return GrammarSpec(self.kind, self.text, self._template, gate)


class GrammarMatcher:
    """Where one sequence stands in its grammar. A rejected token (which the mask makes impossible unless the
    library and the mask disagree) is never passed over silently: the next call reports it."""

    def __init__(self, matcher, gate: AnswerGate | None = None):
        self._matcher = matcher
        self._gate = gate
        self._thinking = bool(gate and gate.closer and gate.inside)  # every token allowed until the closer
        self._first = True
        self._recent: list[int] = []
        self._error: str | None = None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._raise_error()
        target = bitmask[row]
        if self._thinking:
            target.fill_(-1)
            return
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        if self._first and self._gate is not None and self._gate.opener is not None:
            opener = self._gate.opener
            target[opener >> 5] |= _bit(opener & 31)

    def accept(self, token_id: int) -> None:
        first, self._first = self._first, False
        gate = self._gate
        if first and gate is not None and gate.opener is not None and token_id == gate.opener and gate.closer:
            self._thinking = True
            return
        if self._thinking:
            self._recent = (self._recent + [token_id])[-len(gate.closer):]
            if tuple(self._recent) == gate.closer:
                self._thinking = False
            return
        if self._error is None and not self._matcher.consume_token(token_id):
            self._error = f"the grammar rejected token {token_id}: {self._matcher.get_error()}"

    def is_terminated(self) -> bool:
        self._raise_error()
        return not self._thinking and self._matcher.is_stopped()

    def _raise_error(self) -> None:
        if self._error is None and self._matcher.is_error():
            self._error = self._matcher.get_error()
        if self._error is not None:
            # The library's message ends in dumps of its parser state and the grammar: the first part says it.
            reason = _one_line(self._error.split("<state>")[0])
            raise GrammarFailure(f"structured output failed: {reason}",
                                 too_complex="ParserTooComplex" in self._error or "Too many items" in self._error)


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if index == 31 else 1 << index


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU bitmask for `rows` matchers; every token allowed until a matcher fills its row."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def forbidden_on_host(bitmask: torch.Tensor) -> torch.Tensor:
    """[rows, words * 32] bool of a CPU bitmask: True where it forbids the token (the CPU path's way)."""
    # Bit i of int32 word j is bit i % 8 of byte 4j + i // 8 (little-endian), so unpacking the bytes
    # little-endian lists the tokens in order; one C loop, far cheaper than shifting a tensor 32 ways.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits).logical_not()


def _forbidden(bitmask: torch.Tensor, device: torch.device, cpu_fast_path: bool = True) -> torch.Tensor:
    """[rows, words * 32] bool on `device`: True where the bitmask forbids the token. Off the CPU path (CUDA, or
    DEVICE=cuda-sim, which runs what CUDA runs) the words are shifted on the device."""
    if device.type == "cpu" and cpu_fast_path:
        return forbidden_on_host(bitmask)
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = bitmask.to(device, non_blocking=True)
    return ((words.unsqueeze(-1) >> shifts) & 1 == 0).view(bitmask.shape[0], -1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], cpu_fast_path: bool = True) -> None:
    """Set to -inf, in place, the logits of tokens the bitmask forbids; bitmask row i masks logits row rows[i]."""
    if not rows:
        return
    vocab = logits.shape[1]
    forbidden = _forbidden(bitmask[:len(rows)], logits.device, cpu_fast_path)
    if forbidden.shape[1] < vocab:  # tokens past the grammar's vocabulary are never allowed
        forbidden = torch.nn.functional.pad(forbidden, (0, vocab - forbidden.shape[1]), value=True)
    forbidden = forbidden[:, :vocab]
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(forbidden, float("-inf"))
        return
    for i, row in enumerate(rows):
        logits[row].masked_fill_(forbidden[i], float("-inf"))


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching them by (kind, text, whitespace pattern). Thread-safe;
    compiling can take milliseconds to seconds, so callers run it off the event loop and the engine thread."""

    def __init__(self, hf_tokenizer, eos_token_ids: frozenset[int], vocab_size: int):
        import llguidance
        import llguidance.hf
        import transformers

        if not isinstance(hf_tokenizer, transformers.PreTrainedTokenizerFast):
            raise GrammarError("structured outputs need a fast (Rust) tokenizer, and this model's is not one")
        self._llg = llguidance
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=sorted(eos_token_ids) or None)
        self._cache: OrderedDict[tuple, GrammarSpec] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "GrammarCompiler":
        """A compiler for the engine's Tokenizer (engine/tokenizer.py): its Hugging Face tokenizer, end tokens and
        vocabulary size."""
        return cls(tokenizer.hf, tokenizer.eos_token_ids, tokenizer.vocab_size)

    def compile(self, kind: str, text: str, whitespace_pattern: str | None = None) -> GrammarSpec:
        key = (kind, text, whitespace_pattern)
        with self._lock:
            spec = self._cache.get(key)
            if spec is not None:
                self._cache.move_to_end(key)
                return spec
        spec = GrammarSpec(kind, text, self._matcher(self._grammar(kind, text, whitespace_pattern)))
        with self._lock:
            self._cache[key] = spec
            while len(self._cache) > _CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return spec

    def _grammar(self, kind: str, text: str, whitespace_pattern: str | None) -> str:
        llg = self._llg
        if kind == "json_schema":
            # Without a whitespace pattern, JSON is written with single spaces after ',' and ':' and no other
            # whitespace: a small model left free to add whitespace can spend its whole budget on newlines.
            # An empty pattern means no whitespace at all.
            if whitespace_pattern:
                options = {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern}
            else:
                space = " " if whitespace_pattern is None else ""
                options = {"whitespace_flexible": False, "item_separator": "," + space, "key_separator": ":" + space}
            try:
                return llg.LLMatcher.grammar_from_json_schema(text, overrides=options)
            except ValueError as exc:
                raise GrammarError(f"invalid JSON schema: {exc}") from None
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            # Each choice is matched as a literal string, never as a pattern.
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "grammar":
            try:
                return llg.grammar_from("grammar", text)  # Lark, or GBNF/EBNF as llama.cpp writes it
            except ValueError as exc:
                raise GrammarError(str(exc)) from None
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(KINDS)}")

    def _matcher(self, grammar: str):
        error = self._llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(_one_line(error))
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_one_line(matcher.get_error()))
        return matcher


def _one_line(message: str) -> str:
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text[:500] or "invalid grammar"
