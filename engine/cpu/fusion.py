"""Fewer, larger operations per decoder layer, for any model that has the usual shapes.

A decode step of a small model is dominated by per-operation cost: each layer runs seven separate products
and a dozen small element-wise operations per norm. Where a model has the common structure, this merges
- the gate and up projections of a gated MLP into one product (`down(act(gate(x)) * up(x))`),
- the query, key and value projections of attention into one product, and
- the several operations of an RMS norm into `F.rms_norm`.
Each rewrite is checked against the module's own forward on random input at load and dropped where it
differs, so models with another structure (offset norm weights, biased projections...) keep their own code.
The merged weights are the originals' storage (the originals become views), so no memory is added.
Only plain torch.nn.Linear layers are merged by concatenating weights: subclasses (bitsandbytes' Linear4bit and
Linear8bitLt on CUDA hold packed weights and quantization state) keep their own. A quantized checkpoint's
PackedLinear layers merge through their own concatenation of blocks (engine/cpu/packed_linear.py).
"""
from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from engine.cpu.packed_linear import PackedLinear

log = logging.getLogger("engine.cpu.fusion")


_verdicts = None  # the start-up verdicts of the model being rewritten (engine/startup_cache.py), or None
_current = ""  # the module's name in the model, naming its verdict


def _matches(module: torch.nn.Module, new_forward, hidden: int, dtype: torch.dtype, device) -> bool:
    if _verdicts is None:
        return _compare(module, new_forward, hidden, dtype, device)
    return _verdicts.get(f"fusion:{_current}:{new_forward.__name__}:{dtype}",
                         lambda: _compare(module, new_forward, hidden, dtype, device))


def _compare(module: torch.nn.Module, new_forward, hidden: int, dtype: torch.dtype, device) -> bool:
    x = torch.randn(3, 5, hidden, dtype=dtype, device=device)
    expected = module(x)
    got = new_forward(module, x)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    return got.shape == expected.shape and torch.allclose(got, expected, atol=tolerance, rtol=tolerance)


def _share(fused: torch.Tensor, parts: list[torch.nn.Linear]) -> None:
    """Make each part's weight a view of its rows in the fused weight, so the two never use twice the memory."""
    start = 0
    for part in parts:
        rows = part.out_features
        part.weight = torch.nn.Parameter(fused[start:start + rows], requires_grad=False)
        part.fused_into = True  # the CPU product choice skips parts: they run only when the fused product can't
        start += rows


