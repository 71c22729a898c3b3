"""Forward passes over the KV cache: prefill chunks of prompts and batched decode steps."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import SlotKVCache


@dataclass
class PrefillChunk:
    row: int  # KV cache row of the sequence
    start: int  # tokens of this sequence already in the cache
    token_ids: list[int]  # the next tokens to compute


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, max_rows: int, max_len: int):
        self.model = model
        self.device = device
        self.kv = SlotKVCache(device, dtype, max_rows=max_rows, max_len=max_len)

    def _forward(self, input_ids, positions, mask, rows, columns, kv_len, logits_to_keep):
        cache = self.kv.step(rows, columns, kv_len)
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                         past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
        return out.logits

    @torch.inference_mode()
    def prefill(self, chunks: list[PrefillChunk], all_logits: bool = False) -> torch.Tensor:
        """Compute the chunks' tokens into the cache. Returns logits [chunks, vocab] of each chunk's last token,
        or [chunks, width, vocab] for every position (left-padded to the widest chunk) when `all_logits`."""
        width = max(len(c.token_ids) for c in chunks)
        kv_len = max(c.start + len(c.token_ids) for c in chunks)
        rows = [c.row for c in chunks]
        self.kv.reserve(max(rows) + 1, kv_len)
        # Chunks are left-padded to a common width so that the last position holds every chunk's last token.
        # Padding positions write to the scratch column and see only column 0.
        ids = torch.zeros((len(chunks), width), dtype=torch.long)
        positions = torch.full((len(chunks), width), -1, dtype=torch.long)
        for i, chunk in enumerate(chunks):
            n = len(chunk.token_ids)
            ids[i, width - n:] = torch.tensor(chunk.token_ids, dtype=torch.long)
            positions[i, width - n:] = torch.arange(chunk.start, chunk.start + n)
        columns = torch.where(positions >= 0, positions, self.kv.scratch_column)
        mask = torch.arange(kv_len).view(1, 1, -1) <= positions.unsqueeze(-1)
        mask[:, :, 0] |= positions < 0
        logits = self._forward(ids.to(self.device), positions.clamp(min=0).to(self.device),
                               mask.unsqueeze(1).to(self.device), rows, columns.to(self.device), kv_len,
                               logits_to_keep=0 if all_logits else 1)
        return logits if all_logits else logits[:, -1]

    @torch.inference_mode()
    def decode(self, rows: list[int], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """One new token per row at the given positions. Returns logits [rows, vocab]."""
        kv_len = max(positions) + 1
        self.kv.reserve(max(rows) + 1, kv_len)
        pos = torch.tensor(positions, dtype=torch.long).view(-1, 1)
        mask = (torch.arange(kv_len).view(1, -1) <= pos).view(len(rows), 1, 1, kv_len)
        ids = torch.tensor(token_ids, dtype=torch.long).view(-1, 1)
        pos = pos.to(self.device)
        logits = self._forward(ids.to(self.device), pos, mask.to(self.device), rows, pos, kv_len, logits_to_keep=1)
        return logits[:, -1]
