"""Faster linear layers on CPU: the weight layout the CPU's matrix product runs fastest on.

Decode steps multiply a few rows (one per running sequence) by every weight matrix, where PyTorch's default CPU
product over row-major weights (`F.linear`) is far from the machine's limits. Two alternatives, each probed on
this machine at load and used only where it wins, so other CPUs keep the default:

- Column-major weights: the same values stored transposed, so the product runs as `x @ W_t` over a contiguous
  `[in, out]` matrix, for which MKL has a faster kernel at a few rows on some CPUs. No memory is added: each
  weight (and the fused projections' parts, which are views of it) moves to the new storage.
- oneDNN's linear over a weight reordered once into its blocked layout (the primitive torch.compile uses for
  frozen CPU models), from the batch size where it starts to win: below it the product keeps the (row- or
  column-major) original. Which sizes win is timed over a whole decode step's weights in order, since a step
  streams them from memory rather than from cache, and CPUs differ: on some the packed product loses at one row
  and wins from a few, on others it wins from one row. The packed copy doubles the linear weights' memory, so it
  applies to models up to `_MAX_MODEL_BYTES`. Float32 and bfloat16 weights are tried.

Results equal `F.linear` up to float summation order. What the layouts gained where they were measured:
docs/performance.md (figures behind design choices).
"""
from __future__ import annotations

import hashlib
import logging
import math
import time
import types
from typing import NamedTuple

import torch
import torch.nn.functional as F

log = logging.getLogger("engine.cpu.layout")

_MAX_MODEL_BYTES = 2 * 2**30
_GAIN_NEEDED = 1.1
_BATCH_HINT = 16  # the batch size oneDNN picks its weight layout for; good from 1 to 256 rows here


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_product(weight: torch.Tensor):
    """x -> F.linear(x, weight) through oneDNN's packed layout, or None where this torch build has none for the
    weight's type (other probes time it as what a model of that type would run)."""
    try:
        packed = _pack(weight)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    return lambda x: _packed_linear(x, packed, None)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.weight_packed is not None and x.numel() >= self.packed_from * x.shape[-1]:
        return _packed_linear(x, self.weight_packed, self.bias)
    return F.linear(x, self.weight, self.bias)


_INVARIANT_ROWS_MAX = 64  # the most rows one invariant product call takes (each size up to it is checked)


def _invariant_forward(self, x: torch.Tensor) -> torch.Tensor:
    """BATCH_INVARIANT: every row multiplied in a call of 2 to `invariant_rows` rows, a single row as two. oneDNN
    sums a row alike at any number of rows in that range, but a single row takes another kernel that rounds
    differently, and past a size it may take yet another (AMX's bfloat16 tiles from 33 rows on one Xeon)."""
    width = x.shape[-1]
    rows = x.numel() // width
    if 2 <= rows <= self.invariant_rows:
        return self.dense_product(x)
    flat = x.reshape(rows, width)
    parts = []
    for start in range(0, rows, self.invariant_rows):
        part = flat[start:start + self.invariant_rows]
        if part.shape[0] == 1:
            parts.append(self.dense_product(part.expand(2, -1).contiguous())[:1])
        else:
            parts.append(self.dense_product(part))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.view(*x.shape[:-1], -1)


