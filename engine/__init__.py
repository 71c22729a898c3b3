"""Model loading and generation. Knows nothing of OpenAI JSON: takes token ids and SamplingParams, yields
RequestOutputs."""
from engine.async_engine import AsyncEngine, GenerationError
from engine.config import EngineConfig
from engine.core.interface import EngineDeadError, RequestTooLarge
from engine.core.sequence import RequestOutput, SequenceDelta
from engine.sampling.sampler import SamplingParams, TokenLogprob
from engine.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["AsyncEngine", "ChatTemplateError", "EngineConfig", "EngineDeadError", "GenerationError",
           "RequestOutput", "RequestTooLarge", "SamplingParams", "SequenceDelta", "TokenLogprob", "Tokenizer"]
