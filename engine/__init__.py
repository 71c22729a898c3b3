"""Model loading and generation. Knows nothing of OpenAI JSON: takes token ids and SamplingParams, yields
RequestOutputs."""
from .async_engine import AsyncEngine, GenerationError
from .config import EngineConfig
from .engine import EngineDeadError, RequestOutput, RequestTooLarge, SequenceDelta
from .sampling import SamplingParams, TokenLogprob
from .tokenizer import ChatTemplateError, Tokenizer

__all__ = ["AsyncEngine", "ChatTemplateError", "EngineConfig", "EngineDeadError", "GenerationError",
           "RequestOutput", "RequestTooLarge", "SamplingParams", "SequenceDelta", "TokenLogprob", "Tokenizer"]
