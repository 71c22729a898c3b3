"""C++ kernels for CPU decode steps (native/decode_kernels.cpp) and prompt chunks' attention
(native/prefill_attention.cpp), built once per sources and CPU variant and checked at load.

A decode step of a small model on CPU spends a large share of its time outside the matrix products: each of a
layer's ~25 small tensor operations pays a dispatch and a pass over its tensors that, at a few rows, cost as much
as its arithmetic, and attention first copies every row's keys and values out of the paged cache. The kernels
fuse those passes (RMS norm with the residual add, the SiLU-gated product, rotary embedding with the cache write)
and attend straight from the cache's blocks, so a step makes fewer passes and no copies (what that saved:
docs/performance.md).

Builds and where they live. A build targets a CPU variant, not the building machine (`-march=native` would bake
the builder's CPU into an image that runs on other machines): `avx512_vnni` (x86-64-v4 and VNNI: the sources'
AVX-512 paths and their products from 16- and 8-bit activations), `avx_vnni` (x86-64-v3 and AVX-VNNI: the AVX2
paths, their products from 16- and 8-bit activations summing with VPDPWSSD and VPDPBUSD) or `avx2` (x86-64-v3:
the AVX2 block products, VPMADDWD and VPMADDUBSW, and the plain loops, vectorised by the compiler); other architectures build for their baseline. At load
the best variant whose instructions this CPU has all of is chosen (/proc/cpuinfo's flags, cross-checked with
CPUID as this process sees it: torch's probes, and cpuid.py for AVX-VNNI); an x86 CPU without AVX2 keeps the
PyTorch operations. A build is one file, `<name>.so`, named by a hash of the sources' bytes, the
flags, the variant, torch and the Python ABI, never by paths, so every path to the same sources and venv shares
it. It is looked up in the package's `native/prebuilt/` folder (the image fills it for every variant:
`python -m engine.cpu.native_kernels --prebuild`) and then in the build folder, `$NATIVE_KERNELS_DIR` or
`<BASE_PATH>/native-kernels` (`scripts/install.sh` builds there ahead; otherwise the first start does, about a
minute). A build runs in its own temporary folder under an flock on `<name>.lock`, which the OS releases when
its holder dies, so a killed build never blocks a later start; a start waits for a live builder at most
BUILD_WAIT_S, logging whom it waits for, and then serves through the PyTorch operations.

Each kernel is then compared with the PyTorch operations it replaces on random input; a machine without a
compiler, a failed build or a differing kernel keeps the PyTorch path, and the log says why.

The loaded kernels are process-wide, like torch's own backend switches: `load()` sets them, `active()` returns
them (None: use PyTorch operations).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import itertools
import logging
import math
import os
import platform
import shutil
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import devices
from engine.cpu import cpuid
import torch.nn.functional as F

log = logging.getLogger("engine.cpu.native_kernels")

SOURCE = Path(__file__).with_name("native") / "decode_kernels.cpp"
QUANTIZED_SOURCE = SOURCE.with_name("quantized_linear.cpp")  # built into the same module
PREFILL_SOURCE = SOURCE.with_name("prefill_attention.cpp")  # this one too
BF16_SOURCE = SOURCE.with_name("bf16_linear.cpp")  # and the AVX512_BF16 product
LORA_SOURCE = SOURCE.with_name("lora_linear.cpp")  # and LoRA adapters' per-row term
STACK_SOURCE = SOURCE.with_name("decode_stack.cpp")  # and a decode step's layers in one call


def sources() -> tuple[Path, ...]:
    """Every source file of the build, read at call time (a test swaps SOURCE for a broken one)."""
    return SOURCE, QUANTIZED_SOURCE, PREFILL_SOURCE, BF16_SOURCE, LORA_SOURCE, STACK_SOURCE


PREBUILT = SOURCE.with_name("prebuilt")  # the image's builds (--prebuild), beside the sources they came from

BUILD_WAIT_S = 300.0  # the longest a start waits for another process's build (one takes minutes on 2 cores)
WAIT_LOG_EVERY_S = 10.0

_active = None
_variant = ""  # the active build's variant
_reason = "not loaded"


def active():
    """The checked kernels module, or None where the PyTorch operations run instead."""
    return _active


def serving_variant() -> str:
    """The name of the variant whose build is active ('' when none is)."""
    return _variant if _active is not None else ""


def products(kernels) -> str:
    """What a build multiplies packed weights from, in words for the start-up log."""
    if kernels.quad_blocks_supported():
        return "packed blocks from 16- or 8-bit integer activations"
    if kernels.word_blocks_supported():
        return "packed blocks from 16-bit integer activations"
    return "GGUF Q4_1 / Q8_0 blocks from float32 activations only" if kernels.blocks_supported() else "no packed blocks"


def reason() -> str:
    """Why the kernels are not active ('' when they are)."""
    return _reason


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # the compiler's target flags
    needs: frozenset[str]  # /proc/cpuinfo flags the CPU must have for everything those flags let the compiler use


_X86_64_V3 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3",  # x86-64-v2
                        "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
# Best first. The sources' intrinsics need AVX-512 F and BW, and VNNI for the product from 16-bit activations
# (quantized_linear.cpp); the rest of x86-64-v4 (CD, DQ, VL) is what the compiler may use in the plain loops.
# A CPU with AVX-512 but no VNNI (Skylake-SP) takes the avx2 build; one with AVX-VNNI but no AVX-512 (Alder Lake
# and later client cores) the avx_vnni build.
X86_64_VARIANTS = (
    Variant("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"),
            _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}),
    Variant("avx_vnni", ("-march=x86-64-v3", "-mavxvnni"), _X86_64_V3 | {"avx_vnni"}),
    Variant("avx2", ("-march=x86-64-v3",), _X86_64_V3),
)
GENERIC = Variant("generic", (), frozenset())  # other architectures: their baseline, which every CPU of them runs
_COMMON_FLAGS = ("-O3", "-fopenmp")


def variants() -> tuple[Variant, ...]:
    """This architecture's builds, best first."""
    return X86_64_VARIANTS if platform.machine() in ("x86_64", "AMD64") else (GENERIC,)


