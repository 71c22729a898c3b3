"""What the OpenAI layer needs to know. Built by the entrypoint from the environment."""
from __future__ import annotations

from dataclasses import dataclass

from engine import MediaLimits


@dataclass(frozen=True)
class ServingConfig:
    served_model_name: str | None = None  # None: the model's own name
    response_role: str = "assistant"
    raw_openai_output: bool = True  # streams as SSE text; False: lists of chunk dicts
    # Streamed chunks are sent to the platform in batches growing from min to default size, so the first
    # token leaves at once and long streams cost few round trips.
    default_batch_size: int = 50
    min_batch_size: int = 1
    batch_size_growth_factor: float = 3.0
    # Tool calls and reasoning: parsers named as vLLM names them; None: recognised from the chat template.
    enable_auto_tool_choice: bool = True
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # "none": thinking stays in content
    # What one request may ask for; beyond these it is a 400, so no single request can hold the worker.
    max_prompts_per_request: int = 256
    max_sequences_per_request: int = 256  # prompts x max(n, best_of)
    max_prompt_tokens_per_request: int = 262144  # all prompts of the request together
    media: MediaLimits = MediaLimits()  # image parts: how many, how large, where they may be fetched from
    runtime_lora_updating: bool = False  # VLLM_ALLOW_RUNTIME_LORA_UPDATING: the load/unload adapter routes
