"""Images for vision-language models: decoding `data:` URLs and fetched bytes into pictures (images.py), fetching
http(s) URLs safely (fetch.py), and the model's processor turning a rendered prompt and its pictures into the
token ids and pixel tensors the engine runs (processor.py). Nothing here knows the OpenAI JSON shapes."""
from engine.vision.fetch import fetch_image_bytes, load_image
from engine.vision.images import ImageError, MediaLimits, decode_data_url, decode_image
from engine.vision.processor import ImageInputs, ImagePlacementError, VisionProcessor, is_vision_config

__all__ = ["ImageError", "ImageInputs", "ImagePlacementError", "MediaLimits", "VisionProcessor", "decode_data_url", "decode_image",
           "fetch_image_bytes", "is_vision_config", "load_image"]
