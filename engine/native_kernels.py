"""C++ kernels for CPU decode steps (native/decode_kernels.cpp) and prompt chunks' attention
(native/prefill_attention.cpp), built once per machine and checked at load.

A decode step of a small model on CPU spends a large share of its time outside the matrix products: each of a
layer's ~25 small tensor operations costs 5 to 10 us, and attention first copies every row's keys and values
out of the paged cache. The kernels fuse those passes (RMS norm with the residual add, the SiLU-gated product,
rotary embedding with the cache write) and attend straight from the cache's blocks. Measured on the embedded
model (2-core Xeon, float32; bench/compact_forward.py): decode steps 1.24x faster at 1 row, 1.22x at 8 and 1.19x
at 32 rows than the same forward through PyTorch's operations.

Built with torch's extension builder (g++ and ninja) into torch's extension cache, for this machine's CPU (the
build's name carries a fingerprint of the CPU's features, so a cache shared by different machines never runs
a build for another CPU). The first load on a machine compiles for about 30 s; `scripts/install.sh` does it
ahead. Each kernel is then compared with the PyTorch operations it replaces on random input; a machine without
a compiler, a failed build or a differing kernel keeps the PyTorch path, and the log says why.

The loaded kernels are process-wide, like torch's own backend switches: `load()` sets them, `active()` returns
them (None: use PyTorch operations).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import platform
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("engine.native_kernels")

SOURCE = Path(__file__).with_name("native") / "decode_kernels.cpp"
QUANTIZED_SOURCE = SOURCE.with_name("quantized_linear.cpp")  # built into the same module
PREFILL_SOURCE = SOURCE.with_name("prefill_attention.cpp")  # this one too

_active = None
_reason = "not loaded"


def active():
    """The checked kernels module, or None where the PyTorch operations run instead."""
    return _active


def reason() -> str:
    """Why the kernels are not active ('' when they are)."""
    return _reason


def _cpu_fingerprint() -> str:
    """What a -march=native build depends on: the CPU's model and feature flags, the compiler, and torch."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        fields = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        fields = [platform.processor()]
    parts = fields + [platform.machine(), shutil.which("g++") or "", torch.__version__]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja package's binary sits in its own folder."""
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


_built: dict[tuple[str, ...], object] = {}  # built modules in this process, by sources and build name


def build():
    """Compile (or take from torch's extension cache) the kernels for this machine; raises where it cannot."""
    from torch.utils import cpp_extension

    key = (str(SOURCE), str(QUANTIZED_SOURCE), str(PREFILL_SOURCE), f"llm_worker_decode_{_cpu_fingerprint()}")
    if key not in _built:
        _ninja_on_path()
        flags = ["-O3", "-march=native", "-fopenmp"]
        # -fopenmp links libgomp.so.1 by name: the loader reuses the copy torch already loaded, so the kernels
        # share torch's OpenMP threads instead of starting a second team (which halves decode speed; README).
        _built[key] = cpp_extension.load(key[-1], list(key[:-1]), extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                         verbose=False)
    return _built[key]


def _close(expected: torch.Tensor, got: torch.Tensor) -> bool:
    tolerance = 1e-5 if expected.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance))


