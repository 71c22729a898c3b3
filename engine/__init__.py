"""Model loading and generation. Knows nothing of OpenAI JSON: takes token ids and SamplingParams, yields
RequestOutputs.

This module is the package's one door: code outside engine/ (the API layer in openai_compat/, the process in
worker/) imports what it uses from here, never from engine's subpackages. Tests and benchmarks may reach further in.
"""
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
