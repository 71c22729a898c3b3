"""Forward passes over the paged KV cache: one packed pass per engine step, decode rows and prefill chunks
together, with no padding (a step costs the tokens it computes)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .block_manager import BLOCK_SIZE
from .kv_cache import DecodeBucket, ForwardCache, LayerShape, PagedKVCache, PrefillSegment, StepCache, StepLayout

log = logging.getLogger("engine")


@dataclass
class DecodeRow:
    token: int  # the sequence's last token, not yet in the cache
    position: int
    blocks: list[int]


@dataclass
class PrefillChunk:
    token_ids: list[int]  # the next tokens of the sequence to compute
    start: int  # tokens of the sequence already in the cache
    blocks: list[int]  # covering at least start + len(token_ids) slots
    logits: str = "none"  # "none" | "last" | "all": which positions' logits the step returns


def _slot(blocks: list[int], position: int) -> int:
    return blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


_PADDING_TOLERANCE = 1.5  # a bucket's gathered keys may be at most this many times the keys its rows hold


def _length_buckets(decodes: list[DecodeRow]) -> list[list[int]]:
    """Decode rows (indices) grouped by length, shortest first, so that one long row does not make every
    short row gather and attend over its length."""
    buckets: list[list[int]] = []
    held = 0
    for i in sorted(range(len(decodes)), key=lambda i: decodes[i].position):
        length = decodes[i].position + 1
        if buckets and (len(buckets[-1]) + 1) * length <= _PADDING_TOLERANCE * (held + length):
            buckets[-1].append(i)
            held += length
        else:
            buckets.append([i])
            held = length
    return buckets


class PagedPathUnsupported(RuntimeError):
    """The model's forward pass does not keep its state in the paged cache (the fallback path serves it)."""


class _ShapeProbe(ForwardCache):
    """A cache that only records the key/value shapes each attention layer writes (start-up probe)."""

    def __init__(self):
        self.layers: dict[int, LayerShape] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.layers[layer_idx] = LayerShape(key_states.shape[1], key_states.shape[-1], value_states.shape[-1],
                                            key_states.device)
        return key_states, value_states


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, kv_budget_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 512):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.layer_shapes = self._probe_layers()
        if device.type == "cuda":
            num_blocks = self._cuda_blocks(gpu_memory_utilization, max_num_batched_tokens)
        else:
            num_blocks = kv_budget_bytes // (PagedKVCache.bytes_per_token(self.layer_shapes, dtype) * BLOCK_SIZE)
        self.kv = PagedKVCache(device, dtype, self.layer_shapes, max(1, num_blocks))

    @torch.inference_mode()
    def _probe_layers(self) -> dict[int, LayerShape]:
        probe = _ShapeProbe()
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        self.model(input_ids=ids, position_ids=torch.arange(2, device=self.device).view(1, 2),
                   past_key_values=probe, use_cache=True, logits_to_keep=1)
        if not probe.layers:
            raise PagedPathUnsupported("the model wrote no keys or values to the cache")
        return probe.layers

    @torch.inference_mode()
    def _cuda_blocks(self, utilization: float, profile_tokens: int) -> int:
        """Blocks that fit each GPU's share (GPU_MEMORY_UTILIZATION) after its weights and the peak a full-size
        step needs there (measured by running one on a provisional cache)."""
        devices = sorted({s.device for s in self.layer_shapes.values()}, key=str)
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
        provisional = -(-profile_tokens // BLOCK_SIZE)
        self.kv = PagedKVCache(self.device, self.dtype, self.layer_shapes, provisional)
        self.execute([], [PrefillChunk([0] * profile_tokens, 0, list(range(provisional)), "last")])
        blocks = None
        for d in devices:
            torch.cuda.synchronize(d)
            per_block = PagedKVCache.bytes_per_token(self.layer_shapes, self.dtype, d) * BLOCK_SIZE
            peak = torch.cuda.max_memory_allocated(d) - per_block * provisional
            total = torch.cuda.get_device_properties(d).total_memory
            budget = int(total * utilization) - peak
            if budget < per_block:
                raise RuntimeError(f"no memory left for the KV cache on {d}: the weights and a step of "
                                   f"{profile_tokens} tokens take {peak / 2**30:.1f} GiB of the {utilization:.0%} of "
                                   f"{total / 2**30:.1f} GiB allowed (GPU_MEMORY_UTILIZATION)")
            blocks = budget // per_block if blocks is None else min(blocks, budget // per_block)
        del self.kv
        torch.cuda.empty_cache()
        return blocks

    @torch.inference_mode()
    def execute(self, decodes: list[DecodeRow], chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """Compute one step. Returns logits [rows, vocab]: one row per decode row, then per chunk none, its last
        position's or all its positions', in order; None when no position asked for logits."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        buckets = []
        packed_at = [0] * len(decodes)  # where each decode row (in the caller's order) sits among the tokens
        for members in _length_buckets(decodes):
            max_len = decodes[members[-1]].position + 1
            width = -(-max_len // BLOCK_SIZE)
            table = []
            for i in members:
                row = decodes[i]
                packed_at[i] = len(ids)
                ids.append(row.token)
                positions.append(row.position)
                slots.append(_slot(row.blocks, row.position))
                table.extend(row.blocks[:width])
                table.extend([row.blocks[0]] * (width - min(width, len(row.blocks))))
            buckets.append(DecodeBucket(packed_at[members[0]], len(members),
                                        torch.tensor(table, device=self.device),
                                        torch.tensor([decodes[i].position + 1 for i in members], device=self.device),
                                        max_len))
        keep: list[int] = list(packed_at)
        segments = []
        for chunk in chunks:
            offset, n = len(ids), len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            span = range(chunk.start, chunk.start + n)
            positions.extend(span)
            slots.extend(_slot(chunk.blocks, p) for p in span)
            needed = -(-(chunk.start + n) // BLOCK_SIZE)
            segments.append(PrefillSegment(offset, n, chunk.start,
                                           torch.tensor(chunk.blocks[:needed], device=self.device)))
            if chunk.logits == "all":
                keep.extend(range(offset, offset + n))
            elif chunk.logits == "last":
                keep.append(offset + n - 1)
        layout = StepLayout(buckets, segments, torch.tensor(slots, device=self.device))
        if not keep:
            keep = [len(ids) - 1]  # the model computes at least one logit row; it is dropped below
        with StepCache(self.kv, layout) as cache:
            out = self.model(input_ids=torch.tensor([ids], device=self.device),
                             position_ids=torch.tensor([positions], device=self.device),
                             past_key_values=cache, use_cache=True,
                             logits_to_keep=torch.tensor(keep, device=self.device))
        if not any(c.logits != "none" for c in chunks) and not decodes:
            return None
        return out.logits[0]
