"""The engine as asyncio code sees it: the model loads on first use, generation is an async iterator.

Loading and generation run on their own threads, so the event loop (which the runpod SDK also uses to fetch
jobs and poll for cancellations) never waits on a forward pass.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import AsyncIterator, Callable

from . import host_memory
from .config import EngineConfig
from .engine import Engine, RequestOutput
from .loader import LoadedModel, load
from .runner import ModelRunner
from .sampling import SamplingParams
from .tokenizer import Tokenizer

log = logging.getLogger("engine")


class GenerationError(RuntimeError):
    """Generation of one request failed; other requests are unaffected."""


class _QueueSink:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def deliver(self, output: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)


def _kv_bytes_per_token(model: LoadedModel) -> int | None:
    """Bytes of keys and values one token takes in the cache, from the model's config (None if it can't tell)."""
    config = model.model.config
    config = getattr(config, "get_text_config", lambda: config)()
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not (layers and kv_heads and head_dim):
        return None
    return layers * 2 * kv_heads * head_dim * model.dtype.itemsize


class AsyncEngine:
    def __init__(self, config: EngineConfig, loader: Callable[[EngineConfig], LoadedModel] = load):
        self.config = config
        self._loader = loader
        self._lock = threading.Lock()
        self._loading: concurrent.futures.Future | None = None
        self._engine: Engine | None = None
        self._model: LoadedModel | None = None
        self.on_fatal: Callable[[BaseException], None] | None = None

    # ---- loading ----

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    async def start(self) -> None:
        """Load the model once. Concurrent callers wait for the same load; after a failure every waiting caller
        gets the error and the next call tries again."""
        if self._engine is not None:
            return
        with self._lock:
            future = self._loading
            if future is None or (future.done() and future.exception() is not None):
                future = self._loading = concurrent.futures.Future()
                threading.Thread(target=self._load, args=(future,), name="model-load", daemon=True).start()
        await asyncio.wrap_future(future)

    def _load(self, future: concurrent.futures.Future) -> None:
        try:
            model = self._loader(self.config)
            runner = ModelRunner(model.model, model.device, model.dtype, max_rows=self.config.max_num_seqs,
                                 max_len=model.max_model_len)
            engine = Engine(runner, model.tokenizer, max_num_seqs=self.config.max_num_seqs,
                            max_num_batched_tokens=self.config.max_num_batched_tokens,
                            max_model_len=model.max_model_len, prefix_cache_bytes=self.config.prefix_cache_bytes)
            engine.on_fatal = self._fatal
            per_token = _kv_bytes_per_token(model)
            if per_token:
                log.info("KV cache: %.1f KB per token; at most %.0f MB per sequence and %.1f GB for MAX_NUM_SEQS=%d "
                         "sequences of MAX_MODEL_LEN=%d tokens", per_token / 1024,
                         per_token * model.max_model_len / 2**20,
                         per_token * model.max_model_len * self.config.max_num_seqs / 2**30,
                         self.config.max_num_seqs, model.max_model_len)
            self._model, self._engine = model, engine
            host_memory.freeze_long_lived()
            future.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
            log.error("model load failed: %s", exc)
            future.set_exception(exc)

    def close(self) -> None:
        """Stop generation and drop the model, so its memory can be reclaimed; start() loads it again."""
        with self._lock:
            engine, self._engine, self._model, self._loading = self._engine, None, None, None
        if engine is not None:
            engine.shutdown()

    def _fatal(self, exc: BaseException) -> None:
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _require(self) -> LoadedModel:
        if self._model is None:
            raise RuntimeError("engine not started")
        return self._model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._require().tokenizer

    @property
    def model_name(self) -> str:
        return self._require().name

    @property
    def max_model_len(self) -> int:
        return self._require().max_model_len

    @property
    def generation_defaults(self) -> dict:
        return self._require().generation_defaults

    @property
    def engine(self) -> Engine:
        self._require()
        return self._engine

    # ---- generation ----

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; the last has `finished` set. Closing the iterator
        early (cancellation, a client that went away) takes the request out of the engine."""
        await self.start()
        sink = _QueueSink(asyncio.get_running_loop())
        self._engine.submit(request_id, prompt_ids, params, sink)
        done = False
        try:
            while True:
                output = await sink.queue.get()
                if output.error is not None:
                    done = True
                    raise GenerationError(str(output.error)) from output.error
                if output.finished:
                    done = True
                yield output
                if done:
                    return
        finally:
            if not done:
                self._engine.abort(request_id)
