"""Quantized checkpoints: which method a model folder holds (QUANTIZATION, or its config.json's
`quantization_config`, or a GGUF file), and, on CPU, its linear layers read from the file's packed tensors.

transformers' own quantizer integrations mostly need CUDA libraries (gptqmodel, autoawq's kernels, bitsandbytes'
GPU builds), so on CPU this module builds the model without them: every layer a method quantized becomes an
engine/cpu/packed_linear.PackedLinear (w = d * q + m per block of 32 inputs) straight from the file's integers,
and the rest (embeddings, norms, unquantized heads) loads as usual. On CUDA transformers' integrations load the
checkpoint. A method, bit width, group size or layout this cannot serve exactly is refused at start-up in one
line naming it: never served wrong.

The readers follow each format's specification (docs/cpu-kernels.md#quantized-checkpoints has the layouts):
- GPTQ (`gptq`): qweight int32 [in * bits / 32, out] packed along the inputs, qzeros int32 [groups, out * bits /
  32] packed along the outputs and holding z - 1 (checkpoint_format `gptq`; `gptq_v2` holds z), scales
  [groups, out], g_idx [in] (act order: groups out of input order, gathered once here);
- AWQ (`awq`, GEMM): qweight int32 [in, out / 8] and qzeros [groups, out / 8] packed along the outputs in the
  nibble order 0 2 4 6 1 3 5 7, scales [groups, out];
- compressed-tensors (`compressed-tensors`): pack-quantized weight_packed int32 [out, in * bits / 32] of q +
  2^(bits-1), weight_scale [out, groups], weight_zero_point packed along the outputs, weight_shape; int-quantized
  int8 weights; float-quantized FP8 weights;
- fine-grained FP8 (`fp8`): float8_e4m3fn weights and float32 weight_scale_inv per 128 x 128 block;
- bitsandbytes int8 (`bitsandbytes`, load_in_8bit): int8 weight and SCB, w = q * SCB / 127 per output;
- bitsandbytes 4-bit (load_in_4bit, nf4 or fp4): uint8 weight [out * in / 2, 1] holding two codes a byte (the
  first in the high nibble) of the flattened weight, absmax per `blocksize` of it (with double quantization:
  uint8 indices into nested_quant_map, times nested_absmax per nested_blocksize, plus nested_offset), quant_map
  the 16 values, and quant_state.bitsandbytes__<type> the JSON of the rest; w = absmax * quant_map[q].
FP8 weights have no integer form (e4m3 is not uniform): they load as dense weights of the model's type
(float32 holds e4m3 times a bfloat16 or float16 scale exactly).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine.cpu.packed_linear import BLOCK, CODE_TABLES, PackedLinear, parent_module as _parent
from engine.quantization.methods import QuantizationError, quantization_config

log = logging.getLogger("engine.quantization")

# --- reading the checkpoint's tensors ---------------------------------------------------------------------------

class _Tensors:
    """The folder's safetensors tensors by name, read when asked; `unused` is what no reader has taken."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise QuantizationError(f"no .safetensors files in {folder} (quantized checkpoints load from "
                                    f"safetensors)")
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._where = {name: f for f, h in self._handles.items() for name in h.keys()}
        self.unused = set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        self.unused.discard(name)
        return self._handles[self._where[name]].get_tensor(name)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits unsigned values each, lowest bits first, along `dim` -> int32 values."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        values = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
        return values.reshape(-1, packed.shape[1])
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(packed.shape[0], -1)


