"""The attention function the engine runs models with.

Registered with transformers' AttentionInterface so every model whose attention layers dispatch through it
(all decoder-only families in transformers 5) reads keys and values from the engine's KV cache and takes the
engine's own 4-D boolean mask, which already encodes causality, padding and each row's length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_IMPLEMENTATION = "worker_sdpa"


def _attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               softcap: float | None = None, **kwargs):
    if softcap is not None:
        # SDPA has no logit soft-capping; compute the few models that use it (Gemma 2) explicitly.
        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        scores = torch.matmul(query, key.transpose(2, 3)) * (scaling or query.shape[-1] ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(value.dtype), value)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, _attention)
