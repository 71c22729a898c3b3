"""The KV cache: a fixed pool of token slots per layer, sized once from the memory budget.

Each attention layer has a key pool and a value pool shaped [blocks, BLOCK_SIZE, kv_heads, head_dim] (keys and
values may differ in width, as in MLA models). A token's slot is `block * BLOCK_SIZE + offset`; which blocks a
sequence owns is the block manager's business. Memory is the pool, allocated at start-up: what a sequence uses is
proportional to the tokens it holds, and nothing grows or copies while serving.

One forward pass sees the cache through a `StepCache` (passed to the model as `past_key_values`): writing new
keys and values to their slots, and the per-sequence layout (`StepLayout`) the engine's attention function reads
keys and values back with.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass, field

import torch

from engine.core.block_manager import BLOCK_SIZE


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    key_dim: int
    value_dim: int
    device: torch.device  # where the layer runs (layers may be split over GPUs)


class PagedKVCache:
    def __init__(self, device: torch.device, dtype: torch.dtype, layers: dict[int, LayerShape], num_blocks: int,
                 native_kernels: bool = True, batch_invariant: bool = False, bf16_products: bool = True):
        self.device = device
        # Whether attention over it may take the native CPU kernels: not on the CUDA path, even simulated on the CPU.
        self.native_kernels = native_kernels
        # Whether a bfloat16 model's prompt chunks attend with VDPBF16PS rather than float32 FMAs (the runner's
        # probe: attention.bfloat16_products_pay).
        self.bf16_products = bf16_products
        # Whether its engine serves BATCH_INVARIANT (attention.py then attends every prompt chunk alike).
        self.batch_invariant = batch_invariant
        self.dtype = dtype
        self.layers = layers
        self.num_blocks = num_blocks
        # torch.empty: pages of the pool count towards resident memory only once a block is written.
        self._k = {i: torch.empty((num_blocks, BLOCK_SIZE, s.kv_heads, s.key_dim), dtype=dtype, device=s.device)
                   for i, s in layers.items()}
        self._v = {i: torch.empty((num_blocks, BLOCK_SIZE, s.kv_heads, s.value_dim), dtype=dtype, device=s.device)
                   for i, s in layers.items()}

    @staticmethod
    def bytes_per_token(layers: dict[int, LayerShape], dtype: torch.dtype, device: torch.device | None = None) -> int:
        """Bytes one token takes over all layers (or over the layers on `device`)."""
        return sum(s.kv_heads * (s.key_dim + s.value_dim) for s in layers.values()
                   if device is None or s.device == device) * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token(self.layers, self.dtype) * BLOCK_SIZE * self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * BLOCK_SIZE

    def pools(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k[layer], self._v[layer]

    def zero_blocks(self, start: int, end: int) -> None:
        """Clear blocks [start, end) before their first use: attention reads a block's unwritten slots (masked
        out), and masked weights of 0 times whatever bits were there must not make NaN."""
        for store in (self._k, self._v):
            for pool in store.values():
                pool[start:end].zero_()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's slots (a forked sequence gets its own copy of a shared, partly filled block)."""
        for store in (self._k, self._v):
            for pool in store.values():
                pool[dst] = pool[src]

    def give_back(self, blocks: list[int]) -> None:
        """Return the memory of blocks holding nothing to the operating system (CPU only; on next write the
        pages come back zeroed). Called while the engine is idle, so long prompts leave no lasting footprint."""
        if not blocks or _madvise is None:
            return
        page = _PAGE_SIZE
        runs = _runs(sorted(blocks))
        for store in (self._k, self._v):
            for pool in store.values():
                if pool.device.type != "cpu":
                    continue
                block_bytes = pool[0].numel() * pool.element_size()
                base = pool.data_ptr()
                for start, end in runs:
                    lo = -(-(base + start * block_bytes) // page) * page
                    hi = (base + end * block_bytes) // page * page
                    if hi > lo:
                        _madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block ids as [start, end) runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for block in blocks:
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        else:
            runs.append((block, block + 1))
    return runs


def _load_madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


_madvise = _load_madvise()
_MADV_DONTNEED = 4
_PAGE_SIZE = 4096


@dataclass
class DecodeBucket:
    """Decode rows of similar lengths that attend in one batched product (gathered to the longest of them)."""
    offset: int  # where its rows start among the step's tokens
    rows: int
    blocks: torch.Tensor  # [rows * width] block ids, row by row (padding repeats a valid block)
    lengths: torch.Tensor  # [rows] keys each row attends to, its new token included
    max_len: int

    def to(self, device: torch.device) -> "DecodeBucket":
        return DecodeBucket(self.offset, self.rows, self.blocks.to(device), self.lengths.to(device), self.max_len)


@dataclass
class PrefillSegment:
    """One sequence's chunk of new tokens inside a packed step."""
    offset: int  # where its tokens start among the step's tokens
    length: int  # new tokens
    start: int  # tokens of this sequence already in the cache (its first new token's position)
    blocks: torch.Tensor  # block ids covering positions [0, start + length)

    def to(self, device: torch.device) -> "PrefillSegment":
        return PrefillSegment(self.offset, self.length, self.start, self.blocks.to(device))


@dataclass
class StepLayout:
    """Where every sequence of one packed forward pass sits. The step's tokens are the decode rows' single
    tokens first (bucket by bucket, one per row), then each prefill segment's tokens."""
    buckets: list[DecodeBucket]
    segments: list[PrefillSegment]
    slots: torch.Tensor  # [tokens] pool slot each new token's key and value go to
    _reads: dict = field(default_factory=dict)  # (kind, index, window) -> what a bucket or segment reads
    written_layer: int | None = None  # the layer whose keys and values were written last (see attention.py)
    _copies: dict = field(default_factory=dict)

    def on(self, device: torch.device) -> "StepLayout":
        """This layout with its tensors on `device` (layers split over GPUs each read their own copy)."""
        if self.slots.device == device:
            return self
        copy = self._copies.get(device)
        if copy is None:
            copy = self._copies[device] = StepLayout([b.to(device) for b in self.buckets],
                                                     [s.to(device) for s in self.segments], self.slots.to(device))
        return copy

    def bucket_keys(self, index: int, window: int | None) -> tuple[torch.Tensor, int, torch.Tensor]:
        """What a bucket's rows read from the cache for a layer with this sliding window (None: all keys): the
        block ids to gather ([rows * width], row by row), the keys per row they hold (width * BLOCK_SIZE, or
        fewer), and the [rows, 1, 1, keys] mask of the keys each row attends to. A windowed layer gathers only
        the blocks its window reaches, not the whole history."""
        key = ("bucket", index, window)
        found = self._reads.get(key)
        if found is None:
            bucket = self.buckets[index]
            rows, device = bucket.rows, bucket.lengths.device
            width = bucket.blocks.numel() // rows
            lengths = bucket.lengths.view(-1, 1)
            if window and bucket.max_len > window + BLOCK_SIZE:
                # Each row's window starts in its own block; gather from there (padding repeats a valid block).
                first = ((lengths - window).clamp(min=0) // BLOCK_SIZE)
                span = min(width, window // BLOCK_SIZE + 2)
                which = (first + torch.arange(span, device=device).view(1, -1)).clamp(max=width - 1)
                blocks = bucket.blocks.view(rows, width).gather(1, which).reshape(-1)
                positions = (first * BLOCK_SIZE + torch.arange(span * BLOCK_SIZE, device=device).view(1, -1))
                keys = span * BLOCK_SIZE
            else:
                blocks, keys = bucket.blocks, bucket.max_len
                positions = torch.arange(keys, device=device).view(1, -1)
            mask = positions < lengths
            if window:
                mask &= positions >= lengths - window
            found = self._reads[key] = (blocks, keys, mask.view(rows, 1, 1, -1))
        return found

    def segment_keys(self, index: int, window: int | None,
                     dtype: torch.dtype = torch.bool) -> tuple[torch.Tensor, int, torch.Tensor]:
        """What a prefill segment with earlier keys (or longer than its window) reads for a layer with this
        sliding window: the block ids to gather, the position of the first key they hold, and the [1, 1, new,
        keys] causal (and windowed) mask: boolean, or additive (0 and -inf) in a float `dtype`, which SDPA takes
        as it is instead of converting a boolean mask in every layer."""
        key = ("segment", index, window, dtype)
        found = self._reads.get(key)
        if found is None:
            seg = self.segments[index]
            device = seg.blocks.device
            first = max(0, seg.start - window + 1) // BLOCK_SIZE if window else 0
            end = seg.start + seg.length
            query_pos = torch.arange(seg.start, end, device=device).view(-1, 1)
            key_pos = torch.arange(first * BLOCK_SIZE, end, device=device).view(1, -1)
            mask = key_pos <= query_pos
            if window:
                mask &= key_pos > query_pos - window
            if dtype != torch.bool:
                mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
            found = self._reads[key] = (seg.blocks[first:], first * BLOCK_SIZE, mask.view(1, 1, seg.length, -1))
        return found


_current = threading.local()


def current_layout() -> tuple[PagedKVCache, StepLayout] | None:
    """The cache and layout of the forward pass running on this thread, or None outside the engine's steps."""
    return getattr(_current, "step", None)


class ForwardCache:
    """What transformers asks of a `past_key_values` object besides `update`: this engine keeps positions and
    masks itself, so the model sees an empty cache and builds no mask."""

    is_compileable = False
    is_sliding = ()  # transformers asks `True in cache.is_sliding`; windows are the attention function's business

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


class StepCache(ForwardCache):
    """The cache as one forward pass sees it, passed to the model as `past_key_values`. Writes each layer's new
    keys and values to their slots; the attention function reads them back per sequence."""

    def __init__(self, cache: PagedKVCache, layout: StepLayout):
        self.cache = cache
        self.layout = layout

    def __enter__(self) -> "StepCache":
        _current.step = (self.cache, self.layout)
        return self

    def __exit__(self, *exc) -> None:
        _current.step = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # [1, kv_heads, tokens, dim] -> [tokens, kv_heads, dim] rows of the flattened pool (a stateful model's
        # decode pass has one row per sequence instead: [rows, kv_heads, 1, dim])
        self.write(layer_idx, _token_rows(key_states), _token_rows(value_states))
        return key_states, value_states

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the step's keys and values, [tokens, kv_heads, dim] in packed order, in their slots."""
        k_pool, v_pool, slots = self.write_target(layer_idx)
        k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slots, _stored_as(keys, k_pool.dtype))
        v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slots, _stored_as(values, v_pool.dtype))

    def write_target(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pools a layer's new keys and values go to and the step's slots in them ([tokens]), for a caller
        that stores them itself (a native kernel)."""
        self.layout.written_layer = layer_idx
        k_pool, v_pool = self.cache.pools(layer_idx)
        return k_pool, v_pool, self.layout.on(k_pool.device).slots


def _stored_as(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """States in the cache's type. A float16 cache under a wider model saturates at +-65504 instead of storing
    infinity (as the native cache write does), so one outlying key cannot poison a softmax."""
    if dtype == torch.float16 and states.dtype != dtype:
        states = states.clamp(-65504.0, 65504.0)
    return states.to(dtype)


def _token_rows(states: torch.Tensor) -> torch.Tensor:
    """[1, heads, tokens, dim] or [rows, heads, 1, dim] as [tokens, heads, dim]."""
    return states[0].transpose(0, 1) if states.shape[0] == 1 else states[:, :, 0]
