"""Embeddings and classification scores: one forward pass over whole prompts, no KV cache, no decoding.

Pooling requests wait in a `PoolingQueue`; the generation loop gives it one batch per iteration, between
generation steps, so embeddings never stall running streams for long and many inputs (of one request or of
several) share a forward pass. A batch holds whole inputs, right-padded to the longest, up to a budget of
padded tokens (at least one input).

Decoder models run through the engine's attention function with an explicit 4-D boolean mask (causal and
padding); encoders (and sequence-classification models) run with their own attention and a padding mask.
The pooled vector is the last token's, the first token's (`cls`), the mean or the maximum over the tokens,
cut to the requested matryoshka dimensions and then L2-normalised when asked. Classification models give
their head's scores: a sigmoid for a single label, a softmax over several.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Protocol

import torch
import torch.nn.functional as F

from engine.lora.layers import step as lora_step

log = logging.getLogger("engine.core.pooling")

PoolingType = Literal["last", "mean", "cls", "max"]
POOLING_TYPES: tuple[str, ...] = ("last", "mean", "cls", "max")
Task = Literal["generate", "embed", "classify"]

# sentence-transformers' pooling modes (1_Pooling/config.json) and ours.
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last",
             "pooling_mode_max_tokens": "max"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class PoolingConfig:
    """How the served model turns hidden states into an embedding, when a request does not say otherwise."""
    pooling_type: str
    normalize: bool
    hidden_size: int
    # Dimensions a request may cut embeddings to: None = not a matryoshka model (no cutting), () = any size.
    matryoshka_dimensions: tuple[int, ...] | None = None
    num_labels: int = 0  # classification models: outputs of the head
    # Why embeddings cannot be computed as the model's authors intended (e.g. a Dense module); None if they can.
    unsupported: str | None = None
    source: str = "default"  # where pooling_type and normalize came from, for the start-up log


@dataclass(frozen=True)
class PoolingParams:
    task: Literal["embed", "classify"] = "embed"
    pooling_type: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    lora_name: str | None = None  # a LoRA adapter over the base model (embed on a generative model only)


@dataclass
class PoolingInput:
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # segment ids of a text pair, for encoders that take them


@dataclass
class PoolingOutput:
    request_id: str
    data: list[torch.Tensor] | None = None  # one float32 CPU vector per input, in input order
    error: BaseException | None = None
    prompt_tokens: int = 0
    arrival: float = 0.0
    started: float | None = None
    finished: float | None = None


class PoolingSink(Protocol):
    def deliver(self, output: PoolingOutput) -> None: ...


def read_sentence_transformers(folder: Path) -> tuple[str | None, bool | None, str | None, str | None]:
    """(pooling type, normalize, unsupported modules, pooling problem) from a sentence-transformers model's
    `modules.json` and pooling config; Nones where the folder has no such configuration. A pooling problem
    (a mode this worker does not compute) goes away when POOLING_TYPE chooses the pooling; modules stay."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, None, None, None
    try:
        modules = json.loads(modules_file.read_text())
        types = [m.get("type", "") for m in modules]
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        return None, None, f"modules.json could not be read: {exc}", None
    unknown = [t for t in types if t not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE)]
    unsupported = (f"the model's sentence-transformers pipeline has modules this worker does not run: "
                   f"{', '.join(unknown)}") if unknown else None
    pooling_type = problem = None
    pooling_module = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling_module is not None:
        try:
            config = json.loads((folder / pooling_module.get("path", "1_Pooling") / "config.json").read_text())
        except (OSError, ValueError) as exc:
            return None, None, unsupported, f"the sentence-transformers pooling config could not be read: {exc}"
        chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
        odd = [key for key in _ST_UNSUPPORTED_MODES if config.get(key)]
        if odd or len(chosen) != 1:
            problem = (f"the sentence-transformers pooling config asks for {odd or chosen}; this worker pools with "
                       f"exactly one of {', '.join(POOLING_TYPES)} (set POOLING_TYPE to choose)")
        else:
            pooling_type = chosen[0]
    return pooling_type, _ST_NORMALIZE in types, unsupported, problem


def pooling_config(folder: Path, model_config, task: Task, pooling_type: str | None,
                   normalize: bool | None) -> PoolingConfig:
    """The model's pooling: explicit settings (POOLING_TYPE, EMBEDDING_NORMALIZE) first, then the model's own
    sentence-transformers configuration, then the usual default (last token for decoders, the first token
    for encoders, normalised)."""
    st_type, st_normalize, unsupported, problem = read_sentence_transformers(folder)
    if pooling_type is None:
        unsupported = unsupported or problem
    text_config = getattr(model_config, "get_text_config", lambda: model_config)()
    is_decoder = task == "generate" or bool(getattr(text_config, "is_decoder", False))
    source = "sentence-transformers config" if st_type is not None else "default"
    if pooling_type is not None or normalize is not None:
        source = "settings" if st_type is None else "settings and sentence-transformers config"
    matryoshka = getattr(model_config, "matryoshka_dimensions", None)
    if isinstance(matryoshka, (list, tuple)) and matryoshka:
        dims: tuple[int, ...] | None = tuple(int(d) for d in matryoshka)
    else:
        dims = () if getattr(model_config, "is_matryoshka", False) else None
    return PoolingConfig(
        pooling_type=pooling_type or st_type or ("last" if is_decoder else "cls"),
        normalize=normalize if normalize is not None else (st_normalize if st_normalize is not None else True),
        hidden_size=int(getattr(text_config, "hidden_size", 0) or 0),
        matryoshka_dimensions=dims,
        num_labels=int(getattr(model_config, "num_labels", 0) or 0) if task == "classify" else 0,
        unsupported=unsupported, source=source)


