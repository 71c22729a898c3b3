"""The CPU decode kernels (engine/cpu/native/decode_kernels.cpp): they build on this machine, each equals the PyTorch
operations it replaces over shapes, dtypes, strides and windows, bad arguments are errors (not crashes), and the
engine serves the same tokens with them as without; a failed build or a differing kernel leaves the PyTorch path
serving."""
from __future__ import annotations


import threading
import time

import pytest
import torch
import torch.nn.functional as F

from engine import AsyncEngine, EngineConfig
from engine.cpu import native_kernels
from engine_helpers import greedy_tokens
from tiny_models import q4_1_weight



@pytest.fixture(scope="module")
def kernels():
    assert native_kernels.load("auto"), native_kernels.reason()
    return native_kernels.active()


@pytest.fixture(autouse=True)
def _restore_kernels():
    """Tests here switch the process-wide kernels; leave them as the engine's loads set them."""
    active, reason = native_kernels._active, native_kernels._reason
    yield
    native_kernels._active, native_kernels._reason = active, reason


def _close(expected, got, dtype):
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


DTYPES = [torch.float32, torch.bfloat16]


def test_the_kernels_build_and_pass_their_check_on_this_machine(kernels):
    assert native_kernels.reason() == ""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert native_kernels.self_check(kernels, dtype) == ""


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_gated_product_equal_pytorch(kernels, dtype):
    gen = torch.Generator().manual_seed(1)
    for rows, hidden in ((1, 576), (33, 64), (70, 100)):  # one thread and several, odd widths
        x = torch.randn(1, rows, hidden, generator=gen).to(dtype)
        delta = torch.randn(1, rows, hidden, generator=gen).to(dtype)
        w = torch.randn(hidden, generator=gen).to(dtype)
        norm = lambda v: F.rms_norm(v.float(), (hidden,), None, 1e-5).to(dtype) * w  # transformers' RMS norm
        _close(norm(x), kernels.rms_norm(x, w, 1e-5), dtype)
        summed = x + delta
        got = kernels.add_rms_norm_(delta, x, w, 1e-5)
        _close(summed, delta, dtype)  # delta became the residual stream
        _close(norm(summed), got, dtype)
        gate_up = torch.randn(1, rows, 2 * hidden, generator=gen).to(dtype)
        _close(F.silu(gate_up[..., :hidden]) * gate_up[..., hidden:], kernels.silu_mul(gate_up, hidden), dtype)


def test_the_gated_product_holds_over_the_whole_float_range(kernels):
    """silu uses the kernels' own vectorised exp: no overflow, NaN or lost precision at extreme gates."""
    gate = torch.cat([torch.linspace(-200, 200, 40001), torch.tensor([-1e30, -88.5, -87.5, 87.5, 88.5, 1e30])])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)])[None]
    expected = F.silu(gate.double()) * 3.0
    got = kernels.silu_mul(gate_up, gate.numel())[0].double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotate", [True, False])
