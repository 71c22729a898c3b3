"""Recurrent and convolution state of hybrid and state-space models (Mamba, Jamba, Qwen3-Next, LFM2, Granite 4...).

Their non-attention layers carry a fixed-size state per sequence instead of keys and values per token. Each
running sequence owns one slot: every such layer has a pool shaped [slots, *state] per state it keeps, and a slot
holds that sequence's state as the pool of KV blocks holds its keys and values. Slots are taken at admission,
copied when `n` choices fork from one prompt or beams reassign, and given back when a sequence finishes or is
preempted (it is recomputed from its tokens later). A slot's state is a summary of every token before it, so it
is never shared between sequences and no prefix of it can be cached.

One forward pass sees the slots of its rows through a `StateStepCache`, transformers' recurrent-state API
(`get_conv_state`, `update_recurrent_state`...) on top of the paged KV writes. Writes stay with the pass until
the whole engine step has succeeded, so a step that fails and is retried request by request advances no state
twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.executor.kv_cache import PagedKVCache, StepCache, StepLayout

StateKey = tuple[str, int, int]  # ("conv" | "recurrent", layer, state index)


@dataclass(frozen=True)
class StateShape:
    shape: tuple[int, ...]  # one sequence's state (a convolution state's last dimension is its kernel width)
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def with_left_context(conv_states: torch.Tensor, previous: torch.Tensor | None, width: int) -> torch.Tensor:
    """As transformers' linear-attention cache layer: a convolution's new inputs with the left context it needs,
    the previous state, or zeros at a sequence's start (up to the kernel width)."""
    if previous is not None:
        return torch.cat([previous, conv_states.to(previous.dtype)], dim=-1)
    if conv_states.shape[-1] < width:
        return F.pad(conv_states, (width - conv_states.shape[-1], 0))
    return conv_states


class RecurrentStates:
    """The state pools and which slots are free."""

    def __init__(self, shapes: dict[StateKey, StateShape], num_slots: int):
        self.shapes = shapes
        self.num_slots = num_slots
        self._pools = {key: torch.zeros((num_slots, *s.shape), dtype=s.dtype, device=s.device)
                       for key, s in shapes.items()}
        self._free = list(range(num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_slot(shapes: dict[StateKey, StateShape]) -> int:
        return sum(s.nbytes for s in shapes.values())

    def tensors(self) -> list[torch.Tensor]:
        return list(self._pools.values())

    @property
    def nbytes(self) -> int:
        return self.bytes_per_slot(self.shapes) * self.num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pool(self, key: StateKey) -> torch.Tensor:
        return self._pools[key]

    def allocate(self) -> int:
        if not self._free:  # the scheduler admits at most as many sequences as there are slots
            raise RuntimeError("no free recurrent-state slot")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def copy(self, sources: list[int], destinations: list[int]) -> None:
        """Each destination slot takes its source's state (gathered first, so a slot may be both)."""
        if not sources:
            return
        for pool in self._pools.values():
            src = torch.tensor(sources, device=pool.device)
            dst = torch.tensor(destinations, device=pool.device)
            pool.index_copy_(0, dst, pool.index_select(0, src))


class StateStepCache(StepCache):
    """One forward pass's view of the cache for a model with recurrent layers: the paged KV writes of its
    attention layers and, for its other layers, the states of the pass's rows (one sequence per batch row).

    A pass either starts its sequences from nothing (a prompt's first chunk: no previous state) or continues them
    (decode rows, one token each, or a prompt's later chunk). What the layers read is gathered from the slots; what they leave, including what
    they change in place, is written back by `commit` once the engine step has succeeded."""

    def __init__(self, cache: PagedKVCache, layout: StepLayout, states: RecurrentStates, slots: list[int],
                 previous: bool):
        super().__init__(cache, layout)
        self.states = states
        self.previous = previous
        self._slots = slots
        self._slot_index: dict[torch.device, torch.Tensor] = {}
        self._live: dict[StateKey, torch.Tensor] = {}

    def _index(self, device: torch.device) -> torch.Tensor:
        index = self._slot_index.get(device)
        if index is None:
            index = self._slot_index[device] = torch.tensor(self._slots, device=device)
        return index

    def _read(self, key: StateKey) -> torch.Tensor | None:
        if not self.previous:
            return None
        live = self._live.get(key)
        if live is None:
            pool = self.states.pool(key)
            live = self._live[key] = pool.index_select(0, self._index(pool.device))
        return live

    # ---- transformers' recurrent-state API (transformers.cache_utils.Cache) ----

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.previous

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._read(("conv", layer_idx, state_idx))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._read(("recurrent", layer_idx, state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
                          ) -> torch.Tensor:
        """The new inputs with their left context (`with_left_context`); keeps the last kernel-width columns."""
        key = ("conv", layer_idx, state_idx)
        width = self.states.shapes[key].shape[-1]
        full = with_left_context(conv_states, self._read(key), width)
        self._live[key] = full[..., -width:]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        self._live[("recurrent", layer_idx, state_idx)] = recurrent_states
        return recurrent_states

    def commit(self) -> None:
        """Write the pass's states back to its rows' slots."""
        for key, state in self._live.items():
            pool = self.states.pool(key)
            pool.index_copy_(0, self._index(pool.device), state.to(pool.dtype))
