"""The one interface of a generation loop, which the paged `Engine` (loop.py) and the fallback's
(fallback.py) both implement and `AsyncEngine` alone calls: submit, abort, pooling, checks, stats, health
(`dead`), shutdown. It also holds what the two share: checks on arrival, the command queue the loop drains, and
delivery and failure of outputs.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from engine.core.pooling import PoolingInput, PoolingParams, PoolingSink
from engine.core.sequence import OutputSink, RequestMetrics, RequestOutput, SequenceGroup
from engine.sampling.sampler import SamplingParams

log = logging.getLogger("engine")


class EngineDeadError(RuntimeError):
    """The device failed in a way that leaves the engine unusable; the process should be replaced."""


class RequestTooLarge(ValueError):
    """The request could not run even alone in the whole KV cache."""


def is_fatal(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, EngineDeadError) or any(
        marker in text for marker in ("CUDA error", "device-side assert", "CUBLAS_STATUS", "cudaError",
                                      "illegal memory access", "NCCL error"))


class GenerationLoop:
    """A generation loop as its client sees it; thread-safe. Subclasses set their own attributes, then call
    `_start_loop`, which sets the shared ones and starts their `_loop` on its thread."""

    serves_pooling = False  # embeddings and scores (submit_pooling) run on this loop

    max_model_len: int
    max_num_seqs: int
    _commands: queue.SimpleQueue
    _wake: threading.Event
    _groups: dict[str, SequenceGroup]
    _dead: BaseException | None
    _stopping: bool
    _thread: threading.Thread

    def _start_loop(self, thread_name: str) -> None:
        self._commands = queue.SimpleQueue()
        self._wake = threading.Event()
        self._groups = {}
        self._dead = None
        self._stopping = False
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def check_fits(self, prompt_len: int, max_tokens: int, num_sequences: int) -> str | None:
        """Why a request could never run in this engine, or None."""
        return None

    def check_supported(self, params: SamplingParams) -> str | None:
        """Why this engine cannot honour these parameters, or None."""
        return None

    def stats(self) -> dict:
        """A snapshot for /health, /stats and /metrics, the same keys on every loop (read from another thread:
        each value is consistent on its own, not with the others)."""
        raise NotImplementedError

    def submit_pooling(self, request_id: str, inputs: list[PoolingInput], params: PoolingParams,
                       sink: PoolingSink) -> None:
        raise NotImplementedError("embeddings and scores are not served for models on the fallback path")

    def abort_pooling(self, request_id: str) -> None:
        pass

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped after a device failure: {self._dead}")
        if self._stopping:
            raise EngineDeadError("the engine was shut down")

    serves_images = False  # prompts with images (a vision-language model's ImageInputs) run on this loop

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: OutputSink,
               images=None) -> None:
        self._check_alive()
        if images is not None and not self.serves_images:
            raise ValueError("this model takes text only: a prompt with images cannot run on it")
        if not prompt_ids or len(prompt_ids) >= self.max_model_len:
            raise RequestTooLarge(f"a prompt of {len(prompt_ids)} tokens does not fit a context of "
                                  f"{self.max_model_len} tokens")
        if params.num_sequences > self.max_num_seqs:
            raise RequestTooLarge(f"the request needs {params.num_sequences} sequences; the engine runs at most "
                                  f"{self.max_num_seqs} (MAX_NUM_SEQS)")
        reason = self.check_fits(len(prompt_ids), params.max_tokens, params.num_sequences)
        if reason is not None:
            raise RequestTooLarge(reason)
        reason = self.check_supported(params)
        if reason is not None:
            raise ValueError(reason)
        group = SequenceGroup(request_id, list(prompt_ids), params, sink,
                              RequestMetrics(arrival=time.perf_counter(), prompt_tokens=len(prompt_ids)),
                              images=images)
        self._commands.put(("add", group))
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop: requests still held fail."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def _drain_commands(self) -> None:
        """Take in what other threads asked for since the last pass (on the loop's thread)."""
        while True:
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                self._add(arg)
            elif command == "abort":
                group = self._groups.get(arg)
                if group is not None:
                    self._finish_group(group)

    # ---- delivery and failure, on the loop's thread; log lines run in the request's context (its job id) ----

    def _deliver(self, group: SequenceGroup, output: RequestOutput) -> None:
        try:
            group.sink.deliver(output)
        except Exception:  # the consumer is gone (its event loop closed): drop the request
            group.context.run(log.warning, "request %s: output could not be delivered; dropping it",
                              group.request_id)
            self._finish_group(group)

    def _fail_group(self, group: SequenceGroup, exc: BaseException) -> None:
        if group.done:
            return
        group.context.run(log.error, "request %s failed in generation: %s", group.request_id, exc, exc_info=exc)
        self._finish_group(group)
        self._deliver(group, RequestOutput(group.request_id, [], finished=True, error=exc))

    def _fail_all(self, exc: BaseException) -> None:
        for group in list(self._groups.values()):
            self._fail_group(group, exc)

    def _finish_group(self, group: SequenceGroup) -> None:
        raise NotImplementedError

    @property
    def num_requests(self) -> int:
        """Requests the engine still holds (waiting or running); 0 once everything has left."""
        return len(self._groups)

    @property
    def dead(self) -> BaseException | None:
        return self._dead


