"""Which adapters the worker knows, which it keeps in host memory, and which sit in the MAX_LORAS slots a step can
use.

- Known adapters are those of LORA_MODULES and those loaded at runtime, by name.
- Host memory keeps at most MAX_CPU_LORAS of them read (least recently used dropped first; a dropped one is read
  again from its files when a request wants it).
- A request holds a slot from admission to its end (`acquire` / `release`). A request whose adapter is in no
  slot takes a free one, or the least recently used slot no running request holds; when every slot is held the
  request waits, as for KV blocks (the scheduler retries each step).

`acquire` and `release` run on the engine thread, between steps, so a slot's weights never change under a
forward pass; `add` and `remove` may run on any thread (reading an adapter's files happens outside the lock).
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora import adapters
from engine.lora.adapters import AdapterError, LoraAdapter, LoraSpec
from engine.lora.layers import AdaptedLayers

log = logging.getLogger("engine.lora")


@dataclass(frozen=True)
class LoraConfig:
    """ENABLE_LORA's settings (vLLM's names)."""
    modules: tuple[LoraSpec, ...] = ()  # LORA_MODULES, read at start-up
    max_loras: int = 1  # adapters resident in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read in host memory; None: MAX_LORAS
    base_aliases: tuple[str, ...] = ()  # other names of the base model (the served name) for base_model_name


class LoraRegistry:
    def __init__(self, model: torch.nn.Module, config: LoraConfig, *, cache_dir: Path, baked_dir: Path | None,
                 base_names: tuple[str, ...]):
        self.model = model
        self.config = config
        self.cache_dir, self.baked_dir = cache_dir, baked_dir
        self.base_names = base_names
        self.layers = AdaptedLayers(model, config.max_loras, config.max_lora_rank)
        self.max_cpu = max(config.max_cpu_loras or config.max_loras, config.max_loras)
        self._lock = threading.Lock()
        self._specs: dict[str, LoraSpec] = {}
        self._keys: dict[str, str] = {}  # name -> its prefix-cache identity (a reload is another adapter)
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        slots = config.max_loras + 1  # index 0: no adapter
        self._slot_name: list[str | None] = [None] * slots
        self._slot_key: list[str | None] = [None] * slots
        self._users = [0] * slots
        self._last_used = [0] * slots
        self._tick = itertools.count(1)
        self._loads = itertools.count(1)

    # ---- known adapters (any thread) ----

    def read(self, spec: LoraSpec) -> LoraAdapter:
        adapter = adapters.read(spec, self.model, max_rank=self.config.max_lora_rank, cache_dir=self.cache_dir,
                                baked_dir=self.baked_dir, base_names=self.base_names)
        experts = [name for name in adapter.weights if ".experts." in f".{name}."]
        if experts:  # an expert sees only the rows routed to it, not the pass's rows the slots are given for
            raise AdapterError(f"LoRA adapter {spec.name!r} ({spec.path}): targets {experts[0]}; adapters of "
                               f"mixture-of-experts experts are not supported")
        unknown = self.layers.unknown(adapter)
        if unknown:
            raise AdapterError(f"LoRA adapter {spec.name!r} ({spec.path}): targets {unknown[0]}, which is not a "
                               f"linear layer this worker can adapt")
        return adapter

    def add(self, spec: LoraSpec) -> None:
        """Read, check and register an adapter (AdapterError if it cannot be served or the name is taken)."""
        if spec.name in self.base_names:
            raise AdapterError(f"LoRA adapter name {spec.name!r} is the base model's name")
        if spec.name in self._specs:
            raise AdapterError(f"a LoRA adapter named {spec.name!r} is already loaded")
        adapter = self.read(spec)
        with self._lock:
            if spec.name in self._specs:
                raise AdapterError(f"a LoRA adapter named {spec.name!r} is already loaded")
            self._specs[spec.name] = spec
            self._keys[spec.name] = f"lora:{spec.name}:{next(self._loads)}"
            self._keep(adapter)
        log.info("LoRA adapter %s loaded from %s (rank %d, %d layers, %.1f MB)", spec.name, spec.path, adapter.rank,
                 len(adapter.weights), adapter.nbytes / 2**20)

    def remove(self, name: str) -> None:
        """Forget an adapter (KeyError if unknown). Requests already running with it finish with it."""
        with self._lock:
            del self._specs[name]
            del self._keys[name]
            self._host.pop(name, None)
            for slot, held in enumerate(self._slot_name):
                if held == name:
                    self._slot_name[slot] = None  # its weights stay until the slot is reused
        log.info("LoRA adapter %s unloaded", name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def _keep(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu:
            dropped, _ = self._host.popitem(last=False)
            log.info("LoRA adapter %s dropped from host memory (MAX_CPU_LORAS=%d); read again when asked for",
                     dropped, self.max_cpu)

    # ---- slots (the engine thread) ----

    def acquire(self, name: str) -> tuple[int, str] | None:
        """(slot, prefix-cache key) for a request of adapter `name`, its weights in the slot; None when every slot
        is held by running requests (the request waits). AdapterError when the adapter is gone."""
        with self._lock:
            spec, key = self._specs.get(name), self._keys.get(name)
            if spec is None:
                raise AdapterError(f"LoRA adapter {name!r} was unloaded")
            for slot in range(1, len(self._slot_key)):
                if self._slot_key[slot] == key:
                    self._users[slot] += 1
                    self._last_used[slot] = next(self._tick)
                    return slot, key
            free = [s for s in range(1, len(self._slot_key)) if self._users[s] == 0]
            if not free:
                return None
            slot = min(free, key=lambda s: (self._slot_key[s] is not None, self._last_used[s]))
            adapter = self._host.get(name)
        if adapter is None:  # dropped from host memory: read again (its files are local by now)
            adapter = self.read(spec)
        with self._lock:
            if self._keys.get(name) != key:
                raise AdapterError(f"LoRA adapter {name!r} was unloaded")
            self._keep(adapter)
            self.layers.write(slot, adapter)
            self._slot_name[slot], self._slot_key[slot] = name, key
            self._users[slot] = 1
            self._last_used[slot] = next(self._tick)
        return slot, key

    def release(self, slot: int) -> None:
        with self._lock:
            self._users[slot] -= 1
