"""Weight layout for fast small-batch decoding on CPU.

On CPU a decode step with one or two sequences is a matrix-vector product per linear layer, bound by how fast
the weights stream from memory. With PyTorch's CPU BLAS, `x @ W_t` over a weight stored input-major ([in, out],
contiguous) streams about twice as fast as `F.linear(x, W)` over the usual [out, in] layout; for larger batches
the usual layout is faster (prefill, many sequences). So, on CPU, each linear layer also keeps an input-major
copy of its weight and picks the product by row count. Models too large to hold two copies keep only the
input-major one (`.weight` becomes a transposed view of it, so nothing else changes), at a few percent of
large-batch speed.

Applied only when a quick probe on this machine shows the gain, so other CPUs keep the default path.
"""
from __future__ import annotations

import logging
import time
import types

import torch
import torch.nn.functional as F

log = logging.getLogger("engine.cpu_layout")

_SMALL_ROWS = 2  # up to this many rows use the input-major product
_DUAL_LAYOUT_MAX_BYTES = 2 * 2**30  # keep both layouts for models up to this size


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    if x.numel() <= _SMALL_ROWS * x.shape[-1]:
        out = torch.matmul(x, self.weight_in_major)
        return out if self.bias is None else out + self.bias
    return F.linear(x, self.weight, self.bias)


def _probe_gain(features_in: int, features_out: int, dtype: torch.dtype) -> float:
    weight = torch.randn(features_out, features_in, dtype=dtype)
    weight_t = weight.t().contiguous()
    x = torch.randn(1, features_in, dtype=dtype)

    def best_of(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    return best_of(lambda: F.linear(x, weight)) / best_of(lambda: x @ weight_t)


def apply(model: torch.nn.Module) -> bool:
    """Switch the model's linear layers to the input-major layout when this CPU benefits. Returns whether it did."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return False
    gain = _probe_gain(head.in_features, min(head.out_features, 32768), head.weight.dtype)
    if gain < 1.15:
        log.info("CPU weight layout: input-major product %.2fx, keeping the default layout", gain)
        return False
    dual = sum(p.numel() * p.element_size() for p in model.parameters()) <= _DUAL_LAYOUT_MAX_BYTES
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight_t = module.weight.detach().t().contiguous()
        module.weight_in_major = weight_t
        if not dual and module is not head:  # the head may be tied to the embedding: keep its own tensor
            module.weight = torch.nn.Parameter(weight_t.t(), requires_grad=False)
        module.forward = types.MethodType(_forward, module)
    log.info("CPU weight layout: input-major product %.2fx faster for single-row decode; enabled (%s)", gain,
             "both layouts" if dual else "input-major only")
    return True
