"""A vision-language model's processor: a rendered prompt and its pictures become the prompt's token ids (each
image placeholder expanded into the family's image tokens) and the tensors the model's forward takes with them
(pixel values, image sizes, patch masks, token types). The processor is transformers' own (AutoProcessor,
the PIL image backend), so the tokens and pixels are the ones `generate` would be given."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

# Processor outputs that are the prompt itself or that the fallback loop builds for itself.
_NOT_MODEL_INPUTS = ("input_ids", "attention_mask", "labels")


def is_vision_config(model_config) -> bool:
    """Whether a configuration is an image-text-to-text model transformers loads with
    AutoModelForImageTextToText (a vision tower beside a text decoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(model_config, "vision_config", None) is not None
            and getattr(model_config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


class ImagePlacementError(ValueError):
    """The rendered prompt's image placeholders and the request's images do not pair up (a template that drops
    images, or text that spells an image token)."""


@dataclass
class ImageInputs:
    """What the engine needs besides the prompt's token ids to run a prompt with images: the model's extra
    forward inputs (for one row), and each image's content hash (what a cache keys the image tokens by)."""
    tensors: dict[str, torch.Tensor]
    image_hashes: list[str] = field(default_factory=list)

    def to(self, device) -> "ImageInputs":
        return ImageInputs({k: v.to(device) for k, v in self.tensors.items()}, self.image_hashes)


def image_hash(image) -> str:
    """A picture's content hash: its size, mode and pixels (not its encoding, so the same picture sent as PNG
    and as a fetched URL hashes alike)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class VisionProcessor:
    """The served model's processor, as the API layer uses it (from a worker thread: it is CPU work)."""

    def __init__(self, processor, model_dtype: torch.dtype):
        self.hf = processor
        self.dtype = model_dtype
        self.chat_template = getattr(processor, "chat_template", None)

    def prepare(self, text: str, images: list, add_special_tokens: bool = False
                ) -> tuple[list[int], ImageInputs | None]:
        """The token ids of `text` (already rendered by the chat template, one placeholder per image) with the
        image tokens expanded, and the images' model inputs."""
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
        return ids, ImageInputs(tensors, [image_hash(image) for image in images])
