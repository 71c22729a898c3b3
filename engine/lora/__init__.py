"""LoRA adapters over the served base model: reading them (adapters.py), the per-row low-rank term in the linear
layers (layers.py), and which adapters are known, read and resident (registry.py)."""
from engine.lora.adapters import AdapterError, LoraSpec
from engine.lora.registry import LoraConfig, LoraRegistry

__all__ = ["AdapterError", "LoraConfig", "LoraRegistry", "LoraSpec"]
