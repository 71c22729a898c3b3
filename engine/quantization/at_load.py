"""QUANTIZATION=int8 / int4: a dense checkpoint's decoder layers quantized at load (opt-in, never the default)."""
from __future__ import annotations

import logging

import torch

from engine.cpu.packed_linear import BLOCK, PackedLinear, parent_module as _parent

log = logging.getLogger("engine.quantization")

_SMALLEST_HALF = 2.0 ** -24  # the smallest positive half-precision value


def _half_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest half-precision value >= each (positive, finite) x, as float32: a scale the kernel's
    half-precision headers hold exactly and that still takes the block's extremes within q's range."""
    x = x.clamp_min(_SMALLEST_HALF)
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h).float()


def _half_nearest(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def quantize_at_load(model: torch.nn.Module, method: str) -> int:
    """Replace the decoder layers' linear layers of a dense model by round-to-nearest quantized ones: int8 one
    symmetric scale per output (w = d * q, q in -127..127), int4 a scale and minimum per block of 32 inputs
    (w = d * q + m, q in 0..15). The scales and minimums are half-precision values, as GGUF's Q8_0 and Q4_1 keep
    theirs (the minimum rounded to the nearest half, the scale up to one that still spans the block), so int4's
    blocks carry 16-bit headers, 5 bits a weight rather than 6 (int8's row scale is kept once per 128 inputs).
    The embeddings and the output head keep their weights. Returns how many."""
    head = model.get_output_embeddings()
    count = 0
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if type(module) is not torch.nn.Linear or module is head:
                continue
            w = module.weight.detach().float()
            out, k = w.shape
            if k % BLOCK or out % 16:
                continue  # no kernel blocks for this shape: it keeps its dense weights
            if not bool(w.abs().amax() < 60000):  # beyond half precision (65504), or not finite
                log.warning("QUANTIZATION=%s: %s has weights of 60000 or more (or not finite); kept dense", method, name)
                continue
            if method == "int8":
                d = _half_at_least(w.abs().amax(1, keepdim=True) / 127)
                q = torch.round(w / d).clamp(-127, 127).to(torch.int8)
                scale, minimum, bits = d.expand(-1, k // BLOCK), torch.zeros(out, k // BLOCK), 8
            else:
                blocks = w.view(out, -1, BLOCK)
                lo = _half_nearest(blocks.amin(-1))
                scale = _half_at_least((blocks.amax(-1) - lo) / 15)
                q = torch.round((blocks - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
                q, minimum, bits = q.view(out, k).to(torch.int8), lo, 4
            bias = module.bias.detach().float() if module.bias is not None else None
            parent, child = _parent(model, name)
            setattr(parent, child, PackedLinear(q, scale.contiguous(), minimum.contiguous(), bits, bias, None,
                                                f"{name} ({method} at load)"))
            count += 1
    log.info("QUANTIZATION=%s: %d linear layers quantized at load (round to nearest; %s)", method, count,
             "one scale per output" if method == "int8" else "a scale and minimum per 32 inputs")
    return count
