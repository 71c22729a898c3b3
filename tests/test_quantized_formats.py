"""Quantized checkpoints served from their packed integers, token for token.

For each format a tiny random Llama is written in that format here, its tensors packed as the format's
specification lays them out (GPTQ's int32 words along the inputs and its zero points stored minus one, AWQ's
nibble order 0 2 4 6 1 3 5 7, compressed-tensors' weight_packed / weight_scale / weight_zero_point /
weight_shape, fine-grained FP8's weight_scale_inv per 128 x 128 block, bitsandbytes' int8 weight and SCB, and
its 4-bit codes two a byte with absmax per block, double-quantized or not, and the JSON quant_state). The
same integers, dequantized by the plain formula in this file (w = scale * (q - zero)), are saved as a float32
checkpoint that transformers loads itself: the reference. The worker's greedy tokens on the quantized folder,
for rows of different lengths decoding together, must equal transformers' on the dequantized one. Checkpoints
the worker cannot serve are refused at start-up with one line naming what.
"""
from __future__ import annotations

import asyncio
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import AsyncEngine, EngineConfig
from engine.cpu import fusion, native_kernels, packed_linear
from engine.loader import ModelLoadError
from engine_helpers import choice_ids
from tiny_models import NEW_TOKENS, VOCAB, family_greedy, prompts, q4_1_weight, reference

HIDDEN, INTERMEDIATE = 128, 256
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def dense_llama(folder, tokenizer_folder, seed: int = 0):
    """A tiny random Llama saved as float32; its weights wide enough that greedy choices are decisive."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for f in tokenizer_folder.iterdir():
        shutil.copy(f, folder / f.name)
    return model


def int32(values: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (held in int64) as the int32 tensors the formats store."""
    return torch.from_numpy((values & 0xFFFFFFFF).numpy().astype(np.uint32).view(np.int32))


