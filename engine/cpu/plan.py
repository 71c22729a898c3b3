"""The CPU plan: every choice that makes a model fast on this CPU, made in one place and in this order.

1. the weights' type (`weights_dtype`): bfloat16 where a probe finds its products well ahead of float32;
2. whether a GGUF model may serve from its Q4_1 / Q8_0 blocks (`try_gguf_blocks`), which loads it as float32;
3. after the weights load: the C++ kernels of this CPU's variant (`load_kernels`), the blocks' verdict against
   bfloat16 (`gguf_blocks_win`; the model reloads as bfloat16 when they lose), then batch invariance, the weights'
   layouts, the AVX512_BF16 product of bfloat16 weights and the block products (`apply`);
4. the KV cache's type (`kv_cache_dtype`).

The loader and the engine call these; none of the choices is made anywhere else. Probes' verdicts come from and
go to `verdicts` (engine/startup_cache.py), so a warm start measures nothing again.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cpu import bf16_weights, layout, native_kernels, packed_linear, quantized_weights

log = logging.getLogger("engine.loader")

BFLOAT16_GAIN_NEEDED = 1.5
_BLOCK_SHARE_NEEDED = 0.5  # the share of a GGUF file's weights in Q4_1 / Q8_0 blocks worth serving from


def weights_dtype(verdicts, native_kernels_mode: str = "off") -> torch.dtype:
    """DTYPE=auto on CPU: bfloat16 halves the bytes every decode step reads and, where the CPU has native bfloat16
    products, multiplies several times faster; a probe confirms the gain on this machine before it is used, with
    the AVX512_BF16 kernel among the products it times where NATIVE_KERNELS (`native_kernels_mode`) allows it."""
    kernels = _probe_kernels(native_kernels_mode)
    if kernels is None:
        gain = verdicts.get("bfloat16_gain", layout.bfloat16_gain)
    else:
        gain = verdicts.get("bfloat16_gain:native", lambda: layout.bfloat16_gain(kernels=kernels))
    chosen = torch.bfloat16 if gain >= BFLOAT16_GAIN_NEEDED else torch.float32
    if gain == 0.0:  # bfloat16_gain's answer where nothing was timed
        log.info("DTYPE=auto on CPU: this CPU has no native bfloat16 products (AVX512_BF16 or AMX); using float32")
    else:
        log.info("DTYPE=auto on CPU: bfloat16 products %.2fx float32 here; using %s", gain,
                 str(chosen).removeprefix("torch."))
    return chosen


def _probe_kernels(mode: str):
    """The native kernels' module for the bfloat16 probe where `mode` allows and this CPU has their AVX512_BF16
    product, else None. Built (or found) here, before the weights load; load_kernels checks it afterwards."""
    if mode == "off" or not layout.bfloat16_is_native():
        return None
    try:
        kernels = native_kernels.build(None if mode == "auto" else native_kernels.named_variant(mode))
    except Exception:  # no build for this CPU, or not the one named: load_kernels says why
        return None
    return kernels if kernels.bf16_linear_supported() else None


def try_gguf_blocks(config: EngineConfig, dtype: torch.dtype, gguf: Path | None, verdicts) -> bool:
    """Whether to load a GGUF model as float32 to try serving it from its blocks (float32 weights, 16-bit integer
    activations), which may beat bfloat16 when most of its weights are Q4_1 / Q8_0. A stored verdict that
    bfloat16 wins skips the try, so the model loads once, as bfloat16."""
    if not (config.dtype == "auto" and dtype == torch.bfloat16 and gguf is not None
            and config.native_kernels != "off"):
        return False
    if verdicts.get("gguf_block_share", lambda: quantized_weights.gguf_block_share(gguf)) < _BLOCK_SHARE_NEEDED:
        return False
    return verdicts.cached("beats_bfloat16") != (True, False)


def load_kernels(config: EngineConfig, dtype: torch.dtype, verdicts) -> None:
    """The C++ kernels of this CPU's variant for weights of `dtype` (NATIVE_KERNELS), where they pass their check."""
    native_kernels.load(config.native_kernels, dtype, config.cache_dir, verdicts)


