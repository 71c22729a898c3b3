"""Which quantization method a model is served with: QUANTIZATION (worker-vllm's setting, vLLM's names), checked
against the checkpoint's `quantization_config` or its GGUF file."""
from __future__ import annotations

import logging
from pathlib import Path


log = logging.getLogger("engine.quantization")

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "bitsandbytes", "gguf")
LOAD_TIME_METHODS = ("int8", "int4")
METHODS = CHECKPOINT_METHODS + LOAD_TIME_METHODS
# quant_method spellings in config.json (and vLLM's kernel-specific names) -> the method
_ALIASES = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
            "compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors",
            "fp8": "fp8", "fbgemm_fp8": "fp8", "bitsandbytes": "bitsandbytes", "gguf": "gguf"}


class QuantizationError(ValueError):
    """A quantized checkpoint (or QUANTIZATION) this worker cannot serve exactly; the message is one line."""


def setting(value: str | None) -> str | None:
    """QUANTIZATION as given -> the method, None (unset: detect from the checkpoint); raises on an unknown one."""
    if value is None or not str(value).strip() or str(value).strip().lower() in ("auto", "none"):
        return None
    text = str(value).strip().lower()
    if text in LOAD_TIME_METHODS:
        return text
    if text not in _ALIASES:
        raise QuantizationError(f"QUANTIZATION={value!r} is not a method this worker knows (one of "
                                f"{', '.join(METHODS)})")
    return _ALIASES[text]


def quantization_config(config) -> dict | None:
    """The model config's quantization_config as a dict, or None."""
    value = getattr(config, "quantization_config", None)
    if value is None:
        return None
    return dict(value) if isinstance(value, dict) else value.to_dict()


def checkpoint_method(config, gguf_file: Path | None) -> str | None:
    """The method the checkpoint is in: 'gguf' for a GGUF file, else its quantization_config's quant_method (as
    named in METHODS), None for a dense checkpoint; raises on a method this worker does not know."""
    if gguf_file is not None:
        return "gguf"
    qc = quantization_config(config)
    if qc is None:
        return None
    name = str(qc.get("quant_method", "")).lower()
    if name not in _ALIASES:
        raise QuantizationError(f"the checkpoint's quantization_config.quant_method {name!r} is not supported "
                                f"(supported: {', '.join(CHECKPOINT_METHODS)})")
    return _ALIASES[name]


def resolve(wanted: str | None, config, gguf_file: Path | None) -> str | None:
    """The method to serve with: QUANTIZATION (`wanted`, from `setting`) checked against the checkpoint."""
    found = checkpoint_method(config, gguf_file)
    if wanted is None or wanted == found:
        return found
    if wanted in LOAD_TIME_METHODS:
        if found is not None:
            raise QuantizationError(f"QUANTIZATION={wanted} quantizes a 16- or 32-bit checkpoint at load, but this "
                                    f"checkpoint is already quantized ({found})")
        return wanted
    raise QuantizationError(f"QUANTIZATION={wanted} but the checkpoint is "
                            + (f"{found}" if found else "not quantized (no quantization_config in config.json)"))
