"""Model loading and generation. Knows nothing of OpenAI JSON: takes token ids and SamplingParams, yields
RequestOutputs.

This module is the package's one door: code outside engine/ (the API layer in openai_compat/, the process in
worker/) imports what it uses from here, never from engine's subpackages. Tests and benchmarks may reach further in.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for readers and type checkers: what the names below are
    from engine.async_engine import AsyncEngine, GenerationError
    from engine.config import EngineConfig
    from engine.core.interface import EngineDeadError, RequestTooLarge
    from engine.core.pooling import PoolingInput, PoolingOutput, PoolingParams
    from engine.core.sequence import RequestOutput, SequenceDelta
    from engine.lora import AdapterError
    from engine.sampling.sampler import SamplingParams, TokenLogprob
    from engine.sampling.structured import AnswerGate, GrammarCompiler, GrammarError, GrammarFailure, GrammarSpec
    from engine.settings import EngineSettings, SettingsError, read_settings
    from engine.sources.redaction import redact, redact_urls
    from engine.threads import in_own_thread
    from engine.tokenizer import ChatTemplateError, Tokenizer
    from engine.vision import ImageError, ImageInputs, ImagePlacementError, MediaLimits, load_image
    from engine.vision.images import DETAILS as IMAGE_DETAILS

# Each export, from the module that defines it: imported on first use (PEP 562), so `import engine.cpu.X`
# or one export does not import the whole engine (torch, transformers' model code) before it is needed.
_EXPORTS = {
    "AsyncEngine": ("engine.async_engine", "AsyncEngine"),
    "GenerationError": ("engine.async_engine", "GenerationError"),
    "EngineConfig": ("engine.config", "EngineConfig"),
    "EngineDeadError": ("engine.core.interface", "EngineDeadError"),
    "RequestTooLarge": ("engine.core.interface", "RequestTooLarge"),
    "PoolingInput": ("engine.core.pooling", "PoolingInput"),
    "PoolingOutput": ("engine.core.pooling", "PoolingOutput"),
    "PoolingParams": ("engine.core.pooling", "PoolingParams"),
    "RequestOutput": ("engine.core.sequence", "RequestOutput"),
    "SequenceDelta": ("engine.core.sequence", "SequenceDelta"),
    "AdapterError": ("engine.lora", "AdapterError"),
    "SamplingParams": ("engine.sampling.sampler", "SamplingParams"),
    "TokenLogprob": ("engine.sampling.sampler", "TokenLogprob"),
    "AnswerGate": ("engine.sampling.structured", "AnswerGate"),
    "GrammarCompiler": ("engine.sampling.structured", "GrammarCompiler"),
    "GrammarError": ("engine.sampling.structured", "GrammarError"),
    "GrammarFailure": ("engine.sampling.structured", "GrammarFailure"),
    "GrammarSpec": ("engine.sampling.structured", "GrammarSpec"),
    "EngineSettings": ("engine.settings", "EngineSettings"),
    "SettingsError": ("engine.settings", "SettingsError"),
    "read_settings": ("engine.settings", "read_settings"),
    "redact": ("engine.sources.redaction", "redact"),
    "redact_urls": ("engine.sources.redaction", "redact_urls"),
    "in_own_thread": ("engine.threads", "in_own_thread"),
    "ChatTemplateError": ("engine.tokenizer", "ChatTemplateError"),
    "Tokenizer": ("engine.tokenizer", "Tokenizer"),
    "ImageError": ("engine.vision", "ImageError"),
    "ImageInputs": ("engine.vision", "ImageInputs"),
    "ImagePlacementError": ("engine.vision", "ImagePlacementError"),
    "MediaLimits": ("engine.vision", "MediaLimits"),
    "load_image": ("engine.vision", "load_image"),
    "IMAGE_DETAILS": ("engine.vision.images", "DETAILS"),
}

__all__ = [
    # the engine and its configuration
    "AsyncEngine", "EngineConfig", "Tokenizer",
    # the configuration read from the environment (the worker's settings extend it)
    "EngineSettings", "SettingsError", "read_settings",
    # generation: what goes in, what comes out, and how it fails
    "SamplingParams", "RequestOutput", "SequenceDelta", "TokenLogprob",
    "GenerationError", "EngineDeadError", "RequestTooLarge", "ChatTemplateError", "AdapterError",
    # pooling (embeddings, classification, scores)
    "PoolingInput", "PoolingOutput", "PoolingParams",
    # structured outputs: constraints compiled against the tokenizer
    "AnswerGate", "GrammarCompiler", "GrammarError", "GrammarFailure", "GrammarSpec",
    # images in prompts
    "IMAGE_DETAILS", "ImageError", "ImageInputs", "ImagePlacementError", "MediaLimits", "load_image",
    # helpers the serving layer shares with the engine
    "in_own_thread", "redact", "redact_urls",
]


def __getattr__(name: str):
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'engine' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
