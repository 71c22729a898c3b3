"""The products by bfloat16 weights (engine/cpu/native/bf16_linear.cpp, engine/cpu/bf16_weights.py): bfloat16 rows
with AVX512_BF16, and float32 rows on every x86-64 build. Each multiplies by exactly the weights' values with
float32 sums for any number of rows and any shape (bias, odd sizes, partial panels), a row's result does not
depend on its batch, float32 rows give the same bits on every build, bad arguments are errors, and a model serves
the same greedy tokens through it as through the layout's products."""
from __future__ import annotations

import pytest
import torch

from engine import AsyncEngine, EngineConfig
from engine.cpu import bf16_weights, native_kernels, weight_release
from engine_helpers import greedy_tokens
from tiny_models import build_model


@pytest.fixture(scope="module")
def kernels():
    assert native_kernels.load("auto", torch.bfloat16), native_kernels.reason()
    kernels = native_kernels.active()
    if not kernels.bf16_linear_supported():
        pytest.skip("the bfloat16 product needs AVX-512 with AVX512_BF16")
    return kernels


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


# (outputs, inputs): a single block, partial blocks and panels (17, 70, 100), odd inputs (7, 129), one input
@pytest.mark.parametrize("out_features, in_features", [(16, 64), (17, 7), (70, 129), (100, 1), (200, 960)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("widen", [False, True])  # VDPBF16PS, or float32 FMAs on the widened weights
def test_the_product_is_float32_sums_of_the_bfloat16_values(kernels, out_features, in_features, with_bias, widen):
    weight = _bf16(out_features, in_features, seed=1)
    bias = _bf16(out_features, seed=2).float() if with_bias else None
    packed = kernels.bf16_pack(weight)
    for rows in (*range(1, 34), 200, 301):  # from 187 rows float32 FMAs widen each panel once for all rows
        x = _bf16(rows, in_features, seed=rows)
        exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
        got = kernels.bf16_linear(x, packed, out_features, bias, widen)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # Rounded once to bfloat16 (half a unit in its last place: 2^-9 of the value, 2^-8 bounds it) from float32
        # sums, whose error is bounded by a few float32 units of the sum of |x| |w|.
        reach = x.double().abs() @ weight.double().abs().t() + (0 if bias is None else bias.double().abs())
        bound = exact.abs() * 2.0**-8 + reach * 1e-6 * in_features ** 0.5 + 1e-30
        assert bool(((got.double() - exact).abs() <= bound).all()), rows


@pytest.mark.parametrize("widen", [False, True])
def test_unit_rows_give_back_the_weights_and_rows_do_not_depend_on_their_batch(kernels, widen):
    weight = _bf16(75, 33, seed=3)
    packed = kernels.bf16_pack(weight)
    units = torch.eye(33, dtype=torch.bfloat16)
    assert torch.equal(kernels.bf16_linear(units, packed, 75, None, widen), weight.t())
    # Transposed (column-major) weights pack to the same layout.
    assert torch.equal(kernels.bf16_pack(weight.t().contiguous().t()), packed)
    x = _bf16(300, 33, seed=4)  # a prompt chunk's size: float32 FMAs take the panels widened once
    batched = kernels.bf16_linear(x, packed, 75, None, widen)
    for rows in (slice(0, 1), slice(3, 5), slice(7, 20), slice(39, 40), slice(0, 40), slice(100, 290)):
        assert torch.equal(kernels.bf16_linear(x[rows].contiguous(), packed, 75, None, widen), batched[rows])


def test_bad_arguments_are_errors_not_crashes(kernels):
    weight = _bf16(32, 64, seed=5)
    packed = kernels.bf16_pack(weight)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        kernels.bf16_linear(torch.randn(2, 64).half(), packed, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.bf16_linear(_bf16(2, 66, seed=6), packed, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        kernels.bf16_linear(_bf16(2, 64, seed=6), packed, 48)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.bf16_linear(_bf16(2, 64, seed=6), packed, 32, torch.zeros(31))
    with pytest.raises(RuntimeError, match="bfloat16 CPU weight"):
        kernels.bf16_pack(torch.randn(32, 64))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: biased q/k/v projections, fused with their biases
def test_a_bfloat16_model_serves_the_same_tokens_through_the_product(kernels, tmp_path, tokenizer_folder,
                                                                    monkeypatch, caplog, family):
    """Greedy tokens of batched rows (prompt chunks and decode steps together) through the kernel equal those
    through the layout's products (the kernel left out), which round the same float32 sums once to bfloat16 in
    another order. The probe's timing is not what is tested: the kernel is made to win it."""
    build_model(family, dict(hidden_size=128, intermediate_size=200, head_dim=32, tie_word_embeddings=False),
                tmp_path, tokenizer_folder)
    prompts = [[(7 * i + 3 * j) % 900 + 100 for j in range(n)] for i, n in enumerate((3, 17, 40))]
    calls = []
    real = kernels.bf16_linear
    counting = type("Counting", (), {"__getattr__": lambda self, name: getattr(kernels, name),
                                     "bf16_linear": lambda self, *a: calls.append(1) or real(*a)})()
    monkeypatch.setattr(native_kernels, "active", lambda: counting)
    monkeypatch.setattr(bf16_weights, "_GAIN_NEEDED", 0.0)
    monkeypatch.setattr(bf16_weights, "_LOSS_ALLOWED", 0.0)
    results = {}
    for mode in ("kernel", "layout"):
        if mode == "layout":
            monkeypatch.setattr(bf16_weights, "apply", lambda *a, **k: 0)
        engine = AsyncEngine(EngineConfig(model=str(tmp_path), dtype="bfloat16", max_num_batched_tokens=32,
                                          kv_cache_memory=16 * 2**20, max_model_len=256, max_num_seqs=4))
        try:
            caplog.clear()
            with caplog.at_level("INFO"):
                calls.clear()
                results[mode] = greedy_tokens(engine, prompts)
            if mode == "kernel":
                assert "multiply through the AVX512_BF16 product at every batch size" in caplog.text
                assert calls, "the kernel never ran"
            else:
                assert not calls
        finally:
            engine.close()
    assert results["kernel"] == results["layout"]


def _runnable_builds():
    """Every x86-64 build this CPU runs, lowest first."""
    found = [v for v in reversed(native_kernels.variants()) if v.needs <= native_kernels.cpu_features()]
    return [pytest.param(v, id=v.name) for v in found if v is not native_kernels.GENERIC]


@pytest.fixture(scope="module")
def float_products():
    """The float32-rows product of each build this CPU runs, by name."""
    builds = {v.id: native_kernels.build(v.values[0]) for v in _runnable_builds()}
    if not builds:
        pytest.skip("the float32-rows product is in the x86-64 builds")
    for name, kernels in builds.items():
        assert kernels.bf16_weights_supported(), name
    return builds


@pytest.mark.parametrize("out_features, in_features", [(16, 64), (17, 7), (70, 129), (100, 1), (200, 960)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_rows_by_bfloat16_weights_are_float32_sums_the_same_on_every_build(float_products, out_features,
                                                                                  in_features, with_bias):
    """Float32 rows by bfloat16 weights (a bfloat16 checkpoint loaded as float32, on a CPU without bfloat16
    products): the float32 product of the same values, within float32 summation error, from every build to the
    bit (each sums in input order with FMAs), tiles widening in registers and panels widened once alike."""
    weight = _bf16(out_features, in_features, seed=1)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2)) if with_bias else None
    for rows in (*range(1, 20), 33, 47, 48, 100, 301):  # from 48 (AVX2) or 96 rows (AVX-512) panels widen once
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        exact = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
        reach = x.double().abs() @ weight.double().abs().t() + (0 if bias is None else bias.double().abs())
        outputs = {}
        for name, kernels in float_products.items():
            got = kernels.bf16_linear(x, kernels.bf16_pack(weight), out_features, bias)
            assert got.dtype == torch.float32 and got.shape == (rows, out_features)
            assert bool(((got.double() - exact).abs() <= reach * 2.0**-22 * in_features ** 0.5 + 1e-30).all()), \
                (name, rows)
            outputs[name] = got
        first = next(iter(outputs.values()))
        assert all(torch.equal(first, got) for got in outputs.values()), (rows, list(outputs))


def test_float32_rows_do_not_depend_on_their_batch(float_products):
    weight = _bf16(75, 33, seed=3)
    for name, kernels in float_products.items():
        packed = kernels.bf16_pack(weight)
        assert torch.equal(kernels.bf16_linear(torch.eye(33), packed, 75, None), weight.t().float()), name
        x = torch.randn(300, 33, generator=torch.Generator().manual_seed(4))
        batched = kernels.bf16_linear(x, packed, 75, None)
        for rows in (slice(0, 1), slice(3, 5), slice(7, 20), slice(39, 40), slice(0, 47), slice(100, 290)):
            assert torch.equal(kernels.bf16_linear(x[rows].contiguous(), packed, 75, None), batched[rows]), name


def test_only_float32_weights_of_bfloat16_values_take_the_product():
    exact = torch.randn(64, 32).bfloat16().float()
    assert bf16_weights.bfloat16_values(exact)
    assert bf16_weights.bfloat16_values(exact.t())  # column-major weights too
    off = exact.clone()
    off[5, 7] = torch.nextafter(off[5, 7], torch.tensor(float("inf")))  # one float32 step from a bfloat16 value
    assert not bf16_weights.bfloat16_values(off)


def test_a_start_reads_each_weight_once_to_find_bfloat16_values(monkeypatch):
    """A start asks which layers hold bfloat16 values twice (what will be served, then apply): each weight is read
    once, and read again once it changes."""
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(layer.weight.bfloat16().float())
    reads = []
    scan = bf16_weights._all_bfloat16
    monkeypatch.setattr(bf16_weights, "_all_bfloat16", lambda w: reads.append(w) or scan(w))
    for _ in range(2):
        assert bf16_weights._candidates(model, torch.float32) == list(model)
    assert len(reads) == 3
    with torch.no_grad():
        model[1].weight.add_(1e-3)  # no longer bfloat16 values
    # The first is still known, the second read again; one that is not bfloat16 values ends the question.
    assert bf16_weights._candidates(model, torch.float32) == [] and len(reads) == 4


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bfloat16", "float32"])
def test_a_bfloat16_checkpoint_served_as_float32_reads_its_weights_as_bfloat16(tmp_path, tokenizer_folder,
                                                                              monkeypatch, caplog, weights):
    """DTYPE=float32 (what DTYPE=auto takes on a CPU without native bfloat16 products) with the avx2 build: a
    bfloat16 checkpoint's layers multiply float32 rows by their bfloat16 values through the kernel, with the same
    greedy tokens as the layout's float32 products; a float32 checkpoint (values that are not bfloat16 ones)
    keeps the layout's products. The probe's timing is not what is tested: the kernel is made to win it."""
    model = build_model("llama", dict(hidden_size=128, intermediate_size=200, head_dim=32,
                                      tie_word_embeddings=False), tmp_path, tokenizer_folder)
    if weights == "bfloat16":
        model.to(torch.bfloat16).save_pretrained(tmp_path)
    prompts = [[(7 * i + 3 * j) % 900 + 100 for j in range(n)] for i, n in enumerate((3, 17, 40))]
    monkeypatch.setattr(bf16_weights, "_GAIN_NEEDED", 0.0)
    monkeypatch.setattr(bf16_weights, "_LOSS_ALLOWED", 0.0)
    results = {}
    for mode in ("kernel", "layout"):
        if mode == "layout":
            monkeypatch.setattr(bf16_weights, "apply", lambda *a, **k: 0)
        engine = AsyncEngine(EngineConfig(model=str(tmp_path), dtype="float32", native_kernels="avx2",
                                          max_num_batched_tokens=32, kv_cache_memory=16 * 2**20, max_model_len=256,
                                          max_num_seqs=4))
        try:
            caplog.clear()
            with caplog.at_level("INFO"):
                results[mode] = greedy_tokens(engine, prompts)
            served = "multiply through the product of float32 rows by bfloat16 weights at every batch size"
            assert (served in caplog.text) == (mode == "kernel" and weights == "bfloat16"), caplog.text[-3000:]
        finally:
            engine.close()
    assert results["kernel"] == results["layout"]


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_a_bfloat16_checkpoint_keeps_one_copy_of_its_weights(tmp_path, tokenizer_folder, monkeypatch, tied):
    """Served through the kernel, a bfloat16 checkpoint's linear layers hold only the kernel's packing: the weights
    as loaded (float32 here, twice the file's bytes) are released, fused projections' parts with them, so the
    model's tensors take about the file's bytes. Reading a layer's `weight` still gives the checkpoint's values;
    an embedding tied to the output head looks its rows up in the head's packing, an untied one keeps its table
    as bfloat16."""
    from safetensors.torch import load_file

    from engine import loader
    model = build_model("llama", dict(hidden_size=128, intermediate_size=200, head_dim=32,
                                      tie_word_embeddings=tied), tmp_path, tokenizer_folder)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    file_bytes = sum(t.numel() * t.element_size() for t in saved.values())
    monkeypatch.setattr(bf16_weights, "_GAIN_NEEDED", 0.0)
    monkeypatch.setattr(bf16_weights, "_LOSS_ALLOWED", 0.0)
    loaded = loader.load(EngineConfig(model=str(tmp_path), dtype="float32", native_kernels="avx2",
                                      max_model_len=256))
    served = loaded.model
    storages = {}
    for module in served.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False),
                   *(t for t in vars(module).values() if isinstance(t, torch.Tensor))]
        for t in tensors:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) <= 1.15 * file_bytes, (sum(storages.values()), file_bytes)
    layer = served.model.layers[1]
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"):
        weight = layer.get_submodule(name).weight
        assert weight.dtype == torch.float32
        assert torch.equal(weight, saved[f"model.layers.1.{name}.weight"].float()), name
    head = served.get_output_embeddings()
    assert "weight" not in head._parameters
    assert torch.equal(head.weight, saved["model.embed_tokens.weight" if tied else "lm_head.weight"].float())
    table = saved["model.embed_tokens.weight"].float()
    ids = torch.tensor([[0, 5, 63, 64, 1000], [49151, 49100, 17, 16, 15]])
    assert torch.equal(served.model.embed_tokens(ids), table[ids])
    assert "weight" not in served.model.embed_tokens._parameters


def test_the_packing_reads_back_as_the_weight_and_its_rows(float_products):
    """What a released layer's `weight` and a tied embedding's lookups read: the packed weight's values, in whole
    panels and partial ones, odd inputs included."""
    for kernels in float_products.values():
        for out_features, in_features in [(16, 64), (17, 7), (70, 129), (200, 960), (100, 1), (260, 33)]:
            weight = _bf16(out_features, in_features, seed=9)
            packed = kernels.bf16_pack(weight)
            assert torch.equal(bf16_weights.unpack(packed, out_features, in_features), weight)
            ids = torch.tensor([[0, out_features - 1, 3], [out_features // 2, 15 % out_features, 1]])
            assert torch.equal(bf16_weights.packed_rows(packed, ids, out_features, in_features), weight[ids])


@pytest.mark.slow
def test_a_start_that_knows_the_verdict_packs_and_releases_one_layer_at_a_time(tmp_path, tokenizer_folder,
                                                                              monkeypatch):
    """A first start packs every layer to check and time the kernel, then releases the weights as loaded; a start
    that finds that verdict packs a layer and releases its weight before it packs the next, so the loaded weights
    and the kernel's copy are never both held whole (the load's peak memory)."""
    from engine import loader
    build_model("llama", dict(hidden_size=128, intermediate_size=200, head_dim=32, tie_word_embeddings=True),
                tmp_path / "model", tokenizer_folder).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    monkeypatch.setattr(bf16_weights, "_GAIN_NEEDED", 0.0)
    monkeypatch.setattr(bf16_weights, "_LOSS_ALLOWED", 0.0)
    assert native_kernels.load("avx2")
    kernels = native_kernels.active()
    events = []
    recording = type("Recording", (), {
        "__getattr__": lambda self, name: getattr(kernels, name),
        "bf16_pack": lambda self, w: events.append("pack") or kernels.bf16_pack(w)})()
    monkeypatch.setattr(native_kernels, "active", lambda: recording)
    release = weight_release.Release.__call__
    monkeypatch.setattr(weight_release.Release, "__call__", lambda self, m: events.append("release") or release(self, m))
    config = EngineConfig(model=str(tmp_path / "model"), dtype="float32", native_kernels="avx2", max_model_len=256,
                          startup_cache=True, cache_dir=tmp_path / "cache")
    loader.load(config).verdicts.save()  # as the engine's start saves them
    layers = events.count("release")
    assert layers == 4 * 2 + 1  # q/k/v, o, gate/up and down of 2 layers, and the head
    checks = events.count("pack") - layers  # the kernel's check packs no layer twice
    assert checks == 0 and events == ["pack"] * layers + ["release"] * layers, events
    events.clear()
    loader.load(config)
    assert events == ["pack", "release"] * layers, events
