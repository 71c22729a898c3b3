"""The attention function the engine runs models with.

Registered with transformers' AttentionInterface, so every model whose attention layers dispatch through it
(the decoder-only families of transformers 5) reads its keys and values from the engine's paged KV cache.

Inside an engine step the model sees one packed sequence of tokens (no padding): the decode rows' single tokens,
then each prefill chunk. This function splits it again: all decode rows attend in one batched product over their
own blocks (in buckets of similar lengths, each gathered to its longest row and masked to each row's length), and
each prefill chunk attends causally over its sequence's keys. A sliding-window layer gathers only the blocks its
window reaches. On CPU, where engine/cpu/native_kernels.py built its kernels, decode rows instead attend straight from
their blocks, each over its own length, and prompt chunks of 64 tokens or more attend from their blocks in
register tiles, over only the keys each token reads. Outside a step (pooling forwards) it is plain SDPA with the
mask it is given.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.cpu import native_kernels
from engine.cpu.layout import speedup
from engine.executor.kv_cache import current_layout

ATTENTION_IMPLEMENTATION = "worker_paged"
# Prompt chunks from this many tokens take the native prefill kernel; shorter ones keep SDPA, which is as fast or
# faster there (the kernel's work is split by tiles of 16 tokens, too few to share out).
NATIVE_PREFILL_MIN_TOKENS = 64
WINDOW_ATTRIBUTE = "worker_sliding_window"


def _sdpa(query, key, value, mask, scaling, softcap, is_causal=False, sinks=None):
    if softcap is not None or sinks is not None:
        # SDPA has neither logit soft-capping (Gemma 2) nor attention sinks (gpt-oss: a learned per-head logit
        # that joins the softmax's denominator and attends to nothing); compute those models explicitly.
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if is_causal:
            mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        scores = scores.float()
        if sinks is not None:
            sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1)
        return torch.matmul(weights.to(value.dtype), value)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=is_causal,
                                          enable_gqa=query.shape[1] != key.shape[1])


def paged_attention(module, query, key, value, scaling, softcap=None, window=None, sinks=None):
    """Attention of one step's packed tokens over the paged cache, inside a StepCache: query [1, heads, tokens,
    dim]; key and value [1, kv_heads, tokens, dim], the step's own (already written to the cache). Returns
    [1, tokens, heads, value_dim]."""
    cache, layout = current_layout()
    layer = module.layer_idx
    if layer not in cache.layers:
        # An attention block shared by several layers (Zamba2) has no index of its own; the cache call just
        # before this one named the layer it runs for.
        layer = layout.written_layer
    k_pool, v_pool = cache.pools(layer)
    layout = layout.on(k_pool.device)
    kv_heads, key_dim, value_dim = k_pool.shape[2], k_pool.shape[3], v_pool.shape[3]
    # MLA models (DeepSeek V2/V3) cache compressed latents and expand them to per-head keys and values after
    # reading the cache: gathered latents go through the module's own expansion.
    expand = getattr(module, "expand_kv", None)
    tokens = query.shape[2]
    # A step of one bucket or one segment (one stream decoding, one prompt) returns its attention output as is.
    single = len(layout.buckets) + len(layout.segments) == 1
    out = None if single else query.new_empty((1, tokens, query.shape[1], value.shape[-1]))
    # What both native kernels cover (the rest keeps the gather and SDPA below): CPU queries with a contiguous
    # last dimension, no MLA expansion, soft-capping or sinks, and pools of the query's type or 16-bit pools
    # under float32 queries (KV_CACHE_DTYPE).
    native = native_kernels.active() if (
        cache.native_kernels and expand is None and softcap is None and sinks is None and query.device.type == "cpu"
        and query.stride(-1) == 1 and k_pool.dtype == v_pool.dtype
        and (k_pool.dtype == query.dtype
             or (query.dtype == torch.float32 and k_pool.dtype in (torch.float16, torch.bfloat16)))) else None
    native_scale = scaling if scaling is not None else query.shape[-1] ** -0.5  # the kernels take it explicitly
    for index, bucket in enumerate(layout.buckets):
        rows, span = bucket.rows, slice(bucket.offset, bucket.offset + bucket.rows)
        if native is not None:
            # Straight from the cache's blocks (engine/cpu/native_kernels.py): no gathered copy, no padding to the
            # bucket's longest row.
            o = query.new_empty((rows, query.shape[1], value_dim)) if single else out[0, span]
            native.paged_decode_attention(query[0, :, span].transpose(0, 1), k_pool, v_pool, bucket.blocks,
                                          bucket.lengths, window or 0, native_scale, o)
            if single:
                return o.unsqueeze(0)
            continue
        q = query[0, :, span].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        # index_select copies whole blocks (several times faster than advanced indexing on CPU)
        blocks, keys, mask = layout.bucket_keys(index, window)
        k = k_pool.index_select(0, blocks).view(rows, -1, kv_heads, key_dim)[:, :keys].to(query.dtype)
        v = v_pool.index_select(0, blocks).view(rows, -1, kv_heads, value_dim)[:, :keys].to(query.dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if expand is not None:
            k, v = expand(k, v)
        o = _sdpa(q, k, v, mask, scaling, softcap, sinks=sinks)
        if single:
            return o[:, :, 0].unsqueeze(0)
        out[0, span] = o[:, :, 0]
    prefill = native if (native is not None and key_dim == value_dim and key_dim in (64, 128)
                         and native.prefill_attention_supported()) else None
    # The prefill kernel multiplies float32 queries (16-bit pools widen as it reads them): a 16-bit model's chunk
    # goes in widened and its output rounds to the model's type once.
    wide = query.dtype != torch.float32
    for index, seg in enumerate(layout.segments):
        span = slice(seg.offset, seg.offset + seg.length)
        q = query[:, :, span]
        # Under BATCH_INVARIANT (the cache's engine's) every chunk takes the native kernel, whose result for a
        # token depends only on its position and its sequence's keys (key tiles aligned to position 0), while SDPA
        # rounds differently by chunk length and by whether the chunk starts its sequence; how a prompt is chunked
        # depends on what else shares the step.
        if prefill is not None and (cache.batch_invariant or seg.length >= NATIVE_PREFILL_MIN_TOKENS):
            # Straight from the cache's blocks in register tiles, over only the keys each token reads
            # (engine/cpu/native/prefill_attention.cpp): no gathered copy, no mask, no masked scores computed.
            o = (query.new_empty((seg.length, query.shape[1], value_dim), dtype=torch.float32)
                 if single or wide else out[0, span])
            prefill.paged_prefill_attention(q[0].transpose(0, 1).float(), k_pool, v_pool, seg.blocks, seg.start,
                                            window or 0, native_scale, o, cache.bf16_products)
            if wide:
                o = o.to(query.dtype) if single else out[0, span].copy_(o)
            if single:
                return o.unsqueeze(0)
            continue
        if seg.start == 0 and not (window and seg.length > window):
            # A chunk that starts its sequence attends only to its own keys: no gather, plain causal attention.
            o = _sdpa(q, key[:, :, span], value[:, :, span], None, scaling, softcap, is_causal=True, sinks=sinks)
        else:
            blocks, first, mask = layout.segment_keys(index, window, query.dtype)
            keys = seg.start + seg.length - first
            k = k_pool.index_select(0, blocks).view(-1, kv_heads, key_dim)[:keys].to(query.dtype)
            v = v_pool.index_select(0, blocks).view(-1, kv_heads, value_dim)[:keys].to(query.dtype)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            if expand is not None:
                k, v = expand(k, v)
            o = _sdpa(q, k, v, mask, scaling, softcap, sinks=sinks)
        if single:
            return o.transpose(1, 2)
        out[0, span] = o[0].transpose(0, 1)
    return out


def bfloat16_products_pay(kernels, heads: int, kv_heads: int, dim: int) -> bool:
    """Whether a bfloat16 model's prompt chunk attends faster with VDPBF16PS than with float32 FMAs over the same
    widened values (engine/cpu/native/prefill_attention.cpp): twice the products an instruction, but on some CPUs
    at half the instructions a cycle, where float32 attends faster.
    Timed on a 256-token chunk after 256 cached keys, in the layer's shape."""
    if dim not in (64, 128) or not kernels.prefill_attention_supported() or not kernels.bf16_linear_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    tokens, start, block = 256, 256, 16
    blocks = torch.arange((start + tokens) // block)
    k_pool, v_pool = (torch.randn(len(blocks), block, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
    query = torch.randn(tokens, heads, dim, generator=gen).bfloat16().float()
    out = torch.empty(tokens, heads, dim)

    def attend(bf16: bool):
        return lambda: kernels.paged_prefill_attention(query, k_pool, v_pool, blocks, start, 0, dim ** -0.5, out, bf16)
    return speedup(attend(False), attend(True), repeats=5) > 1.0


class DecodeAttention:
    """A step of decode rows, attending straight from the cache's blocks through the native kernel bucket by
    bucket, called by the compact forward for each layer. paged_attention decides the same per layer (the step's
    layout, the pools' types, the kernel's conditions) and reshapes its query and output around it, which at one
    stream costs about as much as the kernel's own work."""

    def __init__(self, kernels, cache, buckets, slots):
        self.kernels, self.cache = kernels, cache
        # The step's buckets (DecodeBucket), column by column: bucket i's rows start at offsets[i] and attend
        # together over their block table blocks[i], with lengths[i] keys each.
        self.offsets = [bucket.offset for bucket in buckets]
        self.blocks = [bucket.blocks for bucket in buckets]
        self.lengths = [bucket.lengths for bucket in buckets]
        self.slots = slots  # [rows] the pool slot each row's new key and value go to

    def pools(self, layers: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The key pools and the value pools of `layers`, for a caller that attends several layers in one call."""
        pairs = [self.cache.pools(layer) for layer in layers]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def __call__(self, layer: int, query: torch.Tensor, scaling: float | None, window: int | None) -> torch.Tensor:
        """query [rows, heads, dim] (last dimension contiguous) -> [rows, heads, value_dim]."""
        k_pool, v_pool = self.cache.pools(layer)
        out = query.new_empty((query.shape[0], query.shape[1], v_pool.shape[3]))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        if len(self.offsets) == 1:  # one bucket (every one-stream step): no slicing
            self.kernels.paged_decode_attention(query, k_pool, v_pool, self.blocks[0], self.lengths[0], window or 0,
                                                scale, out)
            return out
        for offset, blocks, lengths in zip(self.offsets, self.blocks, self.lengths):
            rows = slice(offset, offset + lengths.numel())
            self.kernels.paged_decode_attention(query[rows], k_pool, v_pool, blocks, lengths, window or 0, scale,
                                                out[rows])
        return out


def decode_attention(dtype: torch.dtype) -> DecodeAttention | None:
    """The running step's decode attention for queries of `dtype` when the step is decode rows alone that the
    native kernel serves in every layer (CPU pools of the queries' type, or 16-bit pools under float32 queries),
    else None: paged_attention then decides per layer."""
    step = current_layout()
    if step is None:
        return None
    cache, layout = step
    kernels = native_kernels.active() if cache.native_kernels else None
    pools_fit = cache.dtype == dtype or (dtype == torch.float32 and cache.dtype in (torch.float16, torch.bfloat16))
    if (kernels is None or not pools_fit or layout.segments or not layout.buckets
            or any(shape.device.type != "cpu" for shape in cache.layers.values())):
        return None
    return DecodeAttention(kernels, cache, layout.buckets, layout.slots)


def layer_window(module, sliding_window: int | None) -> int | None:
    """The window an attention layer attends over: the one its model passes, else the one engine/executor/windows.py
    marked at load (models that build a sliding-window mask without passing the window here)."""
    return sliding_window or getattr(module, WINDOW_ATTRIBUTE, None)


def _attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               softcap: float | None = None, sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
               **kwargs):
    window = layer_window(module, sliding_window)
    if current_layout() is not None:
        rows = query.shape[0]
        if rows > 1:
            # A stateful model's decode pass (runner.py): one sequence per batch row, one token each, which is
            # the packed layout's decode rows laid along the batch.
            out = paged_attention(module, query.transpose(0, 2), key.transpose(0, 2), value.transpose(0, 2), scaling,
                         softcap, window, s_aux)
            return out.reshape(rows, 1, *out.shape[2:]), None
        return paged_attention(module, query, key, value, scaling, softcap, window, s_aux), None
    out = _sdpa(query, key, value, attention_mask, scaling, softcap, sinks=s_aux)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, _attention)
