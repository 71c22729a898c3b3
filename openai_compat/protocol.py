"""What every request and response of the OpenAI layer shares, as vLLM's server accepts and returns them.

Requests validate ranges and types in their models (a failure becomes a 400 naming the parameter). Parameters
OpenAI defines that change nothing for a self-hosted model are accepted and ignored (`IGNORED_FIELDS`); any other
unknown parameter is rejected rather than silently dropped. Each endpoint family keeps its own bodies in its
package (`chat/protocol.py`, `completions/protocol.py`, ...); the generation parameters chat and completions
share are in `sampling.py`.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, model_serializer, model_validator

# Accepted for compatibility with OpenAI clients; they have no effect here.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "verbosity", "prediction",
})

MAX_SEED = 2**63 - 1
# Token ids must be JSON integers: 1.0, true or "1" are more likely a caller's bug than an id.
TokenId = StrictInt


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry, given as validation context. Checked on the raw value before pydantic builds
    anything, so an oversized request costs a length check, not a walk over millions of items."""
    max_prompts: int  # entries of a completions prompt list
    max_prompt_tokens: int  # token ids of all prompts together
    context_tokens: int  # the model's context length
    max_token_chars: int  # no token of the tokenizer stands for more characters: n tokens hold at most n x this


def limits_of(info: ValidationInfo) -> RequestLimits | None:
    """The per-request limits a validation runs under, if it was given them."""
    return info.context if isinstance(info.context, RequestLimits) else None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ParamError(ValueError):
    """A request-level check that fails because of one parameter; the 400 names it (pydantic cannot tell which
    field a model validator meant)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    @model_validator(mode="after")
    def _unknown_fields(self) -> "RequestModel":
        unknown = sorted(set(self.model_extra or {}) - IGNORED_FIELDS)
        if unknown:
            raise ParamError(unknown[0], f"unsupported parameter(s): {', '.join(unknown)}")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---------------------------------------------------------------- output constraints


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` object: one constraint on the output."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False  # JSON with no whitespace at all


@dataclass(frozen=True)
class Constraint:
    """What the output must match: a grammar kind and its text (as engine.sampling.structured compiles them), and the
    request parameter it came from (named by errors)."""
    kind: Literal["json_schema", "regex", "choice", "grammar"]
    text: str
    param: str
    whitespace_pattern: str | None = None


ANY_JSON_OBJECT = '{"type": "object"}'


def schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ParamError(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise ParamError(param, f"{param} must be a JSON schema (an object)")
    return json.dumps(value)


def choice_text(choices: list[str], param: str) -> str:
    if not choices:
        raise ParamError(param, f"{param} must list at least one choice")
    if any(c == "" for c in choices):
        raise ParamError(param, f"{param} must not contain an empty string")
    return json.dumps(choices)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # enforced either way: the output always matches the schema


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ParamError("json_schema", "response_format json_schema needs a json_schema object")
        return self


# ---------------------------------------------------------------- response parts


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


# A token's logprob as chat (and the Responses API) report it: the token, its logprob and UTF-8 bytes, and the
# most likely alternatives at its position.
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


def _omit_none(data: dict, keys: frozenset[str]) -> dict:
    for key in keys:
        if key in data and data[key] is None:
            del data[key]
    return data


class OmitsNone(BaseModel):
    """vLLM's optional response keys (prompt_logprobs, prompt_token_ids, token_ids) appear only when the
    request asked for them: a key in `omitted_when_none` leaves the JSON while it is None."""
    omitted_when_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        return _omit_none(handler(self), self.omitted_when_none)


class StreamChunk(OmitsNone):
    """A stream chunk has a `usage` key only when the request asked for usage (null until the last chunk)."""

    @model_serializer(mode="wrap")
    def _usage_when_asked(self, handler):
        data = _omit_none(handler(self), self.omitted_when_none)
        if "usage" not in self.model_fields_set:
            data.pop("usage", None)
        return data


def token_name(text: str, token_id: int, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or `token_id:<id>` (return_tokens_as_token_ids, as vLLM)."""
    return f"token_id:{token_id}" if as_ids else text


def prompt_logprobs_json(entries: list, top_n: int, token_text, as_ids: bool = False) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else a map from token id (the prompt's
    own token and its `top_n` likeliest alternatives) to its logprob, rank and decoded text."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token_id: (entry.logprob, entry.rank)}
        for rank, (token_id, logprob) in enumerate(entry.top[:top_n], start=1):
            ranked.setdefault(token_id, (logprob, rank))
        out.append({str(token_id): {"logprob": max(logprob, -9999.0), "rank": rank,
                                    "decoded_token": token_name(token_text(token_id), token_id, as_ids)}
                    for token_id, (logprob, rank) in ranked.items()})
    return out
