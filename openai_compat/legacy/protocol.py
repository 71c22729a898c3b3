"""worker-vllm's native job form: `{"prompt" | "messages", "sampling_params", "stream", ...}`."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..chat.protocol import ChatMessage, check_messages_size
from ..protocol import ParamError, RequestLimits
from ..sampling import SamplingFields


class LegacySamplingParams(SamplingFields):
    """vLLM's sampling parameters as worker-vllm takes them. Logprobs are not among them: the legacy output has
    no place for them, so asking is a 400 (use /v1/completions) rather than work whose result is dropped."""
    max_tokens: int = Field(default=100, ge=1)


class LegacyJob(BaseModel):
    """worker-vllm's native job form."""
    model_config = ConfigDict(extra="forbid")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    sampling_params: LegacySamplingParams = Field(default_factory=lambda: LegacySamplingParams())
    stream: bool = False
    apply_chat_template: bool = False
    lora: str | None = None  # a LoRA adapter's name (engine/lora/); None: the base model
    max_batch_size: int | None = Field(default=None, ge=1)
    min_batch_size: int | None = Field(default=None, ge=1)
    batch_size_growth_factor: float | None = Field(default=None, ge=1.0)

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_size(cls, value, info: ValidationInfo):
        check_messages_size(value, info.context if isinstance(info.context, RequestLimits) else None)
        return value

    @model_validator(mode="after")
    def _one_input(self) -> "LegacyJob":
        # Both or neither would leave it to chance which text the model sees.
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("prompt", "give either prompt (a string) or messages (a list), not both or neither")
        if self.stream and self.sampling_params.beam_search:
            raise ParamError("stream", "beam search cannot stream: beams are reordered and replaced until the "
                                       "search ends, so no beam's text is final before then")
        return self
