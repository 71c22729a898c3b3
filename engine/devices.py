"""Where the engine runs, decided once: the paths that differ between CUDA and the CPU branch on a `Platform`,
never on a tensor's device type.

Three platforms: the CPU (its fast paths: native kernels, oneDNN-packed weights, GGUF blocks, host-memory
trimming, the chunked argmax and the host-side grammar bitmask), a CUDA device (bfloat16, PyTorch attention, a KV
cache sized from GPU_MEMORY_UTILIZATION after a profiled step), and `DEVICE=cuda-sim`, the CUDA path run with
tensors on the CPU. No GPU is at hand where this worker is built and tested, so cuda-sim is how CI runs the
branches a single GPU takes (not LAYER_SPLIT_DEVICES > 1: the CPU is one torch device): its device memory is
SIMULATED_DEVICE_MEMORY, and the profiled step's peak is measured by counting the bytes of the tensors alive.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SIMULATED = "cuda-sim"
DEFAULT_SIMULATED_MEMORY = 4 * 2**30  # small enough for the pool to be reserved on a CI machine's CPU


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("model name", "flags", ...); empty where there is none. Start-up
    verdicts key on it and the kernel variant is chosen from its flags."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, sep, value = line.partition(":")
            if not sep:
                if fields:
                    break  # the first processor's block ended
                continue
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


class DeviceUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Platform:
    device: torch.device  # where tensors live (the CPU under cuda-sim)
    simulated_memory: int | None = None  # bytes of the simulated device (cuda-sim), else None

    @property
    def simulated(self) -> bool:
        return self.simulated_memory is not None

    @property
    def accelerator(self) -> bool:
        """Takes the CUDA path: bfloat16 by default, PyTorch attention, the KV cache sized by GPU_MEMORY_UTILIZATION
        from the device's memory after a profiled step."""
        return self.simulated or self.device.type == "cuda"

    @property
    def cpu_fast_paths(self) -> bool:
        """Whether the CPU-only paths may run: native kernels, oneDNN packing, GGUF blocks, host-memory trimming."""
        return self.device.type == "cpu" and not self.simulated

    @property
    def name(self) -> str:
        return SIMULATED if self.simulated else str(self.device)

    def bfloat16_supported(self) -> bool:
        return self.simulated or torch.cuda.is_bf16_supported()

    def total_memory(self, device: torch.device) -> int:
        if self.simulated:
            return self.simulated_memory
        return torch.cuda.get_device_properties(device).total_memory

    @contextlib.contextmanager
    def peak_memory(self, devices: list[torch.device], resident: list[torch.Tensor]) -> Iterator[dict]:
        """The most memory allocated on each device while the block runs, everything already allocated there
        included (`resident`: the weights, recurrent states): filled in when the block ends."""
        peaks: dict[torch.device, int] = {}
        if self.simulated:
            with _LiveBytes(resident) as live:
                yield peaks
            peaks.update({d: live.peak for d in devices})  # one CPU holds every simulated layer
            return
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
        yield peaks
        for d in devices:
            torch.cuda.synchronize(d)
            peaks[d] = torch.cuda.max_memory_allocated(d)

    def release_cached(self) -> None:
        if not self.simulated and self.device.type == "cuda":
            torch.cuda.empty_cache()


def resolve(name: str, simulated_memory: int | None = None) -> Platform:
    """The platform DEVICE names: auto (cuda when available), cpu, cuda, cuda:N, mps or cuda-sim."""
    if name == SIMULATED:
        return Platform(torch.device("cpu"), simulated_memory or DEFAULT_SIMULATED_MEMORY)
    if name == "auto":
        return Platform(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(f"DEVICE={name} but no CUDA device is available (DEVICE=cuda-sim runs the CUDA "
                                f"path on the CPU)")
    return Platform(device)


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages alive (the simulated device's allocator): the resident tensors' from
    the start, then each storage an operation returns until its last tensor is collected."""

    def __init__(self, resident: list[torch.Tensor]):
        super().__init__()
        self._refs: dict[int, int] = {}  # storage address -> tensors holding it that are being watched
        self._sizes: dict[int, int] = {}
        self.live = 0
        for t in resident:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._sizes:  # tied weights count once
                self._sizes[storage.data_ptr()] = storage.nbytes()
                self._refs[storage.data_ptr()] = 1 << 30  # never released: alive throughout
                self.live += storage.nbytes()
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._watch(t)
        return out

    def _watch(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        if not size:
            return
        if address in self._refs:
            self._refs[address] += 1
        else:
            self._refs[address], self._sizes[address] = 1, size
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._release, address)

    def _release(self, address: int) -> None:
        self._refs[address] -= 1
        if self._refs[address] == 0:
            del self._refs[address]
            self.live -= self._sizes.pop(address)