class PoolingModel:
    """The forward passes and the pooling math."""

    def __init__(self, model: torch.nn.Module, device: torch.device, task: Task, engine_attention: bool):
        self.model = model
        self.base = model.base_model
        self.device = device
        self.task = task
        self.engine_attention = engine_attention  # the engine's attention function: 4-D boolean masks
        # Decoder classification heads score the last token that is not padding, found by the pad id, so
        # padding must use that id; without one, such inputs run one per forward.
        self.pad_id = getattr(model.config, "pad_token_id", None)

    def _batch(self, inputs: list[PoolingInput]):
        width = max(len(i.token_ids) for i in inputs)
        ids = torch.full((len(inputs), width), self.pad_id or 0, dtype=torch.long)
        types = None
        if any(i.token_type_ids is not None for i in inputs):
            types = torch.zeros((len(inputs), width), dtype=torch.long)
        lengths = torch.tensor([len(i.token_ids) for i in inputs], dtype=torch.long)
        for row, item in enumerate(inputs):
            ids[row, :len(item.token_ids)] = torch.tensor(item.token_ids, dtype=torch.long)
            if types is not None and item.token_type_ids is not None:
                types[row, :len(item.token_type_ids)] = torch.tensor(item.token_type_ids, dtype=torch.long)
        valid = torch.arange(width).view(1, -1) < lengths.view(-1, 1)  # [batch, width]: real tokens
        return ids, types, lengths, valid

    def _forward(self, module: torch.nn.Module, inputs: list[PoolingInput], slots: list[int]):
        ids, types, lengths, valid = self._batch(inputs)
        # Each token row of the padded batch takes its input's adapter slot (rows are input-major).
        with lora_step([slot for slot in slots for _ in range(ids.shape[1])]):
            return self._forward_rows(module, ids, types, lengths, valid)

    def _forward_rows(self, module: torch.nn.Module, ids, types, lengths, valid):
        kwargs = {}
        if types is not None:
            kwargs["token_type_ids"] = types.to(self.device)
        if self.engine_attention:
            width = ids.shape[1]
            causal = torch.arange(width).view(1, -1) <= torch.arange(width).view(-1, 1)  # [q, kv]
            # Each query sees the real tokens up to itself; a padding query still sees token 0, so no row of
            # the attention is empty.
            mask = (causal.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)
            positions = torch.arange(width).view(1, -1).expand(ids.shape[0], -1)
            out = module(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), use_cache=False, **kwargs)
        else:
            out = module(input_ids=ids.to(self.device), attention_mask=valid.long().to(self.device), **kwargs)
        return out, lengths, valid

    def run(self, inputs: list[PoolingInput], params: list[PoolingParams], slots: list[int] | None = None
            ) -> list[torch.Tensor]:
        """One vector per input: its pooled embedding, or its classification scores. `slots`: each input's LoRA
        adapter slot (0: the base model alone)."""
        slots = slots or [0] * len(inputs)
        results: list[torch.Tensor | None] = [None] * len(inputs)
        embed = [i for i, p in enumerate(params) if p.task == "embed"]
        classify = [i for i, p in enumerate(params) if p.task == "classify"]
        if not classify:
            groups = []
        else:
            groups = [classify] if self.pad_id is not None else [[i] for i in classify]
        for group in groups:
            out, _, _ = self._forward(self.model, [inputs[i] for i in group], [slots[i] for i in group])
            logits = out.logits.float()
            scores = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
            for row, i in enumerate(group):
                results[i] = scores[row].cpu()
        if embed:
            out, lengths, valid = self._forward(self.base, [inputs[i] for i in embed], [slots[i] for i in embed])
            hidden = out.last_hidden_state.float()
            valid = valid.to(hidden.device)
            for row, i in enumerate(embed):
                results[i] = _pool(hidden[row], int(lengths[row]), valid[row], params[i]).cpu()
        return results  # type: ignore[return-value]