def test_rotary_and_cache_write_equal_pytorch(kernels, dtype, rotate):
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim, blocks, block = 40, 6, 2, 16, 8, 16
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    cos, sin = torch.randn(tokens, dim, generator=gen).to(dtype), torch.randn(tokens, dim, generator=gen).to(dtype)
    slots = torch.randperm(blocks * block, generator=gen)[:tokens]
    k_pool = torch.zeros(blocks, block, kv_heads, dim, dtype=dtype)
    v_pool = torch.zeros(blocks, block, kv_heads, dim, dtype=dtype)
    qk, values = qkv[:, :heads + kv_heads].clone(), qkv[:, heads + kv_heads:].clone()
    if rotate:  # transformers' apply_rotary_pos_emb
        half = dim // 2
        qk = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin[:, None]
    kernels.rope_and_cache_(qkv, cos if rotate else None, sin if rotate else None, heads, kv_heads, k_pool, v_pool,
                            slots)
    _close(qk, qkv[:, :heads + kv_heads], dtype)
    _close(qk[:, heads:], k_pool.view(-1, kv_heads, dim)[slots], dtype)
    _close(values, v_pool.view(-1, kv_heads, dim)[slots], dtype)
    untouched = torch.ones(blocks * block, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool.view(-1, kv_heads, dim)[untouched].any() and not v_pool.view(-1, kv_heads, dim)[untouched].any()


def _reference_attention(query, k_pool, v_pool, blocks, lengths, window, scale):
    rows, width = lengths.numel(), blocks.numel() // lengths.numel()
    outs = []
    for row in range(rows):
        length = int(lengths[row])
        start = max(0, length - window) if window else 0
        table = blocks.view(rows, width)[row]
        keys = k_pool[table].reshape(-1, *k_pool.shape[2:])[start:length].transpose(0, 1).float()
        values = v_pool[table].reshape(-1, *v_pool.shape[2:])[start:length].transpose(0, 1).float()
        outs.append(F.scaled_dot_product_attention(query[row][:, None].float(), keys, values, scale=scale,
                                                   enable_gqa=True)[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("window", [0, 5, 40])
@pytest.mark.parametrize("dim", [16, 64, 128])  # 64 and 128 take the kernel's vector paths, 16 its plain loops
def test_decode_attention_over_the_blocks_equals_sdpa(kernels, dtype, heads, kv_heads, window, dim):
    """Rows of different lengths (within a block, across blocks, a padded table), strided query and output views
    of a step's packed tensors, grouped-query heads, with and without a sliding window."""
    gen = torch.Generator().manual_seed(heads * 10 + window + dim)
    block, pool_blocks, width = 16, 20, 4
    k_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    lengths = torch.tensor([1, 16, 17, 64, 33])
    rows = lengths.numel()
    blocks = torch.randperm(pool_blocks, generator=gen)[:rows * width]
    blocks.view(rows, width)[0, 1:] = blocks[0]  # padding repeats a valid block, as the runner's tables do
    packed = torch.randn(rows + 3, heads + 2 * kv_heads, dim, generator=gen).to(dtype)  # a step's qkv rows
    query = packed[2:2 + rows, :heads]  # a strided view, as the attention function passes it
    out_buffer = torch.zeros(1, rows + 3, heads, dim, dtype=dtype)
    out = out_buffer[0, 1:1 + rows]
    kernels.paged_decode_attention(query, k_pool, v_pool, blocks, lengths, window, 0.25, out)
    _close(_reference_attention(query, k_pool, v_pool, blocks, lengths, window, 0.25), out, dtype)
    assert not out_buffer[0, 0].any() and not out_buffer[0, rows + 1:].any()  # nothing written outside the view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(15, 5), (6, 3), (7, 7)])
@pytest.mark.parametrize("rows, window", [(1, 0), (2, 0), (1, 20)])
def test_few_rows_split_their_key_heads_between_tasks(kernels, dtype, heads, kv_heads, rows, window):
    """With too few rows to keep the threads busy a task takes a span of a row's key heads, uneven where the
    spans do not divide them (5 key heads in 4 spans); every head must still attend as SDPA does."""
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + rows + window)
    dim, block, width = 64, 16, 4
    k_pool = torch.randn(rows * width + 3, block, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(rows * width + 3, block, kv_heads, dim, generator=gen).to(dtype)
    lengths = torch.tensor([50, 37][:rows])
    blocks = torch.randperm(rows * width + 3, generator=gen)[:rows * width]
    query = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    out = torch.empty(rows, heads, dim, dtype=dtype)
    kernels.paged_decode_attention(query, k_pool, v_pool, blocks, lengths, window, 0.125, out)
    _close(_reference_attention(query, k_pool, v_pool, blocks, lengths, window, 0.125), out, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, window", [(1, 0), (2, 0), (1, 700), (2, 300), (3, 1500)])
def test_long_rows_split_across_threads_equal_sdpa(kernels, dtype, rows, window):
    """Few rows over long contexts split each row's keys into parts whose softmax terms merge afterwards; the
    merge must give the one softmax over all keys, windows included, whatever the split points."""
    gen = torch.Generator().manual_seed(rows * 7 + window)
    heads, kv_heads, dim, block, width = 6, 2, 64, 16, 130
    k_pool = torch.randn(rows * width + 5, block, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(rows * width + 5, block, kv_heads, dim, generator=gen).to(dtype)
    k_pool[3, 5, 0] = 4.0  # a key far ahead of the rest, so the parts' largest scores differ
    lengths = torch.tensor([2077, 1025, 513][:rows])
    blocks = torch.randperm(rows * width + 5, generator=gen)[:rows * width]
    query = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    out = torch.empty(rows, heads, dim, dtype=dtype)
    kernels.paged_decode_attention(query, k_pool, v_pool, blocks, lengths, window, 0.125, out)
    _close(_reference_attention(query, k_pool, v_pool, blocks, lengths, window, 0.125), out, dtype)


def _reference_prefill(query, k_pool, v_pool, blocks, start, window, scale):
    """SDPA over the sequence's gathered keys with the causal (and windowed) mask of a chunk at `start`."""
    end = start + query.shape[0]
    keys = k_pool[blocks].reshape(-1, *k_pool.shape[2:])[:end].transpose(0, 1)[None]
    values = v_pool[blocks].reshape(-1, *v_pool.shape[2:])[:end].transpose(0, 1)[None]
    positions = torch.arange(end)
    mask = positions[None] <= positions[start:, None]
    if window:
        mask &= positions[None] > positions[start:, None] - window
    return F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 64), (8, 1, 64), (14, 2, 128), (6, 6, 128)])
@pytest.mark.parametrize("tokens, start, window", [(1, 0, 0), (64, 0, 0), (70, 0, 0), (33, 100, 0), (200, 37, 0),
                                                   (90, 0, 17), (80, 150, 64), (40, 9, 1), (130, 500, 0)])
def test_prefill_attention_over_the_blocks_equals_sdpa(kernels, heads, kv_heads, dim, tokens, start, window):
    """A prompt chunk from position 0 or continuing its sequence, a whole or partial last tile of 16 tokens,
    windows narrower than a tile and wider, grouped-query heads, blocks in any order, and the strided query and
    output views of a step's packed tensors."""
    if not kernels.prefill_attention_supported():
        pytest.skip("this build has no AVX-512")
    gen = torch.Generator().manual_seed(heads + tokens + start + window + dim)
    block = 16
    pool_blocks = (start + tokens) // block + 4
    k_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen)
    v_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen)
    k_pool[0, 3] *= 8  # a few keys far ahead of the rest, so the running maximum moves between tiles
    blocks = torch.randperm(pool_blocks, generator=gen)[:(start + tokens + block - 1) // block]
    packed = torch.randn(tokens + 3, heads + 2 * kv_heads, dim, generator=gen) * 2
    query = packed[2:2 + tokens, :heads]
    out_buffer = torch.zeros(tokens + 3, heads + 2, dim)
    out = out_buffer[1:1 + tokens, 1:1 + heads]
    kernels.paged_prefill_attention(query, k_pool, v_pool, blocks, start, window, dim ** -0.5, out)
    _close(_reference_prefill(query, k_pool, v_pool, blocks, start, window, dim ** -0.5), out, torch.float32)
    untouched = torch.ones_like(out_buffer, dtype=torch.bool)
    untouched[1:1 + tokens, 1:1 + heads] = False
    assert not out_buffer[untouched].any()  # nothing written outside the view


@pytest.mark.parametrize("bf16_products", [True, False])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (15, 5, 64), (14, 2, 128)])
@pytest.mark.parametrize("tokens, start, window", [(64, 0, 0), (70, 0, 0), (33, 100, 0), (80, 151, 64), (130, 500, 0)])
def test_a_bfloat16_models_prompt_chunk_equals_sdpa(kernels, heads, kv_heads, dim, tokens, start, window,
                                                    bf16_products):
    """A bfloat16 model's chunk (its queries bfloat16 values widened, its cache bfloat16) multiplies in bfloat16
    where the CPU has AVX512_BF16 (odd numbers of keys pair the last one with a zero weight): equal to SDPA over the
    same values within bfloat16's rounding, as the model's own bfloat16 attention is. With `bf16_products` off (CPUs
    where VDPBF16PS is slower than float32 FMAs) it multiplies the widened values in float32: equal within float32's
    rounding."""
    if not kernels.prefill_attention_supported():
        pytest.skip("this build has no AVX-512")
    gen = torch.Generator().manual_seed(heads + tokens + start + window + dim)
    block = 16
    pool_blocks = (start + tokens) // block + 4
    k_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen).bfloat16()
    v_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen).bfloat16()
    k_pool[0, 3] *= 8  # a few keys far ahead of the rest, so the running maximum moves between tiles
    blocks = torch.randperm(pool_blocks, generator=gen)[:(start + tokens + block - 1) // block]
    packed = (torch.randn(tokens + 3, heads + 2 * kv_heads, dim, generator=gen) * 2).bfloat16().float()
    query = packed[2:2 + tokens, :heads]
    out = torch.empty(tokens, heads, dim)
    kernels.paged_prefill_attention(query, k_pool, v_pool, blocks, start, window, dim ** -0.5, out, bf16_products)
    expected = _reference_prefill(query, k_pool.float(), v_pool.float(), blocks, start, window, dim ** -0.5)
    _close(expected, out, torch.bfloat16 if bf16_products else torch.float32)


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_attention_reads_16_bit_pools_under_float32_queries(kernels, pool_dtype, dim):
    """KV_CACHE_DTYPE: float32 queries against float16 or bfloat16 keys and values, decode rows and a continued
    prompt chunk, equal SDPA over the same (widened) keys and values."""
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, block, pool_blocks, width = 9, 3, 16, 24, 6
    k_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen).to(pool_dtype)
    v_pool = torch.randn(pool_blocks, block, kv_heads, dim, generator=gen).to(pool_dtype)
    lengths = torch.tensor([1, 40, 96])
    blocks = torch.randperm(pool_blocks, generator=gen)[:3 * width]
    query = torch.randn(3, heads, dim, generator=gen)
    out = torch.empty(3, heads, dim)
    for window in (0, 20):
        kernels.paged_decode_attention(query, k_pool, v_pool, blocks, lengths, window, 0.25, out)
        _close(_reference_attention(query, k_pool, v_pool, blocks, lengths, window, 0.25), out, torch.float32)
    if dim in (64, 128) and kernels.prefill_attention_supported():
        chunk = torch.randn(70, heads, dim, generator=gen)
        got = torch.empty(70, heads, dim)
        kernels.paged_prefill_attention(chunk, k_pool, v_pool, blocks[:width], 26, 0, 0.25, got)
        expected = _reference_prefill(chunk, k_pool.float(), v_pool.float(), blocks[:width], 26, 0, 0.25)
        _close(expected, got, torch.float32)


