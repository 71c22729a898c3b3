"""Faster linear layers on CPU: the weight layout the CPU's matrix product runs fastest on.

Decode steps multiply a few rows (one per running sequence) by every weight matrix, where PyTorch's default CPU
product over row-major weights (`F.linear`) is far from the machine's limits. Two alternatives, each probed on
this machine at load and used only where it wins, so other CPUs keep the default:

- Column-major weights: the same values stored transposed, so the product runs as `x @ W_t` over a contiguous
  `[in, out]` matrix (MKL's faster kernel for a few rows). No memory is added: each weight (and the fused
  projections' parts, which are views of it) moves to the new storage. Measured on an Intel AVX-512 machine
  without BF16, one decoder layer's products: 8 rows 0.80 -> 0.48 ms, 16 rows 1.60 -> 0.93, 32 rows 1.80 -> 1.43,
  256 rows about equal.
- oneDNN's linear over a weight reordered once into its blocked layout (the primitive torch.compile uses for
  frozen CPU models). Measured on the 2-core AMD EPYC machine, per step: 1 row 43.8 -> 22.4 ms, 16 rows
  65.9 -> 30.7 ms, 256 rows (prefill) 423 -> 331 ms. The packed copy doubles the linear weights' memory, so this
  applies to models up to `_MAX_MODEL_BYTES`.

Results equal `F.linear` up to float summation order.
"""
from __future__ import annotations

import logging
import math
import time
import types

import torch
import torch.nn.functional as F

log = logging.getLogger("engine.cpu_layout")

_MAX_MODEL_BYTES = 2 * 2**30
_GAIN_NEEDED = 1.1
_BATCH_HINT = 16  # the batch size oneDNN picks its weight layout for; good from 1 to 256 rows here


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return _packed_linear(x, self.weight_packed, self.bias)


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


def _probe(weight: torch.Tensor) -> float:
    """The packed product's worst speed-up over F.linear at 1 and 16 rows on this weight (0 if unavailable)."""
    if not torch.backends.mkldnn.is_available():
        return 0.0
    try:
        packed = _pack(weight)
        gains = []
        for rows in (1, 16):
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
            if not torch.allclose(_packed_linear(x, packed, None), F.linear(x, weight), rtol=1e-3, atol=1e-3):
                return 0.0
            gains.append(speedup(lambda: F.linear(x, weight), lambda: _packed_linear(x, packed, None)))
        return min(gains)
    except (RuntimeError, AttributeError, NotImplementedError):  # a torch build without these oneDNN ops
        return 0.0


def bfloat16_is_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512_BF16 or AMX) through oneDNN."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))
    except (AttributeError, RuntimeError):
        return False


def bfloat16_gain(hidden: int = 1024) -> float:
    """How much faster a bfloat16 product is than a float32 one here, at decode (16 rows) and prefill (256 rows)
    sizes: the smaller of the two speed-ups (0 where bfloat16 is not native)."""
    if not bfloat16_is_native():
        return 0.0
    gains = []
    with torch.inference_mode():
        weight = torch.randn(4 * hidden, hidden)
        for rows in (16, 256):
            x = torch.randn(rows, hidden)
            xb, wb = x.bfloat16(), weight.bfloat16()
            gains.append(speedup(lambda: F.linear(x, weight), lambda: F.linear(xb, wb)))
    return min(gains)


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


def apply(model: torch.nn.Module) -> str:
    """Switch the model's linear layers to the layout this CPU runs fastest ("column-major", "packed" or
    "default"), by a probe on the model's own weights."""
    with torch.inference_mode():
        weights = _layer_weights(model)
        column_gain = _column_major_gain(weights) if weights else 0.0
        packed_gain = _packed_gain(model)
        if max(column_gain, packed_gain) < _GAIN_NEEDED:
            log.info("CPU linear layout: column-major weights %.2fx, packed oneDNN product %.2fx; keeping the "
                     "default product", column_gain, packed_gain)
            return "default"
        if column_gain >= packed_gain:
            moved = use_column_major(model)
            log.info("CPU linear layout: column-major weights %.2fx faster at decode sizes; moved %d weights",
                     column_gain, moved)
            return "column-major"
        for module in model.modules():
            if type(module) is not torch.nn.Linear or getattr(module, "fused_into", False):
                continue
            module.weight_packed = _pack(module.weight.detach())
            module.forward = types.MethodType(_forward, module)
    log.info("CPU linear layout: packed oneDNN product %.2fx faster; enabled", packed_gain)
    return "packed"


def _packed_gain(model: torch.nn.Module) -> float:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32:
        return 0.0
    if sum(p.numel() * p.element_size() for p in model.parameters()) > _MAX_MODEL_BYTES:
        return 0.0  # the packed copy would double too much memory
    return _probe(head.weight.detach()[:16384])
