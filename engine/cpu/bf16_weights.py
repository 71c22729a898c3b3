"""Linear layers with bfloat16 weights multiply through the kernel of engine/cpu/native/bf16_linear.cpp:
- bfloat16 rows, on CPUs with AVX512_BF16 (VDPBF16PS or float32 FMAs over the widened weights);
- float32 rows by weights whose values are all bfloat16 ones, on every x86-64 build (AVX2 and FMA at least): a
  bfloat16 checkpoint loaded as float32, as DTYPE=auto does on a CPU without native bfloat16 products. The
  weights widen to float32 in registers, so each product is the float32 model's own, summed in input order, and
  a step reads half the bytes of the float32 weights.

A decode step at a few rows reads every weight once from memory, so the product's speed is the speed it streams
weights at. oneDNN's packed bfloat16 product (engine/cpu/layout.py) read a step's weights of a 362M Llama at about
half the machine's copy bandwidth on a 2-core AMD EPYC; the kernel reads each thread's share of a weight as one
sequential stream laid out once at load, in the order it multiplies it (docs/cpu-kernels.md). The kernel's
copy replaces oneDNN's packed one and is then the layers' only copy: the weights as loaded are released
(PackedBF16Linear), and an embedding tied to the output head reads its rows from the head's copy (PackedEmbedding).

A probe at load times it against the layout in use over a step's weights in order, at decode batch sizes and at
a prompt chunk's size on one layer's weights; where it wins at decode sizes and loses at none it serves every
batch size and oneDNN's packed copies are released, else the layout keeps serving (a CPU with AMX, whose oneDNN
prompt chunks would be far faster, say). Each distinct weight shape is first checked against a float32 product
of the same values. Float16 weights, and float32 weights that are not all bfloat16 values, keep the layout's
products.
"""
from __future__ import annotations

import hashlib
import logging
import math
import types
import weakref

import torch
import torch.nn.functional as F

from engine.cpu import layout as cpu_layout
from engine.cpu import weight_release

log = logging.getLogger("engine.cpu.bf16_weights")

_BLOCK, _PANEL_BLOCKS = 16, 4  # bf16_pack's layout: blocks of outputs, blocks per panel
_DECODE_ROWS = (1, 4, 16, 64)  # timed over a step's weights in order
_PREFILL_ROWS = 256  # timed over one layer's weights (a product this size is bound by its multiplies)
# It serves every batch size or none: serving only some would keep oneDNN's packed copy for the others, a second
# extra copy of the weights. It must win at decode sizes (geometric mean) and lose nowhere by more than timing noise.
_GAIN_NEEDED = 1.05
_LOSS_ALLOWED = 0.9


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    # Rows of another type go through the kernel's float32 rows: the packed copy is the layer's only weight.
    rows = x if x.dtype in (self.bf16_rows, torch.float32) else x.float()
    out = self.bf16_kernels.bf16_linear(rows.reshape(-1, x.shape[-1]).contiguous(), self.weight_bf16,
                                        self.out_features, self.bias_float, self.bf16_widen)
    return out.view(*x.shape[:-1], self.out_features).to(x.dtype)


