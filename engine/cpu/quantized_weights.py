"""Linear layers whose float32 weights are exactly GGUF Q4_1 or Q8_0 blocks multiply from those blocks on CPU.

A GGUF model (the embedded default: Q4_1 layers, a Q8_0 output head) reaches the engine as the float32 weights
transformers expanded from its blocks, so a decode step streams four to five times the bytes the file holds.
The native kernel (engine/cpu/native/quantized_linear.cpp) recovers each weight's blocks and keeps them only where
they give back every float32 weight bit for bit, then multiplies from them: the same weights, 6 (Q4_1) or 9
(Q8_0) bits each instead of 32. Results equal the float32 product up to summation order. It is used up to the
batch size where a probe over a step's weights, in order, finds it faster than the layout in use
(engine/cpu/layout.py); larger products (prefill chunks) keep that layout. Weights of any other origin find no
exact blocks and are left as they are.

With `integer_activations` (DTYPE=auto) and AVX512_VNNI, the blocks multiply 16-bit integer activations instead:
each row's block of 32 inputs rounds to steps of 2^-15 of its largest magnitude (about 256 times finer than
bfloat16), the block sums run exactly in integers, and VPDPWSSD does twice the multiplies of a float32 FMA, so
the product can beat float32 at every batch size, prefill included; a probe at load decides (docs/cpu-kernels.md
has the measured speed and agreement with float32).
"""
from __future__ import annotations

import hashlib
import logging
import math
import types

import torch
import torch.nn.functional as F

from engine.cpu import layout as cpu_layout
from engine.cpu import weight_release
from engine.cpu.block_values import block_values
from engine.cpu.packed_linear import QUAD_FORMATS

log = logging.getLogger("engine.cpu.quantized_weights")

_PROBE_ROWS = (1, 16, 32, 64)  # batch sizes timed; the blocks serve up to the largest that wins with all below it
# The integer product also serves prefill chunks where it wins at 256 rows, by when the float32 product runs at
# its ceiling; the larger sizes are timed on a quarter of the weights (products that size are compute-bound).
_WORD_PROBE_ROWS = (1, 16, 64, 256)
_LARGE_ROWS = 128
_DECODE_ROWS = (1, 16)  # where the blocks must keep up with bfloat16 for DTYPE=auto to keep float32 weights
_GAIN_NEEDED = 1.05
EVERY_SIZE = 2**62


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if self.dense_forward is not None and (rows > self.blocks_until or x.dtype != torch.float32):
        return self.dense_forward(x)
    # Served at every size, the blocks are the layer's only weight: rows of another type multiply as float32.
    out = self.block_kernels.blocks_linear(x.reshape(rows, x.shape[-1]).float().contiguous(), self.weight_blocks,
                                           self.block_format, self.out_features)
    if self.bias is not None:
        out += self.bias
    return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


class BlockLinear(torch.nn.Linear):
    """A linear layer served from its GGUF blocks at every batch size, whose float32 weight as loaded is released:
    `weight` decodes the blocks on each read (engine/cpu/block_values.py), for code that inspects a layer, never
    for a product. A fused projection's part (`rows_of`: the fused layer and the part's first row) reads its rows
    of the fused layer's blocks."""

    @property
    def weight(self) -> torch.Tensor:
        source, start = getattr(self, "rows_of", (self, 0))
        return block_values(source.weight_blocks, source.block_format, source.out_features, source.in_features,
                            torch.arange(start, start + self.out_features))


