"""Request and response bodies of `/v1/completions`: prompts (text or token ids, one or many), the choices
with OpenAI's legacy logprobs, and the stream chunks."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from ..protocol import OmitsNone, RequestLimits, StreamChunk, TokenId, UsageInfo, limits_of
from ..sampling import OpenAIRequest


def check_prompt_size(value: Any, limits: RequestLimits | None) -> None:
    """A completions `prompt` within the request's bounds, judged from its raw (unvalidated) form."""
    if limits is None or not isinstance(value, list) or not value:
        return
    if not isinstance(value[0], (list, str)):  # one prompt of token ids: the context length bounds it
        return
    if len(value) > limits.max_prompts:
        raise ValueError(f"{len(value)} prompts in one request; at most {limits.max_prompts} are allowed "
                         f"(MAX_PROMPTS_PER_REQUEST)")
    ids = sum(len(p) for p in value if isinstance(p, list))
    if ids > limits.max_prompt_tokens:
        raise ValueError(f"the prompts have {ids} token ids together; a request may carry at most "
                         f"{limits.max_prompt_tokens} (MAX_PROMPT_TOKENS_PER_REQUEST)")
    chars = sum(len(p) for p in value if isinstance(p, str))
    if chars > limits.max_prompt_tokens * limits.max_token_chars:
        raise ValueError(f"the prompts have {chars} characters together, more than the "
                         f"{limits.max_prompt_tokens} tokens a request may carry (MAX_PROMPT_TOKENS_PER_REQUEST)")


class CompletionRequest(OpenAIRequest):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    suffix: str | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_size(cls, value, info: ValidationInfo):
        check_prompt_size(value, limits_of(info))
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be an empty list")
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("token-id prompts must not be empty")
        return value

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_asked(self) -> int | None:
        # echo with logprobs scores the prompt too
        asked = [v for v in (self.prompt_logprobs, self.logprobs if self.echo else None) if v is not None]
        return max(asked) if asked else None

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids): one set of choices per entry."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):  # validated: all ids, or all prompts
            return [prompt]
        return prompt


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OmitsNone):
    omitted_when_none = frozenset({"prompt_logprobs", "prompt_token_ids", "token_ids"})
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the choice's first chunk when streamed
    token_ids: list[int] | None = None  # return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
