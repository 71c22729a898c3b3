"""Forward passes over the paged KV cache: one packed pass per engine step, decode rows and prefill chunks
together, with no padding (a step costs the tokens it computes). Models with recurrent layers, which take one
sequence per batch row, run their decode rows as one batched pass and each prompt chunk as its own
(state_cache.py keeps their state)."""
from __future__ import annotations

import logging

import torch

from engine import devices
from engine.core.block_manager import BLOCK_SIZE, blocks_for
from engine.cpu import native_kernels
from engine.executor.attention import bfloat16_products_pay
from engine.executor.compact_decoder import CompactDecoder
from engine.executor.kv_cache import DecodeBucket, PagedKVCache, PrefillSegment, StepCache, StepLayout
from engine.executor.startup_checks import StartupChecks, cache_argument
from engine.executor.step import DecodeRow, PrefillChunk
from engine.executor.state_cache import RecurrentStates, StateStepCache
from engine.lora import layers as lora_layers

log = logging.getLogger("engine")


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


def _adapter_rows(decodes: list[DecodeRow], chunks: list[PrefillChunk], packed_at: list[int]) -> list[int] | None:
    """The LoRA slot of each token row of a packed pass (decode rows at `packed_at`, then each chunk's tokens), or
    None when no row has an adapter (the usual case: nothing more is done)."""
    if not any(d.lora_slot for d in decodes) and not any(c.lora_slot for c in chunks):
        return None
    rows = [0] * len(decodes)
    for d, at in zip(decodes, packed_at):
        rows[at] = d.lora_slot
    for chunk in chunks:
        rows.extend([chunk.lora_slot] * len(chunk.token_ids))
    return rows


