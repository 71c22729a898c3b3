"""How the CPU kernels are built, found and chosen (engine/cpu/native_kernels.py): a start killed during a build never
blocks a later one, a live build is waited for within a bound that is logged, every path to the same sources and
venv shares one build, and a CPU without a build's instructions never loads that build. Real processes and real
builds; only the CPU's feature list is given where a test needs a CPU this machine is not."""
from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from engine import AsyncEngine, EngineConfig, SamplingParams
from engine.cpu import native_kernels

AVX512_VNNI, AVX_VNNI, AVX2 = native_kernels.X86_64_VARIANTS
# The CPU flags (as /proc/cpuinfo names them) each build's instructions need: x86-64-v3 for the AVX2 build, that and
# AVX-VNNI for the avx_vnni build, and x86-64-v4 with VNNI for the AVX-512 one.
X86_64_V3 = frozenset({"abm", "avx", "avx2", "bmi1", "bmi2", "cx16", "f16c", "fma", "lahf_lm", "movbe", "popcnt",
                       "sse4_1", "sse4_2", "ssse3", "xsave"})
X86_64_V4_VNNI = X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"}
X86_64_V3_AVX_VNNI = X86_64_V3 | {"avx_vnni"}
# A CPU of x86-64-v2 and AVX (Sandy Bridge): neither build's instructions.
OLD_CPU = frozenset({"sse2", "sse4_1", "sse4_2", "ssse3", "popcnt", "cx16", "lahf_lm", "avx", "xsave"})
x86_only = pytest.mark.skipif(native_kernels.variants()[0] is not AVX512_VNNI, reason="x86-64 variants")


@pytest.fixture(autouse=True)
def _restore_kernels():
    active, reason = native_kernels._active, native_kernels._reason
    yield
    native_kernels._active, native_kernels._reason = active, reason


@x86_only
def test_the_best_variant_whose_instructions_the_cpu_has_is_chosen():
    assert (AVX512_VNNI.name, AVX_VNNI.name, AVX2.name) == ("avx512_vnni", "avx_vnni", "avx2")
    assert native_kernels.choose_variant(X86_64_V4_VNNI) is AVX512_VNNI  # Ice Lake, Zen 4
    assert native_kernels.choose_variant(X86_64_V4_VNNI | {"avx_vnni"}) is AVX512_VNNI  # Sapphire Rapids, Zen 5
    assert native_kernels.choose_variant(X86_64_V4_VNNI - {"avx512_vnni"}) is AVX2  # Skylake-SP
    assert native_kernels.choose_variant(X86_64_V3_AVX_VNNI) is AVX_VNNI  # Alder Lake and later client cores
    assert native_kernels.choose_variant(X86_64_V3) is AVX2  # Zen 2 and 3, Haswell to Comet Lake
    for flag in X86_64_V3:  # without any one of its flags, not even the AVX2 build
        assert native_kernels.choose_variant(X86_64_V3 - {flag}) is None, flag
    assert native_kernels.choose_variant(OLD_CPU) is None
    assert len({native_kernels.build_name(v) for v in (AVX512_VNNI, AVX_VNNI, AVX2)}) == 3


@pytest.mark.slow
@x86_only
def test_a_cpu_without_the_builds_instructions_serves_through_pytorch(monkeypatch, caplog):
    """A CPU lacking AVX-512 never loads the AVX-512 build, even where that build sits in the build folder (as on a
    volume shared with an AVX-512 machine), and a CPU without AVX2 either serves through PyTorch's operations."""
    assert native_kernels.load("auto"), native_kernels.reason()  # this machine's build, in the build folder
    mine = _expected_variant(_cpuinfo_flags())
    assert native_kernels.active().__file__.endswith(native_kernels.build_name(mine) + ".so")
    monkeypatch.setattr(native_kernels, "cpu_features", lambda: X86_64_V3)
    assert native_kernels.choose_variant(native_kernels.cpu_features()) is AVX2
    monkeypatch.setattr(native_kernels, "cpu_features", lambda: OLD_CPU)
    engine = AsyncEngine(EngineConfig(dtype="float32", native_kernels="auto", max_model_len=256, max_num_seqs=2,
                                      kv_cache_memory=16 * 2**20))
    try:
        with caplog.at_level("INFO"):
            tokens = _greedy(engine, [101, 202, 303, 404])
    finally:
        engine.close()
    assert native_kernels.active() is None
    assert "none of the builds" in native_kernels.reason() and "avx512_vnni needs" in native_kernels.reason()
    assert "using PyTorch operations" in caplog.text and "through the native CPU kernels" not in caplog.text
    assert len(tokens) == 8


