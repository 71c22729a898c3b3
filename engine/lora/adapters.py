"""A PEFT LoRA adapter read straight from its files (adapter_config.json and adapter_model.safetensors or .bin)
and checked against the base model it is to run on. peft itself is not needed to serve: its format is a config
and, per adapted linear layer, two matrices A [r, in] and B [out, r] whose product, scaled, is added to the
layer's weight (scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.cpu.packed_linear import PackedLinear, SideBySide
from engine.sources import store


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it and what is wrong."""


def adaptable(module: torch.nn.Module) -> bool:
    """A linear layer an adapter can target: torch.nn.Linear, or a quantized checkpoint's packed layer (alone or
    several side by side), whose products keep their own forwards (QLoRA's base model is one)."""
    return isinstance(module, (torch.nn.Linear, PackedLinear, SideBySide))


@dataclass(frozen=True)
class LoraSpec:
    """A name and where its files come from (any source MODEL_NAME takes), as LORA_MODULES or a load request
    gives them. `base_model_name`, when given, must name the served base model."""
    name: str
    path: str
    base_model_name: str | None = None


@dataclass
class LoraAdapter:
    name: str
    source: str
    rank: int  # the largest rank of its layers
    # module name in the base model ("model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r] with the
    # scaling folded in), in float32
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


_PREFIX = "base_model.model."


def _weights_file(folder: Path) -> dict[str, torch.Tensor]:
    safetensors = folder / "adapter_model.safetensors"
    pickled = folder / "adapter_model.bin"
    try:
        if safetensors.is_file():
            from safetensors.torch import load_file
            return load_file(safetensors)
        if pickled.is_file():
            return torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: the library's own words, on one line
        text = " ".join(str(exc).split())[:200]
        raise AdapterError(f"its weights file cannot be read ({type(exc).__name__}: {text})") from None
    raise AdapterError("no adapter_model.safetensors or adapter_model.bin in its folder")


def _config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise AdapterError("no adapter_config.json in its folder")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError("adapter_config.json is not a JSON object")
    return config


def _check_config(config: dict, max_rank: int) -> None:
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"it is a {kind} adapter; only LoRA adapters are served")
    if config.get("use_dora"):
        raise AdapterError("use_dora: DoRA adapters are not supported (their magnitude vector rescales each "
                           "weight column, which the per-row low-rank term cannot express)")
    if config.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {config['modules_to_save']}: adapters that replace whole modules are "
                           f"not supported (the base weights are shared by every request)")
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out: adapters of Conv1D layers (GPT-2 style) are not supported")
    if config.get("bias", "none") not in ("none", None):
        raise AdapterError(f"bias={config['bias']!r}: adapters that train biases are not supported")
    if config.get("layer_replication"):
        raise AdapterError("layer_replication is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise AdapterError(f"its rank {max(ranks)} is above MAX_LORA_RANK={max_rank}")
    alphas = [config.get("lora_alpha", 8), *(config.get("alpha_pattern") or {}).values()]
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in alphas):
        raise AdapterError(f"lora_alpha must be a finite number, got {alphas}")


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern: a key matches a module whose name ends with it (or equals it)."""
    for key, value in (patterns or {}).items():
        if module == key or module.endswith("." + key):
            return value
    return default


def read(spec: LoraSpec, base: torch.nn.Module, *, max_rank: int, cache_dir: Path, baked_dir: Path | None,
         base_names: tuple[str, ...] = ()) -> LoraAdapter:
    """The adapter `spec` names, read and checked against `base` (its layers and their shapes). Raises
    AdapterError naming the adapter."""
    try:
        if spec.base_model_name is not None and base_names and spec.base_model_name not in base_names:
            raise AdapterError(f"base_model_name {spec.base_model_name!r} is not the served model "
                               f"({' / '.join(dict.fromkeys(base_names))})")
        try:
            source = store.resolve(spec.path, revision=None, cache_dir=cache_dir, baked_dir=baked_dir,
                                   role="adapter")
        except Exception as exc:
            raise AdapterError(" ".join(str(exc).split())[:300]) from None
        folder = source.path
        config = _config(folder)
        _check_config(config, max_rank)
        tensors = _weights_file(folder)
        return _build(spec, config, tensors, base, max_rank)
    except AdapterError as exc:
        raise AdapterError(f"LoRA adapter {spec.name!r} ({spec.path}): {exc}") from None


def _build(spec: LoraSpec, config: dict, tensors: dict[str, torch.Tensor], base: torch.nn.Module,
           max_rank: int) -> LoraAdapter:
    modules = dict(base.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for marker, what in (("lora_magnitude_vector", "a DoRA magnitude vector"),
                         ("lora_embedding", "an embedding adapter")):
        key = next((k for k in tensors if marker in k), None)
        if key is not None:
            raise AdapterError(f"weight {key!r} is {what}; only LoRA adapters of linear layers are supported")
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name and name.endswith(".weight"):
                module = name[:name.index(marker)]
                pairs.setdefault(module, {})[part] = tensor
                break
        else:
            raise AdapterError(f"weight {key!r} is not a LoRA A or B matrix (a whole layer saved with the "
                               f"adapter?); only LoRA adapters of linear layers are supported")
    if not pairs:
        raise AdapterError("its weights file holds no LoRA matrices")
    use_rslora = bool(config.get("use_rslora"))
    adapter = LoraAdapter(spec.name, spec.path, 0)
    for module_name, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"layer {module_name} has {' and '.join(pair)} but not both LoRA matrices")
        target = modules.get(module_name)
        if not adaptable(target):
            raise AdapterError(f"targets {module_name}, which the base model has no linear layer for (an adapter "
                               f"of another base model?)")
        a, b = pair["lora_A"].float(), pair["lora_B"].float()
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or a.shape[1] != target.in_features \
                or b.shape[0] != target.out_features:
            raise AdapterError(f"layer {module_name}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                               f"model's {target.out_features} x {target.in_features} weight (an adapter of another "
                               f"base model?)")
        if r > max_rank:
            raise AdapterError(f"its rank {r} is above MAX_LORA_RANK={max_rank}")
        short = module_name
        alpha = _pattern_value(config.get("alpha_pattern"), short, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"layer {module_name} holds infinite or NaN values")
        adapter.weights[module_name] = (a.contiguous(), (b * scaling).contiguous())
        adapter.rank = max(adapter.rank, r)
    return adapter


def parse_modules(text: str) -> tuple[LoraSpec, ...]:
    """LORA_MODULES in vLLM's forms: `name=path` pairs (separated by spaces or commas), or JSON: one object or a
    list of objects with `name`, `path` and optionally `base_model_name`. ValueError says what is wrong."""
    text = text.strip()
    if text.startswith(("[", "{")):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        items = value if isinstance(value, list) else [value]
        specs = []
        for item in items:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str)
                    and item["name"] and item["path"] and set(item) <= {"name", "path", "base_model_name"}
                    and isinstance(item.get("base_model_name", ""), (str, type(None)))):
                raise ValueError(f"each adapter must be an object with a name and a path (and optionally "
                                 f"base_model_name), got {json.dumps(item)[:200]}")
            specs.append(LoraSpec(item["name"], item["path"], item.get("base_model_name")))
    else:
        specs = []
        for pair in text.replace(",", " ").split():
            name, sep, path = pair.partition("=")
            if not (sep and name and path):
                raise ValueError(f"expected name=path pairs or JSON, got {pair!r}")
            specs.append(LoraSpec(name, path))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"adapter names must differ, got {names}")
    if not specs:
        raise ValueError("names no adapter")
    return tuple(specs)