def _pool(hidden: torch.Tensor, length: int, valid: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    kind = params.pooling_type
    if kind == "last":
        vector = hidden[length - 1]
    elif kind == "cls":
        vector = hidden[0]
    elif kind == "mean":
        vector = hidden[:length].mean(dim=0)
    elif kind == "max":
        vector = hidden[:length].max(dim=0).values
    else:
        raise ValueError(f"unknown pooling type {kind!r}")
    if params.dimensions is not None:
        vector = vector[:params.dimensions]
    if params.normalize:
        vector = F.normalize(vector, p=2, dim=-1)
    return vector


@dataclass(eq=False)
class _Job:
    request_id: str
    inputs: list[PoolingInput]
    params: PoolingParams
    sink: PoolingSink
    arrival: float
    results: list[torch.Tensor | None] = field(default_factory=list)
    next_input: int = 0  # inputs before this one are in a batch already
    done_inputs: int = 0
    started: float | None = None
    failed: bool = False
    lora_slot: int = 0  # the adapter slot held from the job's first batch to its end (0: none)


class PoolingQueue:
    """Pooling requests waiting for the engine loop. `add` and `abort` may be called from any thread; the rest
    runs on the engine thread."""

    def __init__(self, model: PoolingModel, max_batch_tokens: int, lora=None):
        self.model = model
        self.max_batch_tokens = max_batch_tokens
        self.lora = lora  # engine/lora/registry.py's LoraRegistry, or None (LoRA off)
        self._refused: list[tuple[_Job, Exception]] = []
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        self._aborted: set[str] = set()

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    @property
    def num_waiting(self) -> int:
        return len(self._jobs)

    def add(self, request_id: str, inputs: list[PoolingInput], params: PoolingParams, sink: PoolingSink) -> None:
        job = _Job(request_id, inputs, params, sink, time.perf_counter(), results=[None] * len(inputs))
        with self._lock:
            self._jobs.append(job)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if any(job.request_id == request_id for job in self._jobs):
                self._aborted.add(request_id)

    def run_next_batch(self, is_fatal: Callable[[BaseException], bool]) -> None:
        """Run one batch of the oldest inputs. A failing batch is retried one request at a time, so only the
        request that causes a failure fails; device failures propagate (the engine stops)."""
        with self._lock:
            aborted, self._aborted = self._aborted, set()
            for job in [j for j in self._jobs if j.request_id in aborted]:
                self._jobs.remove(job)
                self._release(job)
            batch = self._take_batch()
            refused, self._refused = self._refused, []
        for job, exc in refused:
            self._fail(job, exc)
        if not batch:
            return
        try:
            self._run(batch)
        except Exception as exc:
            if is_fatal(exc):
                raise
            jobs = list(dict.fromkeys(job for job, _ in batch))
            if len(jobs) == 1:
                self._fail(jobs[0], exc)
            else:
                for job in jobs:
                    try:
                        self._run([(j, i) for j, i in batch if j is job])
                    except Exception as job_exc:
                        if is_fatal(job_exc):
                            raise
                        self._fail(job, job_exc)

    def _take_batch(self) -> list[tuple[_Job, int]]:
        batch: list[tuple[_Job, int]] = []
        width = 0
        for job in self._jobs:
            if not self._has_slot(job):
                continue  # its adapter waits for a slot, as a generation request does
            while job.next_input < len(job.inputs):
                length = len(job.inputs[job.next_input].token_ids)
                if batch and (len(batch) + 1) * max(width, length) > self.max_batch_tokens:
                    return batch
                width = max(width, length)
                batch.append((job, job.next_input))
                job.next_input += 1
                if job.started is None:
                    job.started = time.perf_counter()
        return batch

    def _has_slot(self, job: _Job) -> bool:
        """Whether the job can run now: no adapter, or its adapter's slot held (taken here when one is free)."""
        if job.failed:
            return False
        if job.params.lora_name is None or job.lora_slot:
            return True
        try:
            held = self.lora.acquire(job.params.lora_name)
        except Exception as exc:  # unloaded since the request arrived
            job.failed = True
            self._refused.append((job, exc))
            return False
        if held is None:
            return False
        job.lora_slot = held[0]
        return True

    def _release(self, job: _Job) -> None:
        if job.lora_slot:
            self.lora.release(job.lora_slot)
            job.lora_slot = 0

    def _run(self, batch: list[tuple[_Job, int]]) -> None:
        vectors = self.model.run([job.inputs[i] for job, i in batch], [job.params for job, _ in batch],
                                 [job.lora_slot for job, _ in batch])
        for (job, i), vector in zip(batch, vectors):
            if job.failed:
                continue
            job.results[i] = vector
            job.done_inputs += 1
            if job.done_inputs == len(job.inputs):
                self._finish(job, PoolingOutput(job.request_id, data=job.results,
                                                prompt_tokens=sum(len(x.token_ids) for x in job.inputs),
                                                arrival=job.arrival, started=job.started,
                                                finished=time.perf_counter()))

    def _fail(self, job: _Job, exc: BaseException) -> None:
        log.error("pooling request %s failed: %s", job.request_id, exc, exc_info=exc)
        job.failed = True
        self._finish(job, PoolingOutput(job.request_id, error=exc, arrival=job.arrival))

    def _finish(self, job: _Job, output: PoolingOutput) -> None:
        with self._lock:
            try:
                self._jobs.remove(job)
            except ValueError:
                pass
            self._release(job)
        try:
            job.sink.deliver(output)
        except Exception:  # the consumer is gone
            log.warning("pooling request %s: output could not be delivered", job.request_id)

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            if not job.failed:
                self._fail(job, exc)
