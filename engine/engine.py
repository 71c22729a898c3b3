"""The generation loop: one thread per model runs every request in shared forward passes.

Each iteration admits waiting requests (while KV rows are free), computes a budget of prompt tokens for
requests still prefilling, then runs one decode step for every sequence that has a token to extend. Outputs
are handed to each request's sink as soon as its step is done. Requests leave the batch the moment they
finish, are aborted, or fail; their rows are reused at once.
"""
from __future__ import annotations

import contextvars
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from . import host_memory
from .detokenizer import StopStringMatcher
from .prefix_cache import PrefixCache
from .runner import ModelRunner, PrefillChunk
from .sampling import Sampler, SamplingParams, SequenceSamplingState, TokenLogprob
from .tokenizer import Tokenizer

log = logging.getLogger("engine")


class EngineDeadError(RuntimeError):
    """The device failed in a way that leaves the engine unusable; the process should be replaced."""


class RequestAborted(Exception):
    pass


@dataclass
class SequenceDelta:
    """What one sequence produced since its last delta."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestMetrics:
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    deltas: list[SequenceDelta]
    finished: bool = False
    prompt_logprobs: list[TokenLogprob | None] | None = None
    metrics: RequestMetrics | None = None
    error: BaseException | None = None


class OutputSink(Protocol):
    """Where a request's outputs go. `deliver` is called on the engine thread and must not block."""

    def deliver(self, output: RequestOutput) -> None: ...


_WAITING, _PREFILLING, _FORKING, _DECODING, _FINISHED = range(5)


class _Sequence:
    def __init__(self, group: "_Group", index: int, tokenizer: Tokenizer, vocab_size: int, device):
        params = group.params
        self.group = group
        self.index = index
        self.tokens = list(group.prompt_ids)
        self.num_computed = 0
        self.row: int | None = None
        self.status = _WAITING
        self.sampling = SequenceSamplingState(params, group.prompt_ids, index, vocab_size, device)
        self.detok = tokenizer.detokenizer(group.prompt_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""
        self.sent_chars = 0
        self.new_ids: list[int] = []
        self.new_logprobs: list[TokenLogprob] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.group.prompt_ids)


@dataclass(eq=False)
class _Group:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    metrics: RequestMetrics
    seqs: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    done: bool = False
    # The submitter's context (made on its thread): log lines about the request carry its job id.
    context: contextvars.Context = field(default_factory=contextvars.copy_context)

    @property
    def holds_output(self) -> bool:
        """best_of > n: candidates are ranked when all finish, so nothing streams before that."""
        return self.params.num_sequences > self.params.n


