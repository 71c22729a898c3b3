"""Worker configuration from environment variables, validated once at start-up: the engine's settings
(engine/settings.py) and the serving ones.

Every variable is documented in the README's configuration table; keep the two in step.
A bad value raises `SettingsError` naming the variable, and the entrypoint exits non-zero with that line.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, field_validator

from engine import EngineSettings, MediaLimits, SettingsError, read_settings
from openai_compat.config import ServingConfig

__all__ = ["SettingsError", "WorkerSettings", "load_settings"]


class WorkerSettings(EngineSettings):
    # The model source, engine, LoRA and embedding settings, MAX_LOGPROBS and OPENAI_SERVED_MODEL_NAME_OVERRIDE
    # are the engine's (EngineSettings); these are the serving layer's and the process's.
    vllm_allow_runtime_lora_updating: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter

    # Serving
    # Which kind of endpoint `python -m worker` serves: queue jobs, or HTTP for a load-balancing endpoint
    # (worker/load_balancing.py, which reads these three itself, before anything heavy is imported).
    serving_mode: Literal["auto", "queue", "http"] = "auto"
    port: int | None = Field(default=None, ge=1, le=65535)
    port_health: int | None = Field(default=None, ge=1, le=65535)
    max_concurrency: int = Field(default=30, ge=1)
    openai_response_role: str = "assistant"
    raw_openai_output: bool = True
    default_batch_size: int = Field(default=50, ge=1)
    min_batch_size: int = Field(default=1, ge=1)
    batch_size_growth_factor: float = Field(default=3.0, ge=1.0)
    max_prompts_per_request: int = Field(default=256, ge=1)
    max_sequences_per_request: int = Field(default=256, ge=1)
    max_prompt_tokens_per_request: int = Field(default=262144, ge=1)
    shutdown_grace_seconds: float = Field(default=30.0, ge=0, le=3600)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    # Images (vision-language models)
    limit_mm_per_prompt: str | None = None  # images per request: a number or vLLM's JSON form {"image": N}
    media_max_bytes: int = Field(default=20 * 2**20, ge=1)
    media_max_pixels: int = Field(default=40_000_000, ge=1)
    media_fetch_timeout: float = Field(default=10.0, gt=0, le=600)
    media_max_redirects: int = Field(default=3, ge=0, le=20)
    allowed_media_domains: str | None = None  # comma-separated hosts image URLs may name; unset: any public host
    media_allow_private: bool = False  # image URLs may reach private, loopback and link-local addresses

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _limit_mm(cls, value: str | None) -> str | None:
        if value is not None:
            _images_per_prompt(value)
        return value

    @field_validator("tool_call_parser", "reasoning_parser", mode="before")
    @classmethod
    def _parser_name(cls, value: str | None, info) -> str | None:
        from openai_compat import reasoning, tool_parsers
        if value is None:
            return None
        name = str(value).strip().lower()
        known = sorted(tool_parsers.PARSERS) if info.field_name == "tool_call_parser" else \
            sorted(reasoning.NAMES | {"none"})
        if name not in known:
            raise ValueError(f"must be one of {', '.join(known)} (got {value!r})")
        return name

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: str) -> str:
        return str(value).strip().upper()

    def lora_settings(self) -> list[tuple[str, object]]:
        return [*super().lora_settings(),
                ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", self.vllm_allow_runtime_lora_updating)]

    def check_combinations(self) -> None:
        super().check_combinations()
        if self.min_batch_size > self.default_batch_size:
            raise ValueError("MIN_BATCH_SIZE must not exceed DEFAULT_BATCH_SIZE")

    def serving_config(self) -> ServingConfig:
        return ServingConfig(
            served_model_name=self.openai_served_model_name_override,
            response_role=self.openai_response_role,
            raw_openai_output=self.raw_openai_output,
            default_batch_size=self.default_batch_size,
            min_batch_size=self.min_batch_size,
            batch_size_growth_factor=self.batch_size_growth_factor,
            enable_auto_tool_choice=self.enable_auto_tool_choice,
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            max_prompts_per_request=self.max_prompts_per_request,
            max_sequences_per_request=self.max_sequences_per_request,
            max_prompt_tokens_per_request=self.max_prompt_tokens_per_request,
            media=MediaLimits(
                max_images=_images_per_prompt(self.limit_mm_per_prompt) if self.limit_mm_per_prompt else None,
                max_image_bytes=self.media_max_bytes, max_image_pixels=self.media_max_pixels,
                fetch_timeout=self.media_fetch_timeout, max_redirects=self.media_max_redirects,
                allow_private=self.media_allow_private,
                allowed_domains=tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains.split(",")
                                      if d.strip()) if self.allowed_media_domains else None),
            runtime_lora_updating=self.vllm_allow_runtime_lora_updating,
        )


def _images_per_prompt(value: str) -> int:
    """LIMIT_MM_PER_PROMPT as a number of images: `2`, or vLLM's JSON `{"image": 2}` (other modalities are
    refused: the worker takes images only)."""
    text = value.strip()
    if text.isdigit():
        return int(text)
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or set(parsed) - {"image"} or not isinstance(parsed.get("image"), int) \
            or isinstance(parsed["image"], bool) or parsed["image"] < 0:
        raise ValueError('must be a number of images or JSON such as {"image": 2} (images are the only modality)')
    return parsed["image"]


def load_settings() -> WorkerSettings:
    """Read and validate the environment; raise SettingsError with one line per bad variable."""
    return read_settings(WorkerSettings)
