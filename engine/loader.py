"""Loading a model and its tokenizer onto the chosen device."""
from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from engine import devices, quantization as quantized_checkpoint, startup_cache
from engine.core import fallback
from engine.cpu import fusion, host_memory, packed_linear, quantized_weights
from engine.cpu import plan as cpu_plan
from engine.executor import attention, windows
from engine.sources import store
from engine.sources.gguf import local_folder
from engine.config import EngineConfig
from engine.core.pooling import PoolingConfig, Task, pooling_config
from engine.tokenizer import Tokenizer
from engine.vision.encoder import ImageEncoder, paged_vision_refusal, text_view
from engine.vision.processor import VisionProcessor, is_vision_config, load_processor

log = logging.getLogger("engine.loader")


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    name: str
    generation_defaults: dict  # sampling defaults from the model's generation_config.json
    task: Task = "generate"  # generate (a causal LM), embed (a plain encoder or decoder), classify (a cross-encoder)
    pooling: PoolingConfig | None = None  # how embeddings are pooled from its hidden states
    fallback_reason: str | None = None  # why the paged engine cannot run it (engine/core/fallback.py serves it), or None
    platform: devices.Platform | None = None  # None: the plain platform of `device`
    verdicts: startup_cache.Verdicts | None = None  # the start-up probes' verdicts for this model and machine
    batch_invariant: bool = False  # a request's output does not depend on what is batched with it
    vision: "VisionProcessor | None" = None  # a vision-language model's processor (images in prompts), or None

    def __post_init__(self):
        if self.platform is None:
            self.platform = devices.Platform(self.device)


_GENERATING_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def model_task(config) -> Task:
    """What the model's architecture can serve: text generation, classification (a sequence-classification
    head, as cross-encoders have) or embeddings only (a model without a head, such as BertModel)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = list(getattr(config, "architectures", None) or ())
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "classify"
    if any(a.endswith(_GENERATING_HEADS) for a in architectures):
        return "generate"
    if not architectures and getattr(config, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "generate"
    return "embed"


_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _generation_defaults(model) -> dict:
    """Sampling values the model's authors set in generation_config.json; requests that leave a parameter unset
    get these (as vLLM does)."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    explicit = config.to_diff_dict()
    return {key: explicit[key] for key in _GENERATION_DEFAULT_KEYS if explicit.get(key) is not None}


def resolve_platform(name: str, simulated_memory: int | None = None) -> devices.Platform:
    try:
        return devices.resolve(name, simulated_memory)
    except devices.DeviceUnavailable as exc:
        raise ModelLoadError(str(exc)) from None


def resolve_dtype(name: str, device: torch.device | devices.Platform,
                  verdicts: startup_cache.Verdicts | None = None, native_kernels: str = "off") -> torch.dtype:
    platform = device if isinstance(device, devices.Platform) else devices.Platform(device)
    if name != "auto":
        return getattr(torch, name)
    if platform.accelerator:
        return torch.bfloat16 if platform.bfloat16_supported() else torch.float16
    return cpu_plan.weights_dtype(verdicts or startup_cache.in_memory(),
                                  native_kernels if platform.cpu_fast_paths else "off")


def model_folder(config: EngineConfig) -> Path:
    """The transformers-layout folder the configured model loads from (fetched or converted if needed)."""
    source = store.resolve(config.model, revision=config.revision, cache_dir=config.cache_dir,
                           baked_dir=config.baked_model_dir)
    return local_folder(source, config.cache_dir, config.baked_model_dir)


