"""Request and response bodies of the OpenAI API, as vLLM's server accepts and returns them.

Requests validate ranges and types here (a failure becomes a 400 naming the parameter). Parameters OpenAI
defines that change nothing for a self-hosted model are accepted and ignored (`IGNORED_FIELDS`); any other
unknown parameter is rejected rather than silently dropped.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_serializer,
                      model_validator)

from engine import SamplingParams

from .errors import context_exceeded

if TYPE_CHECKING:
    from engine.structured import GrammarSpec

# Accepted for compatibility with OpenAI clients; they have no effect here.
IGNORED_FIELDS = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "reasoning_effort", "verbosity", "modalities", "prediction", "web_search_options", "audio",
})

MAX_SEED = 2**63 - 1
# Token ids must be JSON integers: 1.0, true or "1" are more likely a caller's bug than an id.
TokenId = StrictInt
MAX_STOP_STRINGS = 32


@dataclass(frozen=True)
class RequestLimits:
    """What one request may carry, given as validation context. Checked on the raw value before pydantic builds
    anything, so an oversized request costs a length check, not a walk over millions of items."""
    max_prompts: int  # entries of a completions prompt list
    max_prompt_tokens: int  # token ids of all prompts together
    context_tokens: int  # the model's context length
    max_token_chars: int  # no token of the tokenizer stands for more characters: n tokens hold at most n x this


def _limits(info: ValidationInfo) -> RequestLimits | None:
    return info.context if isinstance(info.context, RequestLimits) else None


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


def check_messages_size(value: Any, limits: RequestLimits | None) -> None:
    """Raw `messages` that could not fit the context whatever the template: every message renders to at least
    one token, and its content text to at least one token per `max_token_chars` characters."""
    if limits is None or not isinstance(value, list):
        return
    max_chars = limits.context_tokens * limits.max_token_chars
    if len(value) > limits.context_tokens:
        raise ValueError(context_exceeded(limits.context_tokens, f"there are {len(value)} messages, and each takes "
                                          f"at least one token", "the number of messages"))
    chars = 0
    for message in value:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += len(content)  # the newline that joins each text part to the next
            if chars <= max_chars:
                chars += sum(len(part["text"]) for part in content
                             if isinstance(part, dict) and isinstance(part.get("text"), str))
        if chars > max_chars:
            break
    if chars > max_chars:
        raise ValueError(context_exceeded(
            limits.context_tokens, f"the messages have {chars} characters of content, which is more than "
            f"{limits.context_tokens} tokens for this model's tokenizer (no token spans more than "
            f"{limits.max_token_chars} characters)", "the length of the messages"))


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


def _finite(value: float | None, name: str) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    """What the output must match: a grammar kind and its text (as engine.structured compiles them), and the
    request parameter it came from (named by errors)."""
    kind: Literal["json_schema", "regex", "choice", "grammar"]
    text: str
    param: str
    whitespace_pattern: str | None = None


ANY_JSON_OBJECT = '{"type": "object"}'


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ParamError(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise ParamError(param, f"{param} must be a JSON schema (an object)")
    return json.dumps(value)


def _choice_text(choices: list[str], param: str) -> str:
    if not choices:
        raise ParamError(param, f"{param} must list at least one choice")
    if any(c == "" for c in choices):
        raise ParamError(param, f"{param} must not contain an empty string")
    return json.dumps(choices)


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
                           with_special_tokens: bool = False) -> SamplingParams:
        """The engine's parameters for this request. From the model: its generation defaults (a sampling field
        the request leaves unset takes the model's value), the resolved completion budget and the compiled
        grammar; `with_special_tokens` keeps special tokens in the text for parsers that read them. Checks
        against the model are the serving's (OpenAIServing.sampling_params)."""

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
            assistant_confidence_threshold=self.assistant_confidence_threshold)

    def constraints(self) -> list[Constraint]:
        """Every output constraint the request sets; more than one is a 400 (see `constraint`)."""
        found: list[Constraint] = []
        space = self.guided_whitespace_pattern
        if self.guided_json is not None:
            found.append(Constraint("json_schema", _schema_text(self.guided_json, "guided_json"), "guided_json", space))
        if self.guided_regex is not None:
            found.append(Constraint("regex", self.guided_regex, "guided_regex"))
        if self.guided_choice is not None:
            found.append(Constraint("choice", _choice_text(self.guided_choice, "guided_choice"), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(Constraint("grammar", self.guided_grammar, "guided_grammar"))
        so = self.structured_outputs
        if so is not None:
            space = so.whitespace_pattern if so.whitespace_pattern is not None else space
            if so.disable_any_whitespace:
                space = ""  # engine.structured: an empty pattern means no whitespace
            if so.json_schema is not None:
                found.append(Constraint("json_schema", _schema_text(so.json_schema, "structured_outputs.json"),
                                        "structured_outputs.json", space))
            if so.regex is not None:
                found.append(Constraint("regex", so.regex, "structured_outputs.regex"))
            if so.choice is not None:
                found.append(Constraint("choice", _choice_text(so.choice, "structured_outputs.choice"),
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


class OpenAIRequest(SamplingFields):
    """Fields common to the chat and completions endpoints."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    def constraints(self) -> list[Constraint]:
        found = super().constraints()
        fmt = self.response_format
        space = self.guided_whitespace_pattern
        if fmt is not None and fmt.type == "json_object":
            found.insert(0, Constraint("json_schema", ANY_JSON_OBJECT, "response_format", space))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_
            found.insert(0, Constraint("json_schema", _schema_text(True if schema is None else schema,
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
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# ---------------------------------------------------------------- chat


ContentType = Literal["text", "image_url", "input_audio", "file", "refusal", "video_url", "audio_url", "input_image"]


class ContentPart(BaseModel):
    """One part of a message's content. Every OpenAI part type parses (so the 400 for a non-text part can say
    that this model takes text only); one model rather than a union keeps validation errors at the field."""
    model_config = ConfigDict(extra="allow")
    type: ContentType
    text: str | None = None

    @model_validator(mode="after")
    def _text(self) -> "ContentPart":
        if self.type == "text" and self.text is None:
            raise ParamError("text", "a text content part needs a text string")
        return self


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    @property
    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if part.type == "text")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_size(cls, value, info: ValidationInfo):
        check_messages_size(value, _limits(info))
        return value

    @model_validator(mode="after")
    def _chat_consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ParamError("continue_final_message",
                             "add_generation_prompt and continue_final_message cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ParamError("continue_final_message",
                             "continue_final_message needs the last message to be an assistant message")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise ParamError("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not "
                                            f"among the tools")
        if self.forces_tool_call:
            constraint = self.constraint()
            if constraint is not None:
                raise ParamError(constraint.param, f"{constraint.param} cannot be combined with tool_choice "
                                                   f"{'required' if choice == 'required' else 'naming a function'}")
        return self

    prompt_param: ClassVar[str] = "messages"
    logprobs_param: ClassVar[str] = "top_logprobs"

    @property
    def max_tokens_param(self) -> str:
        # max_completion_tokens wins over the deprecated max_tokens (as in vLLM); errors name the one used.
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or ()]

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: `auto` when tools are given, else `none`."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def forces_tool_call(self) -> bool:
        """`required` or a named function: the reply is generated as tool calls, under a grammar."""
        return self.tools is not None and (self.tool_choice == "required"
                                           or isinstance(self.tool_choice, NamedToolChoice))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str
    content: str | None = None
    # A reasoning model's thinking: `reasoning_content` as vLLM names it, `reasoning` as newer clients read it.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _reasoning_when_present(self, handler):
        data = handler(self)
        if self.reasoning_content is None:
            data.pop("reasoning_content", None)
            data.pop("reasoning", None)
        return data


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class DeltaToolCall(BaseModel):
    """A piece of one tool call: the first piece has its id, type and name, later ones more arguments text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class DeltaMessage(BaseModel):
    """Only what changed: the opening delta has the role, later ones the new content, the last may be empty."""
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


class _StreamChunk(BaseModel):
    """A stream chunk has a `usage` key only when the request asked for usage (null until the last chunk)."""

    @model_serializer(mode="wrap")
    def _usage_when_asked(self, handler):
        data = handler(self)
        if "usage" not in self.model_fields_set:
            data.pop("usage", None)
        return data


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- completions


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
        check_prompt_size(value, _limits(info))
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
        return self.logprobs if self.echo else None  # echo with logprobs scores the prompt too

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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(_StreamChunk):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llm-worker"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
