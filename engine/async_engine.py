"""The engine as asyncio code sees it: the model loads on first use, generation is an async iterator.

Loading and generation run on their own threads, so the event loop (which the runpod SDK also uses to fetch
jobs and poll for cancellations) never waits on a forward pass.
"""
from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import logging
import os
import threading
from typing import AsyncIterator, Callable


from engine.config import EngineConfig
from engine.core.fallback import FallbackEngine
from engine.core.interface import GenerationLoop
from engine.core.loop import Engine
from engine.core.sequence import RequestOutput
from engine.core.pooling import (PoolingConfig, PoolingInput, PoolingModel, PoolingOutput, PoolingParams,
                                 PoolingQueue, Task)
from engine.core.speculative import Speculator
from engine.cpu import host_memory
from engine.cpu import plan as cpu_plan
from engine.executor.runner import ModelRunner
from engine.executor.startup_checks import PagedPathUnsupported
from engine.loader import LoadedModel, load
from engine.lora import AdapterError, LoraRegistry, LoraSpec
from engine.sampling.sampler import SamplingParams
from engine.threads import in_own_thread
from engine.tokenizer import Tokenizer
from engine.vision.processor import VisionProcessor

log = logging.getLogger("engine")


class GenerationError(RuntimeError):
    """Generation of one request failed; other requests are unaffected."""


def _use_own_attention(model) -> None:
    """Give a model that goes to the fallback path transformers' own attention back: SDPA, or eager for the
    classes that refuse SDPA (those without attention layers, as Mamba)."""
    try:
        model.set_attn_implementation("sdpa")
    except ValueError:
        model.set_attn_implementation("eager")


class _QueueSink:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | PoolingOutput] = asyncio.Queue()

    def deliver(self, output: RequestOutput | PoolingOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, output)


_DEFAULT_CPU_KV_BYTES = 4 * 2**30


