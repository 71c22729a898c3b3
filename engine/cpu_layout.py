"""Faster linear layers for decoding on CPU, chosen by a probe of this machine.

Decode steps multiply a few rows (one per running sequence) by every weight matrix, and PyTorch's default CPU
product is far from the machine's limits there. Measured on the project's 2-core AVX-512 machine, over the
embedded model's linear layers:
- one row: `x @ W_t` over an input-major copy ([in, out], contiguous) streams the weights about 1.3x faster
  than `F.linear(x, W)`, and about 2x on the large output projection;
- 2 to 32 rows: oneDNN's linear over a weight reordered to its own blocked layout is 1.2x to 1.7x faster.
Larger products (prefill) run at about the same speed either way. The probe times the output projection
both ways at load; each variant is used only where this CPU gains from it, so other CPUs keep the default.

The extra weight copies double or triple the linear weights' memory, so this applies to models up to
`_MAX_MODEL_BYTES` only. Numbers equal the default product up to float rounding order.
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


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows == 1 and self.weight_in_major is not None:
        out = torch.matmul(x, self.weight_in_major)
        return out if self.bias is None else out + self.bias
    if self.weight_onednn is not None:
        flat = x.reshape(rows, x.shape[-1])
        out = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self.weight_onednn, self.bias_onednn).to_dense()
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.linear(x, self.weight, self.bias)


def _best_time(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _probe(weight: torch.Tensor) -> tuple[float, float]:
    """Speed-up of the input-major product for one row and of oneDNN for 16 rows, on this weight."""
    x1 = torch.randn(1, weight.shape[1], dtype=weight.dtype)
    x16 = torch.randn(16, weight.shape[1], dtype=weight.dtype)
    weight_t = weight.t().contiguous()
    in_major_gain = _best_time(lambda: F.linear(x1, weight)) / _best_time(lambda: x1 @ weight_t)
    onednn_gain = 0.0
    if torch.backends.mkldnn.is_available():
        weight_onednn = weight.to_mkldnn()
        onednn_gain = _best_time(lambda: F.linear(x16, weight)) / _best_time(
            lambda: torch._C._nn.mkldnn_linear(x16.to_mkldnn(), weight_onednn, None).to_dense())
    return in_major_gain, onednn_gain


def apply(model: torch.nn.Module) -> bool:
    """Give the model's linear layers the faster products this CPU supports. Returns whether any applied."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.weight.dtype != torch.float32:
        return False
    if sum(p.numel() * p.element_size() for p in model.parameters()) > _MAX_MODEL_BYTES:
        log.info("CPU linear layout: model over %d GiB, keeping the default product", _MAX_MODEL_BYTES // 2**30)
        return False
    with torch.inference_mode():
        in_major_gain, onednn_gain = _probe(head.weight.detach()[:16384])
    use_in_major = in_major_gain >= _GAIN_NEEDED
    use_onednn = onednn_gain >= _GAIN_NEEDED
    log.info("CPU linear layout: one row %.2fx (%s), 16 rows oneDNN %.2fx (%s)", in_major_gain,
             "used" if use_in_major else "not used", onednn_gain, "used" if use_onednn else "not used")
    if not (use_in_major or use_onednn):
        return False
    for module in model.modules():
        if type(module) is not torch.nn.Linear or getattr(module, "fused_into", False):
            continue
        weight = module.weight.detach()
        module.weight_in_major = weight.t().contiguous() if use_in_major else None
        module.weight_onednn = weight.to_mkldnn() if use_onednn else None
        module.bias_onednn = module.bias.detach().to_mkldnn() if use_onednn and module.bias is not None else None
        module.forward = types.MethodType(_forward, module)
    return True