class BlockEmbedding(torch.nn.Embedding):
    """An embedding tied to an output head served from its blocks: each lookup decodes its rows from the head's
    blocks (`table_blocks`, of `table_format`), so the table is held once, 8.5 or 5 bits a value."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        values = block_values(self.table_blocks, self.table_format, self.num_embeddings, self.embedding_dim, ids)
        return values.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        return block_values(self.table_blocks, self.table_format, self.num_embeddings, self.embedding_dim)


def _make_block_linear(module: torch.nn.Linear, dtype: torch.dtype) -> None:
    module.weight_dtype = dtype
    module.__class__ = BlockLinear


def _make_block_embedding(embedding: torch.nn.Embedding, head: torch.nn.Linear, dtype: torch.dtype) -> None:
    embedding.weight_dtype = dtype
    embedding.table_blocks, embedding.table_format = head.weight_blocks, head.block_format
    embedding.__class__ = BlockEmbedding


def _direct(self, dtype: torch.dtype):
    """_forward's kernel call for contiguous float32 rows [tokens, in], bound (see PackedLinear.direct): more rows
    than `blocks_until` take the dense forward, as _forward does. None where an adapter wraps the forward, the
    layer has a bias or the rows are of another type."""
    if getattr(self.forward, "__func__", None) is not _forward or dtype is not torch.float32 or self.bias is not None:
        return None
    product = self.block_kernels.blocks_product(self.weight_blocks, self.block_format, self.out_features)
    if self.blocks_until == EVERY_SIZE:
        return product
    until, dense = self.blocks_until, self.dense_forward
    return lambda rows: product(rows) if rows.shape[0] <= until else dense(rows)


def rounds_activations(model: torch.nn.Module) -> bool:
    """Whether linear layers of `model` multiply 16-bit integer activations: start-up checks that compare two
    forwards then allow for their rounding (on the embedded model the logits move by about 3e-4 of the largest,
    where float32 differs by 2e-6), since an input one ulp away may round to the next step."""
    return any(getattr(m, "block_format", 0) not in _FLOAT_ACTIVATION_FORMATS for m in model.modules())


def eight_bit_activations(model: torch.nn.Module) -> bool:
    """Whether some linear layer of `model` multiplies 8-bit integer activations (QUANTIZED_ACTIVATIONS=int8):
    a one-ulp change of an input there moves an output by up to 1/254 of its block's largest input times the
    weights, and over a deep model that reaches a few hundredths of the largest logit."""
    return any(getattr(m, "block_format", 0) in QUAD_FORMATS for m in model.modules())


def _candidates(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """Linear layers in step order (fused projections' parts, which run only when the fused product cannot, left
    out) with float32 CPU weights."""
    return [m for m in model.modules()
            if type(m) is torch.nn.Linear and not getattr(m, "fused_into", False)
            and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]


# 3 and 4: arranged for 16-bit integer activations; 10 and 14 for 8-bit ones (QUANTIZED_ACTIVATIONS=int8)
_FORMATS = {1: "Q4_1", 2: "Q8_0", 3: "Q4_1", 4: "Q8_0", 10: "Q4_1", 14: "Q8_0"}
WORD_FORMATS = (3, 4)
# Every other block format (3 and up: GGUF blocks arranged for words, quantized checkpoints' blocks of
# engine/cpu/packed_linear.py) multiplies integer activations, 16-bit or, in the quad formats, 8-bit; 0 is no
# blocks.
_FLOAT_ACTIVATION_FORMATS = (0, 1, 2)


def _agrees(module: torch.nn.Linear, kernels, blocks: tuple[int, torch.Tensor]) -> bool:
    """The block product against the layer's own on random rows, through each of the kernel's paths: each output
    within float32 rounding (integer activations: within their 2^-16 steps) of the sum of |x| * |w| it adds, |w|
    raised by its block's |minimum| (integer activations meet d * q = w - m)."""
    tolerance = 1e-4 if blocks[0] in WORD_FORMATS + QUAD_FORMATS else 1e-5
    weight = module.weight.reshape(module.out_features, -1, 32)
    reach = (weight.abs() + weight.amin(-1, keepdim=True).abs()).reshape(module.out_features, module.in_features)
    for rows in (1, 17):
        x = torch.randn(rows, module.in_features)
        expected = torch.nn.functional.linear(x, module.weight)
        got = kernels.blocks_linear(x, blocks[1], blocks[0], module.out_features)
        bound = tolerance * torch.nn.functional.linear(x.abs(), reach) + 1e-6
        if blocks[0] in QUAD_FORMATS:  # half an 8-bit step of each block's largest input, times |d q|
            step = x.abs().view(rows, -1, 32).amax(-1) / 254
            bound = bound + step @ reach.view(module.out_features, -1, 32).sum(-1).T
        if not bool(((got - expected).abs() <= bound).all()):
            return False
    return True


