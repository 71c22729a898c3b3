"""A vision-language model's processor: a rendered prompt and its pictures become the prompt's token ids (each
image placeholder expanded into the family's image tokens) and the tensors the model's forward takes with them
(pixel values, image sizes, patch masks, token types). The processor is transformers' own (AutoProcessor,
the PIL image backend; for the families whose processor needs torchvision, see load_processor), so the tokens
and pixels are the ones `generate` would be given."""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.vision.encoder import row_keys

# Processor outputs that are the prompt itself or that the fallback loop builds for itself.
_NOT_MODEL_INPUTS = ("input_ids", "attention_mask", "labels")


def is_vision_config(model_config) -> bool:
    """Whether a configuration is an image-text-to-text model transformers loads with
    AutoModelForImageTextToText (a vision tower beside a text decoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(model_config, "vision_config", None) is not None
            and getattr(model_config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


# Processors that need torchvision in transformers 5.23 (not in this CPU install), loaded without it. The Qwen VL
# families' and SmolVLM 2's also hold a video processor (the torchvision part): they are loaded as their own class
# without that attribute, so the image processor (PIL backend), the tokenizer and the image-token expansion stay
# transformers' own; the worker takes no video parts, so nothing it accepts needs the video processor.
# PixtralProcessor (Mistral 3, Pixtral) cannot be imported at all: pixtral.py stands in for it.
_WITHOUT_VIDEO = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "SmolVLMProcessor")


def load_processor(folder, model_config, trust_remote_code: bool = False):
    """The model's processor from its folder, with the PIL image backend (no torchvision)."""
    import transformers

    name = _processor_class_name(Path(folder), getattr(model_config, "model_type", None))
    if name in _WITHOUT_VIDEO:
        return _images_only(getattr(transformers, name)).from_pretrained(folder, backend="pil")
    if name == "PixtralProcessor":
        from engine.vision.pixtral import PixtralImagesProcessor

        return PixtralImagesProcessor.from_pretrained(folder, backend="pil")
    return transformers.AutoProcessor.from_pretrained(folder, backend="pil", trust_remote_code=trust_remote_code)


def _processor_class_name(folder: Path, family: str | None) -> str | None:
    """The processor class AutoProcessor would pick: the folder's processor_config.json names it, else the
    family's default."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    saved = folder / "processor_config.json"
    if saved.is_file():
        try:
            name = json.loads(saved.read_text()).get("processor_class")
        except (ValueError, AttributeError):
            name = None
        if isinstance(name, str):
            return name
    return PROCESSOR_MAPPING_NAMES.get(family)


def _images_only(base: type) -> type:
    """`base` (a processor whose __init__ takes image_processor, tokenizer, video_processor, then its settings)
    without its video processor. transformers builds and loads a processor's parts from its __init__
    parameters, so the subclass's __init__ leaves the video processor out and hands the base None for it; and it
    passes a saved setting (SmolVLM's image_seq_len) only where __init__ names it, so the base's settings are
    named for it."""
    settings = [name for name in inspect.signature(base.__init__).parameters
                if name not in ("self", "video_processor")]

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def validate_init_kwargs(processor_config, valid_kwargs):
        return base.validate_init_kwargs(processor_config, [*valid_kwargs, *settings])

    # The base's name: saving and the processor-class checks go by the class name.
    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__,
                                         "validate_init_kwargs": staticmethod(validate_init_kwargs)})


class ImagePlacementError(ValueError):
    """The rendered prompt's image placeholders and the request's images do not pair up (a template that drops
    images, or text that spells an image token)."""


@dataclass
class ImageInputs:
    """What the engine needs besides the prompt's token ids to run a prompt with images. For the fallback loop:
    the model's extra forward inputs, for one row (pixel values, image sizes, patch masks, token types). For the
    paged engine (encoder.py): the image-token positions, the embedding rows they take, and the prompt's
    prefix-cache keys (its token ids with each image position keyed by its row's content); for a decoder with
    multimodal rotary positions, the prompt's [3, tokens] rotary positions and the shift of every later token's
    (its index plus `rope_delta`, in all three components)."""
    tensors: dict[str, torch.Tensor]
    positions: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    key_ids: list[int] | None = None
    rotary: torch.Tensor | None = None
    rope_delta: int = 0

    def to(self, device) -> "ImageInputs":
        return ImageInputs({k: v.to(device) for k, v in self.tensors.items()}, self.positions, self.rows,
                           self.key_ids, self.rotary, self.rope_delta)

    def rotary_between(self, start: int, end: int) -> torch.Tensor | None:
        """The [3, end - start] rotary positions of sequence positions start..end-1 (the prompt's own, then index
        plus rope_delta for generated tokens a resumed sequence recomputes), or None for 1-D positions."""
        if self.rotary is None:
            return None
        prompt = self.rotary.shape[1]
        inside = self.rotary[:, min(start, prompt):min(end, prompt)]
        if end <= prompt:
            return inside
        later = torch.arange(max(start, prompt), end) + self.rope_delta
        return torch.cat([inside, later.expand(3, -1)], dim=1)

    def rows_between(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The image rows of prompt positions start..end-1, as (offsets from start, rows), or None."""
        if self.positions is None:
            return None
        inside = (self.positions >= start) & (self.positions < end)
        if not bool(inside.any()):
            return None
        return self.positions[inside] - start, self.rows[inside]


class VisionProcessor:
    """The served model's processor, as the API layer uses it (from a worker thread: it is CPU work)."""

    def __init__(self, processor, model_dtype: torch.dtype, encoder=None):
        self.hf = processor
        self.dtype = model_dtype
        self.chat_template = getattr(processor, "chat_template", None)
        self.encoder = encoder  # an encoder.ImageEncoder when the paged engine runs the decoder

    def prepare(self, text: str, images: list, add_special_tokens: bool = False, encode: bool = True
                ) -> tuple[list[int], ImageInputs | None]:
        """The token ids of `text` (already rendered by the chat template, one placeholder per image) with the
        image tokens expanded, and the images' model inputs (not encoded when `encode` is false: counting
        tokens needs no image rows)."""
        if not images:
            encoded = self.hf.tokenizer(text, add_special_tokens=add_special_tokens)
            return list(encoded["input_ids"]), None
        try:
            encoded = self.hf(text=[text], images=[images], return_tensors="pt",
                              add_special_tokens=add_special_tokens)
        except (ValueError, IndexError) as exc:  # placeholders and images do not pair up
            raise ImagePlacementError(f"the images do not fit the rendered prompt: {' '.join(str(exc).split())}"
                                      ) from exc
        ids = encoded["input_ids"][0].tolist()
        tensors = {k: v for k, v in encoded.items() if k not in _NOT_MODEL_INPUTS and isinstance(v, torch.Tensor)}
        tensors = {k: (v.to(self.dtype) if v.is_floating_point() else v) for k, v in tensors.items()}
        if self.encoder is None or not encode:
            return ids, ImageInputs(tensors)
        positions, rows, rotary = self.encoder.encode(ids, tensors)
        key_ids = list(ids)
        for position, key in zip(positions.tolist(), row_keys(rows)):
            key_ids[position] = key
        # The shift after the prompt, as the model's get_rope_index defines it: the token after the prompt takes
        # the largest rotary position plus one.
        delta = int(rotary.max()) + 1 - len(ids) if rotary is not None else 0
        return ids, ImageInputs({}, positions, rows, key_ids, rotary, delta)
