"""The fallback path: models the paged engine cannot run, served with transformers' own cache.

The paged engine needs every layer's attention to go through the worker's attention function and every layer's
state to live in its cache (keys and values, or recurrent state through transformers' cache API). Models whose
attention does not dispatch through transformers' AttentionInterface (GPT-J, BLOOM, Falcon, MPT...) or that keep
their state elsewhere (RecurrentGemma) run here instead: each request keeps the cache transformers' model creates
for it, its choices (`n`) decode together as the rows of one batch, and running requests take turns one token
each, so all of them stream. Outputs are the paged engine's: the same sampler, stop handling, detokenising and
deltas.
"""
from __future__ import annotations

import logging
import sys
import time

import torch

from engine.core.interface import EngineDeadError, GenerationLoop, is_fatal
from engine.core.output_processor import OutputProcessor
from engine.sampling.sampler import Sampler, SamplingParams
from engine.core.sequence import Sequence, SequenceGroup, Status, enqueue
from engine.lora import layers as lora_layers
from engine.tokenizer import Tokenizer

log = logging.getLogger("engine")


def paged_path_refusal(model_class) -> str | None:
    """Why the paged engine cannot serve this model class, or None when it can. Recurrent and convolution layers
    are no reason: the paged engine keeps their state per sequence when they use transformers' cache API (the
    start-up probe, runner.py, finds out and sends a model that keeps its state elsewhere here)."""
    modeling = sys.modules.get(getattr(model_class, "__module__", ""))
    if modeling is not None and not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS") and _has_attention(modeling):
        return f"{model_class.__name__} does not route its attention through transformers' AttentionInterface"
    return None


def _has_attention(modeling) -> bool:
    """Whether a modeling module defines attention layers (pure state-space models, such as Mamba, do not)."""
    return any(isinstance(v, type) and issubclass(v, torch.nn.Module) and name.endswith("Attention")
               for name, v in vars(modeling).items())


class _Running:
    """One request on the fallback path: its sequences and the cache they decode with (one row each)."""

    def __init__(self, group: SequenceGroup):
        self.group = group
        self.cache: dict | None = None  # the model's cache, as the keyword argument it takes it back by
        self.recompute = False  # the model hands back no cache (it keeps state in its modules): no cache is used
        self.module_state: dict[int, object] = {}  # per-request state some models keep on a module (see below)


