"""The CPU weight layouts (engine/cpu/layout.py): the same model, the same outputs; column-major adds no memory."""
from __future__ import annotations

import pytest
import torch

from engine.cpu import layout as cpu_layout
from engine.cpu import fusion
from tiny_models import build_small_model


def _storages(model: torch.nn.Module) -> dict[int, int]:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}


def test_column_major_weights_keep_outputs_and_memory(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_small_model(tmp_path), dtype=torch.float32).eval()
    model.requires_grad_(False)
    ids = torch.tensor([[1, 5, 9, 30, 7, 64, 3, 11]])
    with torch.inference_mode():
        expected = model(ids).logits
        fusion.apply(model)
        before = _storages(model)
        moved = cpu_layout.use_column_major(model)
        got = model(ids).logits
    after = _storages(model)

    layer = model.model.layers[0]
    # Every linear weight of the decoder moved (the fused products and their parts: 9 per layer); the output
    # head shares the input embeddings' storage and stays.
    assert moved == 9 * len(model.model.layers)
    assert layer.mlp.gate_up_proj.weight.stride() == (1, layer.mlp.gate_up_proj.out_features)
    assert layer.mlp.gate_proj.weight.untyped_storage().data_ptr() == \
        layer.mlp.gate_up_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(layer.mlp.up_proj.weight,
                       layer.mlp.gate_up_proj.weight[layer.mlp.gate_proj.out_features:])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(after.values()) == sum(before.values()), "the layout added memory"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_keep_outputs_and_run_from_their_batch_size(tmp_path, monkeypatch, dtype):
    from transformers import AutoModelForCausalLM

    if dtype == torch.bfloat16 and not cpu_layout.bfloat16_is_native():
        pytest.skip("bfloat16 products are not native here")
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bfloat16 rounds to 8 bits in either summation order
    model = AutoModelForCausalLM.from_pretrained(build_small_model(tmp_path), dtype=dtype).eval()
    model.requires_grad_(False)
    short, long = torch.tensor([[1, 5, 9]]), torch.tensor([[1, 5, 9, 30, 7, 64, 3, 11]])
    with torch.inference_mode():
        expected = model(short).logits, model(long).logits
        fusion.apply(model)
        cpu_layout.use_column_major(model)
        layers = cpu_layout.use_packed(model, 4)
        packed_rows = []
        real = cpu_layout._packed_linear
        monkeypatch.setattr(cpu_layout, "_packed_linear",
                            lambda x, packed, bias: packed_rows.append(x.numel() // x.shape[-1]) or real(x, packed, bias))
        got_short = model(short).logits
        assert packed_rows == [], "3 rows ran the packed product, which starts at 4"
        got_long = model(long).logits

    # the fused products (2 per layer), o_proj and down_proj, and the output head
    assert layers == 4 * len(model.model.layers) + 1
    assert packed_rows == [8] * layers
    torch.testing.assert_close(got_short, expected[0], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got_long, expected[1], rtol=tolerance, atol=tolerance)


def test_bfloat16_weights_are_timed_packed_too(tmp_path, monkeypatch):
    """Where bfloat16 is native (DTYPE=auto then loads most models as bfloat16), the probe times oneDNN's packed
    product for bfloat16 weights as for float32 ones."""
    from transformers import AutoModelForCausalLM

    if not cpu_layout.bfloat16_is_native():
        pytest.skip("bfloat16 products are not native here")
    # What the timings find is the machine's business; what is tested is that bfloat16 weights reach them. Each
    # timing runs both products and reports a tie: a noisy machine once timed the packed product over 10% slower
    # at prefill size, where the probe stops before the decode sizes.
    timings = []

    def tie(baseline, candidate, repeats=7):
        baseline(), candidate()
        timings.append(repeats)
        return 1.0

    monkeypatch.setattr(cpu_layout, "speedup", tie)
    model = AutoModelForCausalLM.from_pretrained(build_small_model(tmp_path), dtype=torch.bfloat16).eval()
    model.requires_grad_(False)
    with torch.inference_mode():
        fusion.apply(model)
        _, gains, packs = cpu_layout._packed_from(model)
    assert set(gains) == set(cpu_layout._PACKED_ROWS)
    assert len(timings) == 1 + len(cpu_layout._PACKED_ROWS)  # the prefill size, then each decode size
    assert packs and all(p.dtype == torch.bfloat16 for p in packs.values())


def test_the_probe_names_the_layouts_it_chose(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_small_model(tmp_path), dtype=torch.float32).eval()
    model.requires_grad_(False)
    with torch.inference_mode():
        fusion.apply(model)
    layout = cpu_layout.apply(model)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and not getattr(m, "fused_into", False)]
    strides = {m.weight.stride() for m in model.model.layers[0].modules() if type(m) is torch.nn.Linear}
    assert layout.column_major == all(s[0] == 1 for s in strides)
    assert layout.packed_from in (None, *cpu_layout._PACKED_ROWS)
    assert all(getattr(m, "packed_from", None) == layout.packed_from for m in linears)


def test_a_model_without_a_linear_output_head_keeps_its_products_unpacked(tmp_path):
    """The packed product needs the output head's weight; a model whose head is not a linear layer still loads,
    with no packed copies."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_small_model(tmp_path), dtype=torch.float32).eval()
    model.requires_grad_(False)
    model.get_output_embeddings = lambda: None
    layout = cpu_layout.apply(model)
    assert layout.packed_from is None
    assert not any(hasattr(m, "weight_packed") for m in model.modules())