def test_the_cache_write_rounds_to_a_float16_pool_and_saturates(kernels):
    """Float32 keys and values to a float16 cache: rounded, and past +-65504 held at it instead of infinity."""
    heads, kv_heads, dim = 2, 1, 16
    qkv = torch.randn(3, heads + 2 * kv_heads, dim)
    qkv[0, heads, :3] = torch.tensor([1e6, -1e6, 70000.0])
    keys, values = qkv[:, heads].clone(), qkv[:, heads + 1].clone()
    k_pool, v_pool = torch.zeros(2, 4, kv_heads, dim, dtype=torch.float16), torch.zeros(2, 4, kv_heads, dim,
                                                                                      dtype=torch.float16)
    slots = torch.tensor([6, 1, 3])
    kernels.rope_and_cache_(qkv, None, None, heads, kv_heads, k_pool, v_pool, slots)
    stored = k_pool.view(-1, dim)[slots]
    assert torch.isfinite(stored).all()
    assert stored[0, :3].tolist() == [65504.0, -65504.0, 65504.0]
    assert torch.equal(stored[:, 3:], keys[:, 3:].half()) and torch.equal(stored[1:], keys[1:].half())
    assert torch.equal(v_pool.view(-1, dim)[slots], values.half())


def test_prefill_attention_refuses_what_it_does_not_cover(kernels):
    if not kernels.prefill_attention_supported():
        pytest.skip("this build has no AVX-512")
    k_pool, v_pool = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    query, out = torch.zeros(20, 4, 64), torch.zeros(20, 4, 64)
    with pytest.raises(RuntimeError, match="covering the sequence"):
        kernels.paged_prefill_attention(query, k_pool, v_pool, torch.tensor([0, 1]), 20, 0, 1.0, out)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_prefill_attention(query, k_pool, v_pool, torch.tensor([0, 7]), 0, 0, 1.0, out)
    with pytest.raises(RuntimeError, match="head size 64 or 128"):
        kernels.paged_prefill_attention(query[..., :32], k_pool[..., :32].contiguous(), v_pool[..., :32].contiguous(),
                                        torch.tensor([0, 1]), 0, 0, 1.0, out[..., :32])
    with pytest.raises(RuntimeError, match="float32"):
        kernels.paged_prefill_attention(query.bfloat16(), k_pool, v_pool, torch.tensor([0, 1]), 0, 0, 1.0, out)
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        kernels.paged_prefill_attention(query, k_pool.double(), v_pool.double(), torch.tensor([0, 1]), 0, 0, 1.0, out)