def invariant_rows(product, in_features: int, dtype: torch.dtype) -> int:
    """The most rows (up to _INVARIANT_ROWS_MAX) at which `product` gives each row of a random input the same
    values as it gives that row in a 2-row call, every size from 2 up checked."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_INVARIANT_ROWS_MAX, in_features, generator=gen).to(dtype)
    pairs = torch.cat([product(x[i:i + 2]) for i in range(0, _INVARIANT_ROWS_MAX, 2)])
    for rows in range(3, _INVARIANT_ROWS_MAX + 1):
        if not torch.equal(product(x[:rows]), pairs[:rows]):
            return rows - 1
    return _INVARIANT_ROWS_MAX


def use_invariant(model: torch.nn.Module) -> int:
    """Make every linear layer's product independent of the batch (BATCH_INVARIANT): oneDNN's packed product
    at every size where the model has packed copies, each row in a call of a size checked here to sum it alike
    (`invariant_rows`, once per weight type and width on a slice of a layer's own weight), a single row padded
    to two. Float32 weights without packed copies keep MKL's product, whose row sums change with the batch size.
    Returns how many layers changed."""
    count = 0
    checked: dict[tuple, int] = {}
    for module in model.modules():
        if type(module) is not torch.nn.Linear or getattr(module, "fused_into", False):
            continue
        packed = getattr(module, "weight_packed", None)
        if packed is not None:
            module.packed_from = 1
        key = (module.weight.dtype, module.in_features, packed is not None)
        if key not in checked:
            if packed is not None:
                sample = _pack(module.weight.detach()[:256].contiguous())
                checked[key] = invariant_rows(lambda x: _packed_linear(x, sample, None), module.in_features,
                                              module.weight.dtype)
            else:
                checked[key] = _INVARIANT_ROWS_MAX
        module.invariant_rows = max(2, checked[key])
        module.dense_product = module.forward
        module.forward = types.MethodType(_invariant_forward, module)
        count += 1
    return count


def release_packed(module: torch.nn.Module) -> int:
    """Drop `module`'s packed copy (its products then run on its weight as stored) where another product serves
    every batch size; returns the bytes that held it."""
    packed = getattr(module, "weight_packed", None)
    if packed is None:
        return 0
    module.weight_packed = None
    return module.weight.numel() * module.weight.element_size()


def best_time(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def speedup(baseline, candidate, repeats: int = 7) -> float:
    """How many times faster `candidate` runs than `baseline`: the fastest of `repeats` calls each, timed in
    turns so that a burst of load on the machine (another worker starting) slows both alike."""
    baseline()
    candidate()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, kept in ((baseline, times[0]), (candidate, times[1])):
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return min(times[0]) / min(times[1])


def bfloat16_is_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX) through oneDNN."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))
    except (AttributeError, RuntimeError):
        return False


PREFILL_LOSS_ALLOWED = 0.9  # bfloat16 weights may cost prompt chunks this much at most


def bfloat16_gain(hidden: int = 1024, kernels=None) -> float:
    """How much bfloat16 weights speed products up here over float32 (0 where bfloat16 is not native): the
    speed-up at a decode size (16 rows) where a prompt chunk's size (256 rows) loses at most 10%, else the speed-up
    at that size (below 1, so bfloat16 is not taken). Each size takes the fastest bfloat16 product: torch's, or
    where `kernels` (engine/cpu/native_kernels.py) has one, the AVX512_BF16 kernel in either of its arithmetics
    (engine/cpu/bf16_weights.py serves bfloat16 layers through it). Where VDPBF16PS runs at half the rate of the
    CPU's float32 FMAs, torch's bfloat16 products lose to float32 on prompt chunks while the kernel, multiplying
    the same bfloat16 weights with float32 FMAs, still wins at both sizes: so each size takes its fastest."""
    if not bfloat16_is_native():
        return 0.0
    native = kernels is not None and hasattr(kernels, "bf16_linear_supported") and kernels.bf16_linear_supported()
    gains = []
    with torch.inference_mode():
        weight = torch.randn(4 * hidden, hidden)
        wb = weight.bfloat16()
        packed = kernels.bf16_pack(wb) if native else None
        for rows in (16, 256):
            x = torch.randn(rows, hidden)
            xb = x.bfloat16()
            products = [lambda: F.linear(xb, wb)]
            if packed is not None:
                products += [lambda widen=widen: kernels.bf16_linear(xb, packed, 4 * hidden, None, widen)
                             for widen in (False, True)]
            gains.append(max(speedup(lambda: F.linear(x, weight), product) for product in products))
    decode, prefill = gains
    return decode if prefill >= PREFILL_LOSS_ALLOWED else prefill


_DECODE_ROWS = (1, 8, 32)
_PREFILL_ROWS = 256


def _layer_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights one decoder layer multiplies by (fused projections included, their parts not)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not layers:
        return []
    return [m.weight for m in layers[0][0].modules()
            if type(m) is torch.nn.Linear and not getattr(m, "fused_into", False)]


def _column_major_gain(weights: list[torch.Tensor]) -> float:
    """How much faster one layer's products run over column-major weights: the geometric mean over decode sizes,
    or 0 if a prefill-size product gets more than 10% slower."""
    moved = [w.t().contiguous().t() for w in weights]

    def layer(ws, x_for):
        return lambda: [F.linear(x_for[w.shape[1]], w) for w in ws]

    gains = []
    for rows in (*_DECODE_ROWS, _PREFILL_ROWS):
        x_for = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights}
        gains.append(speedup(layer(weights, x_for), layer(moved, x_for)))
    if gains[-1] < 0.9:
        return 0.0
    return math.prod(gains[:-1]) ** (1 / len(_DECODE_ROWS))


def use_column_major(model: torch.nn.Module) -> int:
    """Store every linear weight transposed in memory (same values and shape), moving the views that share its
    storage (fused projections' parts) along. Storage also used outside linear layers (an output head tied to
    the input embeddings) stays as it is. Returns how many weights moved."""
    groups: dict[int, list[torch.nn.Linear]] = {}
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dim() == 2:
            groups.setdefault(module.weight.untyped_storage().data_ptr(), []).append(module)
    shared_elsewhere = {p.untyped_storage().data_ptr() for m in model.modules() if type(m) is not torch.nn.Linear
                        for p in m.parameters(recurse=False)}
    moved = 0
    for key, linears in groups.items():
        if key in shared_elsewhere:
            continue
        whole = max(linears, key=lambda m: m.weight.numel())
        old = whole.weight
        if not old.is_contiguous() or any(m.weight.stride() != old.stride() for m in linears):
            continue
        new = old.detach().t().contiguous().t()
        for module in linears:
            start = (module.weight.data_ptr() - old.data_ptr()) // (old.stride(0) * old.element_size())
            module.weight = torch.nn.Parameter(new[start:start + module.weight.shape[0]], requires_grad=False)
            moved += 1
    return moved


class Layout(NamedTuple):
    column_major: bool
    packed_from: int | None  # the fewest rows that run oneDNN's packed product; None: never


_PACKED_ROWS = (1, 4, 16, 64)  # the decode batch sizes the packed product is timed at
# The weight types the packed product is tried for, and how closely it must agree with F.linear (summation order;
# bfloat16 results round to 8 bits). bfloat16 is tried as well: with AVX512_BF16 oneDNN's packed product speeds up
# its decode steps as it does float32's.
_PACKED_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
_PACKED_GAIN_NEEDED = 1.05
# A step's weights beyond this are left out of the timing (it streams them alike); engine/cpu/quantized_weights.py's
# probe times the same share.
PROBE_BYTES = 512 * 2**20


def _step_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights a decode step multiplies by, in its order (fused projections included, their parts not), up
    to `PROBE_BYTES`, and the output head where it is a linear layer."""
    head = model.get_output_embeddings()
    weights, total = [], 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or getattr(module, "fused_into", False) or module is head:
            continue
        weights.append(module.weight.detach())
        total += module.weight.numel() * module.weight.element_size()
        if total >= PROBE_BYTES:
            break
    return weights + ([head.weight.detach()] if isinstance(head, torch.nn.Linear) else [])


def _key(weight: torch.Tensor) -> tuple:
    return weight.data_ptr(), tuple(weight.shape)


def _packable(model: torch.nn.Module) -> bool:
    """Whether oneDNN can give the model's linear layers packed copies (as `_packed_from` requires, untimed)."""
    head = model.get_output_embeddings()
    if not (torch.backends.mkldnn.is_available() and isinstance(head, torch.nn.Linear)
            and head.weight.dtype in _PACKED_TOLERANCE and head.weight.device.type == "cpu"):
        return False
    if sum(p.numel() * p.element_size() for p in model.parameters()) > _MAX_MODEL_BYTES:
        return False
    try:
        _pack(head.weight.detach()[:16])
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def _packed_from(model: torch.nn.Module) -> tuple[int | None, dict[int, float], dict[tuple, torch.Tensor]]:
    """The fewest rows from which oneDNN's packed product beats the current one (by `_PACKED_GAIN_NEEDED`) at
    every probed decode size, timed over a step's weights in order; the speed-up at each size; and the packed
    weights made for the timing. None where packing is unavailable, not allowed or not faster, or where it loses
    more than 10% at prefill size."""
    head = model.get_output_embeddings()
    if not (torch.backends.mkldnn.is_available() and isinstance(head, torch.nn.Linear)
            and head.weight.dtype in _PACKED_TOLERANCE):
        return None, {}, {}
    if sum(p.numel() * p.element_size() for p in model.parameters()) > _MAX_MODEL_BYTES:
        return None, {}, {}  # the packed copy would double too much memory
    weights = _step_weights(model)
    try:
        packs = [_pack(w) for w in weights]
        x = torch.randn(4, weights[0].shape[1], dtype=weights[0].dtype)
        tolerance = _PACKED_TOLERANCE[head.weight.dtype]
        if not torch.allclose(_packed_linear(x, packs[0], None).float(), F.linear(x, weights[0]).float(),
                              rtol=tolerance, atol=tolerance):
            return None, {}, {}
    except (RuntimeError, AttributeError, NotImplementedError):  # a torch build without these oneDNN ops
        return None, {}, {}

    def step(rows: int, count: int):
        x_for = {w.shape[1]: torch.randn(rows, w.shape[1], dtype=w.dtype) for w in weights[:count]}
        return (lambda: [F.linear(x_for[w.shape[1]], w) for w in weights[:count]],
                lambda: [_packed_linear(x_for[w.shape[1]], p, None) for w, p in zip(weights[:count], packs)])

    layer = len(_layer_weights(model)) or 1
    if speedup(*step(_PREFILL_ROWS, layer), repeats=3) < 0.9:
        return None, {}, {}
    gains = {rows: speedup(*step(rows, len(weights)), repeats=3) for rows in _PACKED_ROWS}
    start = None
    for rows in reversed(_PACKED_ROWS):
        if gains[rows] < _PACKED_GAIN_NEEDED:
            break
        start = rows
    return start, gains, {_key(w): p for w, p in zip(weights, packs)}


def use_packed(model: torch.nn.Module, from_rows: int, packed: dict[tuple, torch.Tensor] | None = None,
               served_elsewhere: frozenset[int] = frozenset()) -> int:
    """Give every linear layer (the output head included, fused projections' parts not, nor the layers by id in
    `served_elsewhere`, whose every product another kernel makes) a packed copy of its weight, used for inputs of
    `from_rows` rows or more (`packed`: copies already made, by `_key`). Returns how many layers got one."""
    packed = packed or {}
    count = 0
    for module in model.modules():
        if (type(module) is not torch.nn.Linear or getattr(module, "fused_into", False)
                or id(module) in served_elsewhere):
            continue
        weight = module.weight.detach()
        module.weight_packed = packed.get(_key(weight))
        if module.weight_packed is None:
            module.weight_packed = _pack(weight)
        module.packed_from = from_rows
        module.forward = types.MethodType(_forward, module)
        count += 1
    return count


_probed: dict[tuple, tuple[Layout, str]] = {}  # the probes' answers in this process, by the weights' shapes


def _probe(model: torch.nn.Module) -> tuple[Layout, str, dict[tuple, torch.Tensor]]:
    """Time the layouts on the model's own weights, moving it to column-major storage first where that wins (the
    packed product is then timed against the layout in use): the layout, what was measured, and the packed copies
    the timing made."""
    weights = _layer_weights(model)
    column_gain = _column_major_gain(weights) if weights else 0.0
    column_major = column_gain >= _GAIN_NEEDED
    if column_major:
        use_column_major(model)
    packed_from, gains, packed = _packed_from(model)
    timed = ", ".join(f"{g:.2f}x at {rows}" for rows, g in gains.items()) or "unavailable"
    measured = f"column-major {column_gain:.2f}x at decode sizes; packed {timed} rows over a step's weights"
    return Layout(column_major, packed_from), measured, packed


def apply(model: torch.nn.Module, batch_invariant: bool = False, verdicts=None,
          served_elsewhere: frozenset[int] = frozenset()) -> Layout:
    """Switch the model's linear layers to the layouts this CPU runs fastest, by probes on the model's own
    weights: column-major storage where it beats row-major at decode sizes, then oneDNN's packed product for
    the batch sizes where it beats that. A model with the same weight shapes as one probed before in this
    process (a reload), or in an earlier process on this machine (`verdicts`, engine/startup_cache.py), takes
    the same answer without timing again. Layers by id in `served_elsewhere` (a kernel of engine/cpu makes their
    every product, as an earlier start found) get no packed copy: it would be made only to be released."""
    with torch.inference_mode():
        shapes = (torch.get_num_threads(), sum(p.numel() for p in model.parameters()),
                  tuple((tuple(w.shape), w.dtype) for w in _step_weights(model)))
        packed: dict[tuple, torch.Tensor] = {}
        name = "cpu_layout:" + hashlib.sha256(repr(shapes[1:]).encode()).hexdigest()[:16]
        found, stored = verdicts.cached(name) if verdicts is not None else (False, None)
        if shapes not in _probed and found:
            _probed[shapes] = Layout(bool(stored[0]), stored[1]), stored[2]
        if shapes in _probed:
            log.debug("CPU linear layout: these weight shapes were probed before")
            layout, measured = _probed[shapes]
            if layout.column_major:
                use_column_major(model)
        else:
            layout, measured, packed = _probe(model)
            _probed[shapes] = layout, measured
            if verdicts is not None:
                verdicts.get(name, lambda: [layout.column_major, layout.packed_from, measured])
        if layout.packed_from is not None:
            use_packed(model, layout.packed_from, packed, served_elsewhere)
        if batch_invariant:
            if layout.packed_from is None and _packable(model):
                # Packed at every size even where it is not the fastest: MKL's float32 product is not invariant.
                layout = layout._replace(packed_from=1)
                use_packed(model, 1, packed, served_elsewhere)
            use_invariant(model)
        log.info("CPU linear layout: %s weights, %s (%s)", "column-major" if layout.column_major else "row-major",
                 f"packed product from {layout.packed_from} rows" if layout.packed_from else "no packed product",
                 measured)
    return layout