@x86_only
def test_cpuid_reads_the_cpu_that_proc_cpuinfo_describes():
    """Run natively, CPUID as the process sees it agrees with /proc/cpuinfo on the vendor and on AVX-VNNI (the one
    flag the variants need that torch has no probe of)."""
    from engine.cpu import cpuid

    vendor = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("vendor_id"))
    assert cpuid.vendor() == vendor
    assert cpuid.has_avx_vnni() is ("avx_vnni" in _cpuinfo_flags())
    assert cpuid.registers(0)[0] >= 1  # the highest standard leaf


@x86_only
def test_native_kernels_names_a_variant_the_cpu_runs(monkeypatch):
    """NATIVE_KERNELS=<variant>: a lower variant is taken on a higher CPU (so any x86 machine measures the AVX2
    path); one the CPU cannot run, or another architecture's, stops the start with a line that says why."""
    from engine.settings import SettingsError
    from worker.settings import load_settings

    assert native_kernels.named_variant("avx2", X86_64_V4_VNNI) is AVX2
    assert native_kernels.named_variant("avx512_vnni", X86_64_V4_VNNI) is AVX512_VNNI
    assert native_kernels.named_variant("avx_vnni", X86_64_V3_AVX_VNNI) is AVX_VNNI
    with pytest.raises(ValueError, match=r"NATIVE_KERNELS=avx_vnni: this CPU cannot run that build \(it lacks "
                                         r"avx_vnni\)"):
        native_kernels.named_variant("avx_vnni", X86_64_V4_VNNI)
    with pytest.raises(ValueError, match=r"NATIVE_KERNELS=avx512_vnni: this CPU cannot run that build \(it lacks "
                                         r"avx512_vnni\)"):
        native_kernels.named_variant("avx512_vnni", X86_64_V4_VNNI - {"avx512_vnni"})
    with pytest.raises(ValueError, match="no such build on x86_64; its builds are avx512_vnni, avx_vnni, avx2"):
        native_kernels.named_variant("generic", X86_64_V4_VNNI)
    monkeypatch.setattr(native_kernels, "cpu_features", lambda: X86_64_V3)
    with pytest.raises(ValueError, match="lacks avx512_vnni avx512bw avx512cd avx512dq avx512f avx512vl"):
        native_kernels.load("avx512_vnni")
    monkeypatch.setenv("NATIVE_KERNELS", "neon")
    with pytest.raises(SettingsError, match="NATIVE_KERNELS"):
        load_settings()


