"""The float32 weights a layer's GGUF blocks hold, read back from the packings of
engine/cpu/native/quantized_linear.cpp: for code that inspects a layer served from its blocks (its `weight`) and
for an embedding tied to such a head, whose lookups gather their rows from the head's blocks. Never a product's
path: the kernel multiplies the blocks themselves.

Each packing is panels of 16 outputs by blocks of 32 inputs, one panel's blocks after another; a block holds its 16
outputs' scales d (and Q4_1's minimums m) in a header, then their 32 codes each. Where a code of output i (in its
panel) and input j (in its block) sits is a header offset plus a term of i plus a term of j in every packing; so
is a 4-bit code's shift. The weight is fl(q * d), plus m for Q4_1, as GGUF expands it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_PANEL, _BLOCK = 16, 32
_CHUNK = 1 << 20  # weights decoded at a time: the byte offsets take 8 bytes each


@dataclass(frozen=True)
class _Packing:
    block_bytes: int
    scale: torch.dtype  # of d and m in the header: 16 d, then (Q4_1) 16 m
    minimums: bool  # Q4_1
    bits: int
    row_byte: tuple[int, ...]  # per output of a panel, added to the header's size and the input's term
    column_byte: tuple[int, ...]  # per input of a block
    row_shift: tuple[int, ...] = (0,) * _PANEL  # a 4-bit code's shift
    column_shift: tuple[int, ...] = (0,) * _BLOCK

    @property
    def header(self) -> int:
        return _PANEL * self.scale.itemsize * (2 if self.minimums else 1)


_I, _J = range(_PANEL), range(_BLOCK)
PACKINGS = {
    # Float32 activations: float32 scales; Q4_1 codes by input, outputs i and i + 8 in one byte's two halves.
    1: _Packing(384, torch.float32, True, 4, tuple(i % 8 for i in _I), tuple(8 * j for j in _J),
                row_shift=tuple(4 * (i >= 8) for i in _I)),
    2: _Packing(576, torch.float32, False, 8, tuple(_I), tuple(16 * j for j in _J)),
    # 16-bit integer activations: half scales; codes by pairs of inputs. Q4_1: groups of 2 pairs' 4-bit codes
    # laid 4 groups to 64 bytes, each group's two nibbles of a byte 2 pairs apart.
    3: _Packing(320, torch.float16, True, 4, tuple(4 * i for i in _I),
                tuple(64 * (j // 8) + 2 * (j % 2) + (j // 2 % 4) // 2 for j in _J),
                column_shift=tuple(4 * (j // 2 % 2) for j in _J)),
    4: _Packing(544, torch.float16, False, 8, tuple(2 * i for i in _I), tuple(32 * (j // 2) + j % 2 for j in _J)),
    # 8-bit integer activations: codes by quads of inputs; Q4_1's two nibbles of a byte 4 inputs apart.
    10: _Packing(320, torch.float16, True, 4, tuple(4 * i for i in _I),
                 tuple(64 * (j // 8) + j % 4 for j in _J), column_shift=tuple(4 * (j % 8 // 4) for j in _J)),
    14: _Packing(544, torch.float16, False, 8, tuple(4 * i for i in _I), tuple(64 * (j // 4) + j % 4 for j in _J)),
}
_TERMS: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}


def _terms(block_format: int, in_features: int) -> tuple[torch.Tensor, ...]:
    """Per output of a panel: its code's byte term, its shift; per input: its code's byte within its panel's row of
    blocks, its shift; per block: its first byte; and a scale's bytes (made once: lookups run every step)."""
    key = (block_format, in_features)
    if key not in _TERMS:
        p = PACKINGS[block_format]
        starts = torch.arange(in_features // _BLOCK) * p.block_bytes
        codes = (starts[:, None] + p.header + torch.tensor(p.column_byte)[None, :]).reshape(-1)
        _TERMS[key] = (torch.tensor(p.row_byte), torch.tensor(p.row_shift, dtype=torch.int32), codes,
                       torch.tensor(p.column_shift, dtype=torch.int32).repeat(in_features // _BLOCK), starts,
                       torch.arange(p.scale.itemsize))
    return _TERMS[key]


def _scales(flat: torch.Tensor, at: torch.Tensor, dtype: torch.dtype, size: torch.Tensor) -> torch.Tensor:
    """The scales of `dtype` whose first bytes are at `at` ([rows, blocks]), as float32 (`size`: their bytes)."""
    return flat[at[..., None] + size].view(dtype).squeeze(-1).float()


def block_values(blocks: torch.Tensor, block_format: int, out_features: int, in_features: int,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weights [len(rows), in_features] of outputs `rows` (every output when None) that `blocks`, a
    packing of format `block_format` for [out_features, in_features] weights, holds."""
    p = PACKINGS.get(block_format)
    if p is None:
        raise ValueError(f"no reader for block format {block_format}")
    if out_features % _PANEL or in_features % _BLOCK:
        raise ValueError(f"[{out_features}, {in_features}] weights are not whole panels of blocks")
    flat = blocks.reshape(-1)
    if flat.numel() != out_features // _PANEL * in_features // _BLOCK * p.block_bytes:
        raise ValueError(f"{flat.numel()} bytes do not hold [{out_features}, {in_features}] weights of format "
                         f"{block_format}")
    wanted = torch.arange(out_features) if rows is None else rows.reshape(-1).long()
    row_byte, row_shift, codes, shifts, starts, size = _terms(block_format, in_features)
    step = max(1, _CHUNK // in_features)
    out = None if 0 < wanted.numel() <= step else torch.empty(wanted.numel(), in_features)
    for first in range(0, wanted.numel(), step):
        r = wanted[first:first + step]
        panel, i = r // _PANEL, r % _PANEL
        row_start = panel * (in_features // _BLOCK * p.block_bytes)
        raw = flat[(row_start + row_byte[i])[:, None] + codes[None, :]]
        if p.bits == 4:
            q = (raw.int() >> (row_shift[i][:, None] + shifts[None, :])) & 15
        else:
            q = raw.view(torch.int8)
        heads = row_start[:, None] + starts[None, :]  # each block's header
        d = _scales(flat, heads + i[:, None] * p.scale.itemsize, p.scale, size)
        w = q.float().view(r.numel(), -1, _BLOCK) * d[..., None]
        if p.minimums:
            w = w + _scales(flat, heads + (_PANEL + i[:, None]) * p.scale.itemsize, p.scale, size)[..., None]
        if out is None:  # one chunk (a step's lookups)
            return w.view(r.numel(), in_features)
        out[first:first + step] = w.view(r.numel(), in_features)
    return out
