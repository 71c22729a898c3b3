"""A GGUF file's Q4_0 / Q5_0 / Q5_1 / K-quant layers (and Q4_1 / Q8_0 ones outside the float32 block path)
multiplied from the file's own blocks."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.cpu.packed_linear import PANEL, PackedLinear, parent_module as _parent
from engine.quantization.methods import QuantizationError

log = logging.getLogger("engine.quantization")

# GGUF block types whose weights are w = d * q + m per 32 weights of one row (K-quants: sub-blocks of 32 with
# 6-bit scales and minimums times the super-block's half-precision d and dmin, exact in float32), served from
# their blocks. Q4_1 / Q8_0 (readable too) keep engine/cpu/quantized_weights.py's product, which a probe weighs
# against bfloat16; a file mostly of other types loads as bfloat16, and there its Q4_1 / Q8_0 layers are read from
# their blocks too (GGUF_RECOVERED_TYPES). Q6_K (w = d * s * q per 16 weights, q in -32..31; Q4_K_M files hold their
# output head and about half the value and down projections in it) takes the product's scale-per-16 form. Q5_0 /
# Q5_1 / Q5_K (q 0..31) take its 5-bit form; llama.cpp writes Q5_0 wherever a K-quant's 256 does not divide a row
# (a 960-wide model's Q4_K_M file is mostly Q5_0). Q2_K / Q3_K / IQ types are not read here: such layers keep the
# dense weights transformers expanded from the file.
GGUF_BLOCK_TYPES = ("Q4_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
GGUF_RECOVERED_TYPES = ("Q4_1", "Q8_0")


def _halves(raw, start: int):
    import numpy as np

    return raw[..., start:start + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _k_scales(s):
    """A K-quant super-block's 12 scale bytes -> (scales, minimums) of its 8 sub-blocks, 6 bits each."""
    import numpy as np

    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def gguf_blocks(kind: str, raw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, tuple | None]:
    """A GGUF tensor's raw rows (uint8 [rows, bytes]) of a type in GGUF_BLOCK_TYPES -> (q int8 [rows, in],
    d [rows, in / 32], m [rows, in / 32], bits, supers): w = d * q + m, as ggml's dequantization computes it. Q6_K
    gives d and m [rows, in / 16] (m zero). Q4_K and Q5_K give their two-level scales too, supers = (D, s, M, t):
    d = D s and m = -M t, D and M float32 [rows, in / 256], s and t uint8 [rows, in / 32]; Q6_K supers = (D, s),
    s int8 [rows, in / 16], d = D s; else None."""
    import numpy as np

    rows = raw.shape[0]
    supers = None
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        b = raw.reshape(rows, -1, size)
        d = _halves(b, 0)
        m = -8 * d if kind == "Q4_0" else _halves(b, 2)
        qs = b[..., size - 16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # weights 0..15 low nibbles, 16..31 high
        bits = 4
    elif kind in ("Q5_0", "Q5_1"):
        # d (and Q5_1's m) half, 4 bytes whose bit j is weight j's fifth bit, then nibbles as Q4_0's
        size = 22 if kind == "Q5_0" else 24
        b = raw.reshape(rows, -1, size)
        d = _halves(b, 0)
        qh = b[..., size - 20:size - 16].copy().view(np.uint32)  # [rows, blocks, 1], little-endian as ggml's
        qs = b[..., size - 16:]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int16)
        q = q + 16 * ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
        m = -16 * d if kind == "Q5_0" else _halves(b, 2)
        bits = 5
    elif kind == "Q8_0":
        b = raw.reshape(rows, -1, 34)
        d = _halves(b, 0)
        m = np.zeros_like(d)
        q = b[..., 2:].copy().view(np.int8)
        bits = 8
    elif kind in ("Q4_K", "Q5_K"):
        size = 144 if kind == "Q4_K" else 176
        b = raw.reshape(rows, -1, size)
        sc, mn = _k_scales(b[..., 4:16])
        big_d, big_m = _halves(b, 0)[..., None], _halves(b, 2)[..., None]  # [rows, super-blocks, 1]
        d = (big_d * sc).reshape(rows, -1)
        m = -(big_m * mn).reshape(rows, -1)
        supers = tuple(torch.from_numpy(np.ascontiguousarray(v.reshape(rows, -1))) for v in (
            big_d, sc.astype(np.uint8), big_m, mn.astype(np.uint8)))
        qs = b[..., size - 128:].reshape(rows, -1, 4, 32)  # pair i: sub-block 2i low nibbles, 2i + 1 high
        q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, -1, 8, 32)
        if kind == "Q5_K":  # bit j of qh[l] is the fifth bit of sub-block j's weight l
            qh = b[..., 16:48]
            q = q + 16 * ((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1)
        bits = 4 if kind == "Q4_K" else 5
    elif kind == "Q6_K":
        # block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed sub-block scales, half d. Each half
        # of 128 weights: quarter t (32 weights) has nibbles from bytes 0..31 (t even) or 32..63 (t odd) of its 64,
        # low (t < 2) or high, and bits 2t, 2t + 1 of its 32 high bytes.
        b = raw.reshape(rows, -1, 210)
        ql = b[..., 0:128].reshape(rows, -1, 2, 2, 32)  # [.., half, bytes 0..31 / 32..63, l]
        qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
        low = np.stack([ql[:, :, :, 0] & 0xF, ql[:, :, :, 1] & 0xF, ql[:, :, :, 0] >> 4, ql[:, :, :, 1] >> 4], axis=3)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
        q = (low | (high << 4)).astype(np.int16) - 32
        big_d, s = _halves(b, 208), b[..., 192:208].copy().view(np.int8)
        d = big_d[..., None] * s.astype(np.float32)
        m = np.zeros_like(d)
        supers = (torch.from_numpy(np.ascontiguousarray(big_d)), torch.from_numpy(s.reshape(rows, -1).copy()))
        bits = 8
    else:
        raise QuantizationError(f"GGUF type {kind} has no packed form here")
    q = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1).astype(np.int8)))
    return (q, torch.from_numpy(d.reshape(rows, -1).copy()), torch.from_numpy(m.reshape(rows, -1).copy()), bits,
            supers)