@pytest.mark.slow  # compiles the avx2 build where the build folder lacks it
@x86_only
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_the_avx2_build_serves_the_compact_forward_beside_pytorchs_avx2_kernels(tmp_path, activations):
    """The embedded model with NATIVE_KERNELS=avx2 while PyTorch, oneDNN and MKL run their AVX2 code, as on an
    AVX2-only CPU (Zen 3): the compact forward through the kernels passes its start-up check, with either
    activation mode. It failed there: with float16 keys and values, a float32 rounding apart between the two
    forwards (PyTorch's AVX2 kernels against the build's) moved cached keys to neighbouring float16 values, 2e-4 of
    the largest logit, against a bound of 1e-4 made for float32 caches; with 8-bit activations the two forwards
    came 0.12 of the largest logit apart, against a bound of 0.1."""
    from engine.config import EngineConfig as Config
    from engine.loader import model_folder
    from worker.settings import load_settings

    native_kernels.build(AVX2)  # natively, in the build folder the start looks in
    default = load_settings().base_path
    model_folder(Config(cache_dir=default))
    (tmp_path / "converted").symlink_to(default / "converted")
    (tmp_path / "native-kernels").symlink_to(native_kernels.build_dir(default))
    env = {**os.environ, "BASE_PATH": str(tmp_path), "NATIVE_KERNELS": "avx2", "STARTUP_CACHE": "off",
           "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
           "LOG_LEVEL": "INFO", "DTYPE": "auto", "QUANTIZED_ACTIVATIONS": activations}
    job = ('{"input": {"openai_route": "/v1/chat/completions", "openai_input": {"messages": [{"role": "user", '
           '"content": "What is the capital of France?"}], "max_tokens": 12, "temperature": 0}}}')
    done = subprocess.run([sys.executable, "handler.py", "--test_input", job], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU kernels: the avx2 build" in done.stderr
    assert "no native bfloat16 products" in done.stderr  # PyTorch's AVX2 code has none: float32 weights
    assert "through the native CPU kernels, checked against the model's own" in done.stderr, done.stderr[-3000:]
    assert "Paris" in done.stdout


def _cpuinfo_flags() -> set[str]:
    line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def _expected_variant(flags: set[str]):
    if X86_64_V4_VNNI <= flags:
        return AVX512_VNNI
    return AVX_VNNI if X86_64_V3_AVX_VNNI <= flags else AVX2


def _greedy(engine: AsyncEngine, ids: list[int]) -> list[int]:
    async def run():
        await engine.start()
        tokens = []
        async for output in engine.generate("r", ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)):
            for delta in output.deltas:
                tokens.extend(delta.token_ids)
        return tokens
    return asyncio.run(run())


@pytest.mark.slow  # compiles the AVX2 builds where the build folder lacks them
@x86_only
@pytest.mark.skipif(not shutil.which("objdump"), reason="needs objdump")
@pytest.mark.parametrize("variant", [AVX2, AVX_VNNI], ids=lambda v: v.name)
def test_the_avx2_builds_have_no_avx512_instructions_and_pass_their_check(variant):
    """What CPUs without AVX-512 load: built with x86-64-v3's flags (and AVX-VNNI's), the machine code has no
    AVX-512 register or mask (so it cannot fault on them); the avx_vnni build's word products sum with the
    VEX-encoded VPDPWSSD, the avx2 build's with VPMADDWD and none of VNNI; each agrees with PyTorch where this
    CPU runs it."""
    kernels = native_kernels._built.get(native_kernels.build_name(variant))
    if kernels is None:  # compiled without importing: this CPU may not run it
        native_kernels._compile(variant, native_kernels.build_dir(), native_kernels.BUILD_WAIT_S)
        path = native_kernels.build_dir() / f"{native_kernels.build_name(variant)}.so"
    else:
        path = Path(kernels.__file__)
    disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True,
                                 text=True, check=True).stdout
    assert "vfmadd" in disassembly  # the compiler did vectorise with x86-64-v3
    assert not re.search(r"%zmm|%[xy]mm(1[6-9]|2\d|3[01])\b|\{%k[1-7]\}", disassembly)
    assert ("vpdpwssd" in disassembly) == ("vpdpbusd" in disassembly) == (variant is AVX_VNNI)
    assert variant is not AVX2 or ("vpmaddwd" in disassembly and "vpmaddubsw" in disassembly)
    if not variant.needs <= native_kernels.cpu_features():
        pytest.skip(f"built and read; this CPU cannot run the {variant.name} build to check it")
    kernels = native_kernels.build(variant)
    assert not kernels.prefill_attention_supported()  # the AVX-512 path
    assert kernels.blocks_supported() and kernels.word_blocks_supported() and kernels.quad_blocks_supported()
    assert native_kernels.self_check(kernels) == ""