def self_check(kernels, dtype: torch.dtype = torch.float32) -> str:
    """Each kernel against the PyTorch operations it replaces, on random input of `dtype`: '' when all agree,
    else which differs."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    with torch.inference_mode():
        x, delta, w = rand(3, 40), rand(3, 40), rand(40)

        def norm(v):  # transformers' RMS norm: normalised in float32, rounded to the type, then the weight
            return F.rms_norm(v.float(), (40,), None, 1e-6).to(dtype) * w

        if not _close(norm(x), kernels.rms_norm(x, w, 1e-6)):
            return "rms_norm"
        summed = x + delta
        got = kernels.add_rms_norm_(delta, x, w, 1e-6)
        if not (_close(summed, delta) and _close(norm(summed), got)):
            return "add_rms_norm_"
        gate_up = rand(3, 2 * 24)
        if not _close(F.silu(gate_up[:, :24]) * gate_up[:, 24:], kernels.silu_mul(gate_up, 24)):
            return "silu_mul"
        heads, kv_heads, dim, block = 4, 2, 8, 4
        qkv, cos, sin = rand(3, heads + 2 * kv_heads, dim), rand(3, dim), rand(3, dim)
        k_pool, v_pool = torch.zeros(6, block, kv_heads, dim, dtype=dtype), torch.zeros(6, block, kv_heads, dim, dtype=dtype)
        slots = torch.tensor([5, 9, 12])
        qk = qkv[:, :heads + kv_heads]
        half = dim // 2
        rotated = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin[:, None]
        values = qkv[:, heads + kv_heads:].clone()
        kernels.rope_and_cache_(qkv, cos, sin, heads, kv_heads, k_pool, v_pool, slots)
        if not (_close(rotated, qkv[:, :heads + kv_heads]) and _close(rotated[:, heads:], k_pool.view(-1, kv_heads, dim)[slots])
                and _close(values, v_pool.view(-1, kv_heads, dim)[slots])):
            return "rope_and_cache_"
        # Float32 models may keep a float16 cache (KV_CACHE_DTYPE): the cache write rounds to it, and both
        # attention kernels read it.
        pool_types = (dtype, torch.float16) if dtype == torch.float32 else (dtype,)
        for pool_type in pool_types[1:]:
            k_pool = torch.zeros(6, block, kv_heads, dim, dtype=pool_type)
            v_pool = torch.zeros(6, block, kv_heads, dim, dtype=pool_type)
            qkv = torch.cat([rotated, values], 1).contiguous()
            kernels.rope_and_cache_(qkv, None, None, heads, kv_heads, k_pool, v_pool, slots)
            if not (_close(rotated[:, heads:].to(pool_type), k_pool.view(-1, kv_heads, dim)[slots])
                    and _close(values.to(pool_type), v_pool.view(-1, kv_heads, dim)[slots])):
                return "rope_and_cache_"
        # Two rows over a few blocks (the plain loops, head size 8), then one row of 600 keys (head size 64: the
        # vector path, its keys split across threads and merged).
        for (dim, block, table, lengths), pool_type in itertools.product(
                ((8, 4, [3, 1, 0, 5, 2, 2], [10, 5]), (64, 16, list(range(38)), [600])), pool_types):
            k_pool = rand(max(table) + 1, block, kv_heads, dim).to(pool_type)
            v_pool = rand(max(table) + 1, block, kv_heads, dim).to(pool_type)
            rows = len(lengths)
            query, blocks, lengths = rand(rows, heads, dim), torch.tensor(table), torch.tensor(lengths)
            out = torch.empty(rows, heads, dim, dtype=dtype)
            for window in (0, 3, 300):
                kernels.paged_decode_attention(query, k_pool, v_pool, blocks, lengths, window, 0.3, out)
                for row in range(rows):
                    length = int(lengths[row])
                    start = max(0, length - window) if window else 0
                    row_blocks = blocks.view(rows, -1)[row]
                    keys = k_pool[row_blocks].reshape(-1, kv_heads, dim)[start:length].transpose(0, 1)
                    vals = v_pool[row_blocks].reshape(-1, kv_heads, dim)[start:length].transpose(0, 1)
                    expected = F.scaled_dot_product_attention(query[row][:, None].float(), keys.float(),
                                                              vals.float(), scale=0.3, enable_gqa=True)[:, 0]
                    if not _close(expected.to(dtype), out[row]):
                        return "paged_decode_attention"
        for pool_type in pool_types if dtype == torch.float32 and kernels.prefill_attention_supported() else ():
            # A chunk of 70 tokens after 50 cached ones (five token tiles, the last one partial), whole and
            # within a window of 30, against SDPA with the causal mask over the gathered keys.
            start, tokens, table = 50, 70, [6, 2, 0, 7, 4, 1, 3, 5]
            k_pool, v_pool = rand(8, 16, kv_heads, 64).to(pool_type), rand(8, 16, kv_heads, 64).to(pool_type)
            query, out = rand(tokens, heads, 64), torch.empty(tokens, heads, 64)
            keys = k_pool[table].reshape(-1, kv_heads, 64)[:start + tokens].transpose(0, 1)[None].float()
            vals = v_pool[table].reshape(-1, kv_heads, 64)[:start + tokens].transpose(0, 1)[None].float()
            positions = torch.arange(start + tokens)
            for window in (0, 30):
                mask = positions[None] <= positions[start:, None]
                if window:
                    mask &= positions[None] > positions[start:, None] - window
                kernels.paged_prefill_attention(query, k_pool, v_pool, torch.tensor(table), start, window, 0.3, out)
                expected = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys, vals, attn_mask=mask,
                                                          scale=0.3, enable_gqa=True)[0].transpose(0, 1)
                if not _close(expected, out):
                    return "paged_prefill_attention"
    return ""


def load(mode: str = "auto", dtype: torch.dtype = torch.float32, verdicts=None) -> bool:
    """Make the kernels active for this process where `mode` allows, they build here and agree with PyTorch on
    `dtype` (the model's). Returns whether they are active; `reason()` says why not. `verdicts`
    (engine/startup_cache.py) keeps the self-check's verdict for this very build across processes."""
    global _active, _reason
    _active = None
    if mode == "off":
        _reason = "NATIVE_KERNELS=off"
        return False
    started = time.perf_counter()
    try:
        kernels = build()
    except Exception as exc:  # no compiler, no headers, a failed build: the PyTorch operations serve instead
        errors = [line.strip() for line in str(exc).splitlines() if "error" in line.lower()]
        _reason = f"not built: {' '.join((errors[-1] if errors else str(exc)).split())[:300]}"
        log.warning("CPU decode kernels: %s; using PyTorch operations", _reason)
        return False
    built = Path(getattr(kernels, "__file__", None) or "/nonexistent")
    if verdicts is None or not built.is_file():
        differs = self_check(kernels, dtype)
    else:  # the verdict holds for this very binary (its file's identity) on this CPU with these sources
        stat = built.stat()
        differs = verdicts.get(f"native_self_check:{dtype}:{built}:{stat.st_size}:{stat.st_mtime_ns}",
                               lambda: self_check(kernels, dtype))
    if differs:
        _reason = f"{differs} differs from PyTorch on this machine"
        log.warning("CPU decode kernels: %s; using PyTorch operations", _reason)
        return False
    _active, _reason = kernels, ""
    log.info("CPU decode kernels: built and checked (engine/native/decode_kernels.cpp) in %.1f s",
             time.perf_counter() - started)
    return True


if __name__ == "__main__":  # scripts/install.sh: build ahead so the first start does not compile
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if load() else 1)
