"""Incremental detokenization and stop-string handling for one generated sequence."""
from __future__ import annotations

# Tokens of the prompt's tail decoded along with the output, so that tokenizers whose text depends on the
# preceding token (leading-space markers, byte fallback) produce the same text as decoding the whole sequence.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding the whole sequence.

    Text is released only once it is complete: a delta that ends in a partial UTF-8 character waits for
    the next token.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Only Python-backend tokenizers use it; Rust (fast) tokenizers ignore it, as they do in vLLM.
        self._spaces = spaces_between_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False,
                                      spaces_between_special_tokens=self._spaces)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""

    def clone(self) -> "IncrementalDetokenizer":
        """An independent copy (a beam continuing from another beam's text)."""
        other = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        other.__dict__.update(self.__dict__)
        other._ids = list(self._ids)
        return other

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):]


class StopStringMatcher:
    """Finds stop strings in the generated text and holds back text that may still become one."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool):
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def find(self, text: str, new_chars: int) -> tuple[str, int] | None:
        """(stop string, cut position) for the earliest stop that the last `new_chars` characters completed."""
        earliest: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if at != -1 and (earliest is None or at < earliest[0]):
                earliest = (at, stop)
        if earliest is None:
            return None
        at, stop = earliest
        return stop, at + len(stop) if self.include_stop else at

    def releasable(self, text: str) -> int:
        """How many characters of `text` can be sent now without risking a stop string that is still forming."""
        if not self.stops:
            return len(text)
        return max(0, len(text) - self._hold)
