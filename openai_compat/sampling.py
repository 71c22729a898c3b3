"""The generation parameters of chat, completions and legacy requests (SamplingFields): sampling, stops,
penalties, beam search, speculation and the output constraint, validated, and mapped onto the engine's
SamplingParams by the request itself (`to_sampling_params`); OpenAIRequest adds what chat and completions
share beyond them (model, stream, stream_options, response_format)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping

from pydantic import Field, field_validator, model_validator

from engine import SamplingParams

from .protocol import (ANY_JSON_OBJECT, MAX_SEED, Constraint, ParamError, RequestModel, ResponseFormat, StreamOptions,
                       StructuredOutputs, TokenId, choice_text, schema_text)

if TYPE_CHECKING:
    from engine import GrammarSpec

MAX_STOP_STRINGS = 32
MAX_BAD_WORDS = 256
MAX_ALLOWED_TOKENS = 1 << 20  # more than any vocabulary; the vocabulary check bounds it for real
MAX_PRIORITY = 2**31 - 1
MAX_ID_CHARS = 256


def _finite(value: float | None, name: str) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number")
    return value


class SamplingFields(RequestModel):
    """Generation parameters shared by chat and completions (and the legacy job form)."""

    n: int = Field(default=1, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # OpenAI's and vLLM's range
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs, as vLLM takes them (at most one constraint per request).
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # Beam search: vLLM's form (use_beam_search with best_of or n beams) and OVMS's (best_of > 1 with
    # length_penalty or diversity_penalty).
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    diversity_penalty: float | None = Field(default=None, ge=0.0)
    num_beam_groups: int | None = Field(default=None, ge=1)
    # OVMS's speculative decoding controls (need SPECULATIVE_CONFIG).
    num_assistant_tokens: int | None = Field(default=None, ge=1, le=16)
    assistant_confidence_threshold: float | None = Field(default=None, gt=0.0, lt=1.0)
    # vLLM's request controls: which tokens may (allowed_token_ids) or may not (bad_words) be generated, the
    # prompt cut to its last tokens, admission priority, and prefix-cache isolation between tenants.
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKENS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "length_penalty", "diversity_penalty")
    @classmethod
    def _finite_numbers(cls, value, info):
        return _finite(value, info.field_name)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value):
        if any(not word.strip() for word in value or ()):
            raise ValueError("bad words must not be empty or only whitespace")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        for key, bias in (value or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if token < 0:
                raise ValueError(f"logit_bias token id {token} is negative")
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingFields":
        if self.best_of is not None and self.best_of < self.n:
            raise ParamError("best_of", f"best_of must be greater than or equal to n, got n={self.n} and "
                                        f"best_of={self.best_of}")
        self.constraint()  # a malformed or conflicting constraint fails here, naming its parameter
        self._check_beam_search()
        if self.num_assistant_tokens is not None and self.assistant_confidence_threshold is not None:
            raise ParamError("assistant_confidence_threshold", "give num_assistant_tokens or "
                                                               "assistant_confidence_threshold, not both")
        if self.beam_search:
            for name in ("num_assistant_tokens", "assistant_confidence_threshold"):
                if getattr(self, name) is not None:
                    raise ParamError(name, f"{name} does not apply to beam search (beams do not speculate)")
        return self

    @property
    def beam_search(self) -> bool:
        return self.use_beam_search or ((self.best_of or 1) > 1 and (self.length_penalty is not None or
                                                                     self.diversity_penalty is not None))

    @property
    def beam_width(self) -> int:
        return max(self.n, self.best_of or 1)

    @property
    def beam_groups(self) -> int:
        """Groups of diverse beam search; a diversity_penalty alone puts each beam in its own group."""
        if self.num_beam_groups is not None:
            return self.num_beam_groups
        return self.beam_width if self.diversity_penalty else 1

    def _check_beam_search(self) -> None:
        if not self.beam_search:
            for name in ("length_penalty", "early_stopping", "diversity_penalty", "num_beam_groups"):
                if getattr(self, name) is not None:
                    raise ParamError(name, f"{name} only applies to beam search (use_beam_search: true, or best_of "
                                           f"> 1 with length_penalty or diversity_penalty)")
            return
        if self.beam_width < 2:
            raise ParamError("best_of", "beam search needs a beam width (best_of, or n) of at least 2")
        for name, off in (("top_p", 1.0), ("top_k", (0, -1)), ("min_p", 0.0)):
            value = getattr(self, name)
            if value is not None and value not in (off if isinstance(off, tuple) else (off,)):
                raise ParamError(name, f"{name} does not apply to beam search, which ranks every token")
        if self.beam_width % self.beam_groups:
            raise ParamError("num_beam_groups", f"num_beam_groups ({self.beam_groups}) must divide the beam width "
                                                f"({self.beam_width})")
        if self.diversity_penalty and self.beam_groups < 2:
            raise ParamError("diversity_penalty", "diversity_penalty needs num_beam_groups > 1")

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    # How the endpoint's request names its prompt, budget and logprobs: errors about them name these fields.
    prompt_param: ClassVar[str] = "prompt"
    logprobs_param: ClassVar[str] = "logprobs"

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    @property
    def max_tokens_asked(self) -> int | None:
        """The completion budget asked for; None: the rest of the context."""
        return getattr(self, self.max_tokens_param, None)

    @property
    def logprobs_asked(self) -> int | None:
        """Alternatives reported per generated token; None: no logprobs."""
        return None

    @property
    def prompt_logprobs_asked(self) -> int | None:
        """Alternatives reported per prompt token; None: none."""
        return None

    def token_bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def to_sampling_params(self, max_tokens: int, defaults: Mapping[str, Any], grammar: GrammarSpec | None = None,
                           with_special_tokens: bool = False,
                           bad_words_ids: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """The engine's parameters for this request. From the model: its generation defaults (a sampling field
        the request leaves unset takes the model's value), the resolved completion budget, the compiled
        grammar and the bad words as token sequences; `with_special_tokens` keeps special tokens in the text for
        parsers that read them. Checks against the model are the serving's (OpenAIServing.sampling_params)."""

        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        # Beam search ranks raw logprobs unless the request itself sets a temperature (the model's sampling
        # defaults are for sampling).
        temperature = (self.temperature or 0.0) if self.beam_search else pick("temperature", 1.0)
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), seed=self.seed, n=self.n, best_of=self.best_of, stop=self.stop_list,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=self.token_bias(), logprobs=self.logprobs_asked, prompt_logprobs=self.prompt_logprobs_asked,
            skip_special_tokens=self.skip_special_tokens and not with_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens, grammar=grammar,
            beam_search=self.beam_search,
            length_penalty=self.length_penalty if self.length_penalty is not None else 1.0,
            early_stopping=self.early_stopping if self.early_stopping is not None else False,
            num_beam_groups=self.beam_groups if self.beam_search else 1,
            diversity_penalty=self.diversity_penalty or 0.0, num_assistant_tokens=self.num_assistant_tokens,
            assistant_confidence_threshold=self.assistant_confidence_threshold,
            allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words_ids=bad_words_ids, priority=self.priority, cache_salt=self.cache_salt)

    def constraints(self) -> list[Constraint]:
        """Every output constraint the request sets; more than one is a 400 (see `constraint`)."""
        found: list[Constraint] = []
        space = self.guided_whitespace_pattern
        if self.guided_json is not None:
            found.append(Constraint("json_schema", schema_text(self.guided_json, "guided_json"), "guided_json", space))
        if self.guided_regex is not None:
            found.append(Constraint("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(Constraint("choice", choice_text(self.guided_choice, "guided_choice"), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(Constraint("grammar", self.guided_grammar, "guided_grammar"))
        so = self.structured_outputs
        if so is not None:
            space = so.whitespace_pattern if so.whitespace_pattern is not None else space
            if so.disable_any_whitespace:
                space = ""  # engine.sampling.structured: an empty pattern means no whitespace
            if so.json_schema is not None:
                found.append(Constraint("json_schema", schema_text(so.json_schema, "structured_outputs.json"),
                                        "structured_outputs.json", space))
            if so.regex is not None:
                found.append(Constraint("regex", so.regex, "structured_outputs.regex"))
            if so.choice is not None:
                found.append(Constraint("choice", choice_text(so.choice, "structured_outputs.choice"),
                                        "structured_outputs.choice"))
            if so.grammar is not None:
                found.append(Constraint("grammar", so.grammar, "structured_outputs.grammar"))
            if so.json_object:
                found.append(Constraint("json_schema", ANY_JSON_OBJECT, "structured_outputs.json_object", space))
        return found

    def constraint(self) -> Constraint | None:
        found = self.constraints()
        if len(found) > 1:
            raise ParamError(found[1].param, f"only one output constraint is allowed per request; got "
                                             f"{', '.join(c.param for c in found)}")
        return found[0] if found else None


class OpenAIRequest(SamplingFields):
    """Fields common to the chat and completions endpoints."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions: the prompt's own logprobs, token ids in the response, tokens named by id in logprobs,
    # and the request's id (the response id is then <prefix>-<request_id>).
    prompt_logprobs: int | None = Field(default=None, ge=0)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    request_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[\x21-\x7e]+$")

    def constraints(self) -> list[Constraint]:
        found = super().constraints()
        fmt = self.response_format
        space = self.guided_whitespace_pattern
        if fmt is not None and fmt.type == "json_object":
            found.insert(0, Constraint("json_schema", ANY_JSON_OBJECT, "response_format", space))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_
            found.insert(0, Constraint("json_schema", schema_text(True if schema is None else schema,
                                                                   "response_format.json_schema.schema"),
                                       "response_format", space))
        return found

    @model_validator(mode="after")
    def _streaming(self) -> "OpenAIRequest":
        if self.stream and self.beam_search:
            raise ParamError("stream", "beam search cannot stream: beams are reordered and replaced until the "
                                       "search ends, so no beam's text is final before then")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ParamError("best_of", "best_of > n is not supported with stream=true")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:
            raise ParamError("prompt_logprobs", "prompt_logprobs is not available when stream is true (as in vLLM)")
        return self

    @property
    def prompt_logprobs_asked(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)
