"""The per-row low-rank term: each adapted linear layer adds B_s (A_s x) to its base output for the token rows of
adapter slot s (slot 0: none).

The base layers keep their own forwards (dense, packed, GGUF block products, the fused q/k/v and gate/up
products): a `LoraLinear` wraps the forward the layer has after every CPU rewrite and adds the term to its
output. The adapters resident in slots 1..MAX_LORAS are stacked per layer, A's as the rows of one
[slots x width, in] matrix and B's (scaled, transposed) as the rows of one [slots x width, out] matrix (so any
run of slots is a contiguous block of both), where `width` is the layer's parts (3 for fused q/k/v, 2 for gate/up, else 1) times MAX_LORA_RANK; a smaller rank is padded with
zeros. A step whose rows all use one adapter takes that adapter's columns; a mixed step computes every row
against every slot up to the highest in use and zeroes the other slots' columns of each row before the second
product, so a step costs two matrix products per layer whatever its mix (the zeros add exactly nothing).

The rows of the current forward come from the runner (`step`), once per pass; with no adapter in the pass the
wrappers only call the base forward.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from engine.lora.adapters import LoraAdapter


class StepRows:
    """The adapter slot of each token row of one forward pass, in the order the model sees its rows
    (flattened batch x tokens); `uniform` passes give one slot to every row, whatever their number."""

    def __init__(self, slots: list[int] | None = None, uniform: int = 0):
        self.count = None if slots is None else len(slots)
        if slots is not None:
            distinct = set(slots)
            self.single = slots[0] if len(distinct) == 1 else None
            self.top = max(distinct)
            self._slots = torch.tensor(slots)
        else:
            self.single, self.top = uniform, uniform
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def mask(self, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[rows, top x width]: 1 in the columns of each row's own slot (none for slot 0), else 0."""
        key = (width, dtype, device)
        found = self._masks.get(key)
        if found is None:
            onehot = torch.zeros(self.count, self.top + 1, dtype=dtype)
            onehot[torch.arange(self.count), self._slots] = 1
            found = self._masks[key] = onehot[:, 1:].repeat_interleave(width, dim=1).to(device)
        return found


_rows: StepRows | None = None  # the pass being computed; set by `step` on the engine thread


@contextlib.contextmanager
def step(slots: list[int] | None = None, uniform: int = 0) -> Iterator[None]:
    """The adapter slots of the forward pass run inside: per token row, or one for all rows (`uniform`). All
    zero (no adapter): nothing is set, and the layers run their base forwards alone."""
    global _rows
    if (slots is None and not uniform) or (slots is not None and not any(slots)):
        yield
        return
    _rows = StepRows(slots, uniform)
    try:
        yield
    finally:
        _rows = None


class LoraLinear:
    """A base linear layer's forward plus the low-rank term of its rows' adapters. `parts` are the (offset,
    size) of the output rows each adapted sub-layer fills (one for a plain linear layer, one per projection of a
    fused one)."""

    def __init__(self, module: torch.nn.Linear, parts: int, max_loras: int, max_rank: int):
        self.base = module.forward
        self.in_features, self.out_features = module.in_features, module.out_features
        self.width = parts * max_rank
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.dtype = module.weight.dtype if module.weight.is_floating_point() else torch.float32
        self.device = module.weight.device
        self.a: torch.Tensor | None = None  # [slots x width, in]; allocated when an adapter first targets it
        self.b: torch.Tensor | None = None  # [slots x width, out]
        module.forward = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = _rows
        if rows is None or self.a is None:
            return y
        return self._add(x, y, rows)

    def _add(self, x: torch.Tensor, y: torch.Tensor, rows: StepRows) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if rows.count is not None and x2.shape[0] != rows.count:
            raise RuntimeError(f"a LoRA-adapted layer saw {x2.shape[0]} rows in a pass of {rows.count} (an adapted "
                               f"layer inside a mixture of experts?)")
        w = self.width
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        if rows.single is not None:
            s = (rows.single - 1) * w
            h = torch.mm(x2, self.a[s:s + w].t())
            b = self.b[s:s + w]
        else:
            cols = rows.top * w
            h = torch.mm(x2, self.a[:cols].t()).mul_(rows.mask(w, self.dtype, self.device))
            b = self.b[:cols]
        if y.dtype == self.dtype and y.is_contiguous():
            y.view(-1, self.out_features).addmm_(h, b)  # the product added in place, in one operation
            return y
        return y + torch.mm(h, b).view(y.shape).to(y.dtype)

    def write(self, slot: int, parts: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor] | None]]) -> None:
        """Put an adapter's matrices for this layer in `slot` (1-based): per part (its index, its output offset,
        (A [r, in], B [out_part, r]) or None where the adapter leaves that part alone)."""
        if self.a is None:
            if all(p[2] is None for p in parts):
                return
            self.a = torch.zeros(self.max_loras * self.width, self.in_features, dtype=self.dtype, device=self.device)
            self.b = torch.zeros(self.max_loras * self.width, self.out_features, dtype=self.dtype,
                                 device=self.device)
        start = (slot - 1) * self.width
        self.a[start:start + self.width] = 0
        self.b[start:start + self.width] = 0
        for index, offset, pair in parts:
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            at = start + index * self.max_rank
            self.a[at:at + r] = a.to(self.dtype)
            self.b[at:at + r, offset:offset + b.shape[0]] = b.t().to(self.dtype)


# A fused linear layer and the projections it computes, in output order (engine/cpu/fusion.py).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdaptedLayers:
    """Every linear layer of the model but its output head (which sees only the rows whose logits are kept),
    wrapped; `targets` maps each adaptable module name (as adapters name them) to (its wrapper, its part index,
    its output offset)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int):
        self.targets: dict[str, tuple[LoraLinear, int, int]] = {}
        self.wrappers: list[LoraLinear] = []
        modules = dict(model.named_modules())
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for name, module in modules.items():
            if not isinstance(module, torch.nn.Linear) or module is head:
                continue
            if getattr(module, "fused_into", False):
                continue  # computed by its fused layer, wrapped below
            parent_name, _, attr = name.rpartition(".")
            parts = _FUSED.get(attr)
            if parts is not None:
                wrapper = LoraLinear(module, len(parts), max_loras, max_rank)
                parent = modules[parent_name]
                offset = 0
                for index, part in enumerate(parts):
                    self.targets[f"{parent_name}.{part}"] = (wrapper, index, offset)
                    offset += getattr(parent, part).out_features
            else:
                wrapper = LoraLinear(module, 1, max_loras, max_rank)
                self.targets[name] = (wrapper, 0, 0)
            self.wrappers.append(wrapper)

    def unknown(self, adapter: LoraAdapter) -> list[str]:
        """The modules the adapter targets that no wrapper computes."""
        return [name for name in adapter.weights if name not in self.targets]

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Fill `slot` with the adapter's matrices (every other layer's slot cleared); None clears it."""
        per_wrapper: dict[int, list] = {id(w): [] for w in self.wrappers}
        for name, (wrapper, index, offset) in self.targets.items():
            pair = adapter.weights.get(name) if adapter is not None else None
            per_wrapper[id(wrapper)].append((index, offset, pair))
        for wrapper in self.wrappers:
            wrapper.write(slot, per_wrapper[id(wrapper)])
