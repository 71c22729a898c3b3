"""Forward passes over the paged KV cache: one packed pass per engine step, decode rows and prefill chunks
together, with no padding (a step costs the tokens it computes). Models with recurrent layers, which take one
sequence per batch row, run their decode rows as one batched pass and each prompt chunk as its own
(state_cache.py keeps their state)."""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass

import torch

from engine import devices

from engine.cpu import native_kernels

from engine.cpu import quantized_weights
from engine.core.block_manager import BLOCK_SIZE, blocks_for
from engine.executor.compact_decoder import CompactDecoder
from engine.executor.kv_cache import DecodeBucket, ForwardCache, LayerShape, PagedKVCache, PrefillSegment, StepCache, StepLayout
from engine.executor.state_cache import RecurrentStates, StateKey, StateShape, StateStepCache, with_left_context

log = logging.getLogger("engine")


@dataclass
class DecodeRow:
    token: int  # the sequence's last token, not yet in the cache
    position: int
    blocks: list[int]
    state_slot: int | None = None  # its recurrent-state slot (models with recurrent layers)


@dataclass
class PrefillChunk:
    token_ids: list[int]  # the next tokens of the sequence to compute
    start: int  # tokens of the sequence already in the cache
    blocks: list[int]  # covering at least start + len(token_ids) slots
    logits: str = "none"  # "none" | "last" | "all": which positions' logits the step returns
    state_slot: int | None = None


def _slot(blocks: list[int], position: int) -> int:
    return blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


_PADDING_TOLERANCE = 1.5  # a bucket's gathered keys may be at most this many times the keys its rows hold


def _length_buckets(decodes: list[DecodeRow]) -> list[list[int]]:
    """Decode rows (indices) grouped by length, shortest first, so that one long row does not make every
    short row gather and attend over its length."""
    buckets: list[list[int]] = []
    held = 0
    for i in sorted(range(len(decodes)), key=lambda i: decodes[i].position):
        length = decodes[i].position + 1
        if buckets and (len(buckets[-1]) + 1) * length <= _PADDING_TOLERANCE * (held + length):
            buckets[-1].append(i)
            held += length
        else:
            buckets.append([i])
            held = length
    return buckets


def _logits_match(expected: torch.Tensor, got: torch.Tensor, tolerance: float) -> bool:
    """Same shape, and every logit within `tolerance` of the largest expected one (the start-up probes' test)."""
    scale = expected.float().abs().max().item()
    return got.shape == expected.shape and torch.allclose(got.float(), expected.float(), rtol=0.0,
                                                          atol=tolerance * scale)


class PagedPathUnsupported(RuntimeError):
    """The model's forward pass does not keep its state in the paged cache (the fallback path serves it)."""


class _ShapeProbe(ForwardCache):
    """A cache that only records what each layer keeps (start-up probe): the key/value shapes an attention layer
    writes, the state shapes a recurrent or convolution layer keeps (one sequence's worth)."""

    def __init__(self):
        self.layers: dict[int, LayerShape] = {}
        self.states: dict[StateKey, StateShape] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.layers[layer_idx] = LayerShape(key_states.shape[1], key_states.shape[-1], value_states.shape[-1],
                                            key_states.device)
        return key_states, value_states

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return False

    def is_recording_past(self, layer_idx) -> bool:
        return False

    def get_conv_state(self, layer_idx, state_idx=0):
        return None

    get_recurrent_state = get_conv_state

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        width = conv_kernel_size or conv_states.shape[-1]
        self.states[("conv", layer_idx, state_idx)] = StateShape((*conv_states.shape[1:-1], width),
                                                                 conv_states.dtype, conv_states.device)
        return with_left_context(conv_states, None, width)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.states[("recurrent", layer_idx, state_idx)] = StateShape(
            tuple(recurrent_states.shape[1:]), recurrent_states.dtype, recurrent_states.device)
        return recurrent_states


def cache_argument(model) -> str:
    """The keyword a model's forward takes its cache by (Mamba-style models: cache_params)."""
    params = inspect.signature(model.forward).parameters
    return "cache_params" if "cache_params" in params and "past_key_values" not in params else "past_key_values"


