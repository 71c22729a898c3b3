"""The generation loop: one thread per model runs every request in shared forward passes.

Each iteration asks the scheduler for a step (which sequences decode, which prompt chunks prefill), runs it as
one packed forward pass, samples the next token of every sequence that has one, and hands outputs to each
request's sink as soon as the step is done. The policy lives in `scheduler.py`, the per-token bookkeeping in
`output_processor.py`; this module joins them and keeps one request's failure from touching the others.
"""
from __future__ import annotations

import logging
import time

import torch

from engine import devices
from engine.core.beam_search import BeamSearch
from engine.core.block_manager import BLOCK_SIZE, BlockManager
from engine.core.interface import EngineDeadError, GenerationLoop, is_fatal
from engine.core.output_processor import OutputProcessor
from engine.core.pooling import PoolingInput, PoolingParams, PoolingQueue, PoolingSink
from engine.core.scheduler import Scheduler, StepPlan
from engine.core.sequence import RequestOutput, Sequence, SequenceGroup, Status
from engine.core.speculative import Speculator
from engine.cpu import host_memory
from engine.executor.runner import ModelRunner
from engine.executor.step import DecodeRow, PrefillChunk
from engine.sampling.sampler import Sampler
from engine.tokenizer import Tokenizer

log = logging.getLogger("engine")


def _rope_delta(seq: Sequence) -> int:
    """The shift of a sequence's rotary positions after its prompt (a multimodal-rotary decoder's prompt with
    images, engine/vision/encoder.py); 0 for every other sequence."""
    images = seq.group.images
    return images.rope_delta if images is not None else 0