def _longest_wait_beside(call) -> tuple[float, float]:
    """Run `call` on another thread until it has taken 0.6 s; meanwhile this thread sleeps 1 ms at a time.
    Returns (the longest one of those sleeps took to come back, the shortest call)."""
    calls, done = [], threading.Event()

    def work():
        while sum(calls) < 0.6:
            started = time.perf_counter()
            call()
            calls.append(time.perf_counter() - started)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    longest = 0.0
    while not done.is_set():
        started = time.perf_counter()
        time.sleep(0.001)
        longest = max(longest, time.perf_counter() - started)
    worker.join()
    return longest, min(calls)


@pytest.mark.parametrize("product", ["bf16_linear", "blocks_linear", "prefill_attention"])
def test_a_long_kernel_call_lets_other_threads_run(kernels, product):
    """The server's event loop runs beside the engine's thread: a kernel that kept the GIL while it computes
    (a prompt chunk's product: a second on a 7B model) would stall every stream, /health and the platform's
    heartbeat until it returns."""
    if product == "bf16_linear":
        if not kernels.bf16_linear_supported():
            pytest.skip("the bfloat16 product needs AVX512_BF16")
        weight, x = torch.randn(4096, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
        packed = kernels.bf16_pack(weight)
        call = lambda: kernels.bf16_linear(x, packed, 4096, None, True)  # noqa: E731
    elif product == "blocks_linear":
        block_format, packed = kernels.pack_blocks(q4_1_weight(4096, 2048), True)
        x = torch.randn(2048, 2048)
        call = lambda: kernels.blocks_linear(x, packed, block_format, 4096)  # noqa: E731
    else:
        if not kernels.prefill_attention_supported():
            pytest.skip("the prefill kernel needs AVX-512")
        tokens, start, blocks = 1024, 3072, torch.arange(256)  # a chunk of 1024 after 3072 cached, 16 a block
        k_pool, v_pool = torch.randn(256, 16, 4, 64), torch.randn(256, 16, 4, 64)
        query, out = torch.randn(tokens, 16, 64), torch.zeros(tokens, 16, 64)
        call = lambda: kernels.paged_prefill_attention(query, k_pool, v_pool, blocks, start, 0, 0.125, out)  # noqa: E731
    longest, shortest = _longest_wait_beside(call)
    assert shortest > 0.03, f"a call of {shortest * 1e3:.0f} ms is too short to tell"
    assert longest < shortest / 2, f"a 1 ms sleep took {longest * 1e3:.0f} ms beside calls of {shortest * 1e3:.0f} ms"


def test_bad_arguments_are_errors_not_crashes(kernels):
    k_pool, v_pool = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    query, out = torch.zeros(2, 4, 8), torch.zeros(2, 4, 8)
    blocks, lengths = torch.tensor([0, 1, 2, 3]), torch.tensor([5, 20])
    with pytest.raises(RuntimeError, match="length exceeds its blocks"):
        kernels.paged_decode_attention(query, k_pool, v_pool, blocks, torch.tensor([5, 33]), 0, 1.0, out)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_decode_attention(query, k_pool, v_pool, torch.tensor([0, 1, 2, 9]), lengths, 0, 1.0, out)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.paged_decode_attention(query.double(), k_pool, v_pool, blocks, lengths, 0, 1.0, out)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.rope_and_cache_(torch.zeros(2, 4 + 4, 8), None, None, 4, 2, k_pool, v_pool, torch.tensor([0, 64]))
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-5)