def _head_order(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a llama GGUF file's query or key weight (it undoes llama.cpp's
    interleaving of each head's rotary halves): row r of the model's weight is row order[r] of the file's."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def gguf_layers(model: torch.nn.Module, path: Path, types: tuple[str, ...]) -> int:
    """Replace the decoder's linear layers whose GGUF tensor is one of `types` by PackedLinear layers read from
    the file's blocks, each kept only where its dequantized weights equal the weights transformers loaded (within
    the loaded type's rounding; the query and key rows in llama's order tried too). Returns how many."""
    import gguf

    from engine.quantization import gguf_header

    arch_name, file_tensors = gguf_header.read(path)
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        return 0
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors = {t.name: t for t in file_tensors}
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    replaced, kept = 0, {}
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        # A tied head is the file's token embeddings (a Q4_K_M file holds them as Q6_K): the head multiplies from
        # their blocks and the embedding keeps its rows, so the two are untied below.
        file_name = "token_embd.weight" if module is head and tied else names.get_name(
            f"{name}.weight", try_suffixes=(".weight",))
        tensor = tensors.get(file_name or "")
        if tensor is None or tensor.tensor_type.name not in types:
            if tensor is not None:
                kept[tensor.tensor_type.name] = kept.get(tensor.tensor_type.name, 0) + 1
            continue
        q, d, m, bits, supers = gguf_blocks(tensor.tensor_type.name, tensor.data)
        dense = module.weight.detach().float()
        if q.shape != dense.shape or q.shape[0] % PANEL:  # (a vocabulary not a multiple of the kernel's panel)
            kept[tensor.tensor_type.name] = kept.get(tensor.tensor_type.name, 0) + 1
            continue
        layer = PackedLinear(q, d, m, bits, None if module.bias is None else module.bias.detach().float(), None,
                             f"{name} (GGUF {tensor.tensor_type.name})", supers=supers)
        tolerance = 1e-6 if module.weight.dtype == torch.float32 else 2**-8
        weight = layer.weight_float()
        if not torch.allclose(weight, dense, rtol=tolerance, atol=1e-30):
            heads = {"q_proj": config.num_attention_heads,
                     "k_proj": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
            order = _head_order(dense.shape[0], heads[name.rpartition(".")[2]]) if name.endswith(
                tuple(heads)) else None
            if order is None or not torch.allclose(weight[order], dense, rtol=tolerance, atol=1e-30):
                log.warning("GGUF: %s's blocks do not give the weights transformers loaded; it keeps them", name)
                continue
            layer = PackedLinear(q[order].contiguous(), d[order].contiguous(), m[order].contiguous(), bits,
                                 layer.bias, None, layer.source,
                                 supers=None if supers is None else tuple(f[order].contiguous() for f in supers))
        parent, child = _parent(model, name)
        setattr(parent, child, layer)
        if module is head and tied:
            model.config.tie_word_embeddings = False  # nothing may tie the embedding's weight back onto the head
            model.config.get_text_config().tie_word_embeddings = False
        replaced += 1
    log.info("GGUF: %d linear layers from their file's blocks (%s); %s", replaced, ", ".join(types),
             ", ".join(f"{n} {t} layers keep dense weights" for t, n in kept.items()) or "no others")
    return replaced