class Engine(GenerationLoop):
    def __init__(self, runner: ModelRunner | None, tokenizer: Tokenizer, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, prefix_cache_bytes: int,
                 pooling: PoolingQueue | None = None, speculator: Speculator | None = None,
                 platform: devices.Platform | None = None, lora=None):
        platform = platform or devices.Platform(torch.device("cpu"))
        self.runner = runner  # None for models that only pool (encoders, classifiers): they never generate
        self.pooling = pooling  # embeddings and scores, run between generation steps (engine/core/pooling.py)
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        kv = runner.kv if runner is not None else None
        self.states = runner.states if runner is not None else None
        self._block_bytes = kv.nbytes // kv.num_blocks if kv is not None else 0
        # A recurrent state sums up everything before it: no prefix of it can be shared, so no prefix cache.
        cacheable = self._block_bytes and self.states is None
        self.blocks = BlockManager(kv.num_blocks if kv is not None else 0,
                                   max_cached_blocks=prefix_cache_bytes // self._block_bytes if cacheable else 0)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, states=self.states,
                                   whole_prompts=runner is not None and not runner.prefill_continues, lora=lora)
        self.sampler = Sampler(tokenizer.eos_token_ids, tokenizer.vocab_size, platform.cpu_fast_paths)
        self.outputs = OutputProcessor(tokenizer.eos_token_ids, max_model_len)
        self.beam_search = BeamSearch(self.blocks, runner.kv.copy_block if runner is not None else None,
                                      self.scheduler.free, self.states.copy if self.states else None,
                                      tokenizer.eos_token_ids, tokenizer.vocab_size, max_model_len)
        self._finished_beams: list[tuple[SequenceGroup, RequestOutput]] = []
        self.speculator = speculator
        # Idle trimming gives host memory back: a CPU fast path, never taken on the CUDA path (the KV cache is
        # device memory there, and trimming the host's heap would only cost time).
        self._idle_release = None if platform.accelerator else \
            host_memory.IdleRelease(on_idle=self._give_back_free_blocks)
        self._zeroed_blocks = 0  # blocks [0, this) have been cleared once (see PagedKVCache.zero_blocks)
        self._start_loop("engine-loop")

    # ---- API used from other threads ----

    def check_fits(self, prompt_len: int, max_tokens: int, num_sequences: int) -> str | None:
        """Why a request could never run in this engine's KV cache, or None."""
        if self.runner is None:
            return "this model does not generate text"
        return self.scheduler.check_fits(prompt_len, max_tokens, num_sequences)

    serves_pooling = True

    @property
    def serves_images(self) -> bool:
        """Prompts with image rows (a vision-language model's decoder, engine/vision/encoder.py) run here; models
        with recurrent state take none (their prompts' steps carry no embedding rows)."""
        return self.runner is not None and self.states is None

    def submit_pooling(self, request_id: str, inputs: list[PoolingInput], params: PoolingParams,
                       sink: PoolingSink) -> None:
        """Embeddings, pooled states and scores: engine/core/pooling.py batches them, the loop runs one batch between
        generation steps."""
        self._check_alive()
        if self.pooling is None:
            raise RuntimeError("this engine has no pooling queue")
        self.pooling.add(request_id, inputs, params, sink)
        self._wake.set()

    def abort_pooling(self, request_id: str) -> None:
        if self.pooling is not None:
            self.pooling.abort(request_id)

    def _pooling_pending(self) -> bool:
        return self.pooling is not None and self.pooling.pending

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running_seqs

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def stats(self) -> dict:
        """A snapshot for /health and the stats routes (read from another thread: each value is consistent on
        its own, not with the others)."""
        return {
            "num_running": self.num_running,
            # Pooling requests wait in their own queue; /health and /stats both count them as waiting.
            "num_waiting": self.num_waiting + (self.pooling.num_waiting if self.pooling is not None else 0),
            "num_requests": self.num_requests,
            "kv_used_tokens": self.blocks.num_used * BLOCK_SIZE,
            "kv_capacity_tokens": self.blocks.num_blocks * BLOCK_SIZE,
            "kv_used_bytes": self.blocks.num_used * self._block_bytes,
            "kv_capacity_bytes": self.blocks.num_blocks * self._block_bytes,
            "kv_peak_used_tokens": self.blocks.peak_used * BLOCK_SIZE,
            "preemptions": self.scheduler.preemptions,
            "prefix_cache_hit_tokens": self.blocks.hit_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            **({"speculative_proposed_tokens": self.speculator.stats.proposed,
                "speculative_accepted_tokens": self.speculator.stats.accepted,
                "speculative_plain_steps": self.speculator.switch.switched_off_steps} if self.speculator else {}),
        }

    # ---- the loop ----

    def _loop(self) -> None:
        # Everything the loop touches (cache buffers included) is created and changed without autograd.
        with torch.inference_mode():
            self._run()

    def _run(self) -> None:
        while not self._stopping:
            if self._idle_release is not None:
                self._idle_release.tick(self.steps)
            if not self._groups and not self._pooling_pending():
                self._wake.wait(timeout=1.0)
            self._wake.clear()
            self._drain_commands()
            if not self._groups and not self._pooling_pending():
                continue
            try:
                if self._pooling_pending():  # one pooling batch between generation steps
                    self.pooling.run_next_batch(is_fatal)
                if self._groups:
                    self._step()
            except BaseException as exc:  # a failure the per-request guards could not pin on one request
                self._fail_all(exc)
                if is_fatal(exc):
                    self._dead = exc
                    log.critical("engine stopped: device failure: %s", exc)
                    self._drain_and_fail_forever(exc)
                    return
        self._drain_commands()
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _give_back_free_blocks(self) -> None:
        """Blocks holding nothing give their memory back (once per idle period, see host_memory.IdleRelease)."""
        if self.runner is not None:
            # Blocks past the ones ever written were never touched: they hold no memory to give back.
            self.runner.kv.give_back([b for b in self.blocks.free_uncached() if b < self._zeroed_blocks])

    def _add(self, group: SequenceGroup) -> None:
        try:
            group.seqs = [Sequence(group, i, self.tokenizer, self.sampler.vocab_size, self.runner.device)
                          for i in range(group.params.num_sequences)]
        except Exception as exc:
            self._groups[group.request_id] = group
            self._fail_group(group, exc)
            return
        self._groups[group.request_id] = group
        self.scheduler.add(group)

    def _step(self) -> None:
        self.steps += 1
        started, generated = time.perf_counter(), self.generation_tokens_total
        speculated = self.speculator is not None and \
            self.speculator.propose(self.scheduler.running, self.max_model_len, bool(self.scheduler.waiting))
        plan = self.scheduler.schedule()
        refused, self.scheduler.refused = self.scheduler.refused, []
        for group, exc in refused:
            self._fail_group(group, exc)
        if plan.empty:
            return
        if self.blocks.high_water > self._zeroed_blocks:
            self.runner.kv.zero_blocks(self._zeroed_blocks, self.blocks.high_water)
            self._zeroed_blocks = self.blocks.high_water
        for part, logits in self._guarded_execute(plan):
            self._process(part, logits)
        if self.speculator is not None and not plan.prefills:
            # Decode-only steps teach the load switch what a generated token costs with and without guesses.
            self.speculator.timed(speculated, time.perf_counter() - started,
                                  self.generation_tokens_total - generated)
        for group, output in self.outputs.take_outputs():
            if output.finished:  # out of the engine before the caller can see the end
                self._finish_group(group)
            self._deliver(group, output)
        finished_beams, self._finished_beams = self._finished_beams, []
        for group, output in finished_beams:
            self._finish_group(group)
            self._deliver(group, output)

    def _guarded_execute(self, plan: StepPlan) -> list[tuple[StepPlan, torch.Tensor | None]]:
        """Run the step; if it fails, run each request's part alone so that only the request that causes the
        failure fails. Device failures are not retried."""
        try:
            return [(plan, self._execute(plan))]
        except Exception as exc:
            if is_fatal(exc):
                raise
            parts: dict[int, StepPlan] = {}
            for seq in plan.decodes:
                parts.setdefault(id(seq.group), StepPlan()).decodes.append(seq)
            for work in plan.prefills:
                parts.setdefault(id(work.seq.group), StepPlan()).prefills.append(work)
            for seq in plan.verifies:
                parts.setdefault(id(seq.group), StepPlan()).verifies.append(seq)
            if len(parts) == 1:
                self._fail_group((plan.decodes or plan.verifies or [w.seq for w in plan.prefills])[0].group, exc)
                return []
            results = []
            for part in parts.values():
                try:
                    results.append((part, self._execute(part)))
                except Exception as part_exc:
                    if is_fatal(part_exc):
                        raise
                    self._fail_group((part.decodes or part.verifies or [w.seq for w in part.prefills])[0].group,
                                     part_exc)
            return results

    def _execute(self, plan: StepPlan) -> torch.Tensor | None:
        decodes = [DecodeRow(s.tokens[-1], len(s.tokens) - 1, s.blocks, s.state_slot, s.group.lora_slot,
                             _rope_delta(s)) for s in plan.decodes]
        chunks = []
        for w in plan.prefills:
            start, end, images = w.seq.num_computed, w.seq.num_computed + w.length, w.seq.group.images
            chunks.append(PrefillChunk(w.seq.tokens[start:end], start, w.seq.blocks, w.logits, w.seq.state_slot,
                                       lora_slot=w.seq.group.lora_slot,
                                       image_rows=images.rows_between(start, end) if images is not None else None,
                                       rotary=images.rotary_between(start, end) if images is not None else None,
                                       rope_delta=_rope_delta(w.seq)))
        chunks += [PrefillChunk([s.tokens[-1]] + s.proposal, len(s.tokens) - 1, s.blocks, "all",
                                lora_slot=s.group.lora_slot, rope_delta=_rope_delta(s)) for s in plan.verifies]
        return self.runner.execute(decodes, chunks)

    def _process(self, plan: StepPlan, logits: torch.Tensor | None) -> None:
        """Account the computed tokens, then sample the next token of every sequence that has one."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for row, seq in enumerate(plan.decodes):
            if seq.group.done:
                continue
            self.scheduler.computed(seq, 1)
            rows.append(row)
            seqs.append(seq)
        row = len(plan.decodes)
        for work in plan.prefills:
            seq, group = work.seq, work.seq.group
            width = work.length if work.logits == "all" else 1 if work.logits == "last" else 0
            chunk_logits = logits[row:row + width] if width else None
            row += width
            if group.done:
                continue
            start = seq.num_computed
            self.scheduler.computed(seq, work.length)
            self.prompt_tokens_total += work.length
            try:
                if work.logits == "all":
                    self._collect_prompt_logprobs(group, start, chunk_logits)
                if seq.num_computed < seq.prefill_target:
                    continue
                if group.started:  # resumed after preemption: its next token is already known
                    seq.status = Status.DECODING
                    continue
                copies, forked = self.scheduler.fork(group)
                for src, dst in copies:
                    self.runner.kv.copy_block(src, dst)
                if self.states is not None:  # every choice starts from the prompt's state
                    self.states.copy([seq.state_slot] * len(forked), [s.state_slot for s in forked])
            except Exception as exc:
                self._fail_group(group, exc)
                continue
            group.metrics.first_token = time.perf_counter()
            seq.status = Status.DECODING
            for member in group.seqs:  # every choice samples from the prompt's last logits
                rows.append(row - 1)
                seqs.append(member)
        for seq in plan.verifies:
            width = len(seq.proposal) + 1
            self._accept_speculated(seq, logits[row:row + width])
            row += width
        if seqs:
            rows, seqs = self._beam_search_step(logits, rows, seqs)
        if seqs:
            self._sample(logits, rows, seqs)

    def _accept_speculated(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Keep the verified prefix of a sequence's proposal and one token of the target's own (speculative.py);
        the cache then holds every kept token but the last, as after a plain decode step."""
        proposal, seq.proposal = seq.proposal, []
        if seq.group.done:
            return
        kept = 0
        try:
            for token, logprob in self.speculator.verify(seq, proposal, logits, self.sampler):
                kept += 1
                self.generation_tokens_total += 1
                if self.outputs.append(seq, token, logprob):
                    self.scheduler.free(seq)
                    return
            self.scheduler.computed(seq, kept)
            self.scheduler.trim(seq)
        except Exception as exc:
            self._fail_group(seq.group, exc)

    def _beam_search_step(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]
                          ) -> tuple[list[int], list[Sequence]]:
        """Beam-search requests choose their next tokens together (beam_search.py); the other rows are returned
        for sampling."""
        rest_rows, rest_seqs = [], []
        beams: dict[SequenceGroup, list[tuple[Sequence, int]]] = {}
        for row, seq in zip(rows, seqs):
            if seq.group.params.beam_search:
                beams.setdefault(seq.group, []).append((seq, row))
            else:
                rest_rows.append(row)
                rest_seqs.append(seq)
        for group, members in beams.items():
            try:
                output = self.beam_search.step(group, [s for s, _ in members], logits[[r for _, r in members]])
            except Exception as exc:
                self._fail_group(group, exc)
                continue
            self.generation_tokens_total += len(members)
            if output is not None:
                self._finished_beams.append((group, output))
        return rest_rows, rest_seqs

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        # A decode-only step samples every row in order: the logits themselves, not a copy.
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        try:
            results = [(seqs, self.sampler.sample(picked, [s.sampling for s in seqs],
                                                  [s.num_generated for s in seqs]))]
        except Exception:  # find the failing request: sample each request's rows on their own
            results = []
            by_group: dict[int, list[int]] = {}
            for i, s in enumerate(seqs):
                by_group.setdefault(id(s.group), []).append(i)
            for members in by_group.values():
                part = [seqs[i] for i in members]
                try:
                    results.append((part, self.sampler.sample(picked[members], [s.sampling for s in part],
                                                              [s.num_generated for s in part])))
                except Exception as exc:
                    self._fail_group(part[0].group, exc)
        for part, (tokens, logprobs) in results:
            for seq, token, logprob in zip(part, tokens, logprobs):
                if seq.group.done:
                    continue
                self.generation_tokens_total += 1
                try:
                    if self.outputs.append(seq, token, logprob):
                        self.scheduler.free(seq)
                except Exception as exc:
                    self._fail_group(seq.group, exc)

    def _collect_prompt_logprobs(self, group: SequenceGroup, start: int, logits: torch.Tensor) -> None:
        """Logprob of each prompt token given the tokens before it; the first prompt token has none."""
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        ids = group.prompt_ids
        targets = ids[start + 1:start + logits.shape[0] + 1]
        if not targets:
            return
        scored = logits[:len(targets)]
        k = group.params.prompt_logprobs or 0
        group.prompt_logprobs.extend(self.sampler.logprobs_of(scored, torch.tensor(targets, device=scored.device),
                                                              [k] * len(targets)))

    # ---- outputs and leaving ----

    def _fail_all(self, exc: BaseException) -> None:
        super()._fail_all(exc)
        if self.pooling is not None:
            self.pooling.fail_all(exc)

    def _drain_and_fail_forever(self, exc: BaseException) -> None:
        if self.on_fatal is not None:
            self.on_fatal(exc)
        while True:
            self._wake.wait()
            self._wake.clear()
            self._drain_commands()
            self._fail_all(exc)

    def _finish_group(self, group: SequenceGroup) -> None:
        """Take a request out of the engine: out of the queue, its blocks freed."""
        if group.done:
            return
        group.done = True
        self._groups.pop(group.request_id, None)
        self.scheduler.remove(group)
        for seq in group.seqs:
            seq.status = Status.FINISHED
