"""The engine's configuration from environment variables, validated once at start-up, into an EngineConfig.

The worker's settings (worker/settings.py) are these plus the serving ones; `python -m engine.device_check` reads
these alone, so it takes the same variables as the worker without depending on it. Every variable is documented
in the README's configuration table; keep the two in step. A bad value raises `SettingsError` naming the variable.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine import quantization
from engine.config import EngineConfig
from engine.core.speculative import SpeculativeConfig
from engine.lora import LoraConfig
from engine.lora.adapters import parse_modules

_DTYPE_ALIASES = {
    "auto": "auto",
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}


class SettingsError(Exception):
    """A start-up configuration problem; the message names the variable."""


def _default_base_path() -> Path:
    volume = Path("/runpod-volume")
    if volume.is_dir():
        return volume
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-worker"


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(case_sensitive=False, env_ignore_empty=True, extra="ignore")

    # Model source
    model_name: str | None = None
    model_revision: str | None = None
    tokenizer_name: str | None = None
    tokenizer_revision: str | None = None
    custom_chat_template: str | None = None
    trust_remote_code: bool = False
    base_path: Path = Field(default_factory=_default_base_path)
    baked_model_dir: Path | None = None

    # Engine
    max_model_len: int | None = Field(default=None, gt=0)
    dtype: str = "auto"
    quantization: str | None = None  # unset: the checkpoint's own method (engine/quantization/)
    quantized_activations: Literal["int16", "int8"] = "int16"  # CPU: packed layers' integer activations
    device: str = "auto"
    simulated_device_memory: int | None = Field(default=None, ge=2**20)  # bytes; DEVICE=cuda-sim only
    max_num_seqs: int = Field(default=32, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=512, ge=16)
    prefix_cache_mb: int = Field(default=256, ge=0)
    kv_cache_memory: int | None = Field(default=None, ge=1)
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)  # only 1: see _no_tensor_parallelism
    layer_split_devices: int = Field(default=1, ge=1, le=64)
    torch_num_threads: int | None = Field(default=None, ge=1)
    # auto | off | a build variant by name (engine/cpu/native_kernels.py), which this CPU must run
    native_kernels: Literal["auto", "off", "avx512_vnni", "avx_vnni", "avx2", "generic"] = "auto"
    # Outputs independent of what is batched with a request (engine/config.py); "auto" where it costs nothing.
    batch_invariant: Literal["auto"] | bool = "auto"
    startup_cache: Literal["on", "off"] = "on"  # start-up verdicts kept in BASE_PATH (engine/startup_cache.py)
    speculative_config: str | None = None  # JSON, vLLM's --speculative-config terms
    max_logprobs: int = Field(default=20, ge=0)

    # LoRA adapters (engine/lora/), vLLM's names
    enable_lora: bool = False
    lora_modules: str | None = None  # name=path pairs or JSON [{"name", "path", "base_model_name"}]
    max_loras: int = Field(default=1, ge=1, le=64)  # adapters resident in one step
    max_lora_rank: int = Field(default=16, ge=1, le=512)
    max_cpu_loras: int | None = Field(default=None, ge=1)  # adapters kept read in host memory (LRU)
    # The name the model is served under; adapters may name it as their base (LoraConfig.base_aliases).
    openai_served_model_name_override: str | None = None

    # Embeddings (unset: the model's sentence-transformers config, else the architecture's usual choice)
    pooling_type: Literal["last", "mean", "cls", "max"] | None = None
    embedding_normalize: bool | None = None

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: str) -> str:
        canonical = _DTYPE_ALIASES.get(str(value).strip().lower())
        if canonical is None:
            raise ValueError(f"must be one of auto, float32, bfloat16, float16 (got {value!r})")
        return canonical

    @field_validator("quantization", mode="before")
    @classmethod
    def _quantization(cls, value: str | None) -> str | None:
        try:
            return quantization.setting(value)
        except quantization.QuantizationError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: str) -> str:
        text = str(value).strip().lower()
        head, _, index = text.partition(":")
        if text == "cuda-sim":  # the CUDA path run on the CPU (engine/devices.py)
            return text
        if head not in ("auto", "cpu", "cuda", "mps") or (index and (head != "cuda" or not index.isdigit())):
            raise ValueError(f"must be auto, cpu, cuda, cuda:N, mps or cuda-sim (got {value!r})")
        return text

    @field_validator("batch_invariant", mode="before")
    @classmethod
    def _auto_or_boolean(cls, value):
        words = {"auto": "auto", "true": True, "1": True, "on": True, "yes": True,
                 "false": False, "0": False, "off": False, "no": False}
        if isinstance(value, str):
            if value.strip().lower() not in words:
                raise ValueError(f"must be auto, true or false, got {value!r}")
            return words[value.strip().lower()]
        return value

    @field_validator("tensor_parallel_size")
    @classmethod
    def _no_tensor_parallelism(cls, value: int) -> int:
        # The worker used to take this name for what is layer placement: whole layers on several GPUs, which run
        # one at a time. A vLLM user's TENSOR_PARALLEL_SIZE=4 expects four GPUs computing together; refuse it.
        if value != 1:
            raise ValueError(f"this worker has no tensor parallelism (got {value}); LAYER_SPLIT_DEVICES={value} "
                             f"places whole layers on {value} GPUs, one GPU computing at a time")
        return value

    @field_validator("custom_chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        """Compiled now, with the sandboxed environment transformers renders it in, so a typo stops the worker at
        start-up instead of failing every chat request."""
        if value is not None:
            from jinja2 import TemplateError
            from transformers.utils.chat_template_utils import _compile_jinja_template
            try:
                _compile_jinja_template(value)
            except TemplateError as exc:
                where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
                raise ValueError(f"not a valid Jinja template: {exc.message or exc}{where}") from None
        return value

    @field_validator("pooling_type", mode="before")
    @classmethod
    def _pooling_type(cls, value):
        return str(value).strip().lower() if value is not None else None

    @field_validator("torch_num_threads")
    @classmethod
    def _threads(cls, value: int | None) -> int | None:
        # Far more threads than cores only slows torch down, and absurd counts crash it (99999: a segfault).
        cores = os.cpu_count() or 1
        if value is not None and value > cores:
            raise ValueError(f"must be at most the {cores} CPUs of this machine (got {value})")
        return value

    @field_validator("speculative_config")
    @classmethod
    def _speculative_config(cls, value: str | None) -> str | None:
        if value is not None:
            SpeculativeConfig.parse(value)
        return value

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, value: str | None) -> str | None:
        if value is not None:
            parse_modules(value)
        return value

    @model_validator(mode="after")
    def _combinations(self) -> "EngineSettings":
        self.check_combinations()
        return self

    def check_combinations(self) -> None:
        """Refuse values that are valid one by one but not together (a ValueError naming them). Subclasses with
        settings of their own extend it."""
        if self.simulated_device_memory is not None and self.device != "cuda-sim":
            raise ValueError(f"SIMULATED_DEVICE_MEMORY applies only with DEVICE=cuda-sim (DEVICE is {self.device})")
        if not self.enable_lora:
            named = [name for name, value in self.lora_settings() if value]
            if named:
                raise ValueError(f"{' and '.join(named)} {'need' if len(named) > 1 else 'needs'} ENABLE_LORA=true")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"MAX_CPU_LORAS ({self.max_cpu_loras}) must be at least MAX_LORAS ({self.max_loras})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every decoding sequence takes one token of a step's budget; prompts need room beside them
            raise ValueError(f"MAX_NUM_BATCHED_TOKENS ({self.max_num_batched_tokens}) must be at least MAX_NUM_SEQS "
                             f"({self.max_num_seqs})")

    def lora_settings(self) -> list[tuple[str, object]]:
        """(variable, value) of the settings that mean something only with ENABLE_LORA=true."""
        return [("LORA_MODULES", self.lora_modules)]

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model_name,
            revision=self.model_revision,
            tokenizer=self.tokenizer_name,
            tokenizer_revision=self.tokenizer_revision,
            chat_template=self.custom_chat_template,
            trust_remote_code=self.trust_remote_code,
            cache_dir=self.base_path,
            baked_model_dir=self.baked_model_dir,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            quantization=self.quantization,
            quantized_activations=self.quantized_activations,
            device=self.device,
            simulated_device_memory=self.simulated_device_memory,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefix_cache_bytes=self.prefix_cache_mb * 2**20,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=self.gpu_memory_utilization,
            layer_split_devices=self.layer_split_devices,
            num_threads=self.torch_num_threads,
            native_kernels=self.native_kernels,
            batch_invariant=self.batch_invariant,
            startup_cache=self.startup_cache == "on",
            max_logprobs=self.max_logprobs,
            pooling_type=self.pooling_type,
            embedding_normalize=self.embedding_normalize,
            speculative=SpeculativeConfig.parse(self.speculative_config) if self.speculative_config else None,
            lora=LoraConfig(modules=parse_modules(self.lora_modules) if self.lora_modules else (),
                            max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras,
                            base_aliases=tuple(filter(None, [self.openai_served_model_name_override])))
            if self.enable_lora else None,
        )


Settings = TypeVar("Settings", bound=EngineSettings)


def read_settings(kind: type[Settings] = EngineSettings) -> Settings:
    """Read and validate the environment as `kind` (EngineSettings or a subclass); raise SettingsError with one line
    per bad variable."""
    try:
        return kind()
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = "_".join(str(part) for part in error["loc"]).upper() or "configuration"
            message = error["msg"].removeprefix("Value error, ")
            given = error.get("input")
            suffix = f" (got {given!r})" if name != "configuration" and not isinstance(given, dict) else ""
            problems.append(f"{name}: {message}{suffix}" if "(got" not in message else f"{name}: {message}")
        raise SettingsError("invalid environment: " + "; ".join(problems)) from None