def default_cpu_kv_budget() -> int:
    """A quarter of the machine's memory, at most 4 GiB (vLLM's CPU default): pool pages count towards resident
    memory only once used, so a generous bound costs nothing until the load needs it."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return _DEFAULT_CPU_KV_BYTES
    return min(_DEFAULT_CPU_KV_BYTES, total // 4)


def _generation_runner(model: LoadedModel, config: EngineConfig) -> ModelRunner:
    """The forward passes and the KV cache, sized once from the budget (logged in tokens and bytes)."""
    kv_dtype, check_kv_dtype = cpu_plan.kv_cache_dtype(config, model.dtype, model.platform.cpu_fast_paths)
    runner = ModelRunner(model.model, model.device, model.dtype,
                         kv_budget_bytes=config.kv_cache_memory or default_cpu_kv_budget(),
                         gpu_memory_utilization=config.gpu_memory_utilization,
                         max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                         kv_dtype=kv_dtype, check_kv_dtype=check_kv_dtype, platform=model.platform,
                         verdicts=model.verdicts, batch_invariant=model.batch_invariant)
    kv = runner.kv
    memory = (f" of {model.platform.simulated_memory / 2**30:.2f} GiB simulated" if model.platform.simulated
              else "")
    budget = (f"GPU_MEMORY_UTILIZATION={config.gpu_memory_utilization}{memory}" if model.platform.accelerator
              else "KV_CACHE_MEMORY")
    if runner.states is not None:
        log.info("recurrent state: %d slots (MAX_NUM_SEQS) in %.1f MB (%.1f KB per sequence) for %d layers; %s",
                 runner.states.num_slots, runner.states.nbytes / 2**20,
                 runner.states.nbytes / runner.states.num_slots / 1024, len({k[1] for k in runner.states.shapes}),
                 "prompts prefill in chunks" if runner.prefill_continues else
                 "each prompt prefills in one pass (its recurrent layers restart a multi-token pass from zero)")
    log.info("forward pass: %s", "compact (engine/executor/compact_decoder.py%s, checked against the model's own)" % (
             ", through the native CPU kernels" if runner.compact.kernels is not None else "")
             if runner.compact is not None else f"the model's own ({runner.compact_reason})")
    if not runner.layer_shapes:
        log.info("KV cache: none (the model has no attention layer)")
        return runner
    log.info("KV cache: %d tokens in %.1f MB (%.1f KB per token, %s; %s keys and values)", kv.capacity_tokens,
             kv.nbytes / 2**20, kv.nbytes / kv.capacity_tokens / 1024, budget, str(kv.dtype).removeprefix("torch."))
    if kv.capacity_tokens < model.max_model_len:
        raise RuntimeError(f"the KV cache holds {kv.capacity_tokens} tokens, fewer than one sequence of "
                           f"MAX_MODEL_LEN={model.max_model_len}: raise {budget.split('=')[0]} or lower MAX_MODEL_LEN")
    return runner


class AsyncEngine:
    def __init__(self, config: EngineConfig, loader: Callable[[EngineConfig], LoadedModel] = load):
        self.config = config
        self._loader = loader
        self._lock = threading.Lock()
        self._loading: concurrent.futures.Future | None = None
        self._engine: GenerationLoop | None = None
        self._model: LoadedModel | None = None
        self._lora: LoraRegistry | None = None
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
            # Adapters wrap the linear layers' final forwards, before the runner builds its compact forward on them.
            lora = self._adapters(model)
            runner = None
            if model.task == "generate" and model.fallback_reason is None:
                try:
                    runner = _generation_runner(model, self.config)
                except (AttributeError, NotImplementedError, TypeError, PagedPathUnsupported) as exc:
                    # The model calls cache methods the paged cache does not have (recurrent or conv state), or
                    # keeps its state elsewhere (a cache of its own, as Mamba does).
                    if model.vision is not None:  # the fallback loop would need the whole model, not its decoder
                        raise RuntimeError(f"the vision-language model's decoder cannot run on the paged engine: "
                                           f"{exc}") from exc
                    model.fallback_reason = f"the paged engine cannot run it ({exc})"
                    _use_own_attention(model.model)
            if model.task == "generate" and model.fallback_reason is not None:
                log.info("serving path: fallback (transformers' cache, requests take turns): %s",
                         model.fallback_reason)
                engine = FallbackEngine(model.model, model.device, model.tokenizer,
                                        max_num_seqs=self.config.max_num_seqs, max_model_len=model.max_model_len,
                                        cpu_fast_paths=model.platform.cpu_fast_paths, lora=lora)
            else:
                if runner is not None:
                    log.info("serving path: paged (batched engine)")
                # A model without attention layers (Mamba) takes the plain padding mask in its mixers.
                pooling = PoolingQueue(PoolingModel(model.model, model.device, model.task,
                                                    engine_attention=runner is not None and bool(runner.layer_shapes)),
                                       max_batch_tokens=self.config.max_num_batched_tokens, lora=lora)
                engine = Engine(runner, model.tokenizer, max_num_seqs=self.config.max_num_seqs,
                                max_num_batched_tokens=self.config.max_num_batched_tokens,
                                max_model_len=model.max_model_len, prefix_cache_bytes=self.config.prefix_cache_bytes,
                                pooling=pooling,
                                speculator=self._speculator(model, runner) if runner is not None else None,
                                platform=model.platform, lora=lora)
            engine.on_fatal = self._fatal
            if model.verdicts is not None and model.verdicts.path is not None:
                model.verdicts.save()
                log.info("start-up verdicts: %s", model.verdicts.summary())
            self._model, self._engine, self._lora = model, engine, lora
            host_memory.freeze_long_lived()
            future.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
            log.error("model load failed: %s", exc)
            future.set_exception(exc)

    def _adapters(self, model: LoadedModel) -> LoraRegistry | None:
        """ENABLE_LORA: the adapted layers and LORA_MODULES' adapters, each read and checked now (a bad one stops
        the start with a line naming it)."""
        config = self.config.lora
        if config is None:
            return None
        if model.task != "generate":
            raise RuntimeError(f"ENABLE_LORA: LoRA adapters are served for text generation; {model.name} is a "
                               f"{model.task} model")
        names = tuple(n for n in (*config.base_aliases, model.name, self.config.model) if n)
        registry = LoraRegistry(model.model, config, cache_dir=self.config.cache_dir,
                                baked_dir=self.config.baked_model_dir, base_names=names)
        for spec in config.modules:
            try:
                registry.add(spec)
            except AdapterError as exc:
                raise RuntimeError(f"LORA_MODULES: {exc}") from None
        log.info("LoRA: %d adapters (%s); MAX_LORAS=%d, MAX_LORA_RANK=%d, MAX_CPU_LORAS=%d", len(config.modules),
                 ", ".join(s.name for s in config.modules) or "none yet", config.max_loras, config.max_lora_rank,
                 registry.max_cpu)
        return registry

    def _speculator(self, model: LoadedModel, runner: ModelRunner) -> Speculator | None:
        """SPECULATIVE_CONFIG's proposer; a draft model loads like the main one and must share its vocabulary."""
        spec = self.config.speculative
        if spec is None:
            return None
        if runner.states is not None:
            raise RuntimeError("SPECULATIVE_CONFIG: speculative decoding is not supported for models with recurrent "
                               "layers (a rejected token cannot be taken back out of a recurrent state)")
        if spec.method != "draft_model":
            return Speculator(spec)
        draft = self._loader(dataclasses.replace(self.config, model=spec.model, revision=spec.revision,
                                                 tokenizer=None, tokenizer_revision=None, speculative=None))
        if draft.tokenizer.vocab_size != model.tokenizer.vocab_size or draft.device != model.device:
            raise RuntimeError(f"SPECULATIVE_CONFIG: the draft model {spec.model} must share the model's vocabulary "
                               f"({draft.tokenizer.vocab_size} vs {model.tokenizer.vocab_size} tokens) and device")
        log.info("speculative decoding: draft model %s, %d tokens", spec.model, spec.num_speculative_tokens)
        return Speculator(spec, draft.model, draft.device)

    def close(self) -> None:
        """Stop generation and drop the model, so its memory can be reclaimed; start() loads it again."""
        with self._lock:
            engine, self._engine, self._model, self._loading = self._engine, None, None, None
            self._lora = None
        if engine is not None:
            engine.shutdown()
            del engine
            host_memory.thaw()

    def _fatal(self, exc: BaseException) -> None:
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _require(self) -> LoadedModel:
        if self._model is None:
            raise RuntimeError("engine not started")
        return self._model

    @property
    def loaded_model(self) -> LoadedModel:
        """The model as loaded: its device, platform, dtype (engine/device_check.py reports them)."""
        return self._require()

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

    def check_fits(self, prompt_len: int, max_tokens: int, num_sequences: int) -> str | None:
        """Why such a request could never run in the KV cache (too large even alone), or None."""
        return self.engine.check_fits(prompt_len, max_tokens, num_sequences)

    def check_supported(self, params: SamplingParams) -> str | None:
        """Why the serving path cannot honour these parameters (beam search on the fallback path), or None."""
        return self.engine.check_supported(params)

    # ---- LoRA adapters ----

    @property
    def lora_enabled(self) -> bool:
        return self.config.lora is not None

    def lora_names(self) -> list[str]:
        """The adapters requests may name (empty with LoRA off)."""
        self._require()
        return self._lora.names() if self._lora is not None else []

    async def load_lora(self, name: str, path: str) -> None:
        """Read, check and register an adapter (its files are read on a worker thread). AdapterError when it
        cannot be served."""
        await self.start()
        if self._lora is None:
            raise AdapterError("LoRA is off (set ENABLE_LORA=true)")
        await in_own_thread(self._lora.add, LoraSpec(name, path))  # its tensors' copies are parallel torch work

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (KeyError when none has that name); running requests finish with it."""
        if self._lora is None or name not in self._lora:
            raise KeyError(name)
        self._lora.remove(name)

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's output is independent of what shares its steps (BATCH_INVARIANT, resolved)."""
        return self._require().batch_invariant

    @property
    def task(self) -> Task:
        """generate, embed or classify: what the served model's architecture can do."""
        return self._require().task

    @property
    def vision(self) -> VisionProcessor | None:
        """The processor of a vision-language model (prompts may carry images), or None for a text model."""
        return self._require().vision

    @property
    def pooling_config(self) -> PoolingConfig:
        return self._require().pooling

    def stats(self) -> dict | None:
        """The generation loop's figures (the same keys on the paged and the fallback loop), or None before the
        model is loaded: what /health, /stats and /metrics read, so none of them reaches into a loop."""
        engine = self._engine
        return None if engine is None else engine.stats()

    @property
    def failure(self) -> BaseException | None:
        """The device failure that stopped the loop, if one did."""
        engine = self._engine
        return None if engine is None else engine.dead

    @property
    def engine(self) -> GenerationLoop:
        """The loop itself, for white-box tests and benchmarks; serving code stays on the methods above."""
        self._require()
        return self._engine

    # ---- generation ----

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, images=None
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; the last has `finished` set. Closing the iterator
        early (cancellation, a client that went away) takes the request out of the engine. `images` is the
        ImageInputs of a prompt with images (VisionProcessor.prepare), for a vision-language model."""
        await self.start()
        sink = _QueueSink(asyncio.get_running_loop())
        # The loop that took the request is the one to abort it on: close() may have dropped it meanwhile.
        engine = self._engine
        engine.submit(request_id, prompt_ids, params, sink, images)
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
                engine.abort(request_id)

    # ---- pooling ----

    async def pool(self, request_id: str, inputs: list[PoolingInput], params: PoolingParams) -> PoolingOutput:
        """One vector per input (embedding or classification scores), computed on the engine thread in batches
        shared with other requests. Cancelling the wait takes the request out of the queue."""
        await self.start()
        if not self._engine.serves_pooling:
            raise GenerationError("embeddings and scores are not served for models on the fallback path")
        sink = _QueueSink(asyncio.get_running_loop())
        self._engine.submit_pooling(request_id, inputs, params, sink)
        try:
            output = await sink.queue.get()
        except BaseException:
            self._engine.abort_pooling(request_id)
            raise
        if output.error is not None:
            raise GenerationError(str(output.error)) from output.error
        return output
