"""Reuse of computed prompt prefixes across requests.

Prompts are cut into fixed-size token blocks; a block's key chains the keys of all blocks before it, so equal
keys mean equal prefixes. After a prompt is prefilled its full blocks are copied out of the KV cache; a later
prompt starting with the same blocks copies them back in instead of recomputing them. Chat requests share
long prefixes (system prompt, template header), which is where this pays.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .kv_cache import SlotKVCache

BLOCK_SIZE = 8


def block_keys(tokens: list[int], limit: int) -> list[int]:
    """Chained keys of the full blocks within the first `limit` tokens."""
    keys, previous = [], 0
    for start in range(0, limit - BLOCK_SIZE + 1, BLOCK_SIZE):
        previous = hash((previous, tuple(tokens[start:start + BLOCK_SIZE])))
        keys.append(previous)
    return keys


class PrefixCache:
    def __init__(self, kv: SlotKVCache, capacity_bytes: int):
        self._kv = kv
        self._capacity = capacity_bytes
        self._bytes = 0
        self._blocks: OrderedDict[int, tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]], int]] = \
            OrderedDict()
        self.hits = 0
        self.hit_tokens = 0

    @property
    def enabled(self) -> bool:
        return self._capacity > 0

    def load_into(self, row: int, tokens: list[int]) -> int:
        """Copy the longest cached prefix of `tokens` (leaving at least one token to compute) into `row`.
        Returns its length in tokens."""
        if not self.enabled:
            return 0
        found = 0
        for index, key in enumerate(block_keys(tokens, len(tokens) - 1)):
            entry = self._blocks.get(key)
            start = index * BLOCK_SIZE
            if entry is None or entry[0] != tuple(tokens[start:start + BLOCK_SIZE]):
                break
            self._blocks.move_to_end(key)
            self._kv.load(row, start, entry[1])
            found = start + BLOCK_SIZE
        if found:
            self.hits += 1
            self.hit_tokens += found
        return found

    def store_from(self, row: int, tokens: list[int], computed_from: int) -> None:
        """Remember the full blocks of a just-prefilled prompt that were computed (not loaded) in `row`."""
        if not self.enabled:
            return
        for index, key in enumerate(block_keys(tokens, len(tokens))):
            start = index * BLOCK_SIZE
            if start < computed_from or key in self._blocks:
                continue
            layers = self._kv.export(row, start, start + BLOCK_SIZE)
            size = sum(k.numel() * k.element_size() * 2 for k, _ in layers)
            if size > self._capacity:
                return
            self._blocks[key] = (tuple(tokens[start:start + BLOCK_SIZE]), layers, size)
            self._bytes += size
            while self._bytes > self._capacity:
                _, (_, _, evicted) = self._blocks.popitem(last=False)
                self._bytes -= evicted

    def clear(self) -> None:
        self._blocks.clear()
        self._bytes = 0