def _is_fatal(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, EngineDeadError) or any(
        marker in text for marker in ("CUDA error", "device-side assert", "CUBLAS_STATUS", "cudaError",
                                      "illegal memory access", "NCCL error"))


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, prefix_cache_bytes: int):
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.sampler = Sampler(tokenizer.eos_token_ids, tokenizer.vocab_size)
        self.prefix_cache = PrefixCache(runner.kv, prefix_cache_bytes)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: deque[_Group] = deque()
        self._groups: dict[str, _Group] = {}
        self._rows: list[_Sequence] = []  # row i holds self._rows[i]; rows are kept compact
        self._dirty: dict[_Group, None] = {}  # groups with outputs to deliver, in order
        self._dead: BaseException | None = None
        self._stopping = False
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- API used from other threads ----

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: OutputSink) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped after a device failure: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine was shut down")
        group = _Group(request_id, list(prompt_ids), params, sink, RequestMetrics(arrival=time.perf_counter(),
                                                                                   prompt_tokens=len(prompt_ids)))
        self._commands.put(("add", group))
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: requests still held fail, the KV cache is freed."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_requests(self) -> int:
        """Requests the engine still holds (waiting or running); 0 once everything has left."""
        return len(self._groups)

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    # ---- the loop ----

    def _loop(self) -> None:
        # Everything the loop touches (cache buffers included) is created and changed without autograd.
        with torch.inference_mode():
            self._run()

    def _run(self) -> None:
        while not self._stopping:
            idle = not self._waiting and not self._rows
            host_memory.release_if_idle(self.steps)
            if idle:
                self._wake.wait(timeout=1.0)
            self._wake.clear()
            self._drain_commands()
            if not self._waiting and not self._rows:
                continue
            try:
                self._step()
            except BaseException as exc:  # a failure the per-request guards could not pin on one request
                self._fail_all(exc)
                if _is_fatal(exc):
                    self._dead = exc
                    log.critical("engine stopped: device failure: %s", exc)
                    self._drain_and_fail_forever(exc)
                    return
        self._drain_commands()
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._groups[arg.request_id] = arg
                self._waiting.append(arg)
            elif command == "abort":
                group = self._groups.get(arg)
                if group is not None:
                    self._finish_group(group)

    def _step(self) -> None:
        self.steps += 1
        self._admit()
        if any(s.status == _PREFILLING for s in self._rows):
            self._prefill()
            self._flush()  # first tokens leave before the decode step
        decoding = [s for s in self._rows if s.status == _DECODING]
        if decoding:
            self._decode(decoding)
        self._flush()
        self._compact()

    def _admit(self) -> None:
        while self._waiting:
            group = self._waiting[0]
            need = group.params.num_sequences
            if need > self.max_num_seqs or len(group.prompt_ids) >= self.max_model_len or not group.prompt_ids:
                self._waiting.popleft()
                self._fail_group(group, ValueError(
                    f"request needs {need} sequences of {len(group.prompt_ids)} prompt tokens; the engine runs at "
                    f"most {self.max_num_seqs} sequences of {self.max_model_len} tokens"))
                continue
            if len(self._rows) + need > self.max_num_seqs:
                return
            self._waiting.popleft()
            group.metrics.admitted = time.perf_counter()
            try:
                group.seqs = [_Sequence(group, i, self.tokenizer, self.sampler.vocab_size, self.runner.device)
                              for i in range(need)]
            except Exception as exc:
                self._fail_group(group, exc)
                continue
            first = group.seqs[0]
            for seq in group.seqs:
                seq.row = len(self._rows)
                seq.status = _PREFILLING if seq is first else _FORKING
                self._rows.append(seq)
            self.runner.kv.reserve(len(self._rows), len(group.prompt_ids))
            if group.params.prompt_logprobs is None:
                try:
                    first.num_computed = self.prefix_cache.load_into(first.row, group.prompt_ids)
                except Exception as exc:
                    self._fail_group(group, exc)
                    continue
                group.metrics.cached_prompt_tokens = first.num_computed

    # ---- prefill ----

    def _prefill(self) -> None:
        budget = self.max_num_batched_tokens
        chunks: list[tuple[_Sequence, PrefillChunk]] = []
        all_logits = False
        for seq in self._rows:
            if seq.status != _PREFILLING or budget <= 0:
                continue
            wants_prompt_logprobs = seq.group.params.prompt_logprobs is not None
            if chunks and wants_prompt_logprobs != all_logits:
                continue  # full-logit prefills run in their own step
            all_logits = wants_prompt_logprobs
            take = min(len(seq.group.prompt_ids) - seq.num_computed, budget)
            chunks.append((seq, PrefillChunk(seq.row, seq.num_computed,
                                             seq.group.prompt_ids[seq.num_computed:seq.num_computed + take])))
            budget -= take
        for members, logits in self._guarded_forward(
                chunks, lambda item: item[0].group,
                lambda part: self.runner.prefill([c for _, c in part], all_logits=all_logits)):
            for i, (seq, chunk) in enumerate(members):
                if seq.group.done:
                    continue
                try:
                    self._after_prefill_chunk(seq, chunk, logits[i])
                except Exception as exc:
                    self._fail_group(seq.group, exc)

    def _after_prefill_chunk(self, seq: _Sequence, chunk: PrefillChunk, logits: torch.Tensor) -> None:
        group = seq.group
        n = len(chunk.token_ids)
        if logits.dim() == 2:  # every position: keep this chunk's rows (left-padded), collect prompt logprobs
            logits = logits[logits.shape[0] - n:]
            self._collect_prompt_logprobs(group, chunk, logits)
            logits = logits[-1]
        seq.num_computed += n
        if seq.num_computed < len(group.prompt_ids):
            return
        self.prefix_cache.store_from(seq.row, group.prompt_ids, group.metrics.cached_prompt_tokens)
        for sibling in group.seqs[1:]:
            self.runner.kv.copy_row(seq.row, sibling.row, seq.num_computed)
            sibling.num_computed = seq.num_computed
        group.metrics.first_token = time.perf_counter()
        live = group.seqs
        tokens, logprobs = self.sampler.sample(logits.unsqueeze(0).expand(len(live), -1), [s.sampling for s in live],
                                               [0] * len(live))
        for s, token, lp in zip(live, tokens, logprobs):
            s.status = _DECODING
            self._append_token(s, token, lp)

    def _collect_prompt_logprobs(self, group: _Group, chunk: PrefillChunk, logits: torch.Tensor) -> None:
        """Logprob of each prompt token given the tokens before it; the first prompt token has none."""
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        ids = group.prompt_ids
        targets = ids[chunk.start + 1:chunk.start + len(chunk.token_ids) + 1]
        if not targets:
            return
        scored = logits[:len(targets)]
        k = group.params.prompt_logprobs or 0
        group.prompt_logprobs.extend(self.sampler.logprobs_of(scored, torch.tensor(targets, device=scored.device),
                                                              [k] * len(targets)))

    # ---- decode ----

    def _decode(self, seqs: list[_Sequence]) -> None:
        def forward(part: list[_Sequence]) -> torch.Tensor:
            return self.runner.decode([s.row for s in part], [s.tokens[-1] for s in part],
                                      [len(s.tokens) - 1 for s in part])

        for members, logits in self._guarded_forward(seqs, lambda seq: seq.group, forward):
            live = [s for s in members if not s.group.done]
            for s in live:
                s.num_computed += 1
            if not live:
                continue
            if len(live) != len(members):
                keep = torch.tensor([i for i, s in enumerate(members) if not s.group.done], device=logits.device)
                logits = logits.index_select(0, keep)
            try:
                tokens, logprobs = self.sampler.sample(logits, [s.sampling for s in live],
                                                       [s.num_generated for s in live])
            except Exception:
                tokens = logprobs = None  # find the failing request row by row
            for i, s in enumerate(live):
                try:
                    if tokens is None:
                        row_tokens, row_logprobs = self.sampler.sample(logits[i:i + 1], [s.sampling],
                                                                       [s.num_generated])
                        self._append_token(s, row_tokens[0], row_logprobs[0])
                    else:
                        self._append_token(s, tokens[i], logprobs[i])
                except Exception as exc:
                    self._fail_group(s.group, exc)

    def _guarded_forward(self, items: list, group_of: Callable[[object], _Group],
                         forward: Callable[[list], torch.Tensor]) -> list[tuple[list, torch.Tensor]]:
        """Run a batched forward; if it fails, retry each request's part alone so that only the request that
        causes the failure fails. Device failures are not retried."""
        if not items:
            return []
        try:
            return [(items, forward(items))]
        except Exception as exc:
            if _is_fatal(exc):
                raise
            parts: dict[int, list] = {}
            for item in items:
                parts.setdefault(id(group_of(item)), []).append(item)
            if len(parts) == 1:
                self._fail_group(group_of(items[0]), exc)
                return []
            results = []
            for part in parts.values():
                try:
                    results.append((part, forward(part)))
                except Exception as part_exc:
                    if _is_fatal(part_exc):
                        raise
                    self._fail_group(group_of(part[0]), part_exc)
            return results

    # ---- per-token bookkeeping ----

    def _append_token(self, seq: _Sequence, token: int, logprob: TokenLogprob | None) -> None:
        params = seq.group.params
        seq.tokens.append(token)
        seq.new_ids.append(token)
        if logprob is not None:
            seq.cumulative_logprob += logprob.logprob
            if params.logprobs is not None:
                seq.new_logprobs.append(logprob)
        self._dirty[seq.group] = None
        generated = seq.num_generated
        is_eos = token in self.tokenizer.eos_token_ids and not params.ignore_eos
        # The first min_tokens tokens cannot end the sequence. EOS is checked before stop_token_ids (vLLM's order:
        # an EOS listed in stop_token_ids still reports stop_reason None).
        if generated > params.min_tokens and (is_eos or token in params.stop_token_ids):
            if params.include_stop_str_in_output:  # as vLLM: the stop token's text stays (empty if special+skipped)
                seq.text += seq.detok.push(token)
            return self._finish(seq, "stop", None if is_eos else token)
        delta = seq.detok.push(token)
        if delta:
            seq.text += delta
            if seq.stops.stops and generated > params.min_tokens:
                found = seq.stops.find(seq.text, len(delta))
                if found is not None:
                    stop, cut = found
                    seq.text = seq.text[:cut]
                    return self._finish(seq, "stop", stop)
        if generated >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            return self._finish(seq, "length", None)

    def _finish(self, seq: _Sequence, reason: str, stop_reason: str | int | None) -> None:
        if not isinstance(stop_reason, str):  # a stop string cut the text; otherwise release held-back bytes
            seq.text += seq.detok.flush()
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.status = _FINISHED
        self._dirty[seq.group] = None
        group = seq.group
        if all(s.status == _FINISHED for s in group.seqs):
            group.metrics.finished = time.perf_counter()
            group.metrics.output_tokens = sum(s.num_generated for s in group.seqs)

    # ---- outputs ----

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, {}
        for group in dirty:
            if group.done:
                continue
            finished = all(s.status == _FINISHED for s in group.seqs)
            if group.holds_output and not finished:
                continue
            seqs = group.seqs
            if group.holds_output:
                ranked = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:group.params.n]
                deltas = [self._take_delta(s, index) for index, s in enumerate(ranked)]
            else:
                deltas = [d for s in seqs if (d := self._take_delta(s, s.index)) is not None]
            output = RequestOutput(group.request_id, deltas, finished=finished,
                                   metrics=group.metrics if finished else None)
            if group.prompt_logprobs is not None and not group.prompt_logprobs_sent and \
                    len(group.prompt_logprobs) == len(group.prompt_ids):
                output.prompt_logprobs = group.prompt_logprobs
                group.prompt_logprobs_sent = True
            self._deliver(group, output)
            if finished:
                self._finish_group(group)

    def _take_delta(self, seq: _Sequence, index: int) -> SequenceDelta | None:
        finished = seq.status == _FINISHED
        upto = len(seq.text) if finished else seq.stops.releasable(seq.text)
        text = seq.text[seq.sent_chars:upto] if upto > seq.sent_chars else ""
        if not text and not seq.new_ids and not finished:
            return None
        seq.sent_chars = max(seq.sent_chars, upto)
        logprobs = seq.new_logprobs if seq.group.params.logprobs is not None else None
        delta = SequenceDelta(index, text, seq.new_ids, logprobs,
                              seq.finish_reason if finished else None, seq.stop_reason if finished else None)
        seq.new_ids, seq.new_logprobs = [], []
        return delta

    def _deliver(self, group: _Group, output: RequestOutput) -> None:
        try:
            group.sink.deliver(output)
        except Exception:  # the consumer is gone (its event loop closed): drop the request
            group.context.run(log.warning, "request %s: output could not be delivered; dropping it",
                              group.request_id)
            self._finish_group(group)

    # ---- leaving ----

    def _fail_group(self, group: _Group, exc: BaseException) -> None:
        if group.done:
            return
        group.context.run(log.error, "request %s failed in generation: %s", group.request_id, exc, exc_info=exc)
        self._deliver(group, RequestOutput(group.request_id, [], finished=True, error=exc))
        self._finish_group(group)

    def _fail_all(self, exc: BaseException) -> None:
        for group in list(self._groups.values()):
            self._fail_group(group, exc)
        self._rows.clear()  # every row belonged to a failed request, and the buffers go with them
        self.runner.kv.clear()

    def _drain_and_fail_forever(self, exc: BaseException) -> None:
        if self.on_fatal is not None:
            self.on_fatal(exc)
        while True:
            self._wake.wait()
            self._wake.clear()
            self._drain_commands()
            self._fail_all(exc)

    def _finish_group(self, group: _Group) -> None:
        """Take a request out of the engine: out of the queue, its rows freed."""
        if group.done:
            return
        group.done = True
        self._groups.pop(group.request_id, None)
        try:
            self._waiting.remove(group)
        except ValueError:
            pass
        for seq in group.seqs:
            seq.status = _FINISHED

    def _compact(self) -> None:
        """Free the rows of finished sequences, moving the last rows into the holes so rows stay 0..n-1."""
        rows = self._rows
        i = 0
        while i < len(rows):
            if rows[i].status != _FINISHED:
                i += 1
                continue
            while rows and rows[-1].status == _FINISHED:
                rows.pop()
            if i < len(rows):
                last = rows.pop()
                self.runner.kv.copy_row(last.row, i, last.num_computed)
                last.row = i
                rows[i] = last
                i += 1
        if not rows:
            self.runner.kv.release_if_idle()
