"""A packed layer's weights where no kernel of ours multiplies them (NATIVE_KERNELS=off, a CPU without AVX2, an
architecture whose build has no packed product): kept at about the checkpoint's size and expanded to float32 one
layer at a time, into a scratch buffer per thread that the next layer reuses, for PyTorch's own product.

What is kept: q as the file packs it (two 4-bit values a byte; 5-bit as those nibbles plus a bit plane; 8-bit as
bytes), and the scales and minimums once per group of blocks that shares them (GPTQ's and AWQ's groups of 64 or
128 inputs, a row for per-channel scales), in half precision where every value is one; a minimum that follows
from its scale (-8 or -16 times it, symmetric int4 and Q5_0) or from an integer zero point takes no float at all.
GGUF K-quants keep their two-level factors (D and M per 256 inputs, 6-bit s and t per 32). The expanded weights
are exactly `PackedLinear.weight_float()`'s: q * scale + minimum in float32, the same two roundings.
"""
from __future__ import annotations

import functools
import threading

import torch

_local = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """This thread's float32 buffer of at least `numel` values (grown to the largest layer, then reused)."""
    buffer = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _local.buffer = torch.empty(numel, dtype=torch.float32)
    return buffer[:numel]


def repeated(t: torch.Tensor, span: int) -> bool:
    """Whether per-block factors [out, in / 32] repeat over each run of `span` blocks (the row's last run may be
    shorter): one per 64 or 128 inputs, or one per row."""
    return torch.equal(t, t[:, ::span].repeat_interleave(span, 1)[:, :t.shape[1]])


def _span(t: torch.Tensor) -> int:
    """The most blocks of each row that share every value of per-block factors `t` [out, blocks] in runs that
    divide the row: the whole row, 8, 4 or 2 (groups of 256, 128 or 64 inputs), else 1."""
    blocks = t.shape[1]
    return next((span for span in (blocks, 8, 4, 2) if span <= blocks and blocks % span == 0 and repeated(t, span)),
                1)


def _super_factors(supers: tuple, per: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, minimum) per block from GGUF K-quants' two-level factors, `per` blocks a super-block: D s and -M t,
    or D s alone (Q6_K: minimum None)."""
    d, s = supers[:2]
    scale = d.float().repeat_interleave(per, 1) * s.float()
    if len(supers) == 2:
        return scale, None
    m, t = supers[2:]
    return scale, -(m.float().repeat_interleave(per, 1) * t.float())


def _narrow(t: torch.Tensor) -> torch.Tensor:
    """t in half precision where that holds every value exactly, else float32."""
    half = t.half()
    return half if torch.equal(half.float(), t) else t


class CompactWeights:
    """One layer's weights [out, in] as w = scale * q + minimum per group of inputs (or codes' table values times a
    scale), held compactly; `expand()` gives them in float32 in this thread's scratch buffer."""

    def __init__(self, layer):
        out, inputs = layer.out_features, layer.in_features
        self.shape, self.bits = (out, inputs), layer.bits
        self.high = None
        if layer.bits == 8:
            self.q = layer.q.contiguous()
        else:
            q = layer.q.to(torch.uint8)
            low = (q & 15).to(torch.uint8).view(out, inputs // 2, 2)
            self.q = low[..., 0] | (low[..., 1] << 4)  # even inputs in the low nibble
            if layer.bits == 5:  # the fifth bit of 8 inputs a byte
                bit = (q >> 4).to(torch.uint8).view(out, inputs // 8, 8)
                self.high = (bit << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
        self.codes = None if layer.codes is None else _code_values(layer.codes)
        scale, minimum = layer.scale, layer.minimum
        self.supers = None
        if layer.supers is not None and self._from_supers(layer.supers, scale, minimum):
            return
        self.span = _span(scale)
        if self.span > 1 and _span(minimum) % self.span:
            self.span = 1
        scale_kept = scale[:, ::self.span].contiguous()
        minimum_kept = minimum[:, ::self.span].contiguous()
        self.scale = _narrow(scale_kept)
        self.minimum = self.zero = None
        self.centered = False
        if not bool(minimum_kept.any()):
            pass  # no minimum
        elif layer.bits in (4, 5) and torch.equal(minimum_kept, scale_kept * -(2 ** (layer.bits - 1))):
            self.centered = True
        else:
            z = torch.where(scale_kept != 0, -minimum_kept / scale_kept, torch.zeros_like(scale_kept)).round()
            kind = next((t for t, lo, hi in ((torch.uint8, 0, 255), (torch.int8, -128, 127))
                         if bool(((z >= lo) & (z <= hi)).all())), None)  # (8-bit q arrive signed)
            if kind is not None and torch.equal(-(scale_kept * z), minimum_kept):
                self.zero = z.to(kind)
            else:
                self.minimum = _narrow(minimum_kept)

    def _from_supers(self, supers, scale: torch.Tensor, minimum: torch.Tensor) -> bool:
        """Keep GGUF K-quants' factors as the file holds them, where they give the layer's scales and minimums
        exactly."""
        self.span = 1
        per = scale.shape[1] // supers[0].shape[1]
        got_scale, got_minimum = _super_factors(supers, per)
        if not (torch.equal(got_scale, scale) and torch.equal(
                torch.zeros_like(minimum) if got_minimum is None else got_minimum, minimum)):
            return False
        self.supers = tuple(f.contiguous() for f in supers)
        self.per = per
        return True

    @property
    def nbytes(self) -> int:
        kept = [self.q, self.high, *(self.supers or ())]  # (a codes table is one per table, shared)
        if self.supers is None:
            kept += [self.scale, self.minimum, self.zero]
        return sum(t.numel() * t.element_size() for t in kept if t is not None)

    def _factors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, minimum) in float32, one per group of self.span blocks (minimum None: zero)."""
        if self.supers is not None:
            return _super_factors(self.supers, self.per)
        scale = self.scale.float()
        if self.centered:
            return scale, scale * -(2 ** (self.bits - 1))
        if self.zero is not None:
            return scale, -(scale * self.zero.float())
        return scale, None if self.minimum is None else self.minimum.float()

    def expand(self) -> torch.Tensor:
        """The float32 weights [out, in], in this thread's scratch buffer (valid until its next expand)."""
        out, inputs = self.shape
        w = _scratch(out * inputs).view(out, inputs)
        if self.bits == 8:
            w.copy_(self.q)
        else:
            pairs = w.view(out, inputs // 2, 2)
            pairs[..., 0].copy_(self.q & 15)
            pairs[..., 1].copy_(self.q >> 4)
            if self.high is not None:
                bits = (self.high.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
                w.add_(bits.view(out, inputs).float().mul_(16))
        if self.codes is not None:
            w.copy_(self.codes[w.long()])  # the table's value of each code
        scale, minimum = self._factors()
        groups = w.view(out, scale.shape[1], -1)
        groups.mul_(scale.unsqueeze(-1))
        if minimum is not None:
            groups.add_(minimum.unsqueeze(-1))
        return w


@functools.cache
def _code_values(table: str) -> torch.Tensor:
    from engine.cpu.packed_linear import code_values
    return code_values(table)