_STATELESS_BLOCKS = 1 << 16  # positions the block manager tracks for a model with no attention layer (no memory)
class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, kv_budget_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 kv_dtype: torch.dtype | None = None, check_kv_dtype: bool = False,
                 platform: devices.Platform | None = None, verdicts=None, batch_invariant: bool = False):
        self.model = model
        self.batch_invariant = batch_invariant  # the engine's BATCH_INVARIANT, which its caches carry to attention
        # The checks' verdicts from earlier starts on this machine, model and code (engine/startup_cache.py; startup_checks.py asks them).
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
        checks = StartupChecks(self)
        self.layer_shapes, state_shapes = checks.layer_shapes()
        # A model with recurrent or convolution layers keeps one state slot per running sequence (state_cache.py);
        # their memory comes out of the budget first.
        self.states = RecurrentStates(state_shapes, max_num_seqs) if state_shapes else None
        if check_kv_dtype and (self.states is not None or not self.layer_shapes):
            self.kv_dtype = dtype  # the probe below covers attention-only models
        self.bf16_attention = self._bf16_attention(checks)
        self.kv = self._allocate_kv(kv_budget_bytes, gpu_memory_utilization, max_num_batched_tokens)
        # Whether a prompt may be computed in chunks: always for attention, for recurrent layers when they continue
        # a multi-token pass from the state an earlier one left (found out by trying).
        self.prefill_continues = self.states is None or checks.prefill_continues()
        if self.states is None and self.layer_shapes:
            if check_kv_dtype and self.kv_dtype != dtype:
                why = checks.kept("kv_rounding", checks.kv_rounding_differs) if self.kv.num_blocks >= 4 else \
                    checks.kv_rounding_differs()
                if why:
                    log.warning("KV cache in %s: %s; keeping %s", str(self.kv_dtype).removeprefix("torch."), why,
                                str(dtype).removeprefix("torch."))
                    self.kv_dtype = dtype
                    del self.kv
                    self.kv = self._allocate_kv(kv_budget_bytes, gpu_memory_utilization, max_num_batched_tokens)
            self.compact, self.compact_reason = checks.compact_decoder()

    def _bf16_attention(self, checks: StartupChecks) -> bool:
        """Whether a bfloat16 cache's prompt chunks attend with VDPBF16PS (attention.bfloat16_products_pay), timed
        once per model shape and machine."""
        kernels = native_kernels.active() if self.platform.cpu_fast_paths else None
        shape = next(iter(self.layer_shapes.values()), None)
        if kernels is None or shape is None or torch.bfloat16 not in (self.kv_dtype, self.dtype):
            return True
        return checks.kept(f"bf16_attention:{shape.kv_heads}:{shape.key_dim}",
                           lambda: bfloat16_products_pay(kernels, 4 * shape.kv_heads, shape.kv_heads, shape.key_dim))

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
        return self.new_cache(self.kv_dtype, max(1, num_blocks))

    def new_cache(self, dtype: torch.dtype, num_blocks: int) -> PagedKVCache:
        return PagedKVCache(self.device, dtype, self.layer_shapes, num_blocks,
                            native_kernels=self.platform.cpu_fast_paths, batch_invariant=self.batch_invariant,
                            bf16_products=self.bf16_attention)

    @torch.inference_mode()
    def _cuda_blocks(self, utilization: float, profile_tokens: int) -> int:
        """Blocks that fit each GPU's share (GPU_MEMORY_UTILIZATION) after its weights and the peak a full-size
        step needs there (measured by running one on a provisional cache)."""
        devices = sorted({s.device for s in self.layer_shapes.values()}, key=str)
        provisional = blocks_for(profile_tokens)
        resident = [*self.model.parameters(), *self.model.buffers(), *(self.states.tensors() if self.states else ())]
        with self.platform.peak_memory(devices, resident) as peaks:
            self.kv = self.new_cache(self.kv_dtype, provisional)
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
        adapters = _adapter_rows(decodes, chunks, keep)
        segments = []
        image_rows = []  # (offsets among the step's tokens, rows) of vision-language prompts' image positions
        rotary = []  # (offset among the step's tokens, [3, tokens] positions) of multimodal-rotary prompt chunks
        for chunk in chunks:
            offset, n = len(ids), len(chunk.token_ids)
            if chunk.image_rows is not None:
                image_rows.append((chunk.image_rows[0] + offset, chunk.image_rows[1]))
            if chunk.rotary is not None:
                rotary.append((offset, chunk.rotary))
            span, chunk_slots, segment = self._chunk_segment(chunk, offset)
            ids.extend(chunk.token_ids)
            positions.extend(span if not chunk.rope_delta else (p + chunk.rope_delta for p in span))
            slots.extend(chunk_slots)
            segments.append(segment)
            if chunk.logits == "all":
                keep.extend(range(offset, offset + n))
            elif chunk.logits == "last":
                keep.append(offset + n - 1)
        layout = StepLayout(buckets, segments, torch.tensor(slots, device=self.device))
        if not keep:
            keep = [len(ids) - 1]  # the model computes at least one logit row; it is dropped below
        position_ids = self._position_ids(positions, rotary)
        with StepCache(self.kv, layout) as cache, lora_layers.step(adapters):
            if image_rows:
                logits = self._forward_with_images(ids, position_ids, cache, keep, image_rows)
            else:
                logits = self._forward([ids], position_ids, cache, keep)
        if not any(c.logits != "none" for c in chunks) and not decodes:
            return None
        return logits[0]

    def _position_ids(self, positions: list[int], rotary: list) -> torch.Tensor:
        """The step's rotary positions: [1, tokens], or [3, 1, tokens] (time, height, width) when a chunk of a
        multimodal-rotary prompt carries its own (every other token takes its 1-D position in all three)."""
        flat = torch.tensor(positions)
        if not rotary:
            return flat.view(1, -1).to(self.device)
        three = flat.expand(3, -1).clone()
        for offset, chunk_positions in rotary:
            three[:, offset:offset + chunk_positions.shape[1]] = chunk_positions
        return three.unsqueeze(1).to(self.device)

    def _forward_with_images(self, ids: list[int], position_ids: torch.Tensor, cache, keep: list[int],
                             image_rows: list) -> torch.Tensor:
        """A step holding image positions: the tokens' embeddings with those positions' rows put in, through the
        model's own forward (the compact forward takes token ids only)."""
        embeds = self.model.get_input_embeddings()(torch.tensor([ids], device=self.device))
        for offsets, rows in image_rows:
            embeds[0, offsets.to(self.device)] = rows.to(self.device, embeds.dtype)
        out = self.model(inputs_embeds=embeds, position_ids=position_ids,
                         use_cache=True, logits_to_keep=torch.tensor(keep, device=self.device),
                         **{self._cache_argument: cache})
        return out.logits

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
                positions.append(row.position + row.rope_delta)
                slots.append(_slot(row.blocks, row.position))
                table.extend(row.blocks[:width])
                table.extend([row.blocks[0]] * (width - min(width, len(row.blocks))))
            buckets.append(DecodeBucket(packed_at[members[0]], len(members),
                                        torch.tensor(table, device=self.device),
                                        torch.tensor([decodes[i].position + 1 for i in members], device=self.device),
                                        max_len))
        return ids, positions, slots, buckets, packed_at

    def _forward(self, ids: list[list[int]], positions: list[list[int]] | torch.Tensor, cache,
                 keep: list[int]) -> torch.Tensor:
        if not isinstance(positions, torch.Tensor):
            positions = torch.tensor(positions, device=self.device)
        if self.compact is not None:
            return self.compact(torch.tensor(ids, device=self.device), positions, cache,
                                torch.tensor(keep, device=self.device))
        out = self.model(input_ids=torch.tensor(ids, device=self.device), position_ids=positions, use_cache=True,
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
                                previous=True) as cache, lora_layers.step([decodes[i].lora_slot for i in order]):
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
                                previous=chunk.start > 0) as cache, lora_layers.step(uniform=chunk.lora_slot):
                logits = self._forward([chunk.token_ids], [list(span)], cache, keep)
            passes.append(cache)
            if chunk.logits != "none":
                parts.append(logits[0])
        for cache in passes:
            cache.commit()
        return torch.cat(parts) if parts else None