def pack_rows(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Pack along dim 1: word c holds values c*per .. c*per + per - 1, value i of a word at bits i*bits (AWQ:
    nibble i holds value order[i])."""
    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    if order is not None:
        v = v[:, :, order]
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i in range(per):
        words |= v[:, :, i] << (bits * i)
    return int32(words)


def quantize_groups(w: torch.Tensor, groups: torch.Tensor, bits: int, sym: bool, scale_dtype=torch.float16):
    """Round to nearest per (output, group): unsigned q, zero points z [out, groups], scales [out, groups]
    (rounded to `scale_dtype`). The dequantized weight is scale * (q - z)."""
    out, n_groups = w.shape[0], int(groups.max()) + 1
    top = (1 << bits) - 1
    scale = torch.empty(out, n_groups)
    zero = torch.empty(out, n_groups, dtype=torch.int64)
    for g in range(n_groups):
        cols = w[:, groups == g]
        if sym:
            scale[:, g] = cols.abs().amax(1) / (top // 2)
            zero[:, g] = (top + 1) // 2
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[:, g] = (hi - lo) / top
            zero[:, g] = torch.round(-lo / scale[:, g]).clamp(1, top)  # GPTQ v1 cannot store z = 0
    scale = scale.to(scale_dtype).float()
    q = torch.round(w / scale[:, groups] + zero[:, groups]).clamp(0, top).to(torch.int64)
    return q, zero, scale


def dequantize(q, zero, scale, groups):
    return scale[:, groups] * (q - zero[:, groups]).float()


def write_quantized(folder, reference_folder, model, quantization_config: dict, layer_tensors):
    """Save `model` with each decoder linear layer replaced by layer_tensors(name, weight) -> (tensors, dequantized
    weight); the dequantized weights go into the reference model, saved to `reference_folder`."""
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with torch.no_grad():
        for index in range(model.config.num_hidden_layers):
            for linear in LINEARS:
                name = f"model.layers.{index}.{linear}"
                tensors, weight = layer_tensors(name, state.pop(f"{name}.weight"))
                state.update({f"{name}.{k}": v.contiguous() for k, v in tensors.items()})
                model.get_submodule(name).weight.copy_(weight)
    model.save_pretrained(reference_folder)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    for f in folder.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json" and not (reference_folder / f.name).exists():
            shutil.copy(f, reference_folder / f.name)


def gptq_layer(bits: int, group: int, sym: bool, desc_act: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def layer(name, w):
        out, k = w.shape
        size = k if group == -1 else group
        groups = torch.arange(k) // size
        if desc_act:  # act order: a group's inputs are scattered over the columns
            groups = groups[torch.randperm(k, generator=gen)]
        q, zero, scale = quantize_groups(w, groups, bits, sym)
        tensors = {"qweight": pack_rows(q, bits).t(),  # packed along the inputs: [in * bits / 32, out]
                   "qzeros": pack_rows(zero.t().contiguous() - 1, bits),  # v1 stores z - 1
                   "scales": scale.t().half(), "g_idx": groups.to(torch.int32)}
        return tensors, dequantize(q, zero, scale, groups)
    return layer


def awq_layer(group: int):
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds output column order[i] of its 8

    def layer(name, w):
        groups = torch.arange(w.shape[1]) // group
        q, zero, scale = quantize_groups(w, groups, 4, sym=False)
        tensors = {"qweight": pack_rows(q.t().contiguous(), 4, order), "qzeros": pack_rows(zero.t().contiguous(), 4, order),
                   "scales": scale.t().half()}
        return tensors, dequantize(q, zero, scale, groups)
    return layer


def compressed_layer(bits: int, group: int, sym: bool):
    def layer(name, w):
        out, k = w.shape
        groups = torch.arange(k) // group
        q, zero, scale = quantize_groups(w, groups, bits, sym, scale_dtype=torch.bfloat16)
        offset = 1 << (bits - 1)  # compressed-tensors holds signed values, packed as value + offset
        tensors = {"weight_packed": pack_rows(q, bits), "weight_scale": scale.bfloat16(),
                   "weight_shape": torch.tensor([out, k])}
        if not sym:
            tensors["weight_zero_point"] = pack_rows(zero.t().contiguous(), bits).t()  # packed along the outputs
        assert bool(((q - offset) >= -offset).all())
        return tensors, dequantize(q, zero, scale, groups)
    return layer


def fp8_layer(block: int = 128):
    def layer(name, w):
        out, k = w.shape
        rows, cols = -(-out // block), -(-k // block)
        scale = torch.empty(rows, cols)
        for r in range(rows):
            for c in range(cols):
                scale[r, c] = w[r * block:(r + 1) * block, c * block:(c + 1) * block].abs().max() / 448
        expanded = scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :k]
        fp8 = (w / expanded).to(torch.float8_e4m3fn)
        return {"weight": fp8, "weight_scale_inv": scale}, fp8.float() * expanded
    return layer


def bnb_int8_layer(name, w):
    scb = w.abs().amax(1)
    q = torch.round(w * 127 / scb[:, None]).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "SCB": scb, "weight_format": torch.tensor([0], dtype=torch.uint8)}, q.float() * scb[:, None] / 127


# bitsandbytes' 4-bit tables as its documentation gives them: NF4's normal quantiles, and FP4's bit patterns
# (sign, 2 exponent bits, 1 mantissa bit; exponent bias 2) 0, 0.0625, 8, 12, 4, 6, 2, 3 over their largest, 12.
BNB_TABLES = {
    "nf4": [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
            1.0],
    "fp4": [v / 12 for v in (0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3)],
}


def bnb_4bit_layer(table: str, blocksize: int, nested: bool, quant_map=None):
    """bitsandbytes' 4-bit serialization of a weight: each block of `blocksize` of the flattened weight scaled by
    its largest magnitude (absmax) and rounded to the nearest table value's index, two indices a byte (the first in
    the high nibble) as uint8 [out * in / 2, 1]; with `nested` (double quantization) absmax minus its mean held as
    8-bit indices into a 256-value map times a float32 absmax per 256 of them."""
    values = torch.tensor(BNB_TABLES[table])

    def layer(name, w):
        out, k = w.shape
        blocks = w.reshape(-1, blocksize)
        absmax = blocks.abs().amax(1)
        q = ((blocks / absmax[:, None]).reshape(-1, 1) - values).abs().argmin(1)
        state = {"quant_type": table, "blocksize": blocksize, "dtype": "float32", "shape": [out, k]}
        tensors = {"weight": ((q[0::2] << 4) | q[1::2]).to(torch.uint8).unsqueeze(1),
                   "weight.quant_map": (values if quant_map is None else torch.tensor(quant_map)).clone()}
        if nested:
            offset = absmax.mean()
            centred = absmax - offset
            index = torch.arange(absmax.numel()) // 256
            nested_absmax = torch.stack([part.abs().max() for part in centred.split(256)])
            nested_map = torch.linspace(-1, 1, 256)  # the file carries its own map: any 256 values serve
            codes = ((centred / nested_absmax[index]).reshape(-1, 1) - nested_map).abs().argmin(1)
            absmax = nested_map[codes] * nested_absmax[index] + offset
            tensors.update({"weight.absmax": codes.to(torch.uint8), "weight.nested_absmax": nested_absmax,
                            "weight.nested_quant_map": nested_map})
            state.update(nested_blocksize=256, nested_dtype="float32", nested_offset=offset.item())
        else:
            tensors["weight.absmax"] = absmax
        tensors[f"weight.quant_state.bitsandbytes__{table}"] = torch.tensor(list(json.dumps(state).encode()),
                                                                            dtype=torch.uint8)
        return tensors, (values[q].view(-1, blocksize) * absmax[:, None]).view(out, k)
    return layer


def _bnb_4bit(table: str, nested: bool) -> dict:
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": table,
            "bnb_4bit_use_double_quant": nested, "bnb_4bit_compute_dtype": "float32"}


_GPTQ = {"quant_method": "gptq", "checkpoint_format": "gptq", "lm_head": False}


def _ct(bits, group, sym, fmt="pack-quantized"):
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group",
                            "group_size": group}}}}


FORMATS = {
    "gptq-4bit-g32-sym": (dict(_GPTQ, bits=4, group_size=32, desc_act=False, sym=True), gptq_layer(4, 32, True, False, 1)),
    "gptq-4bit-g64-zero-points": (dict(_GPTQ, bits=4, group_size=64, desc_act=False, sym=False),
                                  gptq_layer(4, 64, False, False, 2)),
    "gptq-4bit-g128-desc-act": (dict(_GPTQ, bits=4, group_size=128, desc_act=True, sym=False),
                                gptq_layer(4, 128, False, True, 3)),
    "gptq-4bit-g32-desc-act": (dict(_GPTQ, bits=4, group_size=32, desc_act=True, sym=True),
                               gptq_layer(4, 32, True, True, 6)),
    "gptq-4bit-per-channel": (dict(_GPTQ, bits=4, group_size=-1, desc_act=False, sym=True),
                              gptq_layer(4, -1, True, False, 4)),
    "gptq-8bit-g32": (dict(_GPTQ, bits=8, group_size=32, desc_act=False, sym=False), gptq_layer(8, 32, False, False, 5)),
    "awq-gemm-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                     awq_layer(64)),
    "compressed-w4a16-g32-asym": (_ct(4, 32, False), compressed_layer(4, 32, False)),
    "compressed-w8a16-g64": (_ct(8, 64, True), compressed_layer(8, 64, True)),
    "fp8-block-128": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                       "weight_block_size": [128, 128]}, fp8_layer()),
    "bitsandbytes-int8": ({"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False},
                          bnb_int8_layer),
    "bitsandbytes-nf4-b64-double-quant": (_bnb_4bit("nf4", True), bnb_4bit_layer("nf4", 64, True)),
    "bitsandbytes-fp4-b128": (_bnb_4bit("fp4", False), bnb_4bit_layer("fp4", 128, False)),
}


def _engine(folder, dtype: str = "float32", **kw) -> AsyncEngine:
    return AsyncEngine(EngineConfig(model=str(folder), dtype=dtype, max_num_batched_tokens=32,
                                    kv_cache_memory=8 * 2**20, max_num_seqs=8, **kw))


def _serve_batched(engine, rows: list[list[int]]):
    """Greedy tokens of every row, all decoding together; the runner that served them and its packed layers."""
    try:
        asyncio.run(engine.start())

        async def batched():
            return await asyncio.gather(*(choice_ids(engine, f"r{i}", ids, family_greedy())
                                          for i, ids in enumerate(rows)))
        got = asyncio.run(batched())
        served = engine.engine.runner
        return got, served, packed_linear.layers(served.model)
    finally:
        engine.close()


def _checkpoint_and_reference(fmt, tmp_path, tokenizer_folder):
    """The tiny Llama written as a `fmt` checkpoint and as its dequantized float32 reference: (the checkpoint's
    folder, the reference model, 3 prompts, the reference's greedy tokens for each)."""
    from transformers import AutoModelForCausalLM

    quantization_config, layer = FORMATS[fmt]
    folder, reference_folder = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(folder, reference_folder, dense_llama(folder, tokenizer_folder), quantization_config, layer)
    expected_model = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()
    rows = prompts(7)
    return folder, expected_model, rows, [reference(expected_model, ids) for ids in rows]


def _assert_reference_tokens(fmt, rows, got, expected, expected_model) -> None:
    """The worker rounds activations to 16-bit integers per 32 inputs (2^-16 of the block's largest) and sums in
    its own order, so where the reference's top two logits are within float32 noise of each other either may
    come first: a row may part from the reference only at such a tie (on a 2-core Intel Xeon one row did, its
    top two 4e-6 of the largest logit apart), and at most one row a format."""
    ties = 0
    for i, (choices, want) in enumerate(zip(got, expected)):
        k = next((j for j, (a, b) in enumerate(zip(choices[0], want)) if a != b), None)
        if k is None and len(choices[0]) == len(want):
            continue
        assert k is not None, f"{fmt}, row {i}: {choices[0]} != {want}"
        with torch.inference_mode():
            logits = expected_model(torch.tensor([rows[i] + want[:k]])).logits[0, -1]
        gap = logits[want[k]] - logits[choices[0][k]]
        assert gap <= 1e-4 * logits.abs().max(), f"{fmt}, row {i} ({len(rows[i])} prompt tokens): {choices[0]} != {want}"
        ties += 1
    assert ties <= 1, (fmt, ties)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_quantized_checkpoint_serves_the_dequantized_models_tokens(fmt, tmp_path, tokenizer_folder):
    folder, expected_model, rows, expected = _checkpoint_and_reference(fmt, tmp_path, tokenizer_folder)
    got, served, layers = _serve_batched(_engine(folder), rows)
    _assert_reference_tokens(fmt, rows, got, expected, expected_model)
    if fmt.startswith("fp8"):  # no integer form: dense weights of the model's type
        assert not layers
    elif "desc-act" in fmt and "g32" in fmt:  # each layer its own input order: q/k/v and gate/up stay apart
        assert len(layers) == 2 * 7 and all(layer.packed is not None and layer.order is not None for layer in layers)
    else:  # every decoder projection from packed blocks, fused (qkv, o, gate_up, down a layer) for the compact forward
        assert len(layers) == 2 * 4 and all(layer.packed is not None for layer in layers)
    # Kept at the file's size: 4 bits a weight plus a half-precision scale (and a zero point byte) a group, the
    # group of 32, 64 or 128 inputs (a row's 128 or 256 inputs in groups of 128 for per-channel scales);
    # bitsandbytes' blocks of 64 or 128 with a float32 scale (its absmax, double quantization undone)
    bits = {"gptq-4bit-g32-sym": 4 + 16 / 32, "gptq-4bit-g64-zero-points": 4 + 24 / 64, "awq-gemm-g64": 4 + 24 / 64,
            "gptq-4bit-g128-desc-act": 4 + 24 / 128, "gptq-4bit-per-channel": 4 + 16 / 128,
            "bitsandbytes-nf4-b64-double-quant": 4 + 32 / 64, "bitsandbytes-fp4-b128": 4 + 32 / 128,
            # 8 bits and a float32 scale a row, kept once per 128 inputs
            "bitsandbytes-int8": 8 + 32 / 128}.get(fmt)
    if bits is not None:
        weights = sum(layer.in_features * layer.out_features for layer in layers)
        assert sum(layer.packed.numel() for layer in layers) * 8 / weights == bits, fmt
    assert served.compact is not None, served.compact_reason


def round_activations_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """QUANTIZED_ACTIVATIONS=int8's rounding of each block of 32 inputs, as the kernel defines it: steps of
    s = largest |x| / 127, q = round(x * (127 / largest)) in float32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(largest > 0, 127 / largest, torch.zeros_like(largest)))
    return (q.double() * (largest.double() / 127)).reshape(x.shape)


@pytest.mark.slow
@pytest.mark.parametrize("sym", [True, False], ids=["symmetric", "zero-points"])
def test_eight_bit_activations_serve_the_tokens_of_their_arithmetic(sym, tmp_path, tokenizer_folder):
    """QUANTIZED_ACTIVATIONS=int8 on a GPTQ 4-bit checkpoint: every layer multiplies 8-bit activations (as
    llama.cpp does), and the greedy tokens, rows decoding together, are transformers' on the
    dequantized model with each layer computing what the kernel defines: the block's d q times the rounded
    inputs, plus its minimum m = -d z times the exact ones (up to near ties, below)."""
    from transformers import AutoModelForCausalLM

    quantization_config = dict(_GPTQ, bits=4, group_size=32, desc_act=False, sym=sym)
    minimums = {}

    def layer(name, w):
        groups = torch.arange(w.shape[1]) // 32
        tensors, weight = gptq_layer(4, 32, sym, False, 1)(name, w)
        _q, zero, scale = quantize_groups(w, groups, 4, sym)
        minimums[name] = (-zero * scale)[:, groups].double()
        return tensors, weight

    folder, reference_folder = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(folder, reference_folder, dense_llama(folder, tokenizer_folder), quantization_config, layer)
    expected_model = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()
    for name, minimum in minimums.items():
        module = expected_model.get_submodule(name)
        scaled = module.weight.detach().double() - minimum  # d q

        def forward(x, scaled=scaled, minimum=minimum):
            return (round_activations_to_bytes(x) @ scaled.T + x.double() @ minimum.T).to(x.dtype)
        module.forward = forward
    native_kernels.load("auto")
    rows = prompts(7) + prompts(8) + prompts(9)
    expected = [reference(expected_model, ids) for ids in rows]
    got, served, layers = _serve_batched(_engine(folder, quantized_activations="int8"), rows)
    # An input one ulp away can round to the next 8-bit step (1/254 of its block's largest), and the reference's
    # inputs come from torch's float32 operations, the worker's from its kernels: where the arithmetic's own top
    # two are that close, either may come first. The flips add up over the layers: on the 2-core AMD EPYC the
    # nearest ties parted within 1e-2 of the largest logit, on a 2-core Intel Xeon (another BLAS summing the
    # reference) one reached 1.2e-2 and 3 of 9 rows parted per variant. Each row matches until such a near tie, if
    # any; a wrong product parts at most positions by a sizeable share of the largest logit.
    ties = 0
    for choices, want, ids in zip(got, expected, rows):
        k = next((i for i, (a, b) in enumerate(zip(choices[0], want)) if a != b), None)
        if k is None:
            continue
        with torch.inference_mode():
            logits = expected_model(torch.tensor([ids + want[:k]])).logits[0, -1]
        assert logits[want[k]] - logits[choices[0][k]] <= 2e-2 * logits.abs().max(), (ids, k)
        ties += 1
    assert ties <= len(rows) // 2, ties
    # The grouped 4-bit layers' forms for 8-bit activations: 21 with symmetric scales, 29 with zero points.
    assert len(layers) == 2 * 4 and {layer.block_format for layer in layers} == {21 if sym else 29}
    assert served.compact is not None, served.compact_reason


@pytest.mark.slow
def test_eight_bit_activations_where_nothing_takes_them_are_refused(tmp_path, tokenizer_folder):
    """A setting that would change nothing (a dense model) or an unknown value stops the start with one line
    naming it."""
    folder = tmp_path / "quantized"
    model = dense_llama(folder, tokenizer_folder)
    write_quantized(folder, tmp_path / "reference", model, *FORMATS["gptq-8bit-g32"])
    _refused(tmp_path / "reference", "QUANTIZED_ACTIVATIONS=int8: this model has no layers multiplied from packed",
             quantized_activations="int8")
    _refused(folder, "QUANTIZED_ACTIVATIONS=int4: int16 or int8", quantized_activations="int4")


def half_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest half-precision value >= each positive x (float32)."""
    h = x.half()
    up = torch.nextafter(h, torch.full_like(h, float("inf")))
    return torch.where(h.float() < x, up, h).float()


def round_to_nearest(w: torch.Tensor, method: str) -> torch.Tensor:
    """QUANTIZATION=int8: one symmetric scale per output, q in -127..127; int4: per 32 inputs a scale
    (max - m) / 15 and the minimum m, q in 0..15; the minimum the nearest half-precision value, the scale the
    smallest half-precision value at least that. The dequantized weight."""
    if method == "int8":
        d = half_at_least(w.abs().amax(1, keepdim=True) / 127)
        return torch.round(w / d).clamp(-127, 127) * d
    blocks = w.view(w.shape[0], -1, 32)
    lo = blocks.amin(-1, keepdim=True).half().float()
    d = half_at_least((blocks.amax(-1, keepdim=True) - lo) / 15)
    return (torch.round((blocks - lo) / d).clamp(0, 15) * d + lo).view_as(w)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_at_load_serves_the_rounded_weights(method, tmp_path, tokenizer_folder):
    model = dense_llama(tmp_path, tokenizer_folder, seed=1)
    with torch.no_grad():
        for index in range(model.config.num_hidden_layers):
            for linear in LINEARS:
                weight = model.get_submodule(f"model.layers.{index}.{linear}").weight
                weight.copy_(round_to_nearest(weight.detach().clone(), method))
    rows = prompts(8)
    expected = [reference(model, ids) for ids in rows]
    got, _served, layers = _serve_batched(_engine(tmp_path, quantization=method), rows)
    assert [c[0] for c in got] == expected
    assert len(layers) == 2 * 4 and {layer.bits for layer in layers} == {8 if method == "int8" else 4}
    # int4: 16-bit headers a block of 32, as GGUF's Q4_1 (5 bits a weight); int8: the row's scale once per 128
    # inputs in float32 (8.25; rows that do not divide into 128 would take Q8_0's 16-bit headers, 8.5)
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    assert sum(layer.packed.numel() for layer in layers) * 8 / weights == (8 + 32 / 128 if method == "int8" else 5)


def _gptq_folder(tmp_path, tokenizer_folder, **config) -> object:
    folder = tmp_path / "quantized"
    model = dense_llama(folder, tokenizer_folder)
    write_quantized(folder, tmp_path / "reference", model, dict(_GPTQ, bits=4, group_size=32, desc_act=False,
                                                                 sym=True), gptq_layer(4, 32, True, False, 1))
    if config:
        path = folder / "config.json"
        data = json.loads(path.read_text())
        data["quantization_config"] = {**data["quantization_config"], **config}
        path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return folder


def _refused(folder, match: str, **kw) -> str:
    from engine.loader import load

    with pytest.raises(ModelLoadError, match=match) as failure:
        load(EngineConfig(model=str(folder), dtype="float32", **kw))
    message = str(failure.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.slow
@pytest.mark.parametrize("config,match", [
    ({"bits": 3}, "GPTQ with 3-bit weights is not supported"),
    ({"group_size": 16}, "GPTQ group_size 16 is not supported"),
    ({"checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
    ({"quant_method": "hqq"}, "quant_method 'hqq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "int"}, "input_activations": {"num_bits": 8, "type": "int"}}}},
     "quantizes activations too"),
])
def test_checkpoints_that_cannot_run_are_refused_at_start_up(config, match, tmp_path, tokenizer_folder):
    _refused(_gptq_folder(tmp_path, tokenizer_folder, **config), match)


def test_a_bitsandbytes_table_other_than_its_own_is_refused(tmp_path, tokenizer_folder):
    """A 4-bit checkpoint whose quant_map is not bitsandbytes' table of its quant_type would be multiplied by the
    wrong values: it is refused, naming the layer."""
    folder = tmp_path / "quantized"
    swapped = list(reversed(BNB_TABLES["nf4"]))
    write_quantized(folder, tmp_path / "reference", dense_llama(folder, tokenizer_folder), _bnb_4bit("nf4", False),
                    bnb_4bit_layer("nf4", 64, False, quant_map=swapped))
    _refused(folder, "model.layers.0.self_attn.q_proj: its quant_map is not bitsandbytes' nf4 table")


def test_a_packed_weight_of_another_shape_than_its_layer_is_refused(tmp_path, tokenizer_folder):
    """A checkpoint whose packed layer is not the model's layer's shape (here a 4-bit quant_state saying 512x64
    for a 256x128 projection: the same number of weights) is refused at start-up, naming the layer, not served."""
    folder = tmp_path / "quantized"
    layer = bnb_4bit_layer("nf4", 64, False)

    def reshaped(name, w):
        if name != "model.layers.1.mlp.up_proj":
            return layer(name, w)
        tensors, weight = layer(name, w.reshape(512, 64))
        return tensors, weight.reshape(w.shape)
    write_quantized(folder, tmp_path / "reference", dense_llama(folder, tokenizer_folder), _bnb_4bit("nf4", False),
                    reshaped)
    _refused(folder, "model.layers.1.mlp.up_proj: the checkpoint's 512x64 weight does not fit the model's 256x128 "
                     "layer")


@pytest.mark.slow
def test_quantization_must_match_the_checkpoint(tmp_path, tokenizer_folder):
    folder = _gptq_folder(tmp_path, tokenizer_folder)
    _refused(folder, "QUANTIZATION=awq but the checkpoint is gptq", quantization="awq")
    _refused(folder, "QUANTIZATION=int8 quantizes a 16- or 32-bit checkpoint at load, but this checkpoint is already "
                     "quantized", quantization="int8")
    _refused(tmp_path / "reference", r"QUANTIZATION=gptq but the checkpoint is not quantized", quantization="gptq")


def test_an_unknown_quantization_setting_is_a_start_up_error(monkeypatch):
    from worker.settings import SettingsError, load_settings

    monkeypatch.setenv("QUANTIZATION", "squeezellm")
    with pytest.raises(SettingsError, match="QUANTIZATION: QUANTIZATION='squeezellm' is not a method"):
        load_settings()
    monkeypatch.setenv("QUANTIZATION", "GPTQ_Marlin")  # vLLM's kernel-specific name for the same checkpoints
    assert load_settings().quantization == "gptq"
    monkeypatch.setenv("QUANTIZED_ACTIVATIONS", "fp8")
    with pytest.raises(SettingsError, match="QUANTIZED_ACTIVATIONS"):
        load_settings()
    monkeypatch.setenv("QUANTIZED_ACTIVATIONS", "int8")
    assert load_settings().engine_config().quantized_activations == "int8"


class Linear4bit(torch.nn.Linear):
    """bitsandbytes' shape of a 4-bit layer on CUDA: a torch.nn.Linear subclass whose weight is packed uint8."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)
        self.weight = torch.nn.Parameter(torch.randint(0, 255, (in_features * out_features // 2, 1),
                                                       dtype=torch.uint8), requires_grad=False)


def test_fusion_never_concatenates_a_quantized_subclass_of_linear():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    layer = model.model.layers[0]
    for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
        for name in names:
            old = getattr(parent, name)
            setattr(parent, name, Linear4bit(old.in_features, old.out_features))
    packed = {name: p for name, p in model.named_parameters() if p.dtype == torch.uint8}
    counts = fusion.apply(model)
    assert counts["qkv"] == 0 and counts["mlp"] == 0
    assert not hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.mlp, "gate_up_proj")
    assert all(p is dict(model.named_parameters())[name] for name, p in packed.items())
    # The same model with plain layers is fused: the rule is the layers' type, not the model.
    assert fusion.apply(LlamaForCausalLM(model.config)) == {"mlp": 1, "qkv": 1, "rms_norm": 3}


# --- GGUF ---------------------------------------------------------------------------------------------------------

def _k_quant_blocks(w: np.ndarray, bits: int) -> np.ndarray:
    """Rows of float32 weights (a multiple of 256 wide) as Q4_K (bits 4) or Q5_K (bits 5) super-blocks, laid
    out as ggml's block_q4_K / block_q5_K: half d and dmin, 12 bytes of 6-bit sub-block scales and minimums,
    (Q5_K: 32 bytes of fifth bits, bit j of byte l for sub-block j), then 128 bytes of nibbles, pair of sub-blocks
    i in bytes 32i..32i+31 (sub-block 2i low nibbles, 2i + 1 high). Round to nearest, no search."""
    rows = w.shape[0]
    top = (1 << bits) - 1
    sub = w.reshape(rows, -1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    span = (sub.max(-1) - lo) / top
    d = (span.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(span / np.maximum(d.astype(np.float32)[..., None], 1e-12)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.maximum(dmin.astype(np.float32)[..., None], 1e-12)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    shift = dmin.astype(np.float32)[..., None] * mn
    q = np.clip(np.round((sub + shift[..., None]) / step[..., None]), 0, top).astype(np.uint8)
    scales = np.zeros(sub.shape[:2] + (12,), np.uint8)
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    low = (q & 0xF).reshape(rows, -1, 4, 2, 32)
    nibbles = (low[:, :, :, 0] | (low[:, :, :, 1] << 4)).reshape(rows, -1, 128)
    parts = [d.reshape(rows, -1, 1).view(np.uint8), dmin.reshape(rows, -1, 1).view(np.uint8), scales]
    if bits == 5:
        high = (q >> 4).astype(np.uint8)  # [rows, blocks, 8 sub-blocks, 32]
        parts.append(sum(high[:, :, j] << j for j in range(8)).astype(np.uint8))
    parts.append(nibbles)
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """Rows of float32 weights (a multiple of 256 wide) as Q6_K super-blocks, laid out as ggml's block_q6_K:
    128 bytes of low nibbles, 64 bytes of high bit pairs, 16 signed scales (one per 16 weights), half d. In each
    half of 128 weights, weight 32t + l has its low nibble in byte l (t = 0, 2) or 32 + l (t = 1, 3) of the half's
    64, low nibble for t < 2, high for t >= 2, and its two high bits at bits 2t of the half's byte l of 32; q is
    stored + 32. Round to nearest, no search."""
    rows = w.shape[0]
    sub = w.reshape(rows, -1, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    sc = np.clip(np.round(step / np.maximum(d.astype(np.float32)[..., None], 1e-12)), 1, 127).astype(np.int8)
    scale = d.astype(np.float32)[..., None] * sc
    q = (np.clip(np.round(sub / scale[..., None]), -32, 31) + 32).astype(np.uint8).reshape(rows, -1, 2, 4, 32)
    ql = np.concatenate([(q[:, :, :, 0] & 0xF) | ((q[:, :, :, 2] & 0xF) << 4),
                         (q[:, :, :, 1] & 0xF) | ((q[:, :, :, 3] & 0xF) << 4)], axis=-1)  # [rows, blocks, 2, 64]
    qh = sum(((q[:, :, :, t] >> 4) & 3) << (2 * t) for t in range(4)).astype(np.uint8)  # [rows, blocks, 2, 32]
    parts = [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
             d.reshape(rows, -1, 1).view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def _copy_tokenizer(writer, source) -> None:
    import gguf

    reader = gguf.GGUFReader(source)

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode() for i in field.data]

    def number(key):
        field = reader.fields[key]
        return int(field.parts[field.data[0]][0])
    writer.add_tokenizer_model(strings("tokenizer.ggml.model")[0])
    writer.add_tokenizer_pre(strings("tokenizer.ggml.pre")[0])
    writer.add_token_list(strings("tokenizer.ggml.tokens"))
    field = reader.fields["tokenizer.ggml.token_type"]
    writer.add_token_types([int(field.parts[i][0]) for i in field.data])
    writer.add_token_merges(strings("tokenizer.ggml.merges"))
    writer.add_bos_token_id(number("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(number("tokenizer.ggml.eos_token_id"))
    writer.add_pad_token_id(number("tokenizer.ggml.padding_token_id"))


G_HIDDEN, G_FF = 256, 512  # K-quants' super-blocks are 256 wide


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_read_as_ggufs_own_dequantization(kind):
    """The blocks the worker reads from a GGUF tensor give the weights gguf's own dequantization gives, exactly
    (K-quants: any bytes are valid blocks once d and dmin are finite; Q6_K's d is its last two bytes)."""
    import gguf
    from gguf import quants

    from engine.quantization import gguf_blocks

    rng = np.random.default_rng(1)
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind.endswith("_K"):
        raw = rng.integers(0, 256, (48, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
        if kind == "Q6_K":
            raw[:, 208:210] = rng.random((48, 1)).astype(np.float16).view(np.uint8)
        else:
            raw[:, 0:4] = rng.random((48, 2)).astype(np.float16).view(np.uint8)
    else:
        raw = quants.quantize(rng.standard_normal((48, 256)).astype(np.float32), qtype)
    q, d, m, bits, supers = gguf_blocks(kind, raw)
    if kind in ("Q4_K", "Q5_K"):  # the two-level scales the kernel keeps give the same d and m
        big_d, s, big_m, t = supers
        assert torch.equal(big_d.repeat_interleave(8, 1) * s.float(), d)
        assert torch.equal(-(big_m.repeat_interleave(8, 1) * t.float()), m)
    elif kind == "Q6_K":  # D per 256 inputs times a signed byte per 16
        big_d, s = supers
        assert s.dtype == torch.int8 and torch.equal(big_d.repeat_interleave(16, 1) * s.float(), d)
    else:
        assert supers is None
    group = 16 if kind == "Q6_K" else 32  # inputs a scale
    assert d.shape == m.shape == (48, 256 // group)
    weight = (q.float().view(48, -1, group) * d[..., None] + m[..., None]).view(48, -1)
    assert torch.equal(weight, torch.from_numpy(quants.dequantize(raw, qtype)))
    assert bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 5 if kind.startswith("Q5") else 8)


def _check_every_row_count(layer, dq: torch.Tensor, minimum: torch.Tensor, activation_bits: int) -> None:
    """layer(x) against x W^T, W = d q + m per block of 32 (dq [out, blocks, 32], minimum [out, blocks]), for 1 to
    40 rows: within 1e-4 of the sum of |x| |w| (16-bit activations' rounding), plus, with 8-bit activations, half a
    step (1/254 of each block's largest input) times the block's sum of |d q|."""
    n, blocks, _ = dq.shape
    weight = (dq + minimum.double()[..., None]).view(n, blocks * 32)
    for rows in range(1, 41):
        x = torch.randn(rows, blocks * 32)
        bound = 1e-4 * (x.double().abs() @ weight.abs().T) + 1e-6
        if activation_bits == 8:
            bound = bound + (x.double().abs().view(rows, -1, 32).amax(-1) / 254) @ dq.abs().sum(-1).T
        assert ((layer(x).double() - x.double() @ weight.T).abs() <= bound).all(), rows


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("activation_bits", [16, 8])
def test_k_quant_two_level_scales_multiply_within_their_rounding_at_every_row_count(bits, activation_bits):
    """GGUF Q4_K / Q5_K blocks packed with their two-level scales (formats 23-26: per block 6-bit s and t, per
    super-block of 256 inputs half-precision D and M, 4.625 / 5.625 bits a weight): every tile shape of rows gives
    x W^T, W = D s q - M t, within the activations' rounding (16-bit: 1e-4 of sum |x| |w|; 8-bit: half a step
    times the block's |d q| as well)."""
    kernels = _word_kernels(activation_bits)
    torch.manual_seed(11)
    n, k = 48, 512
    q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.int8)
    big_d, big_m = (torch.rand(n, k // 256) * 0.01).half().float(), (torch.rand(n, k // 256) * 0.01).half().float()
    s, t = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8), torch.randint(0, 64, (n, k // 32), dtype=torch.uint8)
    d, m = big_d.repeat_interleave(8, 1) * s.float(), -(big_m.repeat_interleave(8, 1) * t.float())
    layer = packed_linear.PackedLinear(q, d, m, bits, supers=(big_d, s, big_m, t))
    assert packed_linear.apply(torch.nn.Sequential(layer), kernels, activation_bits=activation_bits) == 1
    assert layer.block_format == {(4, 16): 23, (5, 16): 24, (4, 8): 25, (5, 8): 26}[bits, activation_bits]
    assert layer.packed.numel() * 8 / (n * k) == bits + 0.625
    _check_every_row_count(layer, q.double().view(n, -1, 32) * d.double()[..., None], m, activation_bits)


def test_q6_k_six_bit_form_multiplies_within_its_rounding_at_every_row_count():
    """GGUF Q6_K packed as the file holds it (format 27: 6-bit q as nibbles and two words of high bits, a signed
    byte scale per 16 inputs, half-precision D per 256: 6.5625 bits a weight): every tile shape of rows gives
    x W^T, W = D s q per 16 inputs, within the 16-bit activations' rounding. Under 8-bit activations the layer keeps
    its 6.5625 bits (format 30, not format 16's 10) and each output is within half an 8-bit step of each half
    block's largest input times the half block's sum of |w| (the activations' rounding there)."""
    kernels = _word_kernels()
    torch.manual_seed(12)
    n, k = 48, 512
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    big_d = (torch.rand(n, k // 256) * 0.01).half().float()
    s = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8)
    s[:, 1::2] = s[:, 1::2] // 8  # the two halves of a block weigh differently
    d = big_d.repeat_interleave(16, 1) * s.float()
    layer = packed_linear.PackedLinear(q, d, torch.zeros_like(d), 8, supers=(big_d, s))
    assert packed_linear.apply(torch.nn.Sequential(layer), kernels) == 1 and layer.block_format == 27
    assert layer.packed.numel() * 8 / (n * k) == 6.5625
    weight = (q.double().view(n, -1, 16) * d.double()[..., None]).view(n, k)
    for rows in range(1, 41):
        x = torch.randn(rows, k)
        bound = 1e-4 * (x.double().abs() @ weight.abs().T) + 1e-6
        assert ((layer(x).double() - x.double() @ weight.T).abs() <= bound).all(), rows
    if not kernels.quad_blocks_supported():
        return  # a build without the product from 8-bit activations
    eight = packed_linear.PackedLinear(q, d, torch.zeros_like(d), 8, supers=(big_d, s))
    assert packed_linear.apply(torch.nn.Sequential(eight), kernels, activation_bits=8) == 1
    assert eight.block_format == 30 and eight.packed.numel() * 8 / (n * k) == 6.5625
    for rows in range(1, 41):
        x = torch.randn(rows, k)
        step = x.double().abs().view(rows, -1, 32).amax(-1).repeat_interleave(32, 1) / 254
        bound = 1e-4 * (x.double().abs() @ weight.abs().T) + step @ weight.abs().T + 1e-6
        assert ((eight(x).double() - x.double() @ weight.T).abs() <= bound).all(), rows


def test_a_scale_per_16_inputs_multiplies_exactly_at_every_row_count():
    """Q6_K's form (8-bit q, a scale per 16 inputs, no minimum) packed for the kernel: every tile shape of rows
    and panels gives x W^T within the 16-bit activations' rounding, and each half block takes its own scale."""
    native_kernels.load("auto")
    kernels = native_kernels.active()
    if kernels is None or not kernels.word_blocks_supported():
        pytest.skip("no packed product on this CPU")
    torch.manual_seed(3)
    q = torch.randint(-32, 32, (48, 96), dtype=torch.int8)
    scale = torch.rand(48, 6) * 0.1
    scale[:, 1::2] *= 50  # the second half of each block of 32 weighs far more than the first
    layer = packed_linear.PackedLinear(q, scale, torch.zeros_like(scale), 8)
    weight = (q.double().view(48, -1, 16) * scale.double()[..., None]).view(48, 96)
    assert packed_linear.apply(torch.nn.Sequential(layer), kernels) == 1 and layer.block_format == 7
    for rows in range(1, 41):
        x = torch.randn(rows, 96)
        bound = 1e-4 * (x.double().abs() @ weight.abs().T) + 1e-6
        assert ((layer(x).double() - x.double() @ weight.T).abs() <= bound).all(), rows


@pytest.mark.parametrize("table", ["nf4", "fp4"])
def test_bitsandbytes_codes_multiply_within_their_table_at_every_row_count(table):
    """4-bit codes of bitsandbytes' tables (formats 17 and 18): every tile shape of rows and panels gives x W^T
    with W = absmax * table[q] within the 16-bit activations' rounding, plus, for NF4, the table's own rounding
    to steps of 1/2047 (FP4's values are multiples of 1/192: exact)."""
    kernels = _word_kernels()
    torch.manual_seed(5)
    q = torch.randint(0, 16, (48, 128), dtype=torch.int8)
    absmax = torch.rand(48, 4) * 10 ** torch.randint(-2, 3, (48, 4)).float()
    layer = packed_linear.PackedLinear(q, absmax, torch.zeros_like(absmax), 4, codes=table)
    weight = (torch.tensor(BNB_TABLES[table], dtype=torch.float64)[q.long()].view(48, -1, 32)
              * absmax.double()[..., None]).view(48, 128)
    assert packed_linear.apply(torch.nn.Sequential(layer), kernels) == 1
    assert layer.block_format == {"nf4": 17, "fp4": 18}[table]
    table_step = absmax.double().repeat_interleave(32, 1) * (0.5 / 2047 if table == "nf4" else 0)
    for rows in range(1, 41):
        x = torch.randn(rows, 128)
        bound = 1e-4 * (x.double().abs() @ weight.abs().T) + x.double().abs() @ table_step.T + 1e-6
        assert ((layer(x).double() - x.double() @ weight.T).abs() <= bound).all(), rows
        if table == "fp4":  # exact table: bfloat16 rows, rounded once, agree too
            y = layer(x.bfloat16()).double()
            assert ((y - x.bfloat16().double() @ weight.T).abs() <= bound + 2 ** -8 * y.abs()).all(), rows


@pytest.mark.parametrize("activation_bits", [16, 8])
def test_zero_point_blocks_multiply_within_their_rounding_at_every_row_count(activation_bits):
    """4-bit blocks with a zero point (AWQ, GPTQ with zero points: w = d (q - z), d half precision, z 0..15) keep
    d and z (formats 28 and 29: 4.75 bits a weight) and give x W^T within the activations' rounding at every tile
    shape; minimums that are not -d z for an integer z keep float32 headers (format 5)."""
    kernels = _word_kernels(activation_bits)
    torch.manual_seed(13)
    n, k = 48, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.int8)
    scale = (torch.rand(n, k // 32) * 0.1).half().float()
    minimum = -scale * torch.randint(0, 16, (n, k // 32)).float()
    layer = packed_linear.PackedLinear(q, scale, minimum, 4)
    assert packed_linear.apply(torch.nn.Sequential(layer), kernels, activation_bits=activation_bits) == 1
    assert layer.block_format == (28 if activation_bits == 16 else 29)
    assert layer.packed.numel() * 8 / (n * k) == 4.75
    _check_every_row_count(layer, q.double().view(n, -1, 32) * scale.double()[..., None], minimum, activation_bits)
    off = packed_linear.PackedLinear(q, scale, minimum + scale / 3, 4)  # z not an integer
    assert packed_linear.apply(torch.nn.Sequential(off), kernels) == 1 and off.block_format == 5


@pytest.mark.parametrize("form", ["centred", "half", "float32"])
def test_five_bit_blocks_multiply_exactly_at_every_row_count(form):
    """GGUF Q5 types' form (q 0..31: nibbles and a word of fifth bits per pair of inputs) with half-precision
    headers (format 8), float32 ones (9), or, where every minimum is -16 scales (Q5_0), the scale alone (20):
    every tile shape gives x W^T within the 16-bit activations' rounding, each fifth bit counted where its
    weight is."""
    kernels = _word_kernels()
    torch.manual_seed(4)
    q = torch.randint(0, 32, (48, 96), dtype=torch.int8)
    scale = torch.rand(48, 3) * 0.1
    minimum = (-16 if form == "centred" else -15) * scale
    if form != "float32":
        scale = scale.half().float()
        minimum = (-16 * scale) if form == "centred" else minimum.half().float()
    else:
        minimum += 1e-3  # not a half-precision value
    layer = packed_linear.PackedLinear(q, scale, minimum, 5)
    weight = (q.double().view(48, -1, 32) * scale.double()[..., None] + minimum.double()[..., None]).view(48, 96)
    assert packed_linear.apply(torch.nn.Sequential(layer), kernels) == 1
    assert layer.block_format == {"centred": 20, "half": 8, "float32": 9}[form]
    header = {"centred": 2, "half": 4, "float32": 8}[form]  # bytes per output and block of 32
    assert layer.packed.numel() == 48 * 96 * (5 / 8) + 48 * 3 * header  # 5 bits a weight + headers
    for rows in range(1, 41):
        x = torch.randn(rows, 96)
        bound = 1e-4 * (x.double().abs() @ weight.abs().T) + 1e-6
        assert ((layer(x).double() - x.double() @ weight.T).abs() <= bound).all(), rows


def _packed_layers(kernels, bits_list, in_features=96, bias=False):
    """One PackedLinear per entry of bits_list (4, 5, 8, or "per16": Q6_K's form), packed, random weights."""
    layers = []
    for bits in bits_list:
        out = 32 if bits == "per16" else 48  # 2 and 3 panels: an odd panel count ends a part with one panel
        group = 16 if bits == "per16" else 32
        lo, hi = {4: (0, 16), 5: (0, 32), 8: (-128, 128), "per16": (-32, 32)}[bits]
        q = torch.randint(lo, hi, (out, in_features), dtype=torch.int8)
        scale = torch.rand(out, in_features // group) * 0.1
        minimum = torch.zeros_like(scale) if bits in (8, "per16") else -scale * 8 + 1e-3
        layers.append(packed_linear.PackedLinear(q, scale, minimum, 8 if bits == "per16" else bits,
                                                 torch.randn(out) if bias else None))
    assert packed_linear.apply(torch.nn.Sequential(*layers), kernels) == len(layers)
    return layers


def _word_kernels(activation_bits: int = 16):
    native_kernels.load("auto")
    kernels = native_kernels.active()
    if kernels is None or not kernels.word_blocks_supported():
        pytest.skip("no packed product on this CPU")
    if activation_bits == 8 and not kernels.quad_blocks_supported():
        pytest.skip("this build has no product from 8-bit activations")
    return kernels


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_rows_are_multiplied_as_they_are_and_rounded_once(bias):
    """A bfloat16 model's activations go to the kernel as they are and come back in bfloat16 with the bias added
    before the one rounding: exactly the float32 product of the same rows, plus the bias, rounded to bfloat16."""
    kernels = _word_kernels()
    torch.manual_seed(5)
    for layer in _packed_layers(kernels, [4, 5, 8, "per16"], bias=bias):
        for rows in (1, 7, 13, 40):
            x = torch.randn(rows, 96).bfloat16()
            got = layer(x)
            expected = kernels.blocks_linear(x.float(), layer.packed, layer.block_format, layer.out_features)
            if bias:
                expected += layer.bias
            assert got.dtype == torch.bfloat16 and torch.equal(got, expected.bfloat16()), (layer.block_format, rows)
    x = torch.randn(3, 96).bfloat16()
    x[1, 40] = float("nan")
    out = layer(x)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_layers_of_different_formats_side_by_side_share_one_product():
    """A fused projection whose parts are packed in different formats (a GGUF file's Q5_0 keys beside Q8_0
    values) is one kernel call: each part's columns equal that layer's own product, biases included."""
    kernels = _word_kernels()
    torch.manual_seed(6)
    parts = _packed_layers(kernels, [5, 8, "per16", 4], bias=True)
    parts[1].bias = None  # a part without a bias beside ones with
    fused = packed_linear.SideBySide(parts)
    fused.share_product()
    assert fused.together is not None
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 6, 17):
            x = torch.randn(1, rows, 96).to(dtype)
            got = fused(x)
            assert got.shape == (1, rows, sum(p.out_features for p in parts)) and got.dtype == dtype
            assert torch.equal(got, torch.cat([p(x) for p in parts], dim=-1)), (dtype, rows)


def test_the_direct_product_is_the_forwards_own_and_gives_way_to_a_wrapper():
    """The bound kernel call the compact decoder uses in place of a layer's forward (`direct`) gives the forward's
    result bit for bit, for single layers and a shared product of parts; there is none for a part of a fused layer,
    for gathered inputs, for another dtype, or once something (a LoRA wrapper) replaces the layer's forward."""
    kernels = _word_kernels()
    torch.manual_seed(8)
    layers = _packed_layers(kernels, [4, 5, 8, "per16"], bias=True)
    fused = packed_linear.SideBySide(_packed_layers(kernels, [5, 8], bias=True))
    fused.share_product()
    for dtype in (torch.float32, torch.bfloat16):
        for layer in [*layers, fused]:
            call = layer.direct(dtype)
            for rows in (1, 7, 17):
                x = torch.randn(rows, 96).to(dtype)
                assert torch.equal(call(x), layer(x)), (type(layer).__name__, dtype, rows)
    assert layers[0].direct(torch.float16) is None
    gathered = _packed_layers(kernels, [4])[0]
    gathered.order = torch.arange(95, -1, -1)
    assert gathered.direct(torch.float32) is None
    wrapped = layers[1]
    base = wrapped.forward
    wrapped.forward = lambda x: base(x) + 1  # as engine/lora/layers.py's LoraLinear replaces it
    assert wrapped.direct(torch.float32) is None


def test_a_bfloat16_row_only_goes_to_the_integer_activation_formats():
    """Formats 1 and 2 (float32 activations) refuse bfloat16 rows with an error, not a wrong product."""
    kernels = _word_kernels()
    block_format, packed = kernels.pack_blocks(q4_1_weight(32, 64))
    assert block_format == 1
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.blocks_linear(torch.randn(2, 64).bfloat16(), packed, block_format, 32)
    layer = _packed_layers(kernels, [4])[0]
    with pytest.raises(RuntimeError, match="bias"):
        kernels.blocks_linear(torch.randn(2, 96), layer.packed, layer.block_format, 48, torch.randn(47))


@pytest.mark.parametrize("bits,half", [(4, True), (4, False), (5, True), (5, False), (8, True), (8, False),
                                       ("per16", False), (4, "centred"), (5, "centred")])
def test_eight_bit_activations_stay_within_their_rounding_at_every_row_count(bits, half):
    """Formats 10-16, 21 and 22 (4-, 5- and 8-bit blocks, half or float32 headers, Q6_K's scale per 16, 4- and
    5-bit centred blocks whose minimum the kernel derives, for 8-bit activations): every tile shape of rows gives
    x W^T within half an activation step (1/254 of each block's largest input) times the block's |d q|, float32
    and bfloat16 rows; a row's result does not depend on the rows beside it."""
    kernels = _word_kernels(8)
    torch.manual_seed(7)
    group = 16 if bits == "per16" else 32
    lo, hi = {4: (0, 16), 5: (0, 32), 8: (-128, 128), "per16": (-32, 32)}[bits]
    q = torch.randint(lo, hi, (48, 96), dtype=torch.int8)
    scale = torch.rand(48, 96 // group) * 0.1
    minimum = -7 * scale if bits in (4, 5) else torch.zeros_like(scale) if half or bits == "per16" else scale / 3
    if half == "centred":
        scale = scale.half().float()
        minimum = -(2 ** (bits - 1)) * scale
    elif half:
        scale, minimum = scale.half().float(), minimum.half().float()
    elif bits in (4, 5):
        minimum += 1e-3
    width = 8 if bits == "per16" else bits
    layer = packed_linear.PackedLinear(q, scale, minimum, width)
    words = packed_linear.PackedLinear(q, scale, minimum, width)
    assert packed_linear.apply(torch.nn.Sequential(layer), kernels, activation_bits=8) == 1
    assert packed_linear.apply(torch.nn.Sequential(words), kernels) == 1
    assert layer.block_format == {(4, True): 10, (4, False): 11, (5, True): 12, (5, False): 13, (8, True): 14,
                                  (8, False): 15, ("per16", False): 16, (4, "centred"): 21,
                                  (5, "centred"): 22}[bits, half]
    assert layer.packed.numel() == words.packed.numel()  # the same bytes, arranged by quads
    dq = (q.double().view(48, -1, group) * scale.double()[..., None])  # d q per scale's group
    weight = (dq + minimum.double()[..., None]).view(48, 96)
    dq = dq.reshape(48, -1, 32)  # per block of 32, where the activations' steps are
    for rows in range(1, 41):
        x = torch.randn(rows, 96)
        step = x.double().abs().view(rows, -1, 32).amax(-1) / 254
        bound = step @ dq.abs().sum(-1).T + 1e-4 * (x.double().abs() @ weight.abs().T) + 1e-6
        assert ((layer(x).double() - x.double() @ weight.T).abs() <= bound).all(), rows
        x16 = x.bfloat16()
        assert torch.equal(layer(x16), (kernels.blocks_linear(x16.float(), layer.packed, layer.block_format, 48))
                           .bfloat16())
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
        assert torch.equal(alone, layer(x)), rows


def test_parts_in_every_format_share_one_product_with_8_bit_activations():
    """Under QUANTIZED_ACTIVATIONS=int8 a fused projection of parts in different formats (a GGUF file's Q5_0 keys
    beside Q8_0 values, Q6_K) is one call whose columns are each part's own product."""
    kernels = _word_kernels(8)
    torch.manual_seed(8)
    fresh = []
    for bits in (5, 8, "per16", 4):
        out = 32 if bits == "per16" else 48
        group = 16 if bits == "per16" else 32
        lo, hi = {4: (0, 16), 5: (0, 32), 8: (-128, 128), "per16": (-32, 32)}[bits]
        q = torch.randint(lo, hi, (out, 96), dtype=torch.int8)
        scale = torch.rand(out, 96 // group) * 0.1
        minimum = torch.zeros_like(scale) if bits in (8, "per16") else -scale * 8 + 1e-3
        fresh.append(packed_linear.PackedLinear(q, scale, minimum, 8 if bits == "per16" else bits, torch.randn(out)))
    assert packed_linear.apply(torch.nn.Sequential(*fresh), kernels, activation_bits=8) == 4
    assert [p.block_format for p in fresh] == [13, 15, 16, 11]
    fused = packed_linear.SideBySide(fresh)
    fused.share_product()
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 6, 17):
            x = torch.randn(1, rows, 96).to(dtype)
            assert torch.equal(fused(x), torch.cat([p(x) for p in fresh], dim=-1)), (dtype, rows)


def test_every_integer_activation_format_is_known_to_round_activations():
    """Start-up checks allow for 16-bit activations' rounding where a model has such layers: Q6_K's scale-per-16
    form and the Q5 types' 5-bit forms (formats 7-9, 20) too, so a file of only those keeps its checks' tolerance."""
    from engine.cpu import quantized_weights

    native_kernels.load("auto")
    kernels = native_kernels.active()
    if kernels is None or not kernels.word_blocks_supported():
        pytest.skip("no packed product on this CPU")
    forms = {7: (torch.randint(-32, 32, (16, 64), dtype=torch.int8), torch.rand(16, 4), torch.zeros(16, 4), 8),
             8: (torch.randint(0, 32, (16, 64), dtype=torch.int8), torch.ones(16, 2), -15 * torch.ones(16, 2), 5),
             20: (torch.randint(0, 32, (16, 64), dtype=torch.int8), torch.ones(16, 2), -16 * torch.ones(16, 2), 5),
             9: (torch.randint(0, 32, (16, 64), dtype=torch.int8), torch.rand(16, 2), torch.rand(16, 2), 5)}
    for block_format, (q, scale, minimum, bits) in forms.items():
        model = torch.nn.Sequential(packed_linear.PackedLinear(q, scale, minimum, bits))
        packed_linear.apply(model, kernels)
        assert model[0].block_format == block_format
        assert quantized_weights.rounds_activations(model), block_format
    assert not quantized_weights.rounds_activations(torch.nn.Sequential(torch.nn.Linear(64, 16)))


# Each decoder projection in its own block type; attn_v stays float16 (a dense layer beside packed ones). The
# second layer's value and down projections are Q6_K, as a Q4_K_M file holds about half of them, and its output and
# gate projections Q5_0 / Q5_1, as llama.cpp writes them where a row does not divide into K-quants' 256.
GGUF_TYPES = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "F16", "attn_output": "Q4_0", "ffn_gate": "Q4_K",
              "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
GGUF_SECOND_LAYER = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q5_1"}


def _write_gguf(tmp_path, types: dict, second_layer: dict, embeddings: str = "Q6_K"):
    """A 2-layer GGUF llama file in tmp_path/gguf/tiny.gguf with the embedded model's tokenizer: each decoder
    projection of the first layer in `types`' block type (the second layer's in `second_layer` where it names
    one), the tied embeddings in `embeddings`. Returns the folder."""
    import gguf
    from gguf import quants

    from engine.sources.store import resolve

    embedded = resolve(None, revision=None, cache_dir=tmp_path / "cache")
    folder = tmp_path / "gguf"
    folder.mkdir()
    writer = gguf.GGUFWriter(folder / "tiny.gguf", "llama")
    layers, heads, kv_heads = 2, 4, 2
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(G_HIDDEN)
    writer.add_feed_forward_length(G_FF)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(G_HIDDEN // heads)
    _copy_tokenizer(writer, embedded.path / embedded.gguf_file)
    rng = np.random.default_rng(0)

    def weight(rows, cols):
        return (rng.standard_normal((rows, cols)) / cols ** 0.5).astype(np.float32)

    def blocks(w, kind):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        if kind == "Q6_K":
            return _q6_k_blocks(w), qtype
        if kind in ("Q4_K", "Q5_K"):
            return _k_quant_blocks(w, 4 if kind == "Q4_K" else 5), qtype
        if kind == "F16":
            return w.astype(np.float16), qtype
        return quants.quantize(w, qtype), qtype
    raw, qtype = blocks(weight(VOCAB, G_HIDDEN), embeddings)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", np.ones(G_HIDDEN, np.float32))
    shapes = {"attn_q": (G_HIDDEN, G_HIDDEN), "attn_k": (G_HIDDEN // 2, G_HIDDEN), "attn_v": (G_HIDDEN // 2, G_HIDDEN),
              "attn_output": (G_HIDDEN, G_HIDDEN), "ffn_gate": (G_FF, G_HIDDEN), "ffn_up": (G_FF, G_HIDDEN),
              "ffn_down": (G_HIDDEN, G_FF)}
    for index in range(layers):
        writer.add_tensor(f"blk.{index}.attn_norm.weight", np.ones(G_HIDDEN, np.float32))
        writer.add_tensor(f"blk.{index}.ffn_norm.weight", np.ones(G_HIDDEN, np.float32))
        for name, kind in (types | (second_layer if index == 1 else {})).items():
            raw, qtype = blocks(weight(*shapes[name]), kind)
            writer.add_tensor(f"blk.{index}.{name}.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["auto", "off"])
def test_a_gguf_file_of_k_quants_serves_transformers_tokens(kernels, tmp_path, monkeypatch):
    """With the kernels, and without them (the layers kept at the file's bits, expanded a layer at a time, as for
    a model past the float32 copy's limit)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(packed_linear, "DENSE_LIMIT_BYTES", 0)

    # The head is tied to the embeddings, which a Q4_K_M file holds as Q6_K.
    folder = _write_gguf(tmp_path, GGUF_TYPES, GGUF_SECOND_LAYER)
    expected_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    expected_model.generation_config.eos_token_id = None
    rows = prompts(9)
    expected = [reference(expected_model, ids) for ids in rows]
    # The file's converted copy goes to this test's cache; the kernels' build stays where the others find it.
    monkeypatch.setenv("NATIVE_KERNELS_DIR", str(native_kernels.build_dir()))
    got, served, layers_served = _serve_batched(_engine(folder, cache_dir=tmp_path / "cache",
                                                        native_kernels=kernels), rows)
    assert [c[0] for c in got] == expected
    if kernels == "off":
        by_type = {}
        for layer in layers_served:
            assert layer.packed is None and layer.compact is not None, layer.source
            kind = layer.source.split(" ", 1)[1]
            by_type[kind] = by_type.get(kind, 0) + layer.compact.nbytes * 8 / (layer.in_features * layer.out_features)
        counts = {kind: sum(1 for l in layers_served if l.source.endswith(kind)) for kind in by_type}
        bits = {kind: by_type[kind] / counts[kind] for kind in by_type}
        # q as the file packs it, K-quants' 6-bit s and t as bytes and D, M per 256 inputs in float32, Q4_0 / Q5_0
        # / Q8_0 with a half-precision d a block, Q4_1 / Q5_1 with d and m (Q4_1 and Q8_0 too: nothing recovers
        # them from float32 weights without the kernels)
        assert bits == {"(GGUF Q4_K)": 4 + 16 / 32 + 64 / 256, "(GGUF Q5_K)": 5 + 16 / 32 + 64 / 256,
                        "(GGUF Q6_K)": 8 + 8 / 16 + 32 / 256, "(GGUF Q4_0)": 4 + 16 / 32, "(GGUF Q5_0)": 5 + 16 / 32,
                        "(GGUF Q5_1)": 5 + 32 / 32, "(GGUF Q4_1)": 4 + 32 / 32, "(GGUF Q8_0)": 8 + 16 / 32}, bits
        return
    # Q4_K (query, gate), Q5_K (key), Q4_0 (output) a layer, the second layer's Q6_K (value, down), Q5_0 (output)
    # and Q5_1 (gate), and the tied Q6_K head from their blocks, the query and key rows in transformers' order;
    # Q8_0 and Q4_1 in a float32 model take the exact-block product of their float32 weights.
    sources = sorted(layer.source.split(" ", 1)[1] for layer in layers_served)
    assert sources == ["(GGUF Q4_0)", "(GGUF Q4_K)", "(GGUF Q4_K)", "(GGUF Q4_K)", "(GGUF Q5_0)", "(GGUF Q5_1)",
                       "(GGUF Q5_K)", "(GGUF Q5_K)", "(GGUF Q6_K)", "(GGUF Q6_K)", "(GGUF Q6_K)"], sources
    model = served.model
    assert isinstance(model.lm_head, packed_linear.PackedLinear) and model.lm_head.source == "lm_head (GGUF Q6_K)"
    assert type(model.get_input_embeddings()) is torch.nn.Embedding  # the rows a prompt looks up stay dense
    assert served.compact is not None, served.compact_reason


@pytest.mark.slow
def test_a_bfloat16_gguf_model_reads_every_block_type_from_the_file(tmp_path, monkeypatch):
    """A file like llama.cpp's Q4_K_M of a model whose rows do not divide into 256 (mostly Q5_0, Q8_0 where it
    keeps more bits, Q8_0 tied embeddings) loads as bfloat16: every one of its layers, Q4_1 / Q8_0 included,
    multiplies from the file's blocks, and every greedy token the worker picks is transformers' own pick for the
    same text, or within bfloat16's rounding of it (teacher-forced: a near tie may fall either way, and the tokens
    after it then differ; a misread block would be off by far more)."""
    from transformers import AutoModelForCausalLM

    types = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
             "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
    folder = _write_gguf(tmp_path, types, {"attn_v": "Q6_K", "ffn_down": "Q6_K"}, embeddings="Q8_0")
    expected_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="tiny.gguf", dtype=torch.bfloat16).eval()
    expected_model.generation_config.eos_token_id = None
    rows = prompts(9)
    monkeypatch.setenv("NATIVE_KERNELS_DIR", str(native_kernels.build_dir()))
    got, served, layers_served = _serve_batched(_engine(folder, cache_dir=tmp_path / "cache", dtype="bfloat16"), rows)
    for ids, choices in zip(rows, got):
        tokens = choices[0]
        assert len(tokens) == NEW_TOKENS
        with torch.inference_mode():
            logits = expected_model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
        behind = logits.max(1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (behind <= 2**-4).all(), behind  # logits up to ~5: bfloat16 steps of 2^-6 there
    sources = sorted(layer.source.split(" ", 1)[1] for layer in layers_served)
    # Q5_0 query, key and output in both layers (5-bit blocks); the first layer's value and down and the head Q8_0.
    assert sources == ["(GGUF Q4_1)"] * 2 + ["(GGUF Q5_0)"] * 6 + ["(GGUF Q5_1)"] * 2 + ["(GGUF Q6_K)"] * 2 + [
        "(GGUF Q8_0)"] * 3, sources
    assert served.model.lm_head.source == "lm_head (GGUF Q8_0)"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bitsandbytes-nf4-b64-double-quant", "gptq-4bit-g32-desc-act"])
def test_a_quantized_base_serves_its_lora_adapter(fmt, tmp_path, tokenizer_folder):
    """QLoRA's deployment: a 4-bit checkpoint (NF4; GPTQ with act order, whose q/k/v stay separate products side
    by side) with a LoRA adapter on every projection. Rows with and without the adapter, decoding together, give
    the tokens of PEFT's merged model on the dequantized weights, and of that model without the adapter."""
    from transformers import AutoModelForCausalLM

    from engine.lora import LoraSpec
    from test_lora import lora_engine, make_adapter, run_mixed

    folder, reference_folder = tmp_path / "quantized", tmp_path / "reference"
    write_quantized(folder, reference_folder, dense_llama(folder, tokenizer_folder), *FORMATS[fmt])
    base = AutoModelForCausalLM.from_pretrained(reference_folder, dtype=torch.float32).eval()
    merged = make_adapter(base, tmp_path / "qlora", seed=7)
    rows = prompts(7)
    jobs = [(name, ids) for ids in rows for name in (None, "qlora")]
    expected = [reference(merged if name else base, ids) for name, ids in jobs]
    assert expected[0] != expected[1], "the adapter changes nothing"
    engine = lora_engine(folder, [LoraSpec("qlora", str(tmp_path / "qlora"))], max_loras=1)
    try:
        got = run_mixed(engine, jobs)
        layers = packed_linear.layers(engine.engine.runner.model)
        assert layers and all(layer.packed is not None for layer in layers), "not served from packed blocks"
    finally:
        engine.close()
    for (name, ids), tokens, want in zip(jobs, got, expected):
        assert tokens == want, f"adapter {name}, prompt of {len(ids)} tokens"


# Bits a weight the layers keep without the kernels: q as the file packs it, each group's scale (half precision
# where the file's is) and zero point byte once; a minimum that follows from the scale (symmetric) none.
COMPACT_BITS = {"gptq-4bit-g32-sym": 4 + 16 / 32, "gptq-4bit-g64-zero-points": 4 + 24 / 64,
                "gptq-4bit-g128-desc-act": 4 + 24 / 128, "gptq-4bit-g32-desc-act": 4 + 16 / 32,
                "gptq-8bit-g32": 8 + 24 / 32, "awq-gemm-g64": 4 + 24 / 64,
                "compressed-w4a16-g32-asym": 4 + 24 / 32, "compressed-w8a16-g64": 8 + 16 / 64,
                "bitsandbytes-nf4-b64-double-quant": 4 + 32 / 64, "bitsandbytes-fp4-b128": 4 + 32 / 128}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(set(FORMATS) - {"fp8-block-128"}))
def test_without_the_kernels_a_quantized_checkpoint_stays_at_its_size(fmt, tmp_path, tokenizer_folder, monkeypatch):
    """NATIVE_KERNELS=off, as on a CPU or an architecture without our packed product, and a model whose float32
    copy would pass the limit (here any): no layer holds float32 or any dense copy of its weights; each keeps about
    the file's bits and expands to float32 a layer at a time for PyTorch's product, so the tokens are the
    dequantized model's."""
    monkeypatch.setattr(packed_linear, "DENSE_LIMIT_BYTES", 0)

    folder, expected_model, rows, expected = _checkpoint_and_reference(fmt, tmp_path, tokenizer_folder)
    got, served, layers = _serve_batched(_engine(folder, native_kernels="off"), rows)
    _assert_reference_tokens(fmt, rows, got, expected, expected_model)
    assert layers and all(layer.packed is None and layer.compact is not None for layer in layers)
    for layer in layers:  # nothing of the layer's is dense: q, scales and minimums went to the compact form
        assert layer.q is None and layer.scale is None and layer.minimum is None
    weights = sum(layer.in_features * layer.out_features for layer in layers)
    bits = sum(layer.compact.nbytes for layer in layers) * 8 / weights
    if fmt in COMPACT_BITS:
        assert bits == COMPACT_BITS[fmt], (fmt, bits)
    else:  # a scale a row: 4 bits and a half-precision scale, or 8 bits and a float32 one, per row of 128 or 256
        assert (4 < bits < 4 + 16 / 128) if "4bit" in fmt else (8 < bits < 8 + 32 / 128), (fmt, bits)


@pytest.mark.slow
def test_without_the_kernels_a_small_quantized_model_is_expanded_once(tmp_path, tokenizer_folder, monkeypatch, caplog):
    """Below the limit (1 GiB of float32 layers; the tiny model's are well below) the float32 copy is made once:
    at a few rows its product runs several times faster than expanding at every step. The tokens are the
    dequantized model's either way."""
    assert packed_linear.DENSE_LIMIT_BYTES == 2**30
    folder, expected_model, rows, expected = _checkpoint_and_reference("gptq-4bit-g64-zero-points", tmp_path,
                                                                       tokenizer_folder)
    with caplog.at_level("WARNING"):
        got, served, layers = _serve_batched(_engine(folder, native_kernels="off"), rows)
    _assert_reference_tokens("gptq-4bit-g64-zero-points", rows, got, expected, expected_model)
    assert layers and all(l.dense is not None and l.compact is None and l.packed is None for l in layers)
    assert "expanded to float32 once" in caplog.text
