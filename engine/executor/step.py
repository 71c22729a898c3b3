"""What one engine step asks the runner to compute: decode rows (one new token of a running sequence) and prefill
chunks (the next tokens of a prompt), each with the cache blocks it owns."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeRow:
    token: int  # the sequence's last token, not yet in the cache
    position: int
    blocks: list[int]
    state_slot: int | None = None  # its recurrent-state slot (models with recurrent layers)
    lora_slot: int = 0  # its LoRA adapter's slot (engine/lora/layers.py); 0: none
    # Its rotary position is position + rope_delta (a multimodal-rotary decoder's shift after a prompt with
    # images, engine/vision/encoder.py; 0 otherwise). The cache slot stays `position`.
    rope_delta: int = 0


@dataclass
class PrefillChunk:
    token_ids: list[int]  # the next tokens of the sequence to compute
    start: int  # tokens of the sequence already in the cache
    blocks: list[int]  # covering at least start + len(token_ids) slots
    logits: str = "none"  # "none" | "last" | "all": which positions' logits the step returns
    state_slot: int | None = None
    # A vision-language prompt's image rows among these tokens: (offsets in the chunk, embedding rows), which
    # replace those tokens' embeddings (engine/vision/encoder.py); None for text.
    image_rows: tuple | None = None
    lora_slot: int = 0
    # A multimodal-rotary decoder's [3, len(token_ids)] rotary positions of these tokens (a prompt with images);
    # None: each token's index plus rope_delta, in all three components.
    rotary: object = None
    rope_delta: int = 0
