"""Linear layers of a quantized checkpoint, multiplied on CPU from their packed integer weights.

Every integer format a checkpoint brings (GPTQ, AWQ, compressed-tensors' int formats, bitsandbytes int8, GGUF
blocks, the load-time int8 / int4 of QUANTIZATION) is, per block of 32 inputs of one output, w = d * q + m: q a
4-bit (0..15), 5-bit (0..31: GGUF's Q5 types) or 8-bit (-128..127) integer, d a scale and m a minimum (a zero
point z gives m = -d * z). The readers (engine/quantization/checkpoint.py) bring each layer to that form, with its
input channels in an order where every block of 32 has one scale (GPTQ's act-order groups are gathered once at
load; the activations' columns are gathered to match at each product). `apply` packs the blocks into the native
kernel's layout (engine/cpu/native/quantized_linear.cpp, formats 5, 6 and 9: d and m in float32, so m = -d * z is
exact; 3, 4 and 8 where both are half-precision values; 19 and 20 where m = -8d or -16d follows from d; 28
where m = -d z, z a byte; 31-34 where 4-bit blocks share d, or d and z, over a group of 64 or 128 inputs, kept
once a group as the file keeps them, 39-42 for bitsandbytes' codes likewise, and 43 for 8-bit q with a float32
scale per output or per 128 inputs), checks the product against the dequantized weights, and from then on the layer reads
its q (4, 5 or 8 bits a weight) plus its headers. GGUF Q6_K's scale per 16 inputs (w = d * q, q in -32..31)
is the one other grouping: scales [out, in / 16], no minimum. GGUF K-quants bring their two-level scales too (`supers`), which the kernel keeps as the file
does (formats 23, 24 and Q6_K's 6-bit form 27, or 30 for 8-bit activations); bitsandbytes' 4-bit codes index a
table (`codes`, formats 17, 18).
The product takes 16-bit integer activations (each row's block of 32 inputs in steps of 2^-15 of its largest
magnitude), as the GGUF blocks do under DTYPE=auto, or 8-bit ones (docs/cpu-kernels.md).

Without the kernel (a CPU without AVX2, NATIVE_KERNELS=off, an architecture whose build has none) a model whose
layers' float32 copy would exceed DENSE_LIMIT_BYTES keeps them at about the file's size and expands them to float32
a layer at a time for PyTorch's product (compact_weights.py), never the 8x of a 4-bit file; a smaller one gets the
float32 copy once, whose product at a few rows runs 3-4x faster than expanding at every step. The same weights
either way, logged as the slower path it is.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.cpu.compact_weights import CompactWeights, repeated as _repeated

log = logging.getLogger("engine.cpu.packed_linear")

BLOCK = 32  # inputs per scale: the kernel's block
PANEL = 16  # outputs per panel of the kernel's layout
_BITS = (4, 5, 8)  # the widths the kernel's formats hold (quantized_linear.cpp chooses the format at packing)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # activations the kernel reads and writes as they are
# blocks multiplied from 8-bit integer activations (quantized_linear.cpp)
QUAD_FORMATS = (*range(10, 17), 21, 22, 25, 26, 29, 30, *range(35, 39), 44)
# Without a packed product, the float32 copy of every packed layer is made once up to this size (the embedded
# model's is 0.5 GB); beyond it the layers stay compact, so a multi-GB quantized file never becomes 8x its size.
DENSE_LIMIT_BYTES = 2**30


def dense_copy_fits(float32_bytes: int) -> bool:
    """Whether layers whose float32 weights take `float32_bytes` get that copy once where no packed product serves
    them (else they stay compact)."""
    return float32_bytes <= DENSE_LIMIT_BYTES


SUPER = 256  # inputs of a GGUF K-quant super-block, whose D and M scale its blocks' 6-bit s and t
ACTIVATIONS = {"int16": 16, "int8": 8}  # QUANTIZED_ACTIVATIONS
# bitsandbytes' 4-bit tables (w = absmax * value[q]) and the integer levels that stand for 1 in the kernel's
# 16-bit codes of them (quantized_linear.cpp's kNf4Codes / kFp4Codes, formats 17 and 18): FP4's values are
# multiples of 1/192, so exact; NF4's normal quantiles are rounded to steps of 1/2047.
CODE_TABLES = {
    "nf4": ((-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0), 2047),
    "fp4": (tuple(v / 12 for v in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0,
                                   -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)), 192),
}


def code_values(table: str) -> torch.Tensor:
    """The 16 values a 4-bit code of `table` multiplies by, as the product holds them (float32)."""
    values, levels = CODE_TABLES[table]
    return (torch.tensor(values, dtype=torch.float64) * levels).round().div(levels).float()


class PackedLinear(torch.nn.Module):
    """y = x W^T (+ bias) with W [out, in] held as w = scale * q + minimum per block of 32 inputs: q int8
    [out, in] (0..15 for 4 bits, 0..31 for 5), scale and minimum float32 [out, in / 32] (or, 8-bit with zero
    minimums, both [out, in / 16]: a scale per 16 inputs), over the inputs gathered by `order` (None: their own
    order). With `codes` ("nf4", "fp4": bitsandbytes' 4-bit tables) q is a code and w = scale * table[q]
    (minimums zero). With `supers` (D, s, M, t: GGUF Q4_K / Q5_K's two-level scales, D and M float32 [out, in /
    256], s and t uint8 [out, in / 32]) scale = D s and minimum = -M t; with `supers` (D, s: GGUF Q6_K's, s int8
    [out, in / 16]) on 8-bit q, scale = D s per 16 inputs. The kernel keeps the factors. Not a torch.nn.Linear,
    so that no rewrite made for dense weights (fusion's concatenation, layouts, GGUF block recovery) touches it."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
                 bias: torch.Tensor | None = None, order: torch.Tensor | None = None, source: str = "",
                 codes: str | None = None, supers: tuple | None = None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        if bits not in _BITS:
            raise ValueError(f"{bits}-bit weights have no packed product")
        if self.in_features % BLOCK or self.out_features % PANEL:
            raise ValueError(f"a {self.out_features}x{self.in_features} weight does not divide into the kernel's "
                             f"blocks of {PANEL} outputs by {BLOCK} inputs")
        self.bits, self.source, self.codes, self.supers = bits, source, codes, supers
        self.group = self.in_features // scale.shape[1]  # inputs a scale: 32, or 16 (GGUF Q6_K)
        if scale.shape != minimum.shape or self.group not in (BLOCK, BLOCK // 2) or (
                self.group != BLOCK and (bits != 8 or bool(minimum.any()))) or (
                codes is not None and (codes not in CODE_TABLES or bits != 4 or self.group != BLOCK
                                       or bool(minimum.any()))) or (
                supers is not None and (self.in_features % SUPER or not (
                    (len(supers) == 4 and bits in (4, 5) and self.group == BLOCK)
                    or (len(supers) == 2 and bits == 8 and self.group == BLOCK // 2)))):
            raise ValueError(f"scales of {tuple(scale.shape)} and minimums of {tuple(minimum.shape)} for a "
                             f"{self.out_features}x{self.in_features} {bits}-bit weight have no packed product")
        self.q, self.scale, self.minimum = q, scale.float().contiguous(), minimum.float().contiguous()
        self.order = order
        self.bias = None if bias is None else bias.float().contiguous()  # added to float32 sums, as the kernel does
        self.packed = None  # the kernel's blocks, once `apply` packed them
        self.block_format = 0
        self.kernels = None
        self.dense = None  # float32 weights, where no kernel serves and the copy is small (DENSE_LIMIT_BYTES)
        self.compact = None  # the weights kept compact and expanded at each product, where no kernel serves
        self.whole, self.start = None, 0  # a part of a fused layer (engine/cpu/fusion.py): its slice of `whole`

    def become_part_of(self, whole: "PackedLinear", start: int) -> None:
        """Give up this layer's blocks: its outputs are columns start.. of `whole`'s (fused q/k/v, gate/up)."""
        # Not a submodule of the part: `whole` is its parent's (qkv_proj, gate_up_proj) and is found by that name.
        object.__setattr__(self, "whole", whole)
        self.start = start
        self.q = self.scale = self.minimum = self.bias = self.supers = None

    def weight_float(self) -> torch.Tensor:
        """The dequantized weights [out, in] in float32, columns in the layer's order (`order`)."""
        q = (code_values(self.codes)[self.q.long()] if self.codes else self.q.float()).view(
            self.out_features, -1, self.group)
        return (q * self.scale.unsqueeze(-1) + self.minimum.unsqueeze(-1)).view(self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"bias={self.bias is not None}, source={self.source}" + (f", codes={self.codes}" if self.codes else ""))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole is not None:
            return self.whole(x).narrow(-1, self.start, self.out_features)
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if self.order is not None:
            rows = rows.index_select(1, self.order)
        if self.packed is not None and x.dtype in _KERNEL_DTYPES:
            # The kernel reads bfloat16 rows as they are, adds the bias and rounds to x's dtype itself: a decode
            # step's two conversions and the add cost more than a small layer's product.
            out = self.kernels.blocks_linear(rows.contiguous(), self.packed, self.block_format, self.out_features,
                                             self.bias)
            return out.view(*shape[:-1], self.out_features)
        rows = rows.float().contiguous()
        if self.packed is not None:
            out = self.kernels.blocks_linear(rows, self.packed, self.block_format, self.out_features)
        else:
            weight = self.dense if self.dense is not None else (
                self.compact.expand() if self.compact is not None else self.weight_float())
            out = F.linear(rows, weight)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def direct(self, dtype: torch.dtype):
        """The one kernel call `forward` makes for contiguous rows [tokens, in] of `dtype`, the layer's own
        arguments bound (the kernels' Product, which the native decode stack also calls): rows -> [tokens, out].
        None where forward is not this class's own (an adapter wraps it) or does more than that call (a part of a
        fused layer, inputs gathered by `order`, no packed blocks, rows the kernel does not take). The compact
        decoder calls it in place of forward, whose checks and reshapes cost, at one row, a good share of a small
        layer's product."""
        if (getattr(self.forward, "__func__", None) is not PackedLinear.forward or self.whole is not None
                or self.order is not None or self.packed is None or dtype not in _KERNEL_DTYPES):
            return None
        return self.kernels.blocks_product(self.packed, self.block_format, self.out_features, self.bias)

    @classmethod
    def concatenate(cls, parts: list) -> "PackedLinear | SideBySide | None":
        """One layer computing the parts' outputs side by side (fused q/k/v, gate/up), or None where their
        inputs differ or one is packed already. Parts that cannot share one product (inputs gathered in
        different orders, as GPTQ's act order gives each layer its own; other bits; a plain torch.nn.Linear
        beside them, as a GGUF file's Q6_K layer among Q4_K ones) stay separate products under one SideBySide."""
        first = parts[0]
        if any(p.in_features != first.in_features for p in parts) or any(
                isinstance(p, cls) and (p.packed is not None or p.compact is not None or p.dense is not None
                                        or p.whole is not None)
                for p in parts):
            return None
        if not all(isinstance(p, cls) for p in parts) or any(
                p.bits != first.bits or p.group != first.group or p.codes != first.codes
                or (p.supers is None) != (first.supers is None)
                or (p.bias is None) != (first.bias is None)
                or (p.order is None) != (first.order is None)
                or (p.order is not None and not torch.equal(p.order, first.order)) for p in parts):
            return SideBySide(parts)
        bias = None if first.bias is None else torch.cat([p.bias for p in parts])
        supers = None if first.supers is None else tuple(torch.cat(f) for f in zip(*(p.supers for p in parts)))
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                   torch.cat([p.minimum for p in parts]), first.bits, bias, first.order, first.source, first.codes,
                   supers)


class SideBySide(torch.nn.Module):
    """The outputs of several layers of one input (PackedLinear, plain torch.nn.Linear), concatenated: a fused
    projection whose parts cannot share one product."""

    def __init__(self, parts: list[PackedLinear]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.together = None  # (blocks, formats, outputs, bias) once every part is packed in one input order

    def become_part_of(self, *_):
        raise AssertionError("a SideBySide is never a part")

    def share_product(self) -> None:
        """Multiply every part in one kernel call where all are packed word blocks over their inputs in their own
        order (a GGUF file's Q5_0 keys beside Q8_0 values): the activations are quantized once and no
        concatenation follows."""
        parts = list(self.parts)
        if all(isinstance(p, PackedLinear) and p.packed is not None and p.order is None
               and p.block_format not in (1, 2) for p in parts):
            bias = None
            if any(p.bias is not None for p in parts):
                bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])
            self.together = ([p.packed for p in parts], [p.block_format for p in parts],
                             [p.out_features for p in parts], bias)

    def direct(self, dtype: torch.dtype):
        """forward's one kernel call for contiguous rows of `dtype` where every part shares it (PackedLinear.direct),
        else None."""
        if getattr(self.forward, "__func__", None) is not SideBySide.forward or self.together is None or \
                dtype not in _KERNEL_DTYPES:
            return None
        return self.parts[0].kernels.parts_product(*self.together)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The class's own forward: fusion may point a part's instance forward at this module (q/k/v sharing).
        if self.together is not None and x.dtype in _KERNEL_DTYPES:
            rows = x.reshape(-1, self.in_features).contiguous()
            out = self.parts[0].kernels.blocks_linear_parts(rows, *self.together)
            return out.view(*x.shape[:-1], self.out_features)
        return torch.cat([type(part).forward(part, x) for part in self.parts], dim=-1)


def layers(model: torch.nn.Module) -> list[PackedLinear]:
    """The model's PackedLinear layers holding blocks (parts of fused layers left out)."""
    return [m for m in model.modules() if isinstance(m, PackedLinear) and m.whole is None]


def _half_values(t: torch.Tensor) -> bool:
    """Whether every value of `t` is a half-precision value (the kernel's half headers hold it exactly)."""
    return bool((t.half().float() == t).all())


def _half_exact(layer: PackedLinear) -> bool:
    """Whether the layer's scales and minimums are all half-precision values (and, for 8 bits, its minimums
    zero): then the kernel's half-precision headers hold them exactly (GPTQ's float16 scales with symmetric zero
    points, bitsandbytes' int8 rows often do), half a bit a weight less than float32 headers."""
    if layer.group != BLOCK:
        return False  # format 7 keeps float32 headers
    if layer.bits == 8:
        return _half_values(layer.scale) and not bool(layer.minimum.any())
    return _half_values(layer.scale) and _half_values(layer.minimum)


def _centered(layer: PackedLinear) -> bool:
    """Whether every minimum of a 4- or 5-bit layer with half-precision headers is -8 or -16 times its scale
    (GPTQ's symmetric int4, GGUF Q4_0 and Q5_0): the kernel then derives it and keeps d alone, half a bit a weight
    less."""
    return layer.bits in (4, 5) and torch.equal(layer.minimum, layer.scale * -(2 ** (layer.bits - 1)))


def _zero_points(layer: PackedLinear) -> torch.Tensor | None:
    """For a 4-bit layer whose scales are half-precision values and whose minimums are -scale * z with z an
    integer in 0..255 (AWQ, GPTQ with zero points), z as uint8 [out, in / 32]: the kernel then keeps d and z, 4.75
    bits a weight, not 6 with float32 d and m. Else None."""
    if layer.bits != 4 or layer.group != BLOCK or not _half_values(layer.scale):
        return None
    z = torch.where(layer.scale != 0, -layer.minimum / layer.scale, torch.zeros_like(layer.scale)).round()
    if not bool(((z >= 0) & (z <= 255)).all()) or not torch.equal(-(layer.scale * z), layer.minimum):
        return None
    return z.to(torch.uint8)


def _shared(layer: PackedLinear) -> int:
    """The blocks of 32 inputs (4 or 2) that share each scale and minimum throughout a 4-bit layer, as GPTQ's,
    AWQ's, compressed-tensors' and bitsandbytes' groups of 128 or 64 inputs (or whole rows) do, else 1."""
    if layer.bits != 4 or layer.group != BLOCK:
        return 1
    for span in (4, 2):
        if (layer.in_features // BLOCK) % span == 0 and _repeated(layer.scale, span) and \
                _repeated(layer.minimum, span):
            return span
    return 1


def _pack(layer: PackedLinear, kernels, activation_bits: int) -> tuple[int, torch.Tensor]:
    """(format, blocks) of the kernel's most compact form that holds the layer's weights exactly."""
    quads = activation_bits == 8
    if layer.codes:  # bitsandbytes' 4-bit tables take 16-bit activations at any setting; a scale per block of 64
        span = _shared(layer)  # or 128 kept once
        return kernels.pack_coded(layer.q, layer.scale[:, ::span].contiguous(), layer.codes)
    if layer.supers is not None and layer.bits != 8:
        return kernels.pack_super(layer.q, *layer.supers, layer.bits, quads)
    if layer.supers is not None:  # Q6_K's 6-bit form
        return kernels.pack_six_bit(layer.q, *layer.supers, quads)
    if layer.bits == 8 and layer.group == BLOCK and not bool(layer.minimum.any()) and _repeated(layer.scale, 4):
        # a scale per output or per 128 inputs, kept once a group in float32
        return kernels.pack_eight_by_128(layer.q, layer.scale[:, ::4].contiguous(), quads)
    half = _half_exact(layer)
    centered = half and _centered(layer)
    zero = None if centered else _zero_points(layer)
    span = _shared(layer) if layer.bits == 4 and (centered or zero is not None) else 1
    if span > 1:  # one d (and z) per group of inputs, as the file holds them
        d = layer.scale[:, ::span].contiguous()
        z = zero[:, ::span].contiguous() if zero is not None else torch.empty(0, dtype=torch.uint8)
        return kernels.pack_groups(layer.q, d, z, quads)
    if zero is not None:
        return kernels.pack_zero_points(layer.q, layer.scale, zero, quads)
    return kernels.pack_scaled(layer.q, layer.scale, layer.minimum, layer.bits, half, quads, centered)


def _agrees(layer: PackedLinear, weight: torch.Tensor, minimum: torch.Tensor) -> bool:
    """The packed product against the dequantized weights on random rows: each output within the 16-bit
    activations' rounding (2^-15 of each block's largest input, relative 1e-4 with float32's sums) of the sum
    of |x| |w| it adds; with 8-bit activations (formats 10-16), within half a step (1/254 of each block's largest
    input) times the sum of the block's |w - m| (the minimum's term takes the exact sum of x)."""
    for rows in (1, 17):
        x = torch.randn(rows, layer.in_features)
        expected = F.linear(x, weight)
        got = layer.kernels.blocks_linear(x, layer.packed, layer.block_format, layer.out_features)
        bound = 1e-4 * F.linear(x.abs(), weight.abs()) + 1e-6
        if layer.block_format in QUAD_FORMATS:
            blocks = layer.in_features // BLOCK
            step = x.abs().view(rows, blocks, BLOCK).amax(-1) / 254
            dq = weight - minimum.repeat_interleave(layer.group, 1)
            scaled = dq.abs().view(-1, blocks, BLOCK).sum(-1)  # |d q| per block of 32
            bound = bound + step @ scaled.T
        if not bool(((got - expected).abs() <= bound).all()):
            return False
    return True


@torch.inference_mode()
def apply(model: torch.nn.Module, kernels, activation_bits: int = 16) -> int:
    """Pack every PackedLinear of `model` for the kernel (`kernels`: native_kernels.active(), or None), each
    checked against its dequantized weights; without a kernel that packs them, keep them compact for a product
    that expands them a layer at a time, or, where all of them in float32 take at most DENSE_LIMIT_BYTES, expand
    them once.
    `activation_bits` 8 (QUANTIZED_ACTIVATIONS=int8) gives every layer the product from 8-bit integer
    activations. Returns how many layers the kernel serves; raises where its product disagrees (never served
    wrong)."""
    found = layers(model)
    if not found:
        return 0
    usable = kernels is not None and kernels.word_blocks_supported() and hasattr(kernels, "pack_scaled")
    if usable and activation_bits == 8 and not kernels.quad_blocks_supported():
        raise ValueError("8-bit activations: this build of the CPU kernels multiplies 16-bit ones only (8-bit ones "
                         "need AVX512_VNNI)")
    packed_bytes = kept_bytes = 0
    weights = sum(layer.in_features * layer.out_features for layer in found)
    dense = not usable and dense_copy_fits(weights * 4)
    for layer in found:
        weight = layer.weight_float()
        if usable:
            layer.block_format, layer.packed = _pack(layer, kernels, activation_bits)
            layer.kernels = kernels
            if not _agrees(layer, weight, layer.minimum):
                raise RuntimeError(f"the packed {layer.bits}-bit product differs from the dequantized weights "
                                   f"({layer.source}) on this machine")
            packed_bytes += layer.packed.numel()
        elif dense:
            layer.dense = weight
            kept_bytes += weight.numel() * 4
        else:
            layer.compact = CompactWeights(layer)
            if not torch.equal(layer.compact.expand(), weight):
                raise RuntimeError(f"the compact {layer.bits}-bit weights differ from the dequantized ones "
                                   f"({layer.source})")
            kept_bytes += layer.compact.nbytes
        layer.q = layer.scale = layer.minimum = layer.supers = None  # the packed or compact weights replace them
    for module in model.modules():
        if isinstance(module, SideBySide):
            module.share_product()
    if usable:
        quads = any(layer.block_format in QUAD_FORMATS for layer in found)
        log.info("quantized checkpoint: %d linear layers multiply from packed %s-bit blocks (%.0f MB, %.2f bits a "
                 "weight; engine/cpu/native/quantized_linear.cpp) with %s", len(found),
                 "/".join(str(b) for b in sorted({layer.bits for layer in found})), packed_bytes / 2**20,
                 packed_bytes * 8 / weights,
                 "8-bit integer activations" if quads else "16-bit integer activations")
        return len(found)
    if dense:
        log.warning("quantized checkpoint: no packed product on this CPU (it needs the native kernels with AVX2, "
                    "FMA and F16C); %d linear layers expanded to float32 once (%.0f MB, within the %.0f MB a copy "
                    "is made for), multiplied by PyTorch", len(found), kept_bytes / 2**20, DENSE_LIMIT_BYTES / 2**20)
        return 0
    log.warning("quantized checkpoint: no packed product on this CPU (it needs the native kernels with AVX2, FMA "
                "and F16C); %d linear layers kept at %.0f MB (%.2f bits a weight) and expanded to float32 a layer at "
                "a time for each product, slower", len(found), kept_bytes / 2**20, kept_bytes * 8 / weights)
    return 0


def parent_module(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module holding submodule `name` and its attribute name there (to put a PackedLinear in its place)."""
    parent, _, child = name.rpartition(".")
    return (model.get_submodule(parent) if parent else model), child