def _packed_cases(kernels, quads: bool = False) -> list[tuple[str, int, torch.Tensor, int]]:
    """(name, format, blocks, outputs): a random 48 x 512 weight packed by each of `kernels`' packers in every word
    format (16-bit activations) it makes, or with `quads` in every format for 8-bit activations (bitsandbytes'
    4-bit codes have none)."""
    torch.manual_seed(3)
    n, k = 48, 512
    blocks = k // 32

    def q(lo, hi):
        return torch.randint(lo, hi, (n, k), dtype=torch.int8)

    def halves(*shape):
        return (torch.rand(*shape) * 0.05 + 1e-3).half().float()

    def scales(*shape):
        return torch.rand(*shape) * 0.05 + 1e-3

    d = halves(n, blocks)
    packed = {
        "q4_1 words": kernels.pack_scaled(q(0, 16), d, -7 * d, 4, True, quads),
        "q8_0 words": kernels.pack_scaled(q(-128, 128), d, torch.zeros_like(d), 8, True, quads),
        "q4 float32 headers": kernels.pack_scaled(q(0, 16), scales(n, blocks), -scales(n, blocks), 4, False, quads),
        "q8 float32 headers": kernels.pack_scaled(q(-128, 128), scales(n, blocks), scales(n, blocks), 8, False, quads),
        "q8 scale per 16": kernels.pack_scaled(q(-32, 32), scales(n, 2 * blocks), torch.zeros(n, 2 * blocks), 8,
                                               False, quads),
        "q5 words": kernels.pack_scaled(q(0, 32), d, -9 * d, 5, True, quads),
        "q5 float32 headers": kernels.pack_scaled(q(0, 32), scales(n, blocks), -scales(n, blocks), 5, False, quads),
        "q4_0": kernels.pack_scaled(q(0, 16), d, -8 * d, 4, True, quads, True),
        "q5_0": kernels.pack_scaled(q(0, 32), d, -16 * d, 5, True, quads, True),
        "zero points": kernels.pack_zero_points(q(0, 16), d, torch.randint(0, 16, (n, blocks), dtype=torch.uint8),
                                                quads),
        "gptq by 128": kernels.pack_groups(q(0, 16), halves(n, k // 128), torch.empty(0, dtype=torch.uint8), quads),
        "awq by 64": kernels.pack_groups(q(0, 16), halves(n, k // 64),
                                         torch.randint(0, 16, (n, k // 64), dtype=torch.uint8), quads),
        "q4_k": kernels.pack_super(q(0, 16), halves(n, k // 256), torch.randint(0, 64, (n, blocks), dtype=torch.uint8),
                                   halves(n, k // 256), torch.randint(0, 64, (n, blocks), dtype=torch.uint8), 4, quads),
        "q5_k": kernels.pack_super(q(0, 32), halves(n, k // 256), torch.randint(0, 64, (n, blocks), dtype=torch.uint8),
                                   halves(n, k // 256), torch.randint(0, 64, (n, blocks), dtype=torch.uint8), 5, quads),
        "q6_k": kernels.pack_six_bit(q(-32, 32), halves(n, k // 256),
                                     torch.randint(-64, 64, (n, 2 * blocks), dtype=torch.int8), quads),
        "q8 by 128": kernels.pack_eight_by_128(q(-128, 128), scales(n, k // 128), quads),
    }
    if not quads:
        packed |= {
            "nf4": kernels.pack_coded(q(0, 16), scales(n, blocks), "nf4"),
            "fp4 by 64": kernels.pack_coded(q(0, 16), scales(n, k // 64), "fp4"),
            "nf4 by 128": kernels.pack_coded(q(0, 16), scales(n, k // 128), "nf4"),
        }
    return [(name, fmt, blocks_, n) for name, (fmt, blocks_) in packed.items()]


@pytest.mark.slow  # compiles the builds where the build folder lacks them
@x86_only
@pytest.mark.skipif(not X86_64_V4_VNNI <= _cpuinfo_flags(), reason="needs a CPU that runs the AVX-512 build too")
def test_the_avx2_and_avx512_builds_give_the_same_outputs_bit_for_bit():
    """The image's answer does not depend on which CPU the platform gave it: for every packed format with 16-bit
    activations (and GGUF Q4_1 / Q8_0 blocks with float32 ones), at every tile shape of rows, from float32 and
    bfloat16 rows, with and without bias, from 16-bit and from 8-bit activations, the avx2 build's outputs (and the
    avx_vnni build's, where this CPU has AVX-VNNI) equal the AVX-512 build's exactly."""
    wide = native_kernels.build(AVX512_VNNI)
    narrows = [native_kernels.build(v) for v in (AVX2, AVX_VNNI) if v.needs <= native_kernels.cpu_features()]
    words, quads = _packed_cases(wide), _packed_cases(wide, True)
    assert len({fmt for _, fmt, _, _ in words + quads}) == len(words + quads)  # each a format of its own
    for name, fmt, blocks, n in words + quads:
        for rows in (1, 2, 3, 5, 7, 13, 16, 33):
            x = torch.randn(rows, 512)
            bias = torch.randn(n)
            for xs, b in ((x, None), (x.bfloat16(), bias)):
                expected = wide.blocks_linear(xs, blocks, fmt, n, b)
                for narrow in narrows:
                    assert torch.equal(expected, narrow.blocks_linear(xs, blocks, fmt, n, b)), \
                        (name, rows, xs.dtype, narrow.__name__)
    q = torch.randint(0, 16, (48, 512))
    q[:, ::32], q[:, 1::32] = 0, 15  # each block of 32 spans 0..15: exact Q4_1 blocks that pack_blocks recovers
    weight = q.float() * 0.03125 - 0.25
    for words in (False, True):
        fmt, blocks = wide.pack_blocks(weight, words)
        assert fmt == (3 if words else 1)
        for rows in (1, 4, 9):
            x = torch.randn(rows, 512)
            expected = wide.blocks_linear(x, blocks, fmt, 48)
            for narrow in narrows:
                assert torch.equal(expected, narrow.blocks_linear(x, blocks, fmt, 48)), (words, rows, narrow.__name__)


@pytest.mark.slow  # compiles the builds where the build folder lacks them
@x86_only
@pytest.mark.skipif(not X86_64_V4_VNNI <= _cpuinfo_flags(), reason="needs a CPU that runs the AVX-512 build too")
def test_the_avx2_and_avx512_builds_attend_the_same_bit_for_bit():
    """Decode attention from the paged cache, head sizes 64 and 128, float16, bfloat16 and float32 pools, grouped
    and plain heads, short rows and rows long enough to be split across threads, with and without a window: the
    AVX2 builds' outputs equal the AVX-512 build's exactly, and SDPA's to float32 rounding. (The avx2 build
    attended with plain loops, whose sums end in another order.)"""
    wide = native_kernels.build(AVX512_VNNI)
    narrows = [native_kernels.build(v) for v in (AVX2, AVX_VNNI) if v.needs <= native_kernels.cpu_features()]
    generator = torch.Generator().manual_seed(0)
    for dim, pool_type, (heads, kv_heads), lengths, window in itertools.product(
            (64, 128), (torch.float16, torch.bfloat16, torch.float32), ((9, 3), (4, 4)),
            ([1, 7, 16, 33], [700]), (0, 100)):
        rows, width = len(lengths), -(-max(lengths) // 16)
        table = torch.randperm(rows * width + 3, generator=generator)[:rows * width]
        k_pool, v_pool = (torch.randn(rows * width + 3, 16, kv_heads, dim, generator=generator).to(pool_type)
                          for _ in range(2))
        query, scale = torch.randn(rows, heads, dim, generator=generator), dim ** -0.5
        expected = torch.empty(rows, heads, dim)
        wide.paged_decode_attention(query, k_pool, v_pool, table, torch.tensor(lengths), window, scale, expected)
        for row, length in enumerate(lengths):
            start = max(0, length - window) if window else 0
            keys, values = (pool[table.view(rows, -1)[row]].reshape(-1, kv_heads, dim)[start:length].transpose(0, 1)
                            .float() for pool in (k_pool, v_pool))
            reference = F.scaled_dot_product_attention(query[row][:, None], keys, values, scale=scale,
                                                       enable_gqa=True)[:, 0]
            assert torch.allclose(expected[row], reference, atol=1e-5, rtol=1e-4)
        for narrow in narrows:
            got = torch.empty(rows, heads, dim)
            narrow.paged_decode_attention(query, k_pool, v_pool, table, torch.tensor(lengths), window, scale, got)
            assert torch.equal(expected, got), (dim, pool_type, heads, lengths, window, narrow.__name__)


@pytest.mark.slow  # compiles the build where the build folder lacks it
@x86_only
@pytest.mark.parametrize("variant", [AVX2, AVX_VNNI], ids=lambda v: v.name)
def test_the_avx2_builds_multiply_every_word_format_a_row_at_a_time(variant):
    """On any x86 CPU (with AVX-VNNI for that build), the AVX2 builds' product from 16-bit activations gives each
    row the result it gets alone, whatever rows share the call (a row's rounding is its own), from 16-bit and from
    8-bit activations."""
    if not variant.needs <= native_kernels.cpu_features():
        pytest.skip(f"this CPU cannot run the {variant.name} build")
    kernels = native_kernels.build(variant)
    for name, fmt, blocks, n in _packed_cases(kernels) + _packed_cases(kernels, True):
        x = torch.randn(13, 512)
        together = kernels.blocks_linear(x, blocks, fmt, n)
        alone = torch.cat([kernels.blocks_linear(x[i:i + 1], blocks, fmt, n) for i in range(13)])
        assert torch.equal(together, alone), name
        assert torch.isfinite(together).all() and together.abs().max() > 0, name


# A module whose import runs an AVX-512 instruction: what any build with -march=x86-64-v4 may do on import.
_AVX512_ON_IMPORT = r"""
#include <torch/extension.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    asm volatile("vpxord %%zmm0, %%zmm0, %%zmm0" ::: "xmm0");
    m.def("answer", [] { return 42; });
}
"""
# One emulated process for both tests below (starting Python and torch under qemu is most of their time): it loads
# this CPU's build ("auto"), then compiles the avx512_vnni build of the module above. Each part prints its own line.
_ON_HASWELL = """
import sys
from pathlib import Path
from engine.cpu import native_kernels as n
ok = n.load("auto")
print("loaded", ok, n.active().__file__ if ok else n.reason().replace(" ", "_"), flush=True)
n.sources = lambda: (Path(sys.argv[1]),)
variant = n.X86_64_VARIANTS[0]
n._compile(variant, Path(sys.argv[2]), 60)
print("compiled", n.build_name(variant), flush=True)
"""
qemu = pytest.mark.skipif(not shutil.which("qemu-x86_64"), reason="needs qemu-user (Debian: apt-get install qemu-user)")


@pytest.fixture(scope="module")
def on_haswell(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """A run on a CPU without AVX-512 or AVX-VNNI: qemu's Haswell (/proc/cpuinfo still shows this machine's flags;
    torch's CPUID probes and engine/cpu/cpuid.py see the emulated CPU)."""
    native_kernels.build(AVX2)  # natively, as the image or a first start would have: compiling emulated is slow
    folder = tmp_path_factory.mktemp("haswell")
    source = folder / "avx512_on_import.cpp"
    source.write_text(_AVX512_ON_IMPORT)
    result = subprocess.run(["qemu-x86_64", "-cpu", "Haswell", sys.executable, "-c", _ON_HASWELL, str(source),
                             str(folder / "builds")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    return result, folder / "builds"


def _line(result: subprocess.CompletedProcess, word: str) -> list[str]:
    found = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith(word + " ")]
    assert found, (result.returncode, result.stdout, result.stderr[-3000:])
    return found[0]


@pytest.mark.slow
@x86_only
@qemu
def test_an_emulated_cpu_without_avx512_loads_and_checks_the_avx2_build(on_haswell):
    """The start loads the avx2 build and its check passes there (the -march=native build this machine made
    before died of SIGILL on it)."""
    ok, loaded = _line(on_haswell[0], "loaded")
    assert ok == "True" and loaded.endswith(f"{native_kernels.build_name(AVX2)}.so"), loaded


@pytest.mark.slow
@x86_only
@qemu
def test_a_cpu_without_avx512_compiles_the_avx512_build_without_running_it(on_haswell):
    """The image's prebuild compiles every variant on whatever CPU builds the image. On one without AVX-512,
    compiling the avx512_vnni build writes its file and runs none of it: the build used to be imported as it was
    compiled, and died of SIGILL (Illegal instruction, exit 132)."""
    result, builds = on_haswell
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    name, = _line(result, "compiled")
    assert name.startswith("llm_worker_kernels_avx512_vnni_") and (builds / f"{name}.so").is_file()
    assert sorted(p.name for p in builds.iterdir()) == [f"{name}.lock", f"{name}.so"]


# A start whose build is one small source (a module of one function) through the same build(): the lock, the
# per-build folders and the clean-up are what a kill tests, and they do not depend on what is compiled (the real
# sources take minutes on 2 cores; this one still keeps the compiler busy for seconds, on torch's headers).
_SMALL_SOURCE = r"""
#include <torch/extension.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""
_SMALL_START = ("import sys; from pathlib import Path; from engine.cpu import native_kernels as n; "
                "n.sources = lambda: (Path(sys.argv[1]),); n.PREBUILT = Path(sys.argv[2]); "
                "print('answer', n.build().answer(), flush=True)")


def _small_start(env: dict, source: Path, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _SMALL_START, str(source), str(source.parent / "no-prebuilt")],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def _session_processes(session: int) -> dict[int, str]:
    """pid -> command name of every live process of a session."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, fields = text.split("(", 1)[1].rsplit(")", 1)[0], text.rsplit(")", 1)[1].split()
        if int(fields[3]) == session and fields[0] != "Z":
            found[int(stat.parent.name)] = name
    return found


def _kill_session(session: int) -> None:
    """SIGKILL to every process of a session, as a container's stop kills all of them (killing the process group
    is not enough: ninja starts each compiler in a group of its own)."""
    for _ in range(3):  # a dying shell may still have started a child
        for pid in _session_processes(session):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


@pytest.mark.slow
def test_a_start_killed_during_the_build_never_blocks_the_next(tmp_path):
    """A start killed (with its compiler, as a container stop kills them) in the middle of the build: the next
    start builds and loads the kernels, and leaves only the build and its lock file behind."""
    source = tmp_path / "small.cpp"
    source.write_text(_SMALL_SOURCE)
    kernels = tmp_path / "kernels"
    env = {**os.environ, "NATIVE_KERNELS_DIR": str(kernels), "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    first = _small_start(env, source, start_new_session=True)
    deadline = time.monotonic() + 120
    # Killed while a compiler of the build runs (the build holds its lock file all the while).
    while not (list(kernels.glob("*.lock")) and "cc1plus" in _session_processes(first.pid).values()):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the build did not start"
        time.sleep(0.1)
    _kill_session(first.pid)
    first.wait()
    assert first.returncode == -signal.SIGKILL
    name = next(kernels.glob("*.lock")).stem
    assert list(kernels.glob(f"{name}.build-*")) and not list(kernels.glob("*.so"))  # its half-done folder stays
    second = _small_start(env, source)
    try:
        output, _ = second.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        second.kill()
        pytest.fail(f"the next start still waits after 600 s: {second.communicate()[0][-2000:]}")
    assert second.returncode == 0 and "answer 42" in output, output[-3000:]  # built and loaded
    assert sorted(p.name for p in kernels.iterdir()) == [f"{name}.lock", f"{name}.so"]  # the killed folder is gone


@pytest.mark.slow
def test_a_start_waits_for_a_live_build_at_most_the_bound_and_says_for_whom(tmp_path, monkeypatch, caplog):
    """Another process holds the build (it is compiling): the start logs whom it waits for, gives up at the bound
    and serves through PyTorch's operations."""
    root = tmp_path / "kernels"
    root.mkdir()
    lock = root / f"{native_kernels.build_name(native_kernels.choose_variant(native_kernels.cpu_features()))}.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.flock(fd, "
        "fcntl.LOCK_EX); os.write(fd, b'pid %d, a test holder' % os.getpid()); print('held', flush=True); "
        "time.sleep(120)"), str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setenv("NATIVE_KERNELS_DIR", str(root))
        monkeypatch.setattr(native_kernels, "PREBUILT", tmp_path / "none")
        monkeypatch.setattr(native_kernels, "_built", {})  # not this process's own earlier load
        monkeypatch.setattr(native_kernels, "BUILD_WAIT_S", 3.0)
        monkeypatch.setattr(native_kernels, "WAIT_LOG_EVERY_S", 1.0)
        started = time.monotonic()
        with caplog.at_level("INFO", logger="engine.cpu.native_kernels"):
            assert not native_kernels.load("auto")
        assert 3.0 <= time.monotonic() - started < 10
    finally:
        holder.kill()
        holder.wait()
    assert f"pid {holder.pid}, a test holder" in caplog.text and "waiting" in caplog.text
    assert "gave up after 3 s" in native_kernels.reason() and "using PyTorch operations" in caplog.text
    assert not list(root.glob("*.so"))


@pytest.mark.slow
def test_every_path_to_the_same_sources_and_venv_shares_one_build(tmp_path):
    """The checkout and the venv reached through symlinks (another path to the same files, as a mounted or
    linked install is): each start loads the same build file without compiling, in either order, so no two paths
    take turns rebuilding."""
    assert native_kernels.load("auto"), native_kernels.reason()  # the build exists (as installed)
    built = Path(native_kernels.active().__file__)
    written = built.stat().st_mtime_ns  # a compile would write the file again
    checkout, venv = tmp_path / "checkout", tmp_path / "venv"
    checkout.symlink_to(ROOT, target_is_directory=True)
    venv.symlink_to(Path(sys.prefix), target_is_directory=True)
    probe = ("import logging, engine, torch; from engine.cpu import native_kernels as n; "
             "logging.basicConfig(level=logging.INFO); "
             "ok = n.load('auto'); print(ok, engine.__file__, torch.__file__, n.active().__file__ if ok else n.reason())")
    files = set()
    for python, path in ((sys.executable, ROOT), (venv / "bin" / "python", checkout), (sys.executable, ROOT)):
        env = {**os.environ, "PYTHONPATH": str(path)}
        result = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        ok, engine_file, torch_file, build_file = result.stdout.split()
        assert engine_file.startswith(str(path)) and torch_file.startswith(str(Path(python).parent.parent))
        assert ok == "True", result.stdout + result.stderr[-2000:]
        assert "loaded and checked" in result.stderr and "compiling" not in result.stderr, result.stderr[-2000:]
        files.add(Path(build_file).resolve())
    assert files == {built.resolve()}, files
    assert built.stat().st_mtime_ns == written, "the build file was written again"