def _gains(modules: list[torch.nn.Linear], blocks: list[tuple[int, torch.Tensor]], kernels,
           sizes: tuple[int, ...], rival: torch.dtype | None = None) -> dict[int, float]:
    """The speed-up of the block product at each probed batch size, timed in turns over a step's weights in order
    (a step streams them from memory, not from cache), over the layers' current forwards or, with `rival`, over
    products of copies of the weights in that type (activations in it too, as that model would run): plain ones
    and oneDNN's packed ones (engine/cpu/layout.py), whichever is faster at that size."""
    chosen, total = [], 0
    for module, packed in zip(modules, blocks):
        chosen.append((module, packed))
        total += module.weight.numel() * 4
        if total >= cpu_layout.PROBE_BYTES:
            break
    products = []  # per rival product, the function of each chosen module
    if rival is None:
        products.append({m: m.forward for m, _ in chosen})
    else:
        copies = {m: m.weight.detach().to(rival) for m, _ in chosen}
        products.append({m: (lambda x, w=w: F.linear(x, w)) for m, w in copies.items()})
        packed = {m: cpu_layout.packed_product(w) for m, w in copies.items()}
        if all(packed.values()):
            products.append(packed)
    gains = {}
    for rows in sizes:
        timed = chosen[:max(1, len(chosen) // 4)] if rows >= _LARGE_ROWS else chosen
        x_for = {m.in_features: torch.randn(rows, m.in_features) for m, _ in timed}
        dense_x = x_for if rival is None else {k: x.to(rival) for k, x in x_for.items()}
        gains[rows] = min(cpu_layout.speedup(
            lambda: [product[m](dense_x[m.in_features]) for m, _ in timed],
            lambda: [kernels.blocks_linear(x_for[m.in_features], p[1], p[0], m.out_features) for m, p in timed],
            repeats=3) for product in products)
    return gains


def _exact_blocks(model: torch.nn.Module, kernels, words: bool, limit: int | None = None, check: bool = True,
                  quads: bool = False) -> list[tuple[torch.nn.Linear, tuple[int, torch.Tensor]]]:
    """The candidate layers (up to `limit` bytes of float32 weights, in step order) that hold exact blocks, with their
    packed blocks; [] where the product disagrees with the float32 one on this machine (logged). `check=False`
    skips that comparison, for a verdict an earlier start already reached (engine/startup_cache.py)."""
    found, total = [], 0
    for module in _candidates(model):
        packed = kernels.pack_blocks(module.weight.detach(), words, quads)
        if packed[0]:
            found.append((module, packed))
        total += module.weight.numel() * 4
        if limit is not None and total >= limit:
            break
    if check and found and not all(_agrees(m, kernels, b) for m, b in {b[0]: (m, b) for m, b in found}.values()):
        log.warning("the block product differs from the float32 one on this machine; not used")
        return []
    return found


def gguf_block_share(path) -> float:
    """The share of a GGUF file's tensor bytes stored in the block types the product multiplies from (Q4_1, Q8_0),
    read from the file's header: a model mostly in other types (Q4_K, ...) would find few exact blocks."""
    from engine.quantization import gguf_header

    sizes = [(tensor.tensor_type.name, tensor.n_bytes) for tensor in gguf_header.read(path)[1]]
    total = sum(size for _, size in sizes)
    return sum(size for name, size in sizes if name in _FORMATS.values()) / total if total else 0.0


def beats_bfloat16(model: torch.nn.Module, kernels) -> bool:
    """Whether a float32 model's exact blocks with 16-bit integer activations run decode steps (1 and 16 rows, in
    geometric mean) at least as fast as bfloat16 products of the same weights (plain or packed), which DTYPE=auto
    serves otherwise on a CPU with native bfloat16. The blocks read a third of bfloat16's bytes, which bounds a
    decode step at few rows; prefill sizes are timed for the log."""
    if kernels is None or not kernels.word_blocks_supported():
        return False
    with torch.inference_mode():
        found = _exact_blocks(model, kernels, True, cpu_layout.PROBE_BYTES)
        if not found:
            return False
        gains = _gains([m for m, _ in found], [b for _, b in found], kernels, _WORD_PROBE_ROWS, torch.bfloat16)
    # The geometric mean over decode sizes, as cpu_layout weighs layouts; a tie goes to the blocks, whose rounding
    # is 256 times finer than bfloat16's.
    wins = math.prod(gains[rows] for rows in _DECODE_ROWS) ** (1 / len(_DECODE_ROWS)) >= 1.0
    log.info("DTYPE=auto: exact GGUF blocks with 16-bit activations against bfloat16 products, over a step's "
             "weights: %s rows; %s", ", ".join(f"{g:.2f}x at {rows}" for rows, g in gains.items()),
             "float32 weights with their blocks" if wins else "bfloat16")
    return wins


def _verdict_name(model: torch.nn.Module, words: bool, quads: bool) -> str:
    """The stored verdict's name for these candidate layers (their shapes, in order) and activations."""
    shapes = repr([tuple(m.weight.shape) for m in _candidates(model)])
    return f"gguf_blocks:{int(words) + int(quads)}:" + hashlib.sha256(shapes.encode()).hexdigest()[:16]


def _stored(model: torch.nn.Module, kernels, integer_activations: bool, byte_activations: bool, verdicts):
    """(words, quads, verdict name, stored, until, timed): the activations apply multiplies and what an earlier
    start found for these layers (`until`: rows up to which the blocks serve, 0 for none)."""
    words = integer_activations and kernels.word_blocks_supported()
    quads = words and byte_activations  # QUANTIZED_ACTIVATIONS=int8: 8-bit activations
    name = _verdict_name(model, words, quads) if verdicts is not None else ""
    stored, value = verdicts.cached(name) if verdicts is not None else (False, None)
    until, timed = value if stored else (0, "")
    return words, quads, name, stored, until, timed


def blocks_at_every_size(model: torch.nn.Module, kernels, integer_activations: bool = False,
                         every_size: bool = False, verdicts=None, byte_activations: bool = False):
    """The exact blocks apply would use (its `found`), where it is known before any other product is set up that
    they will serve every batch size: BATCH_INVARIANT, or an earlier start's verdict. None where apply's own
    check and timing decide (a first start)."""
    if kernels is None or not kernels.blocks_supported():
        return None
    words, quads, _, stored, until, _ = _stored(model, kernels, integer_activations, byte_activations, verdicts)
    if not (every_size or (stored and until == EVERY_SIZE)):
        return None
    with torch.inference_mode():
        return _exact_blocks(model, kernels, words, check=not (stored and until), quads=quads)


def apply(model: torch.nn.Module, kernels, integer_activations: bool = False, every_size: bool = False,
          verdicts=None, byte_activations: bool = False, found=None) -> int:
    """Give every linear layer whose weight is exact Q4_1 or Q8_0 blocks a block product for batches up to the
    size where it wins (`kernels`: native_kernels.active(), or None), with 16-bit integer activations where
    `integer_activations` allows and the CPU has the product. With `every_size` (BATCH_INVARIANT) the blocks serve
    every batch size: a row's block product does not depend on the other rows, but a row that went to the float32
    product when the step had more rows would round differently. Returns how many layers got one. `verdicts`
    (engine/startup_cache.py) keeps the agreement check's and the timing's outcome across starts: the blocks are
    still recovered from the weights, but neither compared nor timed again. `found`: what blocks_at_every_size
    returned, so the blocks are not recovered twice."""
    if kernels is None or not kernels.blocks_supported():
        return 0
    words, quads, name, stored, until, timed = _stored(model, kernels, integer_activations, byte_activations,
                                                       verdicts)
    sizes = _WORD_PROBE_ROWS if words else _PROBE_ROWS
    if stored and not until and not every_size:
        return 0  # no exact blocks, a product that differs, or one that is not faster here
    with torch.inference_mode():
        # A stored "no" may have been a product that differs: blocks wanted at every size are checked again.
        if found is None:
            found = _exact_blocks(model, kernels, words, check=not (stored and until), quads=quads)
        if not found:
            if verdicts is not None:
                verdicts.get(name, lambda: [0, ""])
            return 0
        modules, blocks = [m for m, _ in found], [b for _, b in found]
        if not stored:
            gains = _gains(modules, blocks, kernels, sizes)
            until = 0
            for rows in sizes:
                if gains[rows] < _GAIN_NEEDED:
                    break
                until = rows
            if words and until == sizes[-1]:
                until = EVERY_SIZE
            timed = ", ".join(f"{g:.2f}x at {rows}" for rows, g in gains.items())
            if verdicts is not None:
                verdicts.get(name, lambda: [until, timed])
    if every_size:
        until = EVERY_SIZE
    formats = ", ".join(f"{sum(b[0] == f for b in blocks)} {name}" for f, name in _FORMATS.items()
                        if any(b[0] == f for b in blocks))
    if not until:
        log.info("linear weights: %d layers hold exact GGUF blocks (%s), but their product is not faster here (%s "
                 "rows over a step's weights); float32 kept", len(modules), formats, timed)
        return 0
    released = 0
    # At every size no float32 product serves these layers: their packed copies and their weights as loaded go.
    release = weight_release.Release(modules, model, _make_block_linear, _make_block_embedding)
    for module, (block_format, packed) in found:
        module.weight_blocks = packed
        module.block_format = block_format
        module.blocks_until = until
        module.block_kernels = kernels
        module.dense_forward = module.forward if until != EVERY_SIZE else None
        module.forward = types.MethodType(_forward, module)
        module.direct = types.MethodType(_direct, module)
        if until == EVERY_SIZE:
            released += cpu_layout.release_packed(module)
            release(module)
    log.info("linear weights: %d layers multiply from their exact GGUF blocks (%s; engine/cpu/native/quantized_linear.cpp"
             ", %.0f MB for %.0f MB of float32) with %s activations %s: %s rows over a step's weights", len(modules),
             formats, sum(b[1].numel() for b in blocks) / 2**20, sum(m.weight.numel() * 4 for m in modules) / 2**20,
             "8-bit integer" if quads else "16-bit integer" if words else "float32",
             "at every batch size" if until == EVERY_SIZE else f"up to {until} rows", timed)
    if released:
        log.info("linear weights: %.0f MB of packed float32 copies released (engine/cpu/layout.py)", released / 2**20)
    if release.released:
        log.info("linear weights: their %.0f MB of float32 weights as loaded released (the blocks are the only copy)",
                 release.released / 2**20)
    return len(modules)