class _Wrong:
    """The kernels with one of them computing something else."""

    def __init__(self, kernels, name):
        self.kernels, self.name = kernels, name

    def __getattr__(self, name):
        real = getattr(self.kernels, name)
        if name != self.name:
            return real

        def off_by_a_little(*args):
            out = real(*args)
            if out is not None:
                return out + 0.01
            # the in-place kernels; attention writes its out, its last tensor argument
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors[-1 if "attention" in name else 0].add_(0.01)
        return off_by_a_little


@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm_", "silu_mul", "rope_and_cache_",
                                  "paged_decode_attention", "paged_prefill_attention"])
def test_the_check_catches_a_kernel_that_differs(kernels, name):
    if name == "paged_prefill_attention" and not kernels.prefill_attention_supported():
        pytest.skip("the prefill kernel needs AVX-512 (the check skips what the build lacks)")
    assert native_kernels.self_check(_Wrong(kernels, name)) == name


def test_a_kernel_that_differs_is_not_used(kernels, monkeypatch, caplog):
    monkeypatch.setattr(native_kernels, "build", lambda *args: _Wrong(kernels, "silu_mul"))
    with caplog.at_level("WARNING", logger="engine.cpu.native_kernels"):
        assert not native_kernels.load("auto")
    assert native_kernels.active() is None
    assert native_kernels.reason() == "silu_mul differs from PyTorch on this machine"
    assert "using PyTorch operations" in caplog.text


