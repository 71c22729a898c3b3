"""The attention function the engine runs models with.

Registered with transformers' AttentionInterface, so every model whose attention layers dispatch through it
(the decoder-only families of transformers 5) reads its keys and values from the engine's paged KV cache.

Inside an engine step the model sees one packed sequence of tokens (no padding): the decode rows' single tokens,
then each prefill chunk. This function splits it again: all decode rows attend in one batched product over their
own blocks (in buckets of similar lengths, each gathered to its longest row and masked to each row's length), and each prefill chunk attends causally
over its sequence's keys. Outside a step (pooling forwards) it is plain SDPA with the mask it is given.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .kv_cache import current_layout

ATTENTION_IMPLEMENTATION = "worker_paged"


def _sdpa(query, key, value, mask, scaling, softcap, is_causal=False):
    if softcap is not None:
        # SDPA has no logit soft-capping; compute the few models that use it (Gemma 2) explicitly.
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling or query.shape[-1] ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        if is_causal:
            mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(value.dtype), value)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, is_causal=is_causal,
                                          enable_gqa=query.shape[1] != key.shape[1])


def _paged(module, query, key, value, scaling, softcap, window):
    cache, layout = current_layout()
    k_pool, v_pool = cache.pools(module.layer_idx)
    layout = layout.on(k_pool.device)
    kv_heads, key_dim, value_dim = k_pool.shape[2], k_pool.shape[3], v_pool.shape[3]
    tokens = query.shape[2]
    out = query.new_empty((1, tokens, query.shape[1], value_dim))
    for index, bucket in enumerate(layout.buckets):
        rows, span = bucket.rows, slice(bucket.offset, bucket.offset + bucket.rows)
        q = query[0, :, span].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        # index_select copies whole blocks (several times faster than advanced indexing on CPU)
        k = k_pool.index_select(0, bucket.blocks).view(rows, -1, kv_heads, key_dim)[:, :bucket.max_len]
        v = v_pool.index_select(0, bucket.blocks).view(rows, -1, kv_heads, value_dim)[:, :bucket.max_len]
        o = _sdpa(q, k.transpose(1, 2), v.transpose(1, 2), layout.bucket_mask(index, window), scaling, softcap)
        out[0, span] = o[:, :, 0]
    for index, seg in enumerate(layout.segments):
        span = slice(seg.offset, seg.offset + seg.length)
        q = query[:, :, span]
        if seg.start == 0 and not (window and seg.length > window):
            # A chunk that starts its sequence attends only to its own keys: no gather, plain causal attention.
            o = _sdpa(q, key[:, :, span], value[:, :, span], None, scaling, softcap, is_causal=True)
        else:
            length = seg.start + seg.length
            k = k_pool.index_select(0, seg.blocks).view(-1, kv_heads, key_dim)[:length].transpose(0, 1).unsqueeze(0)
            v = v_pool.index_select(0, seg.blocks).view(-1, kv_heads, value_dim)[:length].transpose(0, 1)
            v = v.unsqueeze(0)
            o = _sdpa(q, k, v, layout.segment_mask(index, window), scaling, softcap)
        out[0, span] = o[0].transpose(0, 1)
    return out


def _attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               softcap: float | None = None, sliding_window: int | None = None, **kwargs):
    if current_layout() is not None:
        return _paged(module, query, key, value, scaling, softcap, sliding_window), None
    out = _sdpa(query, key, value, attention_mask, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, _attention)
