"""Which attention layers of a model attend over a sliding window, and how wide.

Most families pass their layer's window to the attention function (`sliding_window`); a few only build a
sliding-window mask (Qwen2-MoE, PhiMoE), which the engine's attention never sees. For those the window is read
from the config the way transformers builds its masks (`layer_types`, else every layer when `sliding_window` is
set) and marked on each attention module, so every layer attends exactly as it does under transformers and the
model is served at its full context.
"""
from __future__ import annotations

import sys

from engine.executor.attention import WINDOW_ATTRIBUTE


def layer_windows(model) -> dict[int, int]:
    """Sliding window per layer index, for the layers that have one (empty for full-attention models)."""
    modeling = sys.modules.get(type(model).__module__)
    if modeling is None or not hasattr(modeling, "create_sliding_window_causal_mask"):
        return {}  # the model never builds a sliding-window mask
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return {}
    layers = getattr(config, "num_hidden_layers", 0)
    types = getattr(config, "layer_types", None)
    if types is None:
        return {i: window for i in range(layers)}
    return {i: window for i, kind in enumerate(types) if kind == "sliding_attention"}


def mark_windows(model) -> dict[int, int]:
    """Mark each windowed layer's attention module with its window (read by engine/executor/attention.py)."""
    windows = layer_windows(model)
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and index in windows and "Attention" in type(module).__name__:
            setattr(module, WINDOW_ATTRIBUTE, windows[index])
    return windows