def _input_order(groups: torch.Tensor, name: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(order, group of each block of 32 inputs in that order) for the group index of every input column: None
    where blocks of 32 in file order already lie in one group each; else the columns sorted by group (GPTQ's
    act order), refused where a group does not fill whole blocks of 32."""
    k = groups.numel()
    if k % BLOCK:
        raise QuantizationError(f"{name}: {k} inputs do not divide into blocks of {BLOCK}")
    blocks = groups.view(-1, BLOCK)
    if bool((blocks == blocks[:, :1]).all()):
        return None, blocks[:, 0].long()
    order = torch.sort(groups.long(), stable=True).indices
    blocks = groups[order].view(-1, BLOCK)
    if not bool((blocks == blocks[:, :1]).all()):
        raise QuantizationError(f"{name}: its quantization groups do not split into blocks of {BLOCK} inputs")
    return order, blocks[:, 0].long()


def _blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, groups: torch.Tensor, bits: int,
            name: str, bias: torch.Tensor | None, offset: int) -> PackedLinear:
    """A layer w[o, i] = scale[o, g(i)] * (q[o, i] - zero[o, g(i)]) (q unsigned, 0..2^bits - 1; groups: g(i) per
    input) as a PackedLinear: 4-bit q kept, 8-bit q shifted by -128 into int8 (its minimum takes the shift).
    `offset` is added to the zero points (GPTQ's z - 1 convention)."""
    order, block_groups = _input_order(groups, name)
    if order is not None:
        q = q.index_select(1, order)
    d = scale.float().index_select(1, block_groups)
    z = (zero.float() + offset).index_select(1, block_groups)
    shift = 128 if bits == 8 else 0
    minimum = d * (shift - z)  # exact in float32: d has at most 11 significant bits, shift - z at most 9
    q = (q - shift).to(torch.int8)
    try:
        return PackedLinear(q.contiguous(), d, minimum, bits, bias, order, name)
    except ValueError as exc:
        raise QuantizationError(f"{name}: {exc}") from None


def _group_index(k: int, groups: int, name: str, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    if g_idx is not None:
        return g_idx.to(torch.int64)
    if groups < 1 or k % groups:
        raise QuantizationError(f"{name}: {k} inputs do not split into {groups} groups")
    return torch.arange(k) // (k // groups)


def _check_bits(method: str, bits, allowed=(4, 8)) -> int:
    if bits not in allowed:
        raise QuantizationError(f"{method} with {bits}-bit weights is not supported (only "
                                f"{' and '.join(map(str, allowed))}-bit)")
    return bits


class _Gptq:
    def __init__(self, qc: dict):
        self.bits = _check_bits("GPTQ", qc.get("bits"))
        group = qc.get("group_size", 128)
        if group not in (-1, None) and (not isinstance(group, int) or group % BLOCK):
            raise QuantizationError(f"GPTQ group_size {group} is not supported (a multiple of {BLOCK}, or -1)")
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizationError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0  # gptq (v1) files hold z - 1

    def read(self, t: _Tensors, name: str):
        if f"{name}.qweight" not in t:
            return None
        q = _unpack(t.get(f"{name}.qweight"), self.bits, 0).t()  # [out, in]
        scales = t.get(f"{name}.scales").t()  # [out, groups]
        zeros = _unpack(t.get(f"{name}.qzeros"), self.bits, 1).t()  # [out, groups]
        g_idx = t.optional(f"{name}.g_idx")
        groups = _group_index(q.shape[1], scales.shape[1], name, g_idx)
        return _blocks(q, scales, zeros, groups, self.bits, name, t.optional(f"{name}.bias"), self.zero_offset)


_AWQ_ORDER = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # output column (within 8) held by nibble 0, 1, ... of a word


class _Awq:
    def __init__(self, qc: dict):
        _check_bits("AWQ", qc.get("bits", qc.get("w_bit")), (4,))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(f"AWQ version {version!r} is not supported (gemm)")
        if not qc.get("zero_point", True):
            raise QuantizationError("AWQ without zero points is not supported")

    @staticmethod
    def _unpack(packed: torch.Tensor) -> torch.Tensor:
        nibbles = _unpack(packed, 4, 1).view(packed.shape[0], -1, 8)
        values = torch.empty_like(nibbles)
        values[:, :, _AWQ_ORDER] = nibbles
        return values.view(packed.shape[0], -1)

    def read(self, t: _Tensors, name: str):
        if f"{name}.qweight" not in t:
            return None
        q = self._unpack(t.get(f"{name}.qweight")).t()  # [out, in]
        zeros = self._unpack(t.get(f"{name}.qzeros")).t()  # [out, groups]
        scales = t.get(f"{name}.scales").t()
        groups = _group_index(q.shape[1], scales.shape[1], name)
        return _blocks(q, scales, zeros, groups, 4, name, t.optional(f"{name}.bias"), 0)


def _fp8_dense(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8 weights [out, in] times scales that divide them into equal blocks (per tensor, per output, per
    group or per 2-D block; partial blocks at the ends), in float32."""
    out, k = weight.shape
    scale = scale.float().reshape(-1, 1) if scale.dim() < 2 else scale.float()
    rows, cols = -(-out // scale.shape[0]), -(-k // scale.shape[1])
    expanded = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :k]
    return weight.float() * expanded


class _CompressedTensors:
    def __init__(self, qc: dict):
        self.format = qc.get("format")
        self.schemes = []
        for group_name, group in (qc.get("config_groups") or {}).items():
            if group.get("input_activations"):
                raise QuantizationError(f"compressed-tensors group {group_name} quantizes activations too; only "
                                        f"weight-only schemes (W4A16, W8A16, FP8 weights) are supported")
            weights = group.get("weights") or {}
            kind, bits = weights.get("type", "int"), weights.get("num_bits")
            if kind == "float":
                if bits != 8:
                    raise QuantizationError(f"compressed-tensors {bits}-bit float weights are not supported (FP8)")
            elif kind == "int":
                _check_bits("compressed-tensors", bits)
            else:
                raise QuantizationError(f"compressed-tensors weight type {kind!r} is not supported")
            self.schemes.append((kind, bits))
        if not self.schemes:
            raise QuantizationError("compressed-tensors quantization_config has no config_groups")
        fmt = self.format or (group.get("format") if len(self.schemes) == 1 else None)
        if fmt not in (None, "pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "mixed-precision"):
            raise QuantizationError(f"compressed-tensors format {fmt!r} is not supported (pack-quantized, "
                                    f"int-quantized, float-quantized)")

    def read(self, t: _Tensors, name: str):
        bias = t.optional(f"{name}.bias") if f"{name}.weight_scale" in t else None
        if f"{name}.weight_packed" in t:
            shape = [int(v) for v in t.get(f"{name}.weight_shape").tolist()]
            scale = t.get(f"{name}.weight_scale")
            packed = t.get(f"{name}.weight_packed")
            bits = _check_bits("compressed-tensors", 32 * packed.shape[1] // shape[1])
            q = _unpack(packed, bits, 1)[:, :shape[1]]  # unsigned: q + 2^(bits-1)
            zero = t.optional(f"{name}.weight_zero_point")
            zero = (_unpack(zero, bits, 0)[:shape[0]] if zero is not None
                    else torch.full_like(scale, 1 << (bits - 1), dtype=torch.int32))
            return self._layer(q, scale, zero, bits, name, bias, t.optional(f"{name}.weight_g_idx"))
        if f"{name}.weight_scale" not in t:
            return None
        weight = t.get(f"{name}.weight")
        scale = t.get(f"{name}.weight_scale")
        if weight.dtype == torch.float8_e4m3fn:
            return _fp8_dense(weight, scale), bias
        if weight.dtype != torch.int8:
            raise QuantizationError(f"{name}: compressed-tensors weight of type {weight.dtype} is not supported")
        zero = t.optional(f"{name}.weight_zero_point")
        # int8 values are signed: unsigned q = value + 128, the zero point moves with it
        zero = (zero.to(torch.int32) if zero is not None else torch.zeros_like(scale, dtype=torch.int32)) + 128
        return self._layer(weight.to(torch.int32) + 128, scale, zero, 8, name, bias,
                           t.optional(f"{name}.weight_g_idx"))

    @staticmethod
    def _layer(q, scale, zero, bits, name, bias, g_idx):
        scale = scale.reshape(q.shape[0], -1)
        zero = zero.reshape(q.shape[0], -1)
        groups = _group_index(q.shape[1], scale.shape[1], name, g_idx)
        return _blocks(q, scale, zero, groups, bits, name, bias, 0)


class _Fp8:
    def __init__(self, qc: dict):
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise QuantizationError(f"FP8 activation_scheme {qc.get('activation_scheme')!r} is not supported "
                                    f"(dynamic)")

    def read(self, t: _Tensors, name: str):
        if f"{name}.weight_scale_inv" in t:
            scale = t.get(f"{name}.weight_scale_inv")
        elif f"{name}.weight_scale" in t:
            scale = t.get(f"{name}.weight_scale")
        else:
            return None
        return _fp8_dense(t.get(f"{name}.weight"), scale), t.optional(f"{name}.bias")


class _Bitsandbytes:
    """bitsandbytes int8 or 4-bit: each layer's own tensors say which (SCB, or quant_state and its table)."""

    def __init__(self, qc: dict):
        del qc

    def read(self, t: _Tensors, name: str):
        if f"{name}.weight.absmax" in t:
            return self._four_bit(t, name)
        if f"{name}.SCB" not in t:
            return None
        t.optional(f"{name}.weight_format")  # "row": the only layout transformers saves
        weight = t.get(f"{name}.weight")
        scb = t.get(f"{name}.SCB").float()
        d = (scb / 127).unsqueeze(1).expand(-1, weight.shape[1] // BLOCK)
        try:
            return PackedLinear(weight.contiguous(), d, torch.zeros_like(d), 8, t.optional(f"{name}.bias"), None,
                                name)
        except ValueError as exc:
            raise QuantizationError(f"{name}: {exc}") from None

    @staticmethod
    def _four_bit(t: _Tensors, name: str) -> PackedLinear:
        states = [k for k in (f"{name}.weight.quant_state.bitsandbytes__{c}" for c in CODE_TABLES) if k in t]
        if len(states) != 1:
            raise QuantizationError(f"{name}: a bitsandbytes 4-bit layer needs one quant_state.bitsandbytes__nf4 "
                                    f"or __fp4 tensor")
        state = json.loads(bytes(t.get(states[0]).to(torch.uint8).tolist()).decode("utf-8"))
        table = state.get("quant_type")
        if table not in CODE_TABLES:
            raise QuantizationError(f"{name}: bitsandbytes quant_type {table!r} is not supported (nf4, fp4)")
        values = torch.tensor(CODE_TABLES[table][0])
        quant_map = t.get(f"{name}.weight.quant_map").float().flatten()
        # bitsandbytes' CPU backend writes FP4's values to 4 decimals; any other table would be served wrong.
        if quant_map.shape != (16,) or not torch.allclose(quant_map, values, rtol=0, atol=1e-4):
            raise QuantizationError(f"{name}: its quant_map is not bitsandbytes' {table} table")
        n, k = (int(v) for v in state.get("shape") or (0, 0))
        blocksize = int(state.get("blocksize", 0))
        packed = t.get(f"{name}.weight")
        if packed.dtype != torch.uint8 or packed.numel() != (n * k + 1) // 2:
            raise QuantizationError(f"{name}: bitsandbytes 4-bit weight of {packed.dtype} {tuple(packed.shape)} does "
                                    f"not hold a {n}x{k} weight (quant_storage uint8)")
        if k % BLOCK or blocksize <= 0 or blocksize % BLOCK:
            raise QuantizationError(f"{name}: bitsandbytes blocksize {blocksize} of a {n}x{k} weight does not "
                                    f"divide into the kernel's blocks of {BLOCK} inputs")
        flat = packed.flatten()
        q = torch.stack((flat >> 4, flat & 15), 1).flatten()[:n * k].view(n, k).to(torch.int8)
        absmax = t.get(f"{name}.weight.absmax")
        if "nested_blocksize" in state:  # double quantization: absmax's own 8-bit blocks
            nested = t.get(f"{name}.weight.nested_absmax").float()
            nested_map = t.get(f"{name}.weight.nested_quant_map").float()
            index = torch.arange(absmax.numel()) // int(state["nested_blocksize"])
            absmax = nested_map[absmax.long()] * nested[index] + float(state["nested_offset"])
        absmax = absmax.float().flatten()
        if absmax.numel() != -(-n * k // blocksize):
            raise QuantizationError(f"{name}: {absmax.numel()} absmax values for a {n}x{k} weight in blocks of "
                                    f"{blocksize}")
        scale = absmax[torch.arange(0, n * k, BLOCK) // blocksize].view(n, k // BLOCK)
        try:
            return PackedLinear(q, scale, torch.zeros_like(scale), 4, t.optional(f"{name}.bias"), None, name,
                                codes=table)
        except ValueError as exc:
            raise QuantizationError(f"{name}: {exc}") from None


_READERS = {"gptq": _Gptq, "awq": _Awq, "compressed-tensors": _CompressedTensors, "fp8": _Fp8,
            "bitsandbytes": _Bitsandbytes}
READ_ON_CPU = tuple(_READERS)  # the methods `load` reads on CPU (GGUF: engine/sources/gguf.py and the blocks)


def load(folder: Path, config, method: str, dtype: torch.dtype, **model_kwargs) -> torch.nn.Module:
    """The causal LM of a quantized checkpoint in `folder` on CPU: quantized linear layers as PackedLinear
    (FP8: dense weights of `dtype`), everything else in `dtype`. Raises QuantizationError naming what cannot
    be served."""
    from transformers import AutoModelForCausalLM

    qc = quantization_config(config)
    reader = _READERS[method](qc)
    tensors = _Tensors(folder)
    config = type(config).from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    head_name = "lm_head"
    if any(n.startswith(f"{head_name}.") for n in tensors.unused) and f"{head_name}.weight" not in tensors:
        config.tie_word_embeddings = False  # a quantized head of its own
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **model_kwargs)
    dense: dict[str, torch.Tensor] = {}
    packed = 0
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear:
            continue
        read = reader.read(tensors, name)
        if isinstance(read, PackedLinear):
            if (read.out_features, read.in_features) != (module.out_features, module.in_features):
                raise QuantizationError(f"{name}: the checkpoint's {read.out_features}x{read.in_features} weight "
                                        f"does not fit the model's {module.out_features}x{module.in_features} layer")
            parent, child = _parent(model, name)
            setattr(parent, child, read)
            packed += 1
        elif read is not None:
            weight, bias = read
            dense[f"{name}.weight"] = weight
            if bias is not None:
                dense[f"{name}.bias"] = bias
    if not packed and not dense:
        raise QuantizationError(f"no {method} layers found in {folder} (the tensors' names match none of the "
                                f"model's linear layers)")
    expected = set(model.state_dict())
    for name in sorted(tensors.unused):
        if name in expected:
            dense[name] = tensors.get(name)
    leftover = sorted(n for n in tensors.unused if not n.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise QuantizationError(f"{method} checkpoint tensors this worker does not know how to read: "
                                f"{', '.join(leftover[:3])}{' ...' if len(leftover) > 3 else ''}")
    model.to_empty(device="cpu")
    with torch.no_grad():
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in dense.items()}
        missing, _ = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if model.get_parameter(k).data_ptr()
                   != model.get_input_embeddings().weight.data_ptr()] if missing else missing
    persistent_missing = [k for k in missing if not k.endswith("inv_freq")]
    if persistent_missing:
        raise QuantizationError(f"the checkpoint lacks {', '.join(persistent_missing[:3])}"
                                f"{' ...' if len(persistent_missing) > 3 else ''}")
    for name, module in model.named_modules():  # buffers computed at construction (rotary frequencies)
        if getattr(module, "_non_persistent_buffers_set", None):
            if "RotaryEmbedding" not in type(module).__name__:
                raise QuantizationError(f"{name} ({type(module).__name__}) computes buffers at construction that "
                                        f"a quantized checkpoint's loading does not rebuild")
            model._init_weights(module)
    model.eval()
    model.requires_grad_(False)
    log.info("%s checkpoint: %d linear layers from packed integers, %d dense tensors (%s)", method, packed,
             len(dense), describe(qc))
    return model


def describe(qc: dict | None) -> str:
    """The quantization_config in a few words, for the log."""
    if not qc:
        return "no quantization_config"
    keys = ("quant_method", "bits", "group_size", "desc_act", "sym", "version", "format", "weight_block_size",
            "load_in_8bit", "load_in_4bit")
    return json.dumps({k: qc[k] for k in keys if k in qc})
