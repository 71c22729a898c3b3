"""The per-row low-rank term: each adapted linear layer adds B_s (A_s x) to its base output for the token rows of
adapter slot s (slot 0: none).

The base layers keep their own forwards (dense, packed, GGUF block products, the fused q/k/v and gate/up
products): a `LoraLinear` wraps the forward the layer has after every CPU rewrite and adds the term to its
output. The adapters resident in slots 1..MAX_LORAS are stacked per layer, A's as the rows of one
[slots x width, in] matrix (`width`: MAX_LORA_RANK per projection the layer computes, 3 for fused q/k/v, 2 for
gate/up, else 1) and each projection's B (scaled, transposed) as the rows of one [slots x rank, outputs] matrix,
so any run of slots is a contiguous block of each; a smaller rank is padded with zeros. On CPU (float32 and
bfloat16 layers) one native call adds each row's term from its own slot (engine/cpu/native/lora_linear.cpp).
The matrices are of the layer's type, except under a float32 layer whose own product is coarser (GGUF blocks with
16-bit integer activations, the embedded model's): there they are bfloat16, whose rounding stays below the base
product's, and a mixed step reads half the bytes (four rank-16 adapters of every projection of the embedded
model are 78 MB a step in float32).
Elsewhere PyTorch's operations do: a step whose rows all use one adapter takes that adapter's block; a mixed
step computes every row against every slot up to the highest in use and zeroes the other slots' columns of each
row before the second product, so a step costs one A product and one B product per projection whatever its mix
(the zeros add exactly nothing).

The rows of the current forward come from the runner (`step`), once per pass; with no adapter in the pass the
wrappers only call the base forward.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from engine.cpu import native_kernels
from engine.lora.adapters import LoraAdapter, adaptable

_KERNEL_TYPES = (torch.float32, torch.bfloat16)  # the layer types the native kernel computes the term for


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
        self._uniform: dict[int, torch.Tensor] = {}

    def slots(self, tokens: int) -> torch.Tensor:
        """Each of the pass's `tokens` rows' slot, as int64 (what the native kernel takes)."""
        if self.count is not None:
            return self._slots
        found = self._uniform.get(tokens)
        if found is None:
            found = self._uniform[tokens] = torch.full((tokens,), self.single, dtype=torch.int64)
        return found

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
    """A base linear layer's forward plus the low-rank term of its rows' adapters. `sizes` are the output widths
    of the projections it computes, in order (one for a plain linear layer, one per projection of a fused one):
    A is stacked over them (one product for all), B is kept per projection (a fused layer's B would otherwise be
    mostly zeros: each projection's rank only feeds its own outputs)."""

    def __init__(self, module: torch.nn.Module, sizes: list[int], max_loras: int, max_rank: int,
                 model_dtype: torch.dtype = torch.float32):
        self.base = module.forward
        self.in_features, self.out_features = module.in_features, module.out_features
        self.sizes = sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.width = len(sizes) * max_rank
        self.max_loras = max_loras
        self.max_rank = max_rank
        # A layer whose weight as loaded was released names its type (reading `weight` would decode a copy).
        stored = getattr(module, "weight_dtype", None)
        weight = None if stored is not None else getattr(module, "weight", None)
        # Packed layers (no weight) compute in the model's type: their kernel returns the rows' dtype.
        self.dtype = stored or (weight.dtype if weight is not None and weight.is_floating_point() else model_dtype)
        self.device = weight.device if weight is not None else torch.device("cpu")
        # Integer-activation products: GGUF blocks (engine/cpu/quantized_weights.py) and packed checkpoints.
        coarse = getattr(module, "weight_blocks", None) is not None or (weight is None and stored is None)
        self.store = (torch.bfloat16 if coarse and self.dtype == torch.float32 and self.device.type == "cpu"
                      and native_kernels.active() is not None else self.dtype)
        # Allocated when an adapter first targets the layer: A [slots x width, in], rows slot-major then
        # projection; B per projection [slots x rank, its outputs].
        self.a: torch.Tensor | None = None
        self.b: list[torch.Tensor] = []
        module.forward = self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = _rows
        if rows is None or self.a is None:
            return y
        return self._add(x, y, rows)

    def _add(self, x: torch.Tensor, y: torch.Tensor, rows: StepRows) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        tokens = x2.shape[0]
        if rows.count is not None and tokens != rows.count:
            raise RuntimeError(f"a LoRA-adapted layer saw {tokens} rows in a pass of {rows.count}")
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        out = y if y.dtype == self.dtype and y.is_contiguous() else y.to(self.dtype).contiguous()
        out2 = out.view(tokens, self.out_features)
        kernels = native_kernels.active()
        if kernels is not None and self.dtype in _KERNEL_TYPES and self.device.type == "cpu":
            # One call: each row against its own slot only (engine/cpu/native/lora_linear.cpp).
            kernels.lora_add_(out2, x2.contiguous(), self.a, self.b, rows.slots(tokens), self.max_rank)
        else:
            if self.store != self.dtype:  # bfloat16 matrices kept for the kernel, which is gone: widened once
                self.a, self.b = self.a.to(self.dtype), [b.to(self.dtype) for b in self.b]
                self.store = self.dtype
            w, r = self.width, self.max_rank
            first, last = (rows.single - 1, rows.single) if rows.single is not None else (0, rows.top)
            h = torch.mm(x2, self.a[first * w:last * w].t())
            if rows.single is None:
                h.mul_(rows.mask(w, self.dtype, self.device))  # each row keeps its own slot's columns only
            if len(self.sizes) == 1:
                out2.addmm_(h, self.b[0][first * r:last * r])  # the product added in place, in one operation
            else:
                parts = h.view(tokens, last - first, len(self.sizes), r)
                for index, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
                    out2[:, offset:offset + size].addmm_(parts[:, :, index].reshape(tokens, -1),
                                                         self.b[index][first * r:last * r])
        return out if out is y else out.to(y.dtype)

    def write(self, slot: int, parts: list[tuple[int, tuple[torch.Tensor, torch.Tensor] | None]]) -> None:
        """Put an adapter's matrices for this layer in `slot` (1-based): per projection (its index, (A [r, in],
        B [its outputs, r]) or None where the adapter leaves it alone)."""
        if self.a is None:
            if all(pair is None for _, pair in parts):
                return
            self.a = torch.zeros(self.max_loras * self.width, self.in_features, dtype=self.store, device=self.device)
            self.b = [torch.zeros(self.max_loras * self.max_rank, size, dtype=self.store, device=self.device)
                      for size in self.sizes]
        r = self.max_rank
        self.a[(slot - 1) * self.width:slot * self.width] = 0
        for b in self.b:
            b[(slot - 1) * r:slot * r] = 0
        for index, pair in parts:
            if pair is None:
                continue
            a, b = pair
            rank = a.shape[0]
            at = (slot - 1) * self.width + index * r
            self.a[at:at + rank] = a.to(self.store)
            self.b[index][(slot - 1) * r:(slot - 1) * r + rank] = b.t().to(self.store)


# A fused linear layer and the projections it computes, in output order (engine/cpu/fusion.py).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdaptedLayers:
    """Every linear layer of the model but its output head (which sees only the rows whose logits are kept),
    wrapped; `targets` maps each adaptable module name (as adapters name them) to (its wrapper, its projection's
    index in it)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int):
        self.targets: dict[str, tuple[LoraLinear, int]] = {}
        self.wrappers: list[LoraLinear] = []
        modules = dict(model.named_modules())
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        for name, module in modules.items():
            if not adaptable(module) or module is head:
                continue
            if getattr(module, "fused_into", False):
                continue  # computed by its fused layer, wrapped below
            parent_name, _, attr = name.rpartition(".")
            parts = _FUSED.get(attr)
            if parts is not None:
                parent = modules[parent_name]
                wrapper = LoraLinear(module, [getattr(parent, part).out_features for part in parts], max_loras,
                                     max_rank, model_dtype)
                for index, part in enumerate(parts):
                    self.targets[f"{parent_name}.{part}"] = (wrapper, index)
            else:
                wrapper = LoraLinear(module, [module.out_features], max_loras, max_rank, model_dtype)
                self.targets[name] = (wrapper, 0)
            self.wrappers.append(wrapper)

    def unknown(self, adapter: LoraAdapter) -> list[str]:
        """The modules the adapter targets that no wrapper computes."""
        return [name for name in adapter.weights if name not in self.targets]

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Fill `slot` with the adapter's matrices (every other layer's slot cleared); None clears it."""
        per_wrapper: dict[int, list] = {id(w): [] for w in self.wrappers}
        for name, (wrapper, index) in self.targets.items():
            pair = adapter.weights.get(name) if adapter is not None else None
            per_wrapper[id(wrapper)].append((index, pair))
        for wrapper in self.wrappers:
            wrapper.write(slot, per_wrapper[id(wrapper)])