def gguf_blocks_win(model: torch.nn.Module, verdicts) -> bool:
    """Whether the float32 GGUF model's block products beat bfloat16 here; when they lose the loader reloads the
    model as bfloat16 (dropping the float32 copy first) and loads the kernels again."""
    kernels = native_kernels.active()
    return kernels is not None and verdicts.get("beats_bfloat16",
                                                lambda: quantized_weights.beats_bfloat16(model, kernels))


def unsupported_activations(config: EngineConfig) -> str:
    """Why the loaded kernels cannot honour QUANTIZED_ACTIVATIONS ("" where they can): the product from 8-bit
    activations is in every x86-64 build (VPDPBUSD on AVX-512 and AVX-VNNI, VPMADDUBSW runs on AVX2); a build
    without it multiplies 16-bit ones."""
    kernels = native_kernels.active()
    if config.quantized_activations != "int8" or kernels is None or kernels.quad_blocks_supported():
        return ""
    return (f"QUANTIZED_ACTIVATIONS=int8: the {native_kernels.serving_variant()} build of the CPU kernels has no "
            "product from 8-bit activations; unset it to multiply 16-bit ones")


def apply(model: torch.nn.Module, dtype: torch.dtype, config: EngineConfig, *, from_gguf: bool, verdicts) -> bool:
    """Batch invariance, the weights' layouts and the block products for the loaded model; returns whether
    batch invariance is on."""
    # "auto": a GGUF model served from its blocks pays nothing measurable for invariance (its rows are independent
    # in the block product); a dense 16-bit model pays for it at 1 stream, where a lone row is padded to two.
    invariant = config.batch_invariant is True or (
        config.batch_invariant == "auto" and from_gguf and dtype == torch.float32
        and native_kernels.active() is not None)
    kernels = native_kernels.active()
    # DTYPE=auto lets GGUF blocks take 16-bit integer activations; an explicit float32 keeps float32 activations.
    blocks = dict(integer_activations=config.dtype == "auto", every_size=invariant, verdicts=verdicts,
                  byte_activations=config.quantized_activations == "int8")
    # What a kernel below will serve at every batch size (known from an earlier start's verdicts) gets no packed
    # float copy from the layout: each would be made and released again, a pass over the model's weights.
    found = quantized_weights.blocks_at_every_size(model, kernels, **blocks)
    served = frozenset(id(m) for m, _ in found or ()) | frozenset(
        id(m) for m in bf16_weights.serves_every_size(model, kernels, every_size=invariant, verdicts=verdicts))
    layout.apply(model, batch_invariant=invariant, verdicts=verdicts, served_elsewhere=served)
    # A quantized checkpoint's layers multiply from their packed integers (16-bit integer activations, or 8-bit
    # ones under QUANTIZED_ACTIVATIONS=int8).
    packed_linear.apply(model, kernels, packed_linear.ACTIVATIONS[config.quantized_activations])
    bf16_weights.apply(model, kernels, every_size=invariant, verdicts=verdicts)
    quantized_weights.apply(model, kernels, found=found, **blocks)
    return invariant


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype, cpu_fast_paths: bool) -> tuple[torch.dtype, bool]:
    """The KV cache's type (KV_CACHE_DTYPE) and whether the runner's start-up probe must confirm it. Under
    DTYPE=auto a float32 model on CPU with the native kernels keeps float16 keys and values: decode attention reads
    half the bytes (it is half of a decode step at 1300-token contexts), the budget holds twice the tokens, and the
    embedded model's greedy tokens stay those of float32 (docs/performance.md)."""
    if config.kv_cache_dtype != "auto":
        return getattr(torch, config.kv_cache_dtype), False
    if (config.dtype == "auto" and cpu_fast_paths and model_dtype == torch.float32
            and native_kernels.active() is not None):
        return torch.float16, True
    return model_dtype, False
