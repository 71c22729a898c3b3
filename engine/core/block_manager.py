"""Ownership of the KV cache's blocks: which are free, who holds each, and which hold a known token prefix.

The cache is a fixed pool of blocks of BLOCK_SIZE token slots. A sequence holds a list of blocks (its block
table); a block may be held by several sequences at once (the `n` choices of one prompt, or equal prompt
prefixes of different requests), counted by a reference count. A block whose slots are all computed gets a key
chaining the keys of the blocks before it, so equal keys mean equal prefixes; when its last holder lets go it
stays in an LRU of reusable blocks (the prefix cache) until the pool needs it for something else. Freed blocks
without a key are preferred for new work, so cached prefixes live as long as the budget allows.
"""
from __future__ import annotations

from collections import OrderedDict

BLOCK_SIZE = 16


def blocks_for(tokens: int) -> int:
    """Blocks that hold `tokens` token slots."""
    return -(-tokens // BLOCK_SIZE)


def chain_key(previous: int, tokens: tuple[int, ...]) -> int:
    return hash((previous, tokens))


def prefix_root(cache_salt: str | None, adapter: str | None = None) -> int:
    """Where a prompt's chain of block keys starts: requests with different salts (tenants) or LoRA adapters (their
    keys and values differ) never find each other's blocks."""
    if adapter is not None:
        return hash(("lora", adapter, cache_salt))
    return 0 if cache_salt is None else hash(("cache_salt", cache_salt))


class BlockManager:
    def __init__(self, num_blocks: int, max_cached_blocks: int):
        self.num_blocks = num_blocks
        self.max_cached_blocks = max_cached_blocks  # 0 disables the prefix cache
        self._refs = [0] * num_blocks
        # Free blocks holding nothing worth keeping, lowest first so the touched part of the pool stays small.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free blocks with a key, least recent first
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (key, its tokens)
        self._block_of: dict[int, int] = {}  # key -> block
        self.peak_used = 0
        # Never-used blocks come out lowest first, so blocks [0, high_water) are all that were ever handed out.
        self.high_water = 0
        self.hit_tokens = 0  # prompt tokens taken from the prefix cache since start

    @property
    def enabled(self) -> bool:
        return self.max_cached_blocks > 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        """A block for new content, held once. Raises MemoryError when the pool is exhausted (callers check
        `num_free` first; the scheduler preempts before it gets here)."""
        if self._free:
            block = self._free.pop()
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)
            self._forget(block)
        else:
            raise MemoryError("KV cache pool exhausted")
        self._refs[block] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        self.high_water = max(self.high_water, block + 1)
        return block

    def hold(self, block: int) -> None:
        """One more holder of a block that is already in use or cached."""
        if self._refs[block] == 0:
            self._cached_free.pop(block, None)
        self._refs[block] += 1
        self.peak_used = max(self.peak_used, self.num_used)

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._cached_free[block] = None
                if len(self._cached_free) > self.max_cached_blocks:
                    oldest, _ = self._cached_free.popitem(last=False)
                    self._forget(oldest)
                    self._free.append(oldest)
            else:
                self._free.append(block)

    def refs(self, block: int) -> int:
        return self._refs[block]

    # ---- prefix cache ----

    def lookup(self, tokens: list[int], limit: int, root: int = 0) -> list[tuple[int, int]]:
        """(block, key) of each block holding the longest cached prefix of `tokens` within its first `limit`
        tokens, each block now held once more by the caller."""
        if not self.enabled:
            return []
        found: list[tuple[int, int]] = []
        previous = root
        for start in range(0, limit - BLOCK_SIZE + 1, BLOCK_SIZE):
            part = tuple(tokens[start:start + BLOCK_SIZE])
            previous = chain_key(previous, part)
            block = self._block_of.get(previous)
            if block is None or self._key_of[block][1] != part:
                break
            self.hold(block)  # out of the LRU while held; its release puts it back as the most recent
            found.append((block, previous))
        return found

    def count_hits(self, found: list[tuple[int, int]]) -> None:
        """Count a lookup's blocks as reused, once the request that found them is admitted (a request that
        waits looks up again every step)."""
        self.hit_tokens += len(found) * BLOCK_SIZE

    def register(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """Record that a just-filled block holds the prefix with this key (the first holder of a key wins)."""
        if self.enabled and key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = (key, tokens)

    def _forget(self, block: int) -> None:
        key, _ = self._key_of.pop(block)
        if self._block_of.get(key) == block:
            del self._block_of[key]

    def free_uncached(self) -> list[int]:
        """The free blocks that hold nothing (their memory may be given back while idle)."""
        return list(self._free)
