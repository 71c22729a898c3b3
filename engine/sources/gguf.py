"""GGUF files as transformers folders: a GGUF model is dequantized once into a safetensors copy, which later
starts reload in about a second instead of tens of seconds."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import torch

from engine.sources.base import LocalModel, building

log = logging.getLogger("engine.sources")


_READS = threading.Lock()


@contextlib.contextmanager
def _each_part_read_once():
    """transformers' GGUF loading parses the file's header (its metadata: the whole vocabulary and merges) once for
    the config, again for the weights and twice more for the tokenizer, and rebuilds gguf's tensor-name table once
    for every module of the model: most of a conversion's time. While converting, each header is parsed once and
    each table built once (both are only read after they are made), then released."""
    import gguf

    with _READS:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict = {}
        maps: dict = {}

        def reader(path, mode="r"):
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = reader_class(path, mode)
            return readers[key]

        def tensor_name_map(arch, n_blocks):
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = name_map(arch, n_blocks)
            return maps[arch, n_blocks]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


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
            with _each_part_read_once():
                model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                             dtype=torch.float32)
                tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
            # The dequantized weights are plain tensors; drop the GGUF marker so they save as safetensors.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
            log.info("converted in %.1f s", time.perf_counter() - started)
    return target


def local_folder(source: LocalModel, cache_dir: Path, baked_dir: Path | None = None) -> Path:
    """The transformers-layout folder of resolved model files (GGUF files converted once)."""
    return _converted(source, cache_dir, baked_dir) if source.gguf_file else source.path
