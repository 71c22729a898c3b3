"""Faster linear layers on CPU: oneDNN products over weights packed once at load.

Decode steps multiply a few rows (one per running sequence) by every weight matrix, where PyTorch's default
CPU product (`F.linear`) is far from the machine's limits. oneDNN's linear over a weight reordered once into
its blocked layout (the primitive torch.compile uses for frozen CPU models) is faster at every batch size.
Measured on the project's 2-core AVX-512 machine over the embedded model's (fused) linear layers, per step:
1 row 43.8 -> 22.4 ms, 16 rows 65.9 -> 30.7 ms, 256 rows (prefill) 423 -> 331 ms.

A probe times both products on this machine at load, and the packed product is used only where it wins,
so other CPUs keep the default. The packed copy doubles the linear weights' memory, so this applies to
models up to `_MAX_MODEL_BYTES`. Results equal `F.linear` up to float summation order.
"""
from __future__ import annotations

import logging
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
            gains.append(best_time(lambda: F.linear(x, weight)) / best_time(lambda: _packed_linear(x, packed, None)))
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
            gains.append(best_time(lambda: F.linear(x, weight)) / best_time(lambda: F.linear(xb, wb)))
    return min(gains)


def apply(model: torch.nn.Module) -> bool:
    """Switch the model's linear layers to packed oneDNN products when this CPU gains. Returns whether it did."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32:
        return False
    if sum(p.numel() * p.element_size() for p in model.parameters()) > _MAX_MODEL_BYTES:
        log.info("CPU linear layout: model over %d GiB, keeping the default product", _MAX_MODEL_BYTES // 2**30)
        return False
    with torch.inference_mode():
        gain = _probe(head.weight.detach()[:16384])
    if gain < _GAIN_NEEDED:
        log.info("CPU linear layout: packed oneDNN product %.2fx, keeping the default product", gain)
        return False
    with torch.inference_mode():
        for module in model.modules():
            if type(module) is not torch.nn.Linear or getattr(module, "fused_into", False):
                continue
            module.weight_packed = _pack(module.weight.detach())
            module.forward = types.MethodType(_forward, module)
    log.info("CPU linear layout: packed oneDNN product %.2fx faster; enabled", gain)
    return True