def _eos_ids(hf_tokenizer, model) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(hf_tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _model_max_len(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    else:
        limit = 2048
    # Sliding-window layers attend over their own window in the engine (engine/executor/windows.py): no cap.
    return limit


def _placement(config: EngineConfig, platform: devices.Platform) -> dict:
    """Where the weights load: straight onto the device (no full copy in host memory first), or whole layers over
    the first LAYER_SPLIT_DEVICES GPUs (accelerate's device map; the KV cache follows each layer). That is layer
    placement, not tensor parallelism: a step runs through the GPUs in turn, one computing at a time."""
    size = config.layer_split_devices
    device = platform.device
    if size == 1:
        return {"device_map": {"": device}}
    if platform.simulated:
        # The CPU is one torch device: the simulated GPUs would all be it, and per-GPU KV sizing would see one.
        raise ModelLoadError(f"LAYER_SPLIT_DEVICES={size} cannot be simulated with DEVICE={devices.SIMULATED}")
    if device.type != "cuda":
        raise ModelLoadError(f"LAYER_SPLIT_DEVICES={size} needs CUDA devices; this worker runs on {device.type}")
    available = torch.cuda.device_count()
    if available < size:
        raise ModelLoadError(f"LAYER_SPLIT_DEVICES={size} but only {available} CUDA devices are visible")
    return {"device_map": "auto", "max_memory": {i: torch.cuda.mem_get_info(i)[0] for i in range(size)}}


def _dense_checkpoint(config: EngineConfig, folder: Path, gguf: Path | None) -> bool:
    """Whether the model's linear weights load dense: no GGUF file, no QUANTIZATION, no quantization_config."""
    if gguf is not None or config.quantization:
        return False
    try:
        return "quantization_config" not in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # no readable config.json: the load reports it


@dataclass(frozen=True)
class _Checkpoint:
    """A model's files and how its weights are read: what the steps of `load` share."""
    config: EngineConfig
    name: str  # the source's name
    folder: Path
    gguf: Path | None  # the GGUF file of a GGUF source
    gguf_types: tuple[str, ...]  # GGUF block types multiplied from the file's blocks
    platform: devices.Platform
    placement: dict  # from_pretrained's device arguments
    verdicts: startup_cache.Verdicts

    @property
    def device(self) -> torch.device:
        return self.platform.device

    @property
    def label(self) -> str:
        """The model as load errors name it."""
        return self.config.model or self.name


@dataclass
class _Loading:
    """A model as read so far; `model` is replaced when the CPU plan reads it again in another dtype."""
    model: torch.nn.Module | None
    hf_tokenizer: Any
    task: Task
    vision: VisionProcessor | None = None
    fallback_reason: str | None = None
    causal_lm: Callable[[torch.dtype], torch.nn.Module] | None = None  # a text generator read again in a dtype


def load(config: EngineConfig) -> LoadedModel:
    """The model and tokenizer `config` names, read onto the platform it resolves to and prepared for serving
    there (CPU fast paths, quantized layers, batch invariance)."""
    started = time.perf_counter()
    if config.quantized_activations not in packed_linear.ACTIVATIONS:  # before anything is packed for it
        raise ModelLoadError(f"QUANTIZED_ACTIVATIONS={config.quantized_activations}: int16 or int8")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    platform = resolve_platform(config.device, config.simulated_device_memory)
    placement = _placement(config, platform)
    source = store.resolve(config.model, revision=config.revision, cache_dir=config.cache_dir,
                           baked_dir=config.baked_model_dir)
    folder = local_folder(source, config.cache_dir, config.baked_model_dir)
    verdicts = (startup_cache.open_verdicts(config.cache_dir, "model", folder, config.baked_model_dir,
                                            {"native_kernels": config.native_kernels})
                if config.startup_cache and platform.cpu_fast_paths and folder.is_dir() else startup_cache.in_memory())
    gguf = source.path / source.gguf_file if source.gguf_file else None
    dtype, gguf_blocks, gguf_types = _weights_dtype(config, platform, folder, gguf, verdicts)
    checkpoint = _Checkpoint(config, source.name, folder, gguf, gguf_types, platform, placement, verdicts)
    tokenizer_folder = _tokenizer_folder(config, folder)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model {checkpoint.label}: no config.json in {folder}")
    loading = _read_model(checkpoint, tokenizer_folder, dtype)
    dtype, invariant = _prepare_for_platform(checkpoint, loading, dtype, gguf_blocks)
    # The weights as loaded, the probes' buffers and the copies a kernel replaced are freed by now; the idle
    # release (host_memory.IdleRelease) waits for a first request, so their pages go back here. On a GPU the
    # weights moved to the device and the host heap is not the worker's memory.
    if platform.cpu_fast_paths:
        host_memory.release()
    if config.quantized_activations != "int16" and not quantized_weights.eight_bit_activations(loading.model):
        # Never a setting that silently does nothing.
        raise ModelLoadError(f"QUANTIZED_ACTIVATIONS={config.quantized_activations}: this model has no layers "
                             "multiplied from packed integers by the CPU kernels (a quantized checkpoint's integer "
                             "layers, bitsandbytes' 4-bit codes excepted, QUANTIZATION=int8/int4's, or a GGUF file's "
                             "served from its blocks with DTYPE=auto), which are all it changes; unset it")
    log.info("batch invariance: %s (BATCH_INVARIANT=%s)", "on" if invariant else "off",
             str(config.batch_invariant).lower())
    return _loaded_model(checkpoint, loading, dtype, invariant, started)


def _weights_dtype(config: EngineConfig, platform: devices.Platform, folder: Path, gguf: Path | None,
                   verdicts) -> tuple[torch.dtype, bool, tuple[str, ...]]:
    """The dtype the weights are read in; whether a GGUF file's layers are tried from its blocks under float32
    activations (engine/cpu/plan.py decides after loading whether they stay); and the GGUF block types multiplied
    from the file's blocks."""
    # The AVX512_BF16 kernel weighs in on bfloat16 only for checkpoints of dense weights: a quantized one's packed
    # layers read the same bytes either way (the 330M Q4_K_M file ran 7-10% slower at 8 and 16 streams with
    # bfloat16 activations than with float32 ones on a 2-core Intel Xeon).
    dtype = resolve_dtype(config.dtype, platform, verdicts,
                          config.native_kernels if _dense_checkpoint(config, folder, gguf) else "off")
    gguf_blocks = platform.cpu_fast_paths and cpu_plan.try_gguf_blocks(config, dtype, gguf, verdicts)
    # Q4_1 / Q8_0 layers take the block product that recovers them from float32 weights on that path (and in an
    # explicitly float32 model); elsewhere, and without the kernels (kept compact: packed_linear.py), they are read
    # from the file's blocks as the other types are.
    recovered = (gguf_blocks or dtype == torch.float32) and config.native_kernels != "off"
    gguf_types = quantized_checkpoint.GGUF_BLOCK_TYPES + (() if recovered else quantized_checkpoint.GGUF_RECOVERED_TYPES)
    if gguf_blocks:
        dtype = torch.float32
    return dtype, gguf_blocks, gguf_types


def _tokenizer_folder(config: EngineConfig, folder: Path) -> Path:
    """Where the tokenizer is read from: TOKENIZER_NAME's source, else the model's folder."""
    if not config.tokenizer:
        return folder
    tokenizer_source = store.resolve(config.tokenizer, revision=config.tokenizer_revision,
                                     cache_dir=config.cache_dir, baked_dir=config.baked_model_dir,
                                     role="tokenizer")
    return local_folder(tokenizer_source, config.cache_dir, config.baked_model_dir)


def _read_model(checkpoint: _Checkpoint, tokenizer_folder: Path, dtype: torch.dtype) -> _Loading:
    """The tokenizer and the model, read as what its architecture serves: a vision-language model, a text
    generator or an encoder/classifier. Any failure is a ModelLoadError naming the model."""
    from transformers import AutoConfig, AutoTokenizer

    config = checkpoint.config
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, trust_remote_code=config.trust_remote_code)
        model_config = AutoConfig.from_pretrained(checkpoint.folder, trust_remote_code=config.trust_remote_code)
        task = model_task(model_config)
        quantization = _quantization(config, model_config, checkpoint.gguf, task, checkpoint.device)
        if task == "generate" and is_vision_config(model_config):
            if quantization is not None:
                raise quantized_checkpoint.QuantizationError(
                    f"{quantization}: quantized vision-language models are not served yet (their packed layers "
                    f"would need the vision path's loader); serve the unquantized checkpoint")
            model, vision, fallback_reason = _vision_model(checkpoint.folder, model_config, config, dtype,
                                                           checkpoint.placement, checkpoint.verdicts)
            return _Loading(model, vision.hf.tokenizer, task, vision, fallback_reason)
        if task == "generate":
            fallback_reason = _fallback_reason(model_config)
            causal_lm = functools.partial(_causal_lm, checkpoint, model_config, quantization, fallback_reason)
            return _Loading(causal_lm(dtype), hf_tokenizer, task, None, fallback_reason, causal_lm)
        return _Loading(_encoder_model(checkpoint, task, dtype), hf_tokenizer, task)
    except quantized_checkpoint.QuantizationError as exc:
        raise ModelLoadError(f"model {checkpoint.label}: {_one_line(exc)}") from None
    except Exception as exc:
        raise ModelLoadError(f"model {checkpoint.label}: loading failed: "
                             f"{_one_line(exc)}") from exc


def _causal_lm(checkpoint: _Checkpoint, model_config, quantization: str | None, fallback_reason: str | None,
               dtype: torch.dtype) -> torch.nn.Module:
    """A text generator read in `dtype`: from its packed checkpoint or by transformers, quantized at load or
    multiplied from its GGUF blocks where that applies, and rewritten for the paged engine's decode steps."""
    from transformers import AutoModelForCausalLM

    config, folder, device = checkpoint.config, checkpoint.folder, checkpoint.device
    # The fallback path runs the model with transformers' own attention and cache.
    implementation = {} if fallback_reason else {"attn_implementation": attention.ATTENTION_IMPLEMENTATION}
    if quantization in quantized_checkpoint.READ_ON_CPU and device.type == "cpu":
        model = quantized_checkpoint.load(folder, model_config, quantization, dtype,
                                          trust_remote_code=config.trust_remote_code, **implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, trust_remote_code=config.trust_remote_code, **checkpoint.placement,
            **implementation)
    model.eval()
    model.requires_grad_(False)
    if quantization in quantized_checkpoint.LOAD_TIME_METHODS:
        quantized_checkpoint.quantize_at_load(model, quantization)
    if checkpoint.gguf is not None and device.type == "cpu" and (
            config.native_kernels != "off" or not packed_linear.dense_copy_fits(_linear_bytes(model))):
        # Q4_0, Q5_0 / Q5_1 and K-quant layers multiply from their file's blocks; Q4_1 / Q8_0 ones too
        # unless they keep the product that recovers them from float32 weights (engine/cpu/plan.py). Without the
        # kernels only a model past the float32 copy's limit is read so, its layers kept compact; a smaller one
        # keeps the dense layers transformers made, whose layouts serve a few rows faster.
        quantized_checkpoint.gguf_layers(model, checkpoint.gguf, checkpoint.gguf_types)
    if not fallback_reason:  # faster decode steps; the rewrites target decoder layers
        windows.mark_windows(model)
    fusion.apply(model, checkpoint.verdicts)
    return model


def _linear_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's linear layers' weights in float32."""
    return sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))


def _encoder_model(checkpoint: _Checkpoint, task: Task, dtype: torch.dtype) -> torch.nn.Module:
    """An embedding model or a classifier (a cross-encoder)."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    # Encoders and classifiers never run a generation step: they keep their own attention (and its
    # bidirectional masks) instead of the engine's KV-cache attention.
    auto_class = AutoModelForSequenceClassification if task == "classify" else AutoModel
    model = auto_class.from_pretrained(checkpoint.folder, dtype=dtype, attn_implementation="sdpa",
                                       trust_remote_code=checkpoint.config.trust_remote_code,
                                       **checkpoint.placement)
    model.eval()
    model.requires_grad_(False)
    return model


def _prepare_for_platform(checkpoint: _Checkpoint, loading: _Loading, dtype: torch.dtype,
                          gguf_blocks: bool) -> tuple[torch.dtype, bool]:
    """A text generator on the CPU fast paths gets the native kernels and engine/cpu/plan.py's layouts (read again
    in bfloat16 first where the GGUF block products lose); elsewhere packed layers are expanded. Returns the dtype
    served and whether outputs are batch invariant."""
    config, verdicts = checkpoint.config, checkpoint.verdicts
    invariant = config.batch_invariant is True
    # Never on CUDA, real or simulated.
    if loading.task == "generate" and checkpoint.platform.cpu_fast_paths and loading.vision is None:
        cpu_plan.load_kernels(config, dtype, verdicts)
        if gguf_blocks and not cpu_plan.gguf_blocks_win(loading.model, verdicts):
            dtype, loading.model = torch.bfloat16, None  # the float32 copy goes before the bfloat16 one loads
            loading.model = loading.causal_lm(dtype)
            cpu_plan.load_kernels(config, dtype, verdicts)
        refused = cpu_plan.unsupported_activations(config)
        if refused:
            raise ModelLoadError(refused)
        invariant = cpu_plan.apply(loading.model, dtype, config, from_gguf=checkpoint.gguf is not None,
                                   verdicts=verdicts)
    elif packed_linear.layers(loading.model):  # no native kernels on this path: the same weights, expanded
        packed_linear.apply(loading.model, None)
    return dtype, invariant


def _loaded_model(checkpoint: _Checkpoint, loading: _Loading, dtype: torch.dtype, invariant: bool,
                  started: float) -> LoadedModel:
    """The LoadedModel: the model with its pooling, length limit and engine Tokenizer."""
    config, model, vision = checkpoint.config, loading.model, loading.vision
    pooling = pooling_config(checkpoint.folder, model.config, loading.task, config.pooling_type,
                             config.embedding_normalize)

    limit = _model_max_len(model.config.get_text_config())
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ModelLoadError(f"MAX_MODEL_LEN={config.max_model_len} exceeds the model's limit of {limit} tokens")
    max_model_len = config.max_model_len or limit
    vocab_size = model.get_input_embeddings().num_embeddings
    chat_template = config.chat_template or (vision.chat_template if vision is not None else None)
    tokenizer = Tokenizer(loading.hf_tokenizer, chat_template, _eos_ids(loading.hf_tokenizer, model), vocab_size)
    platform = checkpoint.platform
    log.info("loaded %s on %s (%s, max_model_len %d, task %s, pooling %s%s from %s) in %.1f s", checkpoint.name,
             platform.name, str(dtype).removeprefix("torch."), max_model_len, loading.task, pooling.pooling_type,
             " normalized" if pooling.normalize else "", pooling.source, time.perf_counter() - started)
    return LoadedModel(model, tokenizer, checkpoint.device, dtype, max_model_len, checkpoint.name,
                       _generation_defaults(model), loading.task, pooling, loading.fallback_reason, platform,
                       checkpoint.verdicts, invariant, vision)


_CROSS_ATTENTION_VISION = ("mllama",)


def _vision_model(folder: Path, model_config, config: EngineConfig, dtype: torch.dtype, placement: dict,
                  verdicts):
    """A vision-language model as served, its processor, and why it runs on the fallback loop (None: the paged
    engine runs its decoder, engine/vision/encoder.py). The fallback loop runs the whole model's forward (vision
    tower, projector and text decoder, with the family's own position handling such as multimodal rotary
    positions) on a prompt with images, then decodes with transformers' cache. A paged decoder gets its fused
    projections (for the compact forward); the native kernels and weight layouts are not applied to
    vision-language models."""
    from transformers import AutoModelForImageTextToText

    if getattr(model_config, "model_type", None) in _CROSS_ATTENTION_VISION:
        raise ModelLoadError("cross-attention vision models (mllama) are not supported: their image masks must be "
                             "carried into every decode step, which the fallback loop does not do")
    if config.tokenizer:
        raise ModelLoadError("TOKENIZER_NAME cannot replace a vision-language model's tokenizer: its processor "
                             "places the image tokens with its own")
    processor = load_processor(folder, model_config, config.trust_remote_code)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype, trust_remote_code=config.trust_remote_code,
                                                        **placement)
    model.eval()
    model.requires_grad_(False)
    refusal = paged_vision_refusal(model_config)
    if refusal is not None:
        return model, VisionProcessor(processor, dtype), refusal
    # The paged engine runs the decoder (with its attention); the vision tower keeps transformers' own.
    view = text_view(model)
    view.model.set_attn_implementation(attention.ATTENTION_IMPLEMENTATION)
    windows.mark_windows(view.model)  # the decoder: its modeling module is the one that builds windowed masks
    fusion.apply(view, verdicts)  # fused projections, which the compact forward takes
    encoder = ImageEncoder(model)
    return view, VisionProcessor(processor, dtype, encoder), None


def _quantization(config: EngineConfig, model_config, gguf: Path | None, task: Task,
                  device: torch.device) -> str | None:
    """The quantization method to serve with (QUANTIZATION checked against the checkpoint), or None."""
    method = quantized_checkpoint.resolve(config.quantization, model_config, gguf)
    if method is None:
        return None
    if task != "generate" and method != "gguf":
        raise quantized_checkpoint.QuantizationError(f"{method} checkpoints serve text generation only; this "
                                                     f"model's task is {task}")
    if method in quantized_checkpoint.LOAD_TIME_METHODS and device.type != "cpu":
        raise quantized_checkpoint.QuantizationError(f"QUANTIZATION={method} runs on CPU only (this worker runs on "
                                                     f"{device.type})")
    log.info("quantization: %s (%s)", method, "QUANTIZATION" if config.quantization else "detected from the checkpoint")
    return method


def _fallback_reason(model_config) -> str | None:
    """Why the paged engine cannot run a model of this configuration (see engine/core/fallback.py), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except KeyError:  # remote code or an unknown architecture: the paged path is tried, its probe decides
        return None
    return fallback.paged_path_refusal(model_class)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."