def cpu_features() -> frozenset[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo names them, less what CPUID as this process sees it says
    it lacks (torch's probes and cpuid.py read the CPU the process really runs on, e.g. an emulated one, and
    whether the OS enables AVX-512)."""
    features = set(devices.cpuinfo().get("flags", "").split())
    if "avx_vnni" in features and cpuid.has_avx_vnni() is False:
        features.discard("avx_vnni")
    probes = getattr(torch, "cpu", None)
    for probe, names in (("_is_avx2_supported", ("avx2",)), ("_is_vnni_supported", ("avx512_vnni",)),
                         ("_is_avx512_supported", ("avx512f", "avx512bw", "avx512dq", "avx512vl"))):
        check = getattr(probes, probe, None)
        try:
            if check is not None and not check():
                features.difference_update(names)
        except Exception:  # a private probe that changed: /proc/cpuinfo alone decides
            pass
    return frozenset(features)


def named_variant(name: str, features: frozenset[str] | set[str] | None = None) -> Variant:
    """The variant NATIVE_KERNELS names, where this architecture has it and this CPU (`features`, default this
    one's) runs it: a lower variant runs on a higher CPU, so any machine can serve and measure, say, the avx2
    path. Otherwise a ValueError that says why."""
    found = next((v for v in variants() if v.name == name), None)
    if found is None:
        raise ValueError(f"NATIVE_KERNELS={name}: no such build on {platform.machine()}; its builds are "
                         + ", ".join(v.name for v in variants()))
    missing = found.needs - set(cpu_features() if features is None else features)
    if missing:
        raise ValueError(f"NATIVE_KERNELS={name}: this CPU cannot run that build (it lacks "
                         f"{' '.join(sorted(missing))})")
    return found


def choose_variant(features: frozenset[str] | set[str]) -> Variant | None:
    """The best build whose instructions `features` (a CPU's) include all of; None: no build runs on it."""
    return next((v for v in variants() if v.needs <= set(features)), None)


def build_name(variant: Variant) -> str:
    """The build's name, from what its machine code depends on: the sources' bytes, the flags, torch (headers and
    ABI) and the Python ABI. Not their paths (a symlinked checkout or venv shares the build), and not the
    compiler: a build from another compiler of the same sources is as valid, and the runtime image may have none
    to ask."""
    digest = hashlib.sha256()
    parts = [variant.name, *variant.flags, *_COMMON_FLAGS, torch.__version__,
             str(sysconfig.get_config_var("EXT_SUFFIX")), str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
             platform.machine()]
    for part in parts:
        digest.update(part.encode() + b"\0")
    for source in sources():
        digest.update(source.read_bytes() + b"\0")
    return f"llm_worker_kernels_{variant.name}_{digest.hexdigest()[:16]}"


def build_dir(cache_dir: Path | str | None = None) -> Path:
    """Where builds are made and kept: $NATIVE_KERNELS_DIR, else <cache_dir>/native-kernels (the worker's
    BASE_PATH), else BASE_PATH's default as engine/settings.py has it (the network volume when mounted)."""
    if os.environ.get("NATIVE_KERNELS_DIR"):
        return Path(os.environ["NATIVE_KERNELS_DIR"])
    if cache_dir is None:
        if os.environ.get("BASE_PATH"):
            cache_dir = os.environ["BASE_PATH"]
        elif Path("/runpod-volume").is_dir():
            cache_dir = "/runpod-volume"
        else:
            cache_dir = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-worker"
    return Path(cache_dir) / "native-kernels"


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja package's binary sits in its own folder."""
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


class _BuildLock:
    """An flock on `path` for one build: the OS drops it when its holder dies (a killed start leaves nothing that
    blocks), and acquiring it waits at most `wait_s`, logging whom it waits for."""

    def __init__(self, path: Path, wait_s: float):
        self.path, self.wait_s, self.fd = path, wait_s, None

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        started = time.monotonic()
        next_log = started + min(WAIT_LOG_EVERY_S, self.wait_s / 2)
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    # A filesystem without locks: build unlocked (each build has its own folder; the last one
                    # moved into place wins), only without clearing others' folders.
                    log.warning("CPU kernels: cannot lock %s (%s); building without the lock", self.path, exc)
                    os.close(self.fd)
                    self.fd = None
                    return self
            waited = time.monotonic() - started
            if waited >= self.wait_s:
                holder = self._holder()
                os.close(self.fd)
                self.fd = None
                raise TimeoutError(f"gave up after {waited:.0f} s waiting for another build ({holder}; {self.path})")
            if time.monotonic() >= next_log:
                log.warning("CPU kernels: waiting %.0f s of at most %.0f s for another process's build "
                            "(%s; %s)", waited, self.wait_s, self._holder(), self.path)
                next_log += WAIT_LOG_EVERY_S
            time.sleep(0.25)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                           f"{time.strftime('%H:%M:%S')}".encode(), 0)
        return self

    @property
    def held(self) -> bool:
        return self.fd is not None

    def _holder(self) -> str:
        try:
            return self.path.read_text().strip() or "holder unknown"
        except OSError:
            return "holder unknown"

    def __exit__(self, *exc):
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)  # releases the flock
            self.fd = None


def _import(name: str, path: Path):
    """The built module from its file (torch first: the build links its libraries, already loaded by then)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _find(name: str, roots) -> Path | None:
    return next((root / f"{name}.so" for root in roots if (root / f"{name}.so").is_file()), None)


def _compile(variant: Variant, root: Path, wait_s: float):
    """Compile `variant` into root/<name>.so unless another process built it meanwhile. Compiling never imports
    the build: the image's prebuild compiles variants its CPU cannot run, and importing one of those dies of
    SIGILL (torch's public `load` always imports what it built)."""
    from torch.utils import cpp_extension

    name = build_name(variant)
    target = root / f"{name}.so"
    root.mkdir(parents=True, exist_ok=True)
    with _BuildLock(root / f"{name}.lock", wait_s) as lock:
        if target.is_file():  # built by the process this one waited for
            return
        if lock.held:  # folders of builds killed midway belong to no one now
            for stale in root.glob(f"{name}.build-*"):
                shutil.rmtree(stale, ignore_errors=True)
        # Its own folder per build: a build killed midway leaves half-written objects that no later one reads.
        work = root / f"{name}.build-{socket.gethostname()}-{os.getpid()}"
        work.mkdir()
        try:
            _ninja_on_path()
            log.info("CPU kernels: compiling the %s build %s into %s (minutes on a 2-core machine; once per CPU variant and source)", variant.name,
                     name, root)
            # -fopenmp links libgomp.so.1 by name: the loader reuses the copy torch already loaded, so the
            # kernels share torch's OpenMP threads instead of starting a second team (which halves decode
            # speed; README).
            # The build step of torch's `load` without its import (keywords: the positional order has moved
            # between torch releases).
            cpp_extension._write_ninja_file_and_build_library(
                name=name, sources=[str(source) for source in sources()],
                extra_cflags=[*_COMMON_FLAGS, *variant.flags], extra_cuda_cflags=[], extra_sycl_cflags=[],
                extra_ldflags=["-fopenmp"], extra_include_paths=[], build_directory=str(work), verbose=False,
                with_cuda=False, with_sycl=False)
            os.replace(work / f"{name}.so", target)  # whole or absent: a reader never sees a partial file
        finally:
            shutil.rmtree(work, ignore_errors=True)


_built: dict[str, object] = {}  # modules loaded in this process, by build name


def build(variant: Variant | None = None, cache_dir: Path | str | None = None, wait_s: float | None = None):
    """The kernels for `variant` (default: the best one this CPU runs), from a prebuilt or earlier build or
    compiled now into build_dir(cache_dir); raises where it cannot."""
    if variant is None:
        variant = choose_variant(cpu_features())
        if variant is None:
            raise RuntimeError("this CPU has the instructions of none of the builds ("
                               + "; ".join(f"{v.name} needs {' '.join(sorted(v.needs))}" for v in variants()) + ")")
    name = build_name(variant)
    if name not in _built:
        root = build_dir(cache_dir)
        path = _find(name, (PREBUILT, root))
        if path is None:
            _compile(variant, root, BUILD_WAIT_S if wait_s is None else wait_s)
            path = root / f"{name}.so"
        _built[name] = _import(name, path)
    return _built[name]


def _close(expected: torch.Tensor, got: torch.Tensor) -> bool:
    tolerance = 1e-5 if expected.dtype == torch.float32 else 2e-2
    return bool(torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance))


_CHECK_HEADS, _CHECK_KV_HEADS = 4, 2  # the self-check's attention: query heads, key/value heads


def self_check(kernels, dtype: torch.dtype = torch.float32) -> str:
    """Each kernel against the PyTorch operations it replaces, on random input of `dtype`: '' when all agree,
    else which differs."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    # Float32 models may keep a float16 cache (KV_CACHE_DTYPE): the cache write rounds to it, and both
    # attention kernels read it.
    pool_types = (dtype, torch.float16) if dtype == torch.float32 else (dtype,)
    with torch.inference_mode():  # in this order, each drawing its input from the one generator
        return (_check_row_kernels(kernels, dtype, rand) or _check_draw_tokens(kernels)
                or _check_cache_write(kernels, dtype, rand, pool_types)
                or _check_decode_attention(kernels, dtype, rand, pool_types)
                or _check_prefill_attention(kernels, dtype, rand, pool_types)
                or _check_lora(kernels, dtype, rand))


def _check_row_kernels(kernels, dtype: torch.dtype, rand) -> str:
    """rms_norm, add_rms_norm_ (the residual added in place) and silu_mul: '' or the one that differs."""
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
    return ""


def _check_draw_tokens(kernels) -> str:
    # Three tokens of weight 1, 2, 1 (the rest -inf) across three spans; each uniform's token by the intervals.
    logits = torch.full((7, 600), float("-inf"))
    logits[:, [3, 300, 599]] = torch.tensor([0.0, math.log(2.0), 0.0])
    scale = torch.tensor([1.0] * 6 + [0.5])  # the last row at temperature 2: weights 1, 2 ** 0.5, 1
    uniforms = torch.tensor([0.0, 0.1, 0.3, 0.74, 0.8, 1.0 - 2.0 ** -53, 0.5], dtype=torch.float64)
    if kernels.draw_tokens(logits, scale, uniforms).tolist() != [3, 3, 300, 300, 599, 599, 300]:
        return "draw_tokens"
    return ""


def _check_cache_write(kernels, dtype: torch.dtype, rand, pool_types: tuple[torch.dtype, ...]) -> str:
    """rope_and_cache_: the rotation and the cache write, then the write alone into each other pool type."""
    heads, kv_heads, dim, block = _CHECK_HEADS, _CHECK_KV_HEADS, 8, 4
    qkv, cos, sin = rand(3, heads + 2 * kv_heads, dim), rand(3, dim), rand(3, dim)
    k_pool = torch.zeros(6, block, kv_heads, dim, dtype=dtype)
    v_pool = torch.zeros(6, block, kv_heads, dim, dtype=dtype)
    slots = torch.tensor([5, 9, 12])
    qk = qkv[:, :heads + kv_heads]
    half = dim // 2
    rotated = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin[:, None]
    values = qkv[:, heads + kv_heads:].clone()
    kernels.rope_and_cache_(qkv, cos, sin, heads, kv_heads, k_pool, v_pool, slots)
    if not (_close(rotated, qkv[:, :heads + kv_heads])
            and _close(rotated[:, heads:], k_pool.view(-1, kv_heads, dim)[slots])
            and _close(values, v_pool.view(-1, kv_heads, dim)[slots])):
        return "rope_and_cache_"
    for pool_type in pool_types[1:]:
        k_pool = torch.zeros(6, block, kv_heads, dim, dtype=pool_type)
        v_pool = torch.zeros(6, block, kv_heads, dim, dtype=pool_type)
        qkv = torch.cat([rotated, values], 1).contiguous()
        kernels.rope_and_cache_(qkv, None, None, heads, kv_heads, k_pool, v_pool, slots)
        if not (_close(rotated[:, heads:].to(pool_type), k_pool.view(-1, kv_heads, dim)[slots])
                and _close(values.to(pool_type), v_pool.view(-1, kv_heads, dim)[slots])):
            return "rope_and_cache_"
    return ""


def _check_decode_attention(kernels, dtype: torch.dtype, rand, pool_types: tuple[torch.dtype, ...]) -> str:
    heads, kv_heads = _CHECK_HEADS, _CHECK_KV_HEADS
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
    return ""


def _check_prefill_attention(kernels, dtype: torch.dtype, rand, pool_types: tuple[torch.dtype, ...]) -> str:
    heads, kv_heads = _CHECK_HEADS, _CHECK_KV_HEADS
    # Prefill attention takes float32 queries: a float32 model's (over its own or a float16 cache), or a
    # bfloat16 model's widened (over its bfloat16 cache: multiplied in bfloat16 where the CPU has AVX512_BF16, or
    # with float32 FMAs where the runner finds those faster).
    prefill_pools = {torch.float32: pool_types, torch.bfloat16: (torch.bfloat16,)}.get(dtype, ())
    for pool_type in prefill_pools if kernels.prefill_attention_supported() else ():
        # A chunk of 70 tokens after 50 cached ones (five token tiles, the last one partial), whole and
        # within a window of 30, and in float32 FMAs, against SDPA with the causal mask over the gathered keys.
        start, tokens, table = 50, 70, [6, 2, 0, 7, 4, 1, 3, 5]
        k_pool, v_pool = rand(8, 16, kv_heads, 64).to(pool_type), rand(8, 16, kv_heads, 64).to(pool_type)
        query, out = rand(tokens, heads, 64).float(), torch.empty(tokens, heads, 64)
        keys = k_pool[table].reshape(-1, kv_heads, 64)[:start + tokens].transpose(0, 1)[None].float()
        vals = v_pool[table].reshape(-1, kv_heads, 64)[:start + tokens].transpose(0, 1)[None].float()
        positions = torch.arange(start + tokens)
        for window, bf16_products in ((0, True), (30, True), (0, False)):
            mask = positions[None] <= positions[start:, None]
            if window:
                mask &= positions[None] > positions[start:, None] - window
            kernels.paged_prefill_attention(query, k_pool, v_pool, torch.tensor(table), start, window, 0.3, out,
                                            bf16_products)
            expected = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys, vals, attn_mask=mask,
                                                      scale=0.3, enable_gqa=True)[0].transpose(0, 1)
            if not _close(expected.to(dtype), out):
                return "paged_prefill_attention"
    return ""


def _check_lora(kernels, dtype: torch.dtype, rand) -> str:
    # LoRA's per-row term (engine/lora/layers.py): three resident slots of a fused layer of two projections
    # (rank 4), five rows of slots 2, 0, 1, 3, 2, against each row's own products.
    rank, sizes, slots = 4, (24, 40), [2, 0, 1, 3, 2]
    if dtype not in (torch.float32, torch.bfloat16):
        return ""  # float16 layers keep PyTorch's operations for it
    x, y = rand(5, 40), rand(5, sum(sizes))
    a = rand(3 * 2 * rank, 40)
    bs = [rand(3 * rank, size) for size in sizes]

    def added(a, bs) -> torch.Tensor:  # y plus each row's own slot's term, in float32
        expected = y.float().clone()
        for row, slot in enumerate(slots):
            if slot:
                h = a[(slot - 1) * 2 * rank:slot * 2 * rank].float() @ x[row].float()
                expected[row] += torch.cat([h[j * rank:(j + 1) * rank] @ bs[j][(slot - 1) * rank:slot * rank]
                                            .float() for j in range(len(sizes))])
        return expected

    expected = added(a, bs)
    kernels.lora_add_(y, x, a, bs, torch.tensor(slots), rank)
    if not _close(expected.to(dtype), y):
        return "lora_add_"
    if dtype == torch.float32:  # bfloat16 adapters under float32 rows (GGUF block layers)
        a, bs = a.bfloat16(), [b.bfloat16() for b in bs]
        expected = added(a, bs)
        kernels.lora_add_(y, x, a, bs, torch.tensor(slots), rank)
        if not _close(expected, y):
            return "lora_add_ (bfloat16 adapter)"
    return ""


def load(mode: str = "auto", dtype: torch.dtype = torch.float32, cache_dir: Path | str | None = None,
         verdicts=None) -> bool:
    """Make the kernels active for this process where `mode` allows, a build for this CPU is found or made (in
    build_dir(cache_dir)) and agrees with PyTorch on `dtype` (the model's). Returns whether they are active;
    `reason()` says why not. `verdicts` (engine/startup_cache.py) keeps the self-check's verdict for this very
    build across processes."""
    global _active, _reason, _variant
    _active = None
    if mode == "off":
        _reason = "NATIVE_KERNELS=off"
        return False
    started = time.perf_counter()
    named = mode != "auto"
    variant = named_variant(mode) if named else choose_variant(cpu_features())
    try:
        kernels = build(variant, cache_dir)
    except Exception as exc:  # no compiler, no headers, a failed build, no variant: the PyTorch operations serve
        errors = [line.strip() for line in str(exc).splitlines() if "error" in line.lower()]
        _reason = f"not built: {' '.join((errors[-1] if errors else str(exc)).split())[:300]}"
        if named:
            raise RuntimeError(f"NATIVE_KERNELS={mode}: the build failed ({_reason})") from None
        log.warning("CPU kernels: %s; using PyTorch operations", _reason)
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
        if named:
            raise RuntimeError(f"NATIVE_KERNELS={mode}: the {variant.name} build's {_reason}")
        log.warning("CPU kernels: %s; using PyTorch operations", _reason)
        return False
    _active, _reason, _variant = kernels, "", variant.name
    log.info("CPU kernels: the %s build (%s) loaded and checked in %.1f s; it multiplies %s", variant.name,
             build_name(variant), time.perf_counter() - started, products(kernels))
    return True


def prebuild() -> bool:
    """Every variant of this architecture into PREBUILT (the image's builds, for whatever CPU runs it), each one
    taken from the build folder where a build of the same name is there already; the ones this CPU runs are
    checked. Whether all built (and passed)."""
    PREBUILT.mkdir(parents=True, exist_ok=True)
    features, ok = cpu_features(), True
    for variant in variants():
        name = build_name(variant)
        try:
            found = _find(name, (PREBUILT, build_dir()))
            if found is None:
                _compile(variant, PREBUILT, BUILD_WAIT_S)
            elif found.parent != PREBUILT:
                partial = PREBUILT / f"{name}.so.partial"
                shutil.copy2(found, partial)
                os.replace(partial, PREBUILT / f"{name}.so")
        except Exception as exc:
            log.error("CPU kernels: the %s build failed: %s", variant.name, exc)
            ok = False
            continue
        if variant.needs <= features:
            differs = self_check(build(variant), torch.float32)
            log.info("CPU kernels: %s %s", name, f"{differs} differs from PyTorch" if differs else "checked")
            ok = ok and not differs
        else:
            log.info("CPU kernels: %s built (this CPU cannot run it to check it)", name)
    return ok


if __name__ == "__main__":
    # scripts/install.sh: this CPU's build into the build folder, so the first start does not compile;
    # --prebuild (the Dockerfile): every variant into the package, for the CPUs the image will run on.
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raise SystemExit(0 if (prebuild() if sys.argv[1:] == ["--prebuild"] else load()) else 1)