class FallbackEngine(GenerationLoop):
    """The Engine interface (submit/abort/shutdown/stats...) over transformers' own cache."""

    def __init__(self, model, device: torch.device, tokenizer: Tokenizer, *, max_num_seqs: int,
                 max_model_len: int, cpu_fast_paths: bool = True, lora=None):
        self.model = model
        self.lora = lora  # engine/lora/registry.py's LoraRegistry, or None (LoRA off)
        self.device = device
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.sampler = Sampler(tokenizer.eos_token_ids, tokenizer.vocab_size, cpu_fast_paths)
        self.outputs = OutputProcessor(tokenizer.eos_token_ids, max_model_len)
        self._waiting: list[SequenceGroup] = []
        self._running: list[_Running] = []
        # Qwen2-VL-style models remember a prompt's multimodal rotary offsets (rope_deltas) on a module between
        # its prefill and its decode steps; requests take turns here, so each keeps its own and puts it back.
        self._stateful = [m for m in model.modules() if hasattr(m, "rope_deltas")]
        self._start_loop("fallback-engine-loop")

    serves_images = True  # a vision-language model's whole forward runs a prompt's images at its prefill

    # ---- API used from other threads (as engine.Engine) ----

    # transformers' cache grows with the request: only the context bounds it (GenerationLoop.submit checks it).

    def check_supported(self, params: SamplingParams) -> str | None:
        if params.beam_search:
            return ("beam search is not available for this model: it runs on the fallback path (transformers' own "
                    "cache), which samples each choice on its own")
        return None

    @property
    def num_running(self) -> int:
        return sum(len(r.group.seqs) for r in self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def stats(self) -> dict:
        # No fixed KV pool on this path: its cache figures are zero.
        return {"num_running": self.num_running, "num_waiting": self.num_waiting, "num_requests": self.num_requests,
                "kv_used_tokens": 0,
                "kv_capacity_tokens": 0, "kv_used_bytes": 0, "kv_capacity_bytes": 0, "kv_peak_used_tokens": 0,
                "preemptions": 0, "prefix_cache_hit_tokens": 0, "prompt_tokens_total": self.prompt_tokens_total,
                "generation_tokens_total": self.generation_tokens_total}

    # ---- the loop ----

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                if not self._groups:
                    self._wake.wait(timeout=1.0)
                self._wake.clear()
                self._drain_commands()
                self._admit()
                for running in list(self._running):
                    try:
                        self._step(running)
                    except Exception as exc:  # noqa: BLE001 - one request's failure stays its own
                        if is_fatal(exc):
                            self._dead = exc
                            log.critical("engine stopped: device failure: %s", exc)
                            self._fail_all(exc)
                            if self.on_fatal is not None:
                                self.on_fatal(exc)
                            return
                        self._fail_group(running.group, exc)
                    self._deliver_outputs()
            self._drain_commands()
            self._fail_all(EngineDeadError("the engine was shut down"))

    def _add(self, group: SequenceGroup) -> None:
        self._groups[group.request_id] = group
        try:
            group.seqs = [Sequence(group, i, self.tokenizer, self.sampler.vocab_size, self.device)
                          for i in range(group.params.num_sequences)]
        except Exception as exc:  # noqa: BLE001
            self._fail_group(group, exc)
            return
        enqueue(self._waiting, group)  # by priority, then arrival, as the paged scheduler admits

    def _admit(self) -> None:
        while self._waiting and self.num_running + self._waiting[0].params.num_sequences <= self.max_num_seqs:
            group = self._waiting[0]
            if group.params.lora_name is not None:  # an adapter slot, held to its end (engine/lora/registry.py)
                try:
                    held = self.lora.acquire(group.params.lora_name)
                except Exception as exc:  # noqa: BLE001 - unloaded while it waited
                    self._fail_group(group, exc)
                    continue
                if held is None:
                    return  # every slot is held by running requests: wait for one to finish
                group.lora_slot, group.lora_key = held
            self._waiting.pop(0)
            group.metrics.admitted = time.perf_counter()
            self._running.append(_Running(group))

    def _step(self, running: _Running) -> None:
        """One forward for one request: its prompt (every choice a row), or the next token of every choice."""
        self.steps += 1
        group = running.group
        with lora_layers.step(uniform=group.lora_slot):  # every row of this pass is this request's
            out = self._forward(running)
        # Most models return their cache as past_key_values; Mamba's is cache_params. Some keep their state in
        # their own modules and return none (RecurrentGemma): one model-wide state cannot serve several requests.
        if not running.recompute:
            name = "past_key_values" if getattr(out, "past_key_values", None) is not None else "cache_params"
            running.cache = {name: getattr(out, name, None)}
            running.recompute = running.cache[name] is None
        seqs = group.seqs
        logits = out.logits[:, -1]
        live = [i for i, s in enumerate(seqs) if not s.finished]  # finished choices ride along as padding rows
        tokens, logprobs = self.sampler.sample(logits[live], [seqs[i].sampling for i in live],
                                               [seqs[i].num_generated for i in live])
        for i, token, logprob in zip(live, tokens, logprobs):
            self.generation_tokens_total += 1
            self.outputs.append(seqs[i], token, logprob)
        for i, seq in enumerate(seqs):
            if seq.finished and i not in live:
                seq.tokens.append(seq.tokens[-1])  # keeps every row's length equal; never sent

    def _forward(self, running: _Running):
        """The model's pass for one request's step: its prompt, its next tokens, or (no cache) everything."""
        group = running.group
        seqs = group.seqs
        rows = len(seqs)
        if running.recompute:
            # Every step computes the whole sequences again: quadratic, but exact for any model.
            ids = torch.tensor([s.tokens for s in seqs], device=self.device)
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        elif running.cache is None and group.images is not None:
            out = self._prefill_with_images(running, rows)
        elif running.cache is None:
            ids = torch.tensor([group.prompt_ids] * rows, device=self.device)
            want_all = group.params.prompt_logprobs is not None
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=0 if want_all else 1)
            self.prompt_tokens_total += len(group.prompt_ids)
            if want_all:
                self._collect_prompt_logprobs(group, out.logits[0])
            group.metrics.first_token = time.perf_counter()
            for seq in seqs:
                seq.status = Status.DECODING
                seq.num_computed = len(group.prompt_ids)
        else:
            ids = torch.tensor([[s.tokens[-1]] for s in seqs], device=self.device)
            self._restore_state(running)
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **running.cache)
            self._save_state(running)
        return out

    def _prefill_with_images(self, running: _Running, rows: int):
        """A prompt with images through the whole model once (vision tower, projector, text decoder, with the
        family's own positions), its cache then copied to every choice's row."""
        group = running.group
        want_all = group.params.prompt_logprobs is not None
        ids = torch.tensor([group.prompt_ids], device=self.device)
        self._restore_state(running)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=0 if want_all else 1,
                         **group.images.to(self.device).tensors)
        self._save_state(running)
        if out.past_key_values is None:
            raise RuntimeError("the vision-language model returned no cache")
        if rows > 1:
            out.past_key_values.batch_repeat_interleave(rows)
            out.logits = out.logits.expand(rows, *out.logits.shape[1:])
        self.prompt_tokens_total += len(group.prompt_ids)
        if want_all:
            self._collect_prompt_logprobs(group, out.logits[0])
        group.metrics.first_token = time.perf_counter()
        for seq in group.seqs:
            seq.status = Status.DECODING
            seq.num_computed = len(group.prompt_ids)
        return out

    def _restore_state(self, running: _Running) -> None:
        for module in self._stateful:
            module.rope_deltas = running.module_state.get(id(module))

    def _save_state(self, running: _Running) -> None:
        for module in self._stateful:
            running.module_state[id(module)] = module.rope_deltas

    def _collect_prompt_logprobs(self, group: SequenceGroup, logits: torch.Tensor) -> None:
        targets = group.prompt_ids[1:]
        group.prompt_logprobs = [None]
        if targets:
            k = group.params.prompt_logprobs or 0
            group.prompt_logprobs.extend(self.sampler.logprobs_of(
                logits[:len(targets)], torch.tensor(targets, device=logits.device), [k] * len(targets)))

    def _deliver_outputs(self) -> None:
        for group, output in self.outputs.take_outputs():
            if output.finished:
                self._finish_group(group)
            self._deliver(group, output)

    def _finish_group(self, group: SequenceGroup) -> None:
        if group.done:
            return
        group.done = True
        self._groups.pop(group.request_id, None)
        if group in self._waiting:
            self._waiting.remove(group)
        self._running = [r for r in self._running if r.group is not group]
        if group.lora_slot:
            self.lora.release(group.lora_slot)
            group.lora_slot = 0
        for seq in group.seqs:
            seq.status = Status.FINISHED