_STATELESS_BLOCKS = 1 << 16  # positions the block manager tracks for a model with no attention layer (no memory)
# A 16-bit KV cache chosen by DTYPE=auto serves where the probe's logits stay this close (a fraction of the largest
# logit) to a full-precision cache's. Float16 keys and values of the embedded model measured (README): 100% top-1
# agreement with float32 on chat prompts, mean KL 4.7e-7.
KV_ROUNDING_TOLERANCE = 2e-3


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, kv_budget_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 kv_dtype: torch.dtype | None = None, check_kv_dtype: bool = False,
                 platform: devices.Platform | None = None, verdicts=None):
        self.model = model
        # The checks' verdicts from earlier starts on this machine, model and code (engine/startup_cache.py).
        self.verdicts = verdicts
        self.device = device
        self.platform = platform or devices.Platform(device)
        self.dtype = dtype
        # The KV cache's own type (KV_CACHE_DTYPE): the model's, or 16-bit under a float32 model. One chosen by
        # DTYPE=auto (check_kv_dtype) must first give the model's logits on a probe (_kv_rounding_differs).
        self.kv_dtype = kv_dtype or dtype
        self._cache_argument = cache_argument(model)
        self.compact: CompactDecoder | None = None  # set once checked, below
        self.compact_reason = "the model has recurrent layers"
        self.layer_shapes, state_shapes = self._probe_layers()
        # A model with recurrent or convolution layers keeps one state slot per running sequence (state_cache.py);
        # their memory comes out of the budget first.
        self.states = RecurrentStates(state_shapes, max_num_seqs) if state_shapes else None
        if check_kv_dtype and (self.states is not None or not self.layer_shapes):
            self.kv_dtype = dtype  # the probe below covers attention-only models
        self.kv = self._allocate_kv(kv_budget_bytes, gpu_memory_utilization, max_num_batched_tokens)
        # Whether a prompt may be computed in chunks: always for attention, for recurrent layers when they continue
        # a multi-token pass from the state an earlier one left (found out by trying).
        self.prefill_continues = self.states is None or self._probe_continuation()
        if self.states is None and self.layer_shapes:
            if check_kv_dtype and self.kv_dtype != dtype:
                why = self._kept("kv_rounding", self._kv_rounding_differs) if self.kv.num_blocks >= 4 else \
                    self._kv_rounding_differs()
                if why:
                    log.warning("KV cache in %s: %s; keeping %s", str(self.kv_dtype).removeprefix("torch."), why,
                                str(dtype).removeprefix("torch."))
                    self.kv_dtype = dtype
                    del self.kv
                    self.kv = self._allocate_kv(kv_budget_bytes, gpu_memory_utilization, max_num_batched_tokens)
            self.compact, self.compact_reason = self._compact_decoder()

    def _kept(self, check: str, run):
        """The verdict of `run` (a check of this model's forward), reused from an earlier start that ran the same
        forward: the same types, kernels binary and integer activations (the store's key holds the rest)."""
        if self.verdicts is None:
            return run()
        kernels = native_kernels.active() if self.platform.cpu_fast_paths else None
        built = getattr(kernels, "__file__", None) or ""
        stamp = os.stat(built).st_mtime_ns if built and os.path.isfile(built) else 0
        name = (f"{check}:{self.dtype}:{self.kv_dtype}:{built}:{stamp}:"
                f"{int(quantized_weights.rounds_activations(self.model))}:{len(self.layer_shapes)}")
        return self.verdicts.get(name, run)

    def _allocate_kv(self, kv_budget_bytes: int | None, gpu_memory_utilization: float,
                     max_num_batched_tokens: int) -> PagedKVCache:
        """The paged KV cache in kv_dtype, as many blocks as the budget holds."""
        if not self.layer_shapes:
            num_blocks = _STATELESS_BLOCKS
        elif self.platform.accelerator:
            num_blocks = self._cuda_blocks(gpu_memory_utilization, max_num_batched_tokens)
        else:
            budget = kv_budget_bytes - (self.states.nbytes if self.states else 0)
            num_blocks = budget // (PagedKVCache.bytes_per_token(self.layer_shapes, self.kv_dtype) * BLOCK_SIZE)
        return self._cache(self.kv_dtype, max(1, num_blocks))

    def _cache(self, dtype: torch.dtype, num_blocks: int) -> PagedKVCache:
        return PagedKVCache(self.device, dtype, self.layer_shapes, num_blocks,
                            native_kernels=self.platform.cpu_fast_paths)

    def _probe_steps(self) -> list[tuple[list[DecodeRow], list[PrefillChunk]]]:
        """Two steps over blocks 0 to 3 that cover each attention path: prompts from position 0, a decode row, a
        chunk continuing its sequence (the start-up checks' probe)."""
        vocab = min(97, self.model.config.get_text_config().vocab_size - 1)
        first = [1 + (i * 37) % vocab for i in range(21)]
        second = [1 + (i * 53) % vocab for i in range(30)]
        blocks_first, blocks_second = [0, 1], [2, 3]
        return [([], [PrefillChunk(first[:20], 0, blocks_first, "all"),
                      PrefillChunk(second[:12], 0, blocks_second, "last")]),
                ([DecodeRow(first[20], 20, blocks_first)], [PrefillChunk(second[12:], 12, blocks_second, "all")])]

    @torch.inference_mode()
    def _kv_rounding_differs(self) -> str:
        """Why the 16-bit cache would not serve this model ('' where it does): the probe's logits through it
        against those through a cache in the model's own type, within KV_ROUNDING_TOLERANCE of the largest."""
        if self.kv.num_blocks < 4:
            return "the KV cache is too small to check it"
        steps = self._probe_steps()
        rounded = [self.execute(*step) for step in steps]
        kept, self.kv = self.kv, self._cache(self.dtype, 4)
        try:
            exact = [self.execute(*step) for step in steps]
        finally:
            self.kv = kept
        if not all(_logits_match(e, r, KV_ROUNDING_TOLERANCE) for e, r in zip(exact, rounded)):
            return "its logits differ from a full-precision cache's on the start-up probe"
        return ""

    @torch.inference_mode()
    def _probe_layers(self) -> tuple[dict[int, LayerShape], dict[StateKey, StateShape]]:
        probe = _ShapeProbe()
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        self.model(input_ids=ids, position_ids=torch.arange(2, device=self.device).view(1, 2),
                   use_cache=True, logits_to_keep=1, **{self._cache_argument: probe})
        if not probe.layers and not probe.states:
            raise PagedPathUnsupported("the model wrote no keys, values or recurrent state to the cache")
        if getattr(self.model, "_is_stateful", False) and not probe.states:
            raise PagedPathUnsupported("the model keeps recurrent state outside the cache")
        return probe.layers, probe.states

    @torch.inference_mode()
    def _probe_continuation(self) -> bool:
        """Whether the model's recurrent layers carry a state into a multi-token pass (Mamba-2, gated delta nets and
        short convolutions do; Mamba-1's scan starts from zero whatever the cache holds): a prompt computed in
        two chunks must give the logits it gives whole, up to rounding."""
        ids = [1 + (i * 37) % 97 for i in range(24)]
        blocks = list(range(min(self.kv.num_blocks, blocks_for(len(ids)))))
        if len(blocks) * BLOCK_SIZE < len(ids) and self.layer_shapes:
            return False
        self.prefill_continues = True  # lets the passes below start past position 0
        whole = self._execute_stateful([], [PrefillChunk(ids, 0, blocks, "last", state_slot=0)])
        self._execute_stateful([], [PrefillChunk(ids[:10], 0, blocks, "none", state_slot=0)])
        split = self._execute_stateful([], [PrefillChunk(ids[10:], 10, blocks, "last", state_slot=0)])
        return _logits_match(whole, split, 0.02)

    @torch.inference_mode()
    def _compact_decoder(self) -> tuple[CompactDecoder | None, str]:
        """The compact forward (compact_decoder.py) where the model has its structure and computes the same logits
        through the paged cache: two steps covering each attention path (prompts from position 0, a decode row,
        a chunk continuing its sequence) run with the model's own forward, then again with the compact one. On
        CPU it first tries the compact forward through the native kernels (native_kernels.py), then without."""
        kernels = native_kernels.active() if self.platform.cpu_fast_paths else None
        decoder, why = CompactDecoder.build(self.model, kernels)
        if decoder is None:
            return None, why
        if len({s.device for s in self.layer_shapes.values()}) > 1:
            return None, "its layers are spread over several devices"
        if self.kv.num_blocks < 4:
            return None, "the KV cache is too small to check it"

        def check() -> str:
            """'kernels' or 'plain' for the compact forward that computes the model's logits, else why none does."""
            steps = self._probe_steps()
            own = [self.execute(*step) for step in steps]
            why = self._differs(decoder, steps, own)
            if not why:
                return "kernels" if decoder.kernels is not None else "plain"
            if decoder.kernels is not None:
                log.warning("compact forward through the native kernels: %s; trying it without them", why)
                why = self._differs(CompactDecoder(self.model), steps, own)
            return why or "plain"

        verdict = self._kept(f"compact_forward:{int(decoder.kernels is not None)}", check)
        if verdict == "kernels":
            return decoder, ""
        if verdict == "plain":
            return (decoder if decoder.kernels is None else CompactDecoder(self.model)), ""
        return None, verdict

    def _differs(self, decoder: CompactDecoder, steps, own: list) -> str:
        """Why `decoder` does not compute the model's own logits `own` on `steps` ('' where it does)."""
        self.compact = decoder
        try:
            compact = [self.execute(*step) for step in steps]
        except Exception as exc:  # a shape it does not expect (a partial rotary embedding...): the model's own
            return f"it failed on this model ({type(exc).__name__}: {exc})"
        finally:
            self.compact = None
        tolerance = 1e-4 if self.dtype == torch.float32 else 2e-2
        if quantized_weights.rounds_activations(self.model):
            tolerance = max(tolerance, 2e-3)
        if not all(_logits_match(expected, got, tolerance) for expected, got in zip(own, compact)):
            return "its logits differ from the model's own forward"
        return ""

    @torch.inference_mode()
    def _cuda_blocks(self, utilization: float, profile_tokens: int) -> int:
        """Blocks that fit each GPU's share (GPU_MEMORY_UTILIZATION) after its weights and the peak a full-size
        step needs there (measured by running one on a provisional cache)."""
        devices = sorted({s.device for s in self.layer_shapes.values()}, key=str)
        provisional = blocks_for(profile_tokens)
        resident = [*self.model.parameters(), *self.model.buffers(), *(self.states.tensors() if self.states else ())]
        with self.platform.peak_memory(devices, resident) as peaks:
            self.kv = self._cache(self.kv_dtype, provisional)
            self.execute([], [PrefillChunk([0] * profile_tokens, 0, list(range(provisional)), "last",
                                           state_slot=0 if self.states else None)])
        blocks = None
        for d in devices:
            per_block = PagedKVCache.bytes_per_token(self.layer_shapes, self.kv_dtype, d) * BLOCK_SIZE
            peak = peaks[d] - per_block * provisional
            total = self.platform.total_memory(d)
            budget = int(total * utilization) - peak
            if budget < per_block:
                raise RuntimeError(f"no memory left for the KV cache on {d}: the weights and a step of "
                                   f"{profile_tokens} tokens take {peak / 2**30:.1f} GiB of the {utilization:.0%} of "
                                   f"{total / 2**30:.1f} GiB allowed (GPU_MEMORY_UTILIZATION)")
            blocks = budget // per_block if blocks is None else min(blocks, budget // per_block)
        del self.kv
        self.platform.release_cached()
        return blocks

    @torch.inference_mode()
    def execute(self, decodes: list[DecodeRow], chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """Compute one step. Returns logits [rows, vocab]: one row per decode row, then per chunk none, its last
        position's or all its positions', in order; None when no position asked for logits."""
        if self.states is not None:
            return self._execute_stateful(decodes, chunks)
        ids, positions, slots, buckets, keep = self._decode_rows(decodes)
        segments = []
        for chunk in chunks:
            offset, n = len(ids), len(chunk.token_ids)
            span, chunk_slots, segment = self._chunk_segment(chunk, offset)
            ids.extend(chunk.token_ids)
            positions.extend(span)
            slots.extend(chunk_slots)
            segments.append(segment)
            if chunk.logits == "all":
                keep.extend(range(offset, offset + n))
            elif chunk.logits == "last":
                keep.append(offset + n - 1)
        layout = StepLayout(buckets, segments, torch.tensor(slots, device=self.device))
        if not keep:
            keep = [len(ids) - 1]  # the model computes at least one logit row; it is dropped below
        with StepCache(self.kv, layout) as cache:
            logits = self._forward([ids], [positions], cache, keep)
        if not any(c.logits != "none" for c in chunks) and not decodes:
            return None
        return logits[0]

    def _chunk_segment(self, chunk: PrefillChunk, offset: int) -> tuple[range, list[int], PrefillSegment]:
        """A prompt chunk's positions, the pool slots its new keys and values go to, and its segment starting at
        `offset` among a pass's tokens."""
        end = chunk.start + len(chunk.token_ids)
        span = range(chunk.start, end)
        blocks = torch.tensor(chunk.blocks[:blocks_for(end)], device=self.device)
        return span, [_slot(chunk.blocks, p) for p in span], PrefillSegment(offset, len(span), chunk.start, blocks)

    def _decode_rows(self, decodes: list[DecodeRow]):
        """The decode rows packed bucket by bucket: their tokens, positions and cache slots in packed order, the
        buckets, and where each row (in the caller's order) sits among them."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        buckets = []
        packed_at = [0] * len(decodes)
        for members in _length_buckets(decodes):
            max_len = decodes[members[-1]].position + 1
            width = blocks_for(max_len)
            table = []
            for i in members:
                row = decodes[i]
                packed_at[i] = len(ids)
                ids.append(row.token)
                positions.append(row.position)
                slots.append(_slot(row.blocks, row.position))
                table.extend(row.blocks[:width])
                table.extend([row.blocks[0]] * (width - min(width, len(row.blocks))))
            buckets.append(DecodeBucket(packed_at[members[0]], len(members),
                                        torch.tensor(table, device=self.device),
                                        torch.tensor([decodes[i].position + 1 for i in members], device=self.device),
                                        max_len))
        return ids, positions, slots, buckets, packed_at

    def _forward(self, ids: list[list[int]], positions: list[list[int]], cache, keep: list[int]) -> torch.Tensor:
        if self.compact is not None:
            return self.compact(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device),
                                cache, torch.tensor(keep, device=self.device))
        out = self.model(input_ids=torch.tensor(ids, device=self.device),
                         position_ids=torch.tensor(positions, device=self.device), use_cache=True,
                         logits_to_keep=torch.tensor(keep, device=self.device), **{self._cache_argument: cache})
        return out.logits

    def _execute_stateful(self, decodes: list[DecodeRow], chunks: list[PrefillChunk]) -> torch.Tensor | None:
        """A step of a model with recurrent layers. Those layers take one sequence per batch row, so the decode
        rows run as one [rows, 1] batch and each prompt chunk as its own pass (continuing the state its earlier
        chunks left, for models whose layers can: `prefill_continues`; the others compute prompts whole). States
        are written back only once every pass of the step has succeeded."""
        passes: list[StateStepCache] = []
        parts: list[torch.Tensor] = []
        if decodes:
            ids, positions, slots, buckets, packed_at = self._decode_rows(decodes)
            order = sorted(range(len(decodes)), key=packed_at.__getitem__)
            layout = StepLayout(buckets, [], torch.tensor(slots, device=self.device))
            with StateStepCache(self.kv, layout, self.states, [decodes[i].state_slot for i in order],
                                previous=True) as cache:
                logits = self._forward([[t] for t in ids], [[p] for p in positions], cache, [0])
            passes.append(cache)
            parts.append(logits[:, 0][torch.tensor(packed_at, device=logits.device)])
        for chunk in chunks:
            if chunk.start and not self.prefill_continues:
                raise RuntimeError("this model's recurrent layers compute each prompt in one pass")
            span, chunk_slots, segment = self._chunk_segment(chunk, 0)
            layout = StepLayout([], [segment], torch.tensor(chunk_slots, device=self.device))
            n = len(span)
            keep = list(range(n)) if chunk.logits == "all" else [n - 1]
            with StateStepCache(self.kv, layout, self.states, [chunk.state_slot],
                                previous=chunk.start > 0) as cache:
                logits = self._forward([chunk.token_ids], [list(span)], cache, keep)
            passes.append(cache)
            if chunk.logits != "none":
                parts.append(logits[0])
        for cache in passes:
            cache.commit()
        return torch.cat(parts) if parts else None