def gated_mlp_forward(self, x):
    gate, up = self.gate_up_proj(x).split(self.gate_proj.out_features, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


def _plain(*layers) -> bool:
    """All are plain torch.nn.Linear layers with floating-point weights (not a quantized subclass)."""
    return all(type(m) is torch.nn.Linear and m.weight.is_floating_point() for m in layers)


def _packed_among(*layers) -> bool:
    """Some of the layers are PackedLinear and the others PackedLinear or plain torch.nn.Linear."""
    return any(isinstance(m, PackedLinear) for m in layers) and all(
        isinstance(m, PackedLinear) or _plain(m) for m in layers)


def _fuse_packed(module: torch.nn.Module, name: str, parts: list, new_forward=None) -> bool:
    """Merge PackedLinear parts into module.<name>; the parts then read their slice of its output."""
    fused = PackedLinear.concatenate(parts)
    if fused is None:
        return False
    setattr(module, name, fused)
    # The check's input in the type plain parts multiply (PackedLinear layers take any)
    dtype = next((p.weight.dtype for p in parts if not isinstance(p, PackedLinear)), torch.float32)
    if new_forward is not None and not _matches(module, new_forward, fused.in_features, dtype, "cpu"):
        delattr(module, name)
        return False
    if isinstance(fused, PackedLinear):  # one product now: the parts read their slices of its output
        start = 0
        for part in parts:
            part.become_part_of(fused, start)
            start += part.out_features
    for part in parts:  # computed by the fused layer: no layout or adapter of its own
        part.fused_into = True
    return True


def _fuse_mlp(module: torch.nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not (hasattr(module, "down_proj") and hasattr(module, "act_fn") and not hasattr(module, "gate_up_proj")):
        return False
    if _packed_among(gate, up) and gate.bias is None and up.bias is None:
        if not _fuse_packed(module, "gate_up_proj", [gate, up], gated_mlp_forward):
            return False
        module.forward = types.MethodType(gated_mlp_forward, module)
        return True
    if not (_plain(gate, up) and gate.bias is None and up.bias is None and gate.in_features == up.in_features):
        return False
    weight = gate.weight
    # On the meta device: the new layer's random initialisation would be overwritten at once.
    fused = torch.nn.Linear(gate.in_features, gate.out_features + up.out_features, bias=False,
                            device="meta", dtype=weight.dtype)
    fused.weight = torch.nn.Parameter(torch.cat([gate.weight, up.weight]).detach(), requires_grad=False)
    module.gate_up_proj = fused
    if not _matches(module, gated_mlp_forward, gate.in_features, weight.dtype, weight.device):
        del module.gate_up_proj
        return False
    _share(fused.weight, [gate, up])
    module.forward = types.MethodType(gated_mlp_forward, module)
    return True


class _QKVProjection:
    """q_proj computes q, k and v in one product and keeps k and v for the k_proj and v_proj calls that
    follow on the same input; any other call computes its own projection as before."""

    def __init__(self, q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear, fused: torch.nn.Linear):
        self.fused = fused
        self.sizes = (q.out_features, k.out_features, v.out_features)
        self.k_forward, self.v_forward = k.forward, v.forward
        self.input = None
        self.k = self.v = None

    def q(self, x):
        q, self.k, self.v = self.fused(x).split(self.sizes, dim=-1)
        self.input = x
        return q

    def take_k(self, x):
        if x is self.input and self.k is not None:
            k, self.k = self.k, None
            return k
        return self.k_forward(x)

    def take_v(self, x):
        if x is self.input and self.v is not None:
            v, self.v, self.input = self.v, None, None
            return v
        return self.v_forward(x)


def _fuse_qkv(module: torch.nn.Module) -> bool:
    q, k, v = (getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    if _packed_among(q, k, v) and not hasattr(module, "qkv_proj"):
        if not _fuse_packed(module, "qkv_proj", [q, k, v]):
            return False
        projection = _QKVProjection(q, k, v, module.qkv_proj)
        q.forward, k.forward, v.forward = projection.q, projection.take_k, projection.take_v
        return True
    if not _plain(q, k, v) or not (q.in_features == k.in_features == v.in_features):
        return False
    if (q.bias is None) != (k.bias is None) or (q.bias is None) != (v.bias is None):
        return False
    weight = q.weight
    fused = torch.nn.Linear(q.in_features, q.out_features + k.out_features + v.out_features,
                            bias=q.bias is not None, device="meta", dtype=weight.dtype)
    fused.weight = torch.nn.Parameter(torch.cat([q.weight, k.weight, v.weight]).detach(), requires_grad=False)
    if q.bias is not None:
        fused.bias = torch.nn.Parameter(torch.cat([q.bias, k.bias, v.bias]).detach(), requires_grad=False)
    projection = _QKVProjection(q, k, v, fused)
    module.qkv_proj = fused
    _share(fused.weight, [q, k, v])
    if q.bias is not None:
        start = 0
        for part in (q, k, v):
            part.bias = torch.nn.Parameter(fused.bias[start:start + part.out_features], requires_grad=False)
            start += part.out_features
    q.forward, k.forward, v.forward = projection.q, projection.take_k, projection.take_v
    return True


def _rms_norm_forward(self, x):
    return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)


def _fuse_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if not (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)):
        return False
    if weight.dtype != torch.float32 or not _matches(module, _rms_norm_forward, weight.shape[0], weight.dtype,
                                                     weight.device):
        return False
    module.forward = types.MethodType(_rms_norm_forward, module)
    return True


@torch.inference_mode()
def apply(model: torch.nn.Module, verdicts=None) -> dict[str, int]:
    """Rewrite what matches; returns how many modules of each kind were rewritten. `verdicts` keeps each
    rewrite's check across starts of the same model, machine and code."""
    global _verdicts, _current
    counts = {"mlp": 0, "qkv": 0, "rms_norm": 0}
    _verdicts = verdicts
    try:
        for _current, module in list(model.named_modules()):
            if _fuse_mlp(module):
                counts["mlp"] += 1
            elif _fuse_qkv(module):
                counts["qkv"] += 1
            elif _fuse_rms_norm(module):
                counts["rms_norm"] += 1
    finally:
        _verdicts, _current = None, ""
    log.info("fused projections and norms: %s", counts)
    return counts