def _panels(out_features: int) -> tuple[int, int]:
    """bf16_pack's whole panels of `out_features` outputs, and the blocks of the last partial one (0: none)."""
    return divmod(-(-out_features // _BLOCK), _PANEL_BLOCKS)


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [out_features, in_features] bfloat16 weight that `bf16_pack` laid out as `packed`: panels of 4 blocks of
    16 outputs (fewer in the last panel), each panel pair of inputs by pair of inputs (bf16_linear.cpp)."""
    pairs = (in_features + 1) // 2
    full, rest = _panels(out_features)
    split = full * _PANEL_BLOCKS * _BLOCK * pairs * 2
    parts = [packed[:split].view(full, pairs, _PANEL_BLOCKS, _BLOCK, 2).permute(0, 2, 3, 1, 4)
             .reshape(full * _PANEL_BLOCKS * _BLOCK, pairs * 2)]
    if rest:
        parts.append(packed[split:].view(pairs, rest, _BLOCK, 2).permute(1, 2, 0, 3).reshape(rest * _BLOCK, pairs * 2))
    return torch.cat(parts)[:out_features, :in_features]


class PackedBF16Linear(torch.nn.Linear):
    """A linear layer whose one copy of its weight is the kernel's packing (`weight_bf16`). Its products run
    through the kernel; `weight` unpacks the values on each read, for code that inspects a layer (its type, an
    adapter's base), never for a product. A fused projection's part (`rows_of`: the fused layer and the part's
    first row) reads its rows of the fused layer's weight."""

    @property
    def weight(self) -> torch.Tensor:
        source, start = getattr(self, "rows_of", (self, 0))
        values = unpack(source.weight_bf16, source.out_features, source.in_features)
        return values[start:start + self.out_features].to(self.weight_dtype)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Rows `ids` of the [out_features, in_features] weight `bf16_pack` laid out as `packed` ([*ids.shape,
    in_features], bfloat16), gathered from the packing without unpacking the rest."""
    # Output o's input k sits at its panel's start + (pair k // 2 of the panel's outputs, o's place among them)
    # * 2 + k % 2: a term per row plus a term per column, scaled by the outputs of o's panel.
    flat = ids.reshape(-1).long()
    pairs = (in_features + 1) // 2
    full, rest = _panels(out_features)
    panel, place = flat // (_PANEL_BLOCKS * _BLOCK), flat % (_PANEL_BLOCKS * _BLOCK)
    outputs = torch.where(panel < full, _PANEL_BLOCKS, rest) * _BLOCK  # in o's panel
    k = torch.arange(in_features)
    offsets = (panel * (_PANEL_BLOCKS * _BLOCK * pairs * 2) + place * 2)[:, None] + (
        outputs[:, None] * (k // 2 * 2)[None, :] + (k % 2)[None, :])
    return packed[offsets].view(*ids.shape, in_features)


class PackedEmbedding(torch.nn.Embedding):
    """An embedding whose table is the output head tied to it, which the kernel serves: each lookup gathers its
    rows from the head's packing (`table_bf16`), so the table is held once; `weight` unpacks it on each read."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return packed_rows(self.table_bf16, ids, self.num_embeddings, self.embedding_dim).to(self.weight_dtype)

    @property
    def weight(self) -> torch.Tensor:
        return unpack(self.table_bf16, self.num_embeddings, self.embedding_dim).to(self.weight_dtype)


class BF16Embedding(torch.nn.Embedding):
    """A float32 model's embedding whose table holds bfloat16 values (a bfloat16 checkpoint served as float32),
    kept as bfloat16 (`table_bf16`, half the bytes): each lookup widens its rows, exactly; `weight` widens a copy
    of the table on each read."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table_bf16).float()

    @property
    def weight(self) -> torch.Tensor:
        return self.table_bf16.float()


def _narrow_embeddings(model: torch.nn.Module) -> int:
    """Keep each plain float32 embedding of bfloat16 values that no other layer reads as BF16Embedding; returns the
    bytes released."""
    holders = weight_release.holders(model)
    released = 0
    for m in model.modules():
        table = m._parameters.get("weight") if type(m) is torch.nn.Embedding else None
        if (table is None or m.max_norm is not None or table.dtype != torch.float32 or len(holders[weight_release.storage(table)]) > 1
                or not bfloat16_values(table)):
            continue
        del m._parameters["weight"]
        m.table_bf16 = table.detach().bfloat16()
        m.__class__ = BF16Embedding
        released += table.numel() * 2
    return released


def _make_packed(module: torch.nn.Linear, dtype: torch.dtype) -> None:
    module.weight_dtype = dtype
    module.__class__ = PackedBF16Linear


def _make_embedding(embedding: torch.nn.Embedding, head: torch.nn.Linear, dtype: torch.dtype) -> None:
    embedding.weight_dtype, embedding.table_bf16 = dtype, head.weight_bf16
    embedding.__class__ = PackedEmbedding


def _direct(self, dtype: torch.dtype):
    """_forward's kernel call for contiguous bfloat16 rows [tokens, in], bound (see PackedLinear.direct), or None
    where an adapter wraps the forward or the rows are of another type."""
    if getattr(self.forward, "__func__", None) is not _forward or dtype is not self.bf16_rows:
        return None
    return self.bf16_kernels.bf16_product(self.weight_bf16, self.out_features, self.bias_float, self.bf16_widen)


def widens(modules: list[torch.nn.Linear], packs: list[torch.Tensor], kernels, layer_count: int) -> bool:
    """Whether the kernel's float32 FMAs beat its VDPBF16PS here (bf16_linear.cpp) for bfloat16 rows, timed at a
    prompt chunk's size over the first `layer_count` weights, where the product is bound by its multiplies (at a
    few rows both read the weights at the same pace). The two agree within float32 rounding of the same sums.
    Float32 rows always take the FMAs."""
    if modules[0].weight.dtype is torch.float32:
        return True
    timed = list(zip(modules, packs))[:layer_count]
    x_for = _inputs(timed, _PREFILL_ROWS)
    return cpu_layout.speedup(_kernel_pass(kernels, timed, x_for, False), _kernel_pass(kernels, timed, x_for, True),
                              repeats=5) > 1.0


def _inputs(timed: list[tuple[torch.nn.Linear, torch.Tensor]], rows: int) -> dict[int, torch.Tensor]:
    """Random rows [rows, in] of the layers' type for each input width of the timed layers."""
    return {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m, _ in timed}


def _kernel_pass(kernels, timed: list[tuple[torch.nn.Linear, torch.Tensor]], x_for: dict[int, torch.Tensor],
                 widen: bool):
    """One pass of the kernel over the timed (layer, packed copy) pairs in order, as a callable to time."""
    bias = {m: _bias(m) for m, _ in timed}
    return lambda: [kernels.bf16_linear(x_for[m.in_features], p, m.out_features, bias[m], widen) for m, p in timed]


def _rows_dtype(kernels) -> torch.dtype | None:
    """The type of rows this build and CPU multiply by bfloat16 weights: bfloat16 with AVX512_BF16, else float32
    where the build has the product, else None."""
    if kernels is None or not hasattr(kernels, "bf16_linear_supported"):
        return None
    if kernels.bf16_linear_supported():
        return torch.bfloat16
    return torch.float32 if getattr(kernels, "bf16_weights_supported", lambda: False)() else None


# id(tensor) -> (a weak reference to it, its version counter, whether all its values are bfloat16 ones): a start
# asks twice (what will be served, then apply), and each answer reads the whole weight. (Tensors compare by value,
# so a WeakKeyDictionary cannot hold them.)
_BF16_VALUES: dict[int, tuple[weakref.ref, int, bool]] = {}


def bfloat16_values(weight: torch.Tensor) -> bool:
    """Whether every value of a float32 tensor is a bfloat16 value (the low 16 bits of each are zero)."""
    key = id(weight)
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor keeps no version counter (a loaded model's weights, written once)
        version = -1
    known = _BF16_VALUES.get(key)
    if known is not None and known[0]() is weight and known[1] == version:
        return known[2]
    verdict = _all_bfloat16(weight)
    _BF16_VALUES[key] = (weakref.ref(weight, lambda _: _BF16_VALUES.pop(key, None)), version, verdict)
    return verdict


def _all_bfloat16(weight: torch.Tensor) -> bool:
    return not bool(torch.bitwise_and(weight.detach().view(torch.int32), 0xFFFF).any())


def _candidates(model: torch.nn.Module, rows: torch.dtype | None = torch.bfloat16) -> list[torch.nn.Linear]:
    """Linear layers in step order (fused projections' parts, which run only when the fused product cannot, left
    out) with 2-D CPU weights of the rows' type: bfloat16, or float32 whose values are all bfloat16 ones (every
    layer of the model, or none: a float32 model from a float32 checkpoint keeps its products)."""
    if rows is None:
        return []
    modules = [m for m in model.modules()
               if type(m) is torch.nn.Linear and not getattr(m, "fused_into", False)
               and m.weight.dtype == rows and m.weight.device.type == "cpu" and m.weight.dim() == 2]
    if rows is torch.float32 and not all(bfloat16_values(m.weight) for m in modules):
        return []
    return modules


def _bias(module: torch.nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach().float().contiguous()


def agrees(module: torch.nn.Linear, kernels, packed: torch.Tensor) -> bool:
    """The kernel's product (bfloat16 rows: in both arithmetics) against float32 sums of the same values (+ bias)
    at 1, 7 and 17 rows: each output within float32 summation error, plus for bfloat16 rows its rounding to
    bfloat16 (half a unit in the last place)."""
    weight = module.weight.detach().float()
    bias = _bias(module)
    rows_dtype = module.weight.dtype
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 7, 17):
        x = torch.randn(rows, module.in_features, generator=gen).to(rows_dtype)
        expected = F.linear(x.float(), weight, bias)
        rounding = 2.0**-8 if rows_dtype is torch.bfloat16 else 0.0
        bound = expected.abs() * rounding + 1e-5 * F.linear(x.float().abs(), weight.abs()) + 1e-30
        for widen in ((False, True) if rows_dtype is torch.bfloat16 else (True,)):
            got = kernels.bf16_linear(x, packed, module.out_features, bias, widen).float()
            if got.shape != expected.shape or not bool(((got - expected).abs() <= bound).all()):
                return False
    return True


def _gains(modules: list[torch.nn.Linear], packs: list[torch.Tensor], kernels,
           layer_count: int, widen: bool) -> dict[int, float]:
    """The kernel's speed-up over each layer's current forward at each probed batch size, timed in turns over a
    step's weights in order (up to cpu_layout.PROBE_BYTES, and the output head), a prompt chunk's size over the
    first `layer_count` weights."""
    chosen, total = [], 0
    head = modules[-1]
    for module, packed in zip(modules, packs):
        chosen.append((module, packed))
        total += module.weight.numel() * 2
        if total >= cpu_layout.PROBE_BYTES:
            break
    if chosen[-1][0] is not head:
        chosen.append((head, packs[-1]))
    gains = {}
    for rows in (*_DECODE_ROWS, _PREFILL_ROWS):
        timed = chosen[:layer_count] if rows == _PREFILL_ROWS else chosen
        x_for = _inputs(timed, rows)
        gains[rows] = cpu_layout.speedup(lambda: [m.forward(x_for[m.in_features]) for m, _ in timed],
                                         _kernel_pass(kernels, timed, x_for, widen), repeats=5)
    return gains


def _layer_count(model: torch.nn.Module, modules: list[torch.nn.Linear]) -> int:
    """How many of `modules` belong to the first decoder layer (the first ModuleList of several blocks)."""
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1), None)
    if layers is None:
        return 1
    first = {id(m) for m in layers[0].modules()}
    return max(1, sum(id(m) in first for m in modules))


def _verdict_name(modules: list[torch.nn.Linear]) -> str:
    shapes = repr([(tuple(m.weight.shape), m.bias is not None) for m in modules]
                  + [str(modules[0].weight.dtype), torch.get_num_threads()])
    return "bf16_linear:" + hashlib.sha256(shapes.encode()).hexdigest()[:16]


def serves_every_size(model: torch.nn.Module, kernels, every_size: bool = False, verdicts=None
                      ) -> list[torch.nn.Linear]:
    """The layers apply will give the kernel's product at every batch size, as an earlier start's verdict says;
    [] where no start has decided yet (apply checks and times then)."""
    modules = _candidates(model, _rows_dtype(kernels))
    stored, value = verdicts.cached(_verdict_name(modules)) if verdicts is not None and modules else (False, None)
    if not stored:
        return []
    serves, timed, _ = value
    return modules if serves or (every_size and timed != "differs") else []


def apply(model: torch.nn.Module, kernels, every_size: bool = False, verdicts=None) -> int:
    """Give every linear layer with bfloat16 weights (bfloat16 ones, or float32 ones of bfloat16 values where this
    CPU has no bfloat16 product) the kernel's product where it wins over the layout in use (`kernels`:
    native_kernels.active(), or None). With `every_size` (BATCH_INVARIANT) it serves even where it does not win:
    a row's sums do not depend on the other rows, so the product is batch invariant by itself. Returns how many
    layers got it. `verdicts` (engine/startup_cache.py) keeps the check's and the timing's outcome across starts."""
    rows = _rows_dtype(kernels)
    modules = _candidates(model, rows)
    if not modules:
        return 0
    product = ("the AVX512_BF16 product" if rows is torch.bfloat16
               else "the product of float32 rows by bfloat16 weights")
    name = _verdict_name(modules)
    stored, value = verdicts.cached(name) if verdicts is not None else (False, None)
    serves, timed, widen = value if stored else (False, "", False)
    if stored and not serves and not (every_size and timed != "differs"):
        return 0
    release = weight_release.Release(modules, model, _make_packed, _make_embedding)
    released = 0

    def serve(module: torch.nn.Linear, packed: torch.Tensor) -> int:
        module.weight_bf16 = packed
        module.bias_float = _bias(module)
        module.bf16_kernels = kernels
        module.bf16_widen = widen
        module.bf16_rows = rows
        module.forward = types.MethodType(_forward, module)
        module.direct = types.MethodType(_direct, module)
        layout_copy = cpu_layout.release_packed(module)  # no other product serves these layers now
        release(module)
        return layout_copy

    with torch.inference_mode():
        if stored:
            # The verdict is known: each layer is packed and gives up its weight in turn, so the weights as loaded
            # and the kernel's copy are never both held whole.
            for module in modules:
                released += serve(module, kernels.bf16_pack(module.weight.detach().bfloat16()))  # exact values
        else:
            packs = [kernels.bf16_pack(m.weight.detach().bfloat16()) for m in modules]
            checked = {}
            for module, packed in zip(modules, packs):
                key = (tuple(module.weight.shape), module.bias is not None)
                if key not in checked:
                    checked[key] = agrees(module, kernels, packed)
            if not all(checked.values()):
                log.warning("%s (engine/cpu/native/bf16_linear.cpp) differs from float32 sums on this machine; "
                            "not used", product)
                serves, timed = False, "differs"
            else:
                layer_count = _layer_count(model, modules)
                widen = widens(modules, packs, kernels, layer_count)
                gains = _gains(modules, packs, kernels, layer_count, widen)
                decode = math.prod(gains[rows] for rows in _DECODE_ROWS) ** (1 / len(_DECODE_ROWS))
                serves = decode >= _GAIN_NEEDED and min(gains.values()) >= _LOSS_ALLOWED
                timed = (", ".join(f"{g:.2f}x at {rows}" for rows, g in gains.items()) + " rows, "
                         + ("float32 FMAs" if widen else "VDPBF16PS"))
            if verdicts is not None:
                verdicts.get(name, lambda: [serves, timed, widen])
            if not (serves or (every_size and timed != "differs")):
                log.info("linear weights: %s is not faster here (%s); the layout's products kept", product, timed)
                return 0
            for module, packed in zip(modules, packs):
                released += serve(module, packed)
    dropped = release.released + (_narrow_embeddings(model) if rows is torch.float32 else 0)
    log.info("linear weights: %d bfloat16 layers multiply through %s at every batch size "
             "(engine/cpu/native/bf16_linear.cpp, a %.0f MB copy): %s", len(modules), product,
             sum(m.weight_bf16.numel() * 2 for m in modules) / 2**20, timed or "BATCH_INVARIANT")
    if released:
        log.info("linear weights: %.0f MB of oneDNN's packed copies released (engine/cpu/layout.py)", released / 2**20)
    if dropped:
        log.info("linear weights: their %.0f MB as loaded released (the kernel's copy is the only one)",
                 dropped / 2**20)
    return len(modules)