def test_a_failed_build_keeps_pytorch_and_says_why(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "decode_kernels.cpp"
    broken.write_text("int broken( {\n")
    # The broken file alone (its own build name: the name hashes the sources): with the real ones beside it,
    # the compiler would finish them before reporting the error, minutes of work that fail all the same.
    monkeypatch.setattr(native_kernels, "sources", lambda: (broken,))
    monkeypatch.setenv("NATIVE_KERNELS_DIR", str(tmp_path / "build"))
    with caplog.at_level("WARNING", logger="engine.cpu.native_kernels"):
        assert not native_kernels.load("auto")
    assert native_kernels.active() is None
    assert native_kernels.reason().startswith("not built:") and "error" in native_kernels.reason()
    assert "using PyTorch operations" in caplog.text


class _Counting:
    """The kernels, counting the calls of one of them."""

    def __init__(self, kernels, name):
        self.kernels, self.name, self.calls = kernels, name, 0

    def __getattr__(self, name):
        real = getattr(self.kernels, name)
        if name != self.name:
            return real

        def counted(*args):
            self.calls += 1
            return real(*args)
        return counted


@pytest.mark.slow
def test_the_embedded_model_serves_the_same_tokens_with_and_without_the_kernels(caplog, monkeypatch):
    """Batched decode rows of different lengths (several attention buckets) and a prompt chunked into a decode
    step: greedy tokens through the kernels equal those through PyTorch's operations (NATIVE_KERNELS=off). The
    embedded model is Q4_1 layers and a Q8_0 head, so `auto` also multiplies every linear layer from its GGUF
    blocks (engine/cpu/quantized_weights.py) where `off` keeps float32 products; with DTYPE=auto the blocks take
    16-bit integer activations where the CPU has AVX512_VNNI and keeps a float16 KV cache, and the tokens stay the
    same (docs/performance.md: the measured agreement on chat prompts). Prompt chunks attend through the native
    prefill kernel."""
    from engine.executor import attention

    prompts = [[(7 * i + 3 * j) % 5000 + 100 for j in range(n)] for i, n in enumerate((3, 40, 90, 300))]
    results, logs, prefills = {}, {}, {}
    # Counts the prompt chunks that attend through the prefill kernel: from 16 tokens here (64 in service), as the
    # 64-token step budget leaves the chunks beside decode rows shorter than 64.
    monkeypatch.setattr(attention, "NATIVE_PREFILL_MIN_TOKENS", 16)
    counting = _Counting(None, "paged_prefill_attention")
    monkeypatch.setattr(native_kernels, "active", lambda: None if native_kernels._active is None else (
        setattr(counting, "kernels", native_kernels._active) or counting))
    for mode, dtype in (("off", "float32"), ("auto", "float32"), ("words", "auto")):
        counting.calls = 0
        engine = AsyncEngine(EngineConfig(dtype=dtype, native_kernels="off" if mode == "off" else "auto",
                                          max_num_batched_tokens=64, kv_cache_memory=64 * 2**20, max_model_len=1024,
                                          max_num_seqs=8))
        try:
            caplog.clear()
            with caplog.at_level("INFO"):
                results[mode] = greedy_tokens(engine, prompts)
            logs[mode] = caplog.text
            prefills[mode] = counting.calls
        finally:
            engine.close()
    assert "through the native CPU kernels" in logs["auto"] and "through the native CPU kernels" in logs["words"]
    assert "through the native CPU kernels" not in logs["off"]
    assert "120 Q4_1, 1 Q8_0" in logs["auto"] and "GGUF blocks" not in logs["off"]
    assert "with float32 activations" in logs["auto"]
    words = native_kernels.active() is not None and native_kernels.active().word_blocks_supported()
    assert ("with 16-bit integer activations" in logs["words"]) == words
    assert results["auto"] == results["off"]
    assert results["words"] == results["off"]
    assert prefills["off"] == 0
    if native_kernels._active.prefill_attention_supported():
        assert prefills["auto"] > 0 and prefills["words"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prompt_chunks_of_a_16_bit_model_attend_through_the_prefill_kernel(tmp_path, tokenizer_folder, monkeypatch,
                                                                           dtype):
    """A bfloat16 model's prompt chunks (one from position 0, one continuing its sequence) take the prefill kernel
    with widened queries, as float32 ones do, and give the logits SDPA gives in the model's type (bfloat16: within
    its rounding; the kernel accumulates in float32)."""
    from engine import loader
    from engine.executor import attention
    from engine.executor.runner import ModelRunner
    from engine.executor.step import PrefillChunk
    from tiny_models import build_model

    if not (native_kernels.load("auto", dtype) and native_kernels.active().prefill_attention_supported()):
        pytest.skip("the prefill kernel needs the native kernels and AVX-512")
    build_model("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
                tmp_path, tokenizer_folder)
    loaded = loader.load(EngineConfig(model=str(tmp_path), dtype=str(dtype).removeprefix("torch.")))
    counting = _Counting(native_kernels.active(), "paged_prefill_attention")
    monkeypatch.setattr(native_kernels, "active", lambda: counting)
    runner = ModelRunner(loaded.model, loaded.device, loaded.dtype, kv_budget_bytes=16 * 2**20)
    ids = [(37 * i) % 900 + 50 for i in range(150)]
    blocks = list(range(20, 30))

    def chunks():
        return [runner.execute([], [PrefillChunk(ids[:80], 0, blocks, "all")]),
                runner.execute([], [PrefillChunk(ids[80:], 80, blocks, "all")])]

    counting.calls = 0
    through_kernel = chunks()
    assert counting.calls == 2 * loaded.model.config.num_hidden_layers
    monkeypatch.setattr(attention, "NATIVE_PREFILL_MIN_TOKENS", 10**6)
    through_sdpa = chunks()
    assert counting.calls == 2 * loaded.model.config.num_hidden_layers
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for got, expected in zip(through_kernel, through_sdpa):
        assert got.dtype == dtype
        scale = expected.float().abs().max()
        assert (got.float() - expected.float()).abs().max() <= tolerance * scale
