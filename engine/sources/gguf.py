"""GGUF files as transformers folders: a GGUF model is dequantized once into a safetensors copy, which later
starts reload in about a second instead of tens of seconds."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from engine.sources.base import LocalModel, building

log = logging.getLogger("engine.sources")


def _converted(source: LocalModel, cache_dir: Path, baked_dir: Path | None) -> Path:
    """The safetensors copy of `source`'s GGUF file, made once. A copy baked into the image
    (`python -m engine.sources.prefetch`) is used before the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = source.path / source.gguf_file
    name = f"{gguf.stem}-{gguf.stat().st_size}"
    if baked_dir is not None and (baked_dir / "converted" / name / "config.json").is_file():
        return baked_dir / "converted" / name
    target = cache_dir / "converted" / name
    with building(target) as scratch:
        if scratch is not None:
            started = time.perf_counter()
            log.info("converting %s to safetensors in %s (once)", gguf, target)
            model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                         dtype=torch.float32)
            # The dequantized weights are plain tensors; drop the GGUF marker so they save as safetensors.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(scratch)
            AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file).save_pretrained(scratch)
            log.info("converted in %.1f s", time.perf_counter() - started)
    return target


def local_folder(source: LocalModel, cache_dir: Path, baked_dir: Path | None = None) -> Path:
    """The transformers-layout folder of resolved model files (GGUF files converted once)."""
    return _converted(source, cache_dir, baked_dir) if source.gguf_file else source.path
