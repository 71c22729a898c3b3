"""Dropping a served layer's weight as loaded, once a kernel's own copy of it (bfloat16 panels, GGUF blocks) is the
only thing its products read: the layer, the fused projections' parts that view its rows, and an embedding tied to
it (an output head) turn into classes that read their values back from that copy, so code that inspects a layer
(its type, `weight`, an adapter's base) still works while the model holds each weight once.
"""
from __future__ import annotations

from typing import Callable

import torch


def storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def holders(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """The modules holding a parameter in each storage of the model."""
    found: dict[int, list[torch.nn.Module]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            found.setdefault(storage(p), []).append(m)
    return found


def reads_rows_of(module: torch.nn.Module, weight: torch.Tensor) -> bool:
    """A plain embedding whose table is exactly `weight` (a head tied to it): it can look its rows up in the
    head's copy."""
    table = getattr(module, "weight", None)
    return (type(module) is torch.nn.Embedding and module.max_norm is None and table is not None
            and table.data_ptr() == weight.data_ptr() and table.shape == weight.shape
            and table.stride() == weight.stride())


class Release:
    """Drops the stored weight of each layer a kernel serves (and of the fused parts that view it), one layer at a
    time, `make_linear(layer, dtype)` turning each into its reading class; an embedding tied to a served head is
    handed to `make_embedding(embedding, head, dtype)`. A weight another layer still reads is kept. `released`:
    the bytes of the storages given up."""

    def __init__(self, modules: list[torch.nn.Linear], model: torch.nn.Module,
                 make_linear: Callable[[torch.nn.Linear, torch.dtype], None],
                 make_embedding: Callable[[torch.nn.Embedding, torch.nn.Linear, torch.dtype], None]):
        served = {id(m) for m in modules}
        self.holders = {key: [m for m in held if id(m) not in served and not getattr(m, "fused_into", False)]
                        for key, held in holders(model).items()}
        self.parts = [m for m in model.modules() if type(m) is torch.nn.Linear and getattr(m, "fused_into", False)]
        self.make_linear, self.make_embedding = make_linear, make_embedding
        self.storages: dict[int, int] = {}

    @property
    def released(self) -> int:
        return sum(self.storages.values())

    def __call__(self, module: torch.nn.Linear) -> None:
        weight = module.weight
        tied = self.holders.get(storage(weight), [])
        if not all(reads_rows_of(m, weight) for m in tied):
            return
        for embedding in tied:
            del embedding._parameters["weight"]
            self.make_embedding(embedding, module, weight.dtype)
        begin, size = weight.data_ptr(), weight.numel() * weight.element_size()
        for part in self.parts:
            if type(part) is torch.nn.Linear and begin <= part.weight.data_ptr() < begin + size:
                start = (part.weight.data_ptr() - begin) // (weight.stride(0) * weight.element_size())
                del part._parameters["weight"]
                self.make_linear(part, weight.dtype)
                part.rows_of = (module, start)
        self.storages[storage(weight)] = weight.untyped_storage().nbytes()
        del module._parameters["weight"]
        self.make_linear(module, weight.dtype)
