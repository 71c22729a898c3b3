"""Quantized checkpoints: the method a model is served with (methods.py), GPTQ / AWQ / compressed-tensors / FP8 /
bitsandbytes layers read from their packed tensors (checkpoint.py), GGUF layers from the file's blocks
(gguf_blocks.py), and the opt-in quantization of dense checkpoints at load (at_load.py). The layers they make
multiply on CPU through engine/cpu/packed_linear.py."""
from engine.quantization.at_load import quantize_at_load
from engine.quantization.checkpoint import READ_ON_CPU, describe, load
from engine.quantization.gguf_blocks import GGUF_BLOCK_TYPES, GGUF_RECOVERED_TYPES, gguf_blocks, gguf_layers
from engine.quantization.methods import (CHECKPOINT_METHODS, LOAD_TIME_METHODS, METHODS, QuantizationError,
                                         checkpoint_method, quantization_config, resolve, setting)

__all__ = ["CHECKPOINT_METHODS", "GGUF_BLOCK_TYPES", "GGUF_RECOVERED_TYPES", "LOAD_TIME_METHODS", "METHODS",
           "QuantizationError", "READ_ON_CPU", "checkpoint_method", "describe", "gguf_blocks", "gguf_layers", "load",
           "quantization_config", "quantize_at_load", "resolve", "setting"]
