"""Mistral 3's (Pixtral's) processor without torchvision. transformers 5.23 marks its PixtralProcessor as needing
torchvision (its module imports the torchvision image processor for a token-count helper), so on this CPU
install the class cannot even be imported. This stands in for it with the same saved settings
(processor_config.json: patch_size, spatial_merge_size and the three image tokens), transformers' PIL image
processor (PixtralImageProcessorPil, which resizes each picture to whole patches of patch_size x
spatial_merge_size pixels and reports its size) and transformers' processor machinery (tokenising, placeholder
replacement, the mismatch errors); only the placeholder's expansion is written here: an image is a grid of
[IMG] tokens, one per merged patch, each row closed by [IMG_BREAK] and the last by [IMG_END] instead."""
from __future__ import annotations

from transformers.processing_utils import ProcessorMixin


class PixtralImagesProcessor(ProcessorMixin):
    def __init__(self, image_processor=None, tokenizer=None, patch_size: int = 16, spatial_merge_size: int = 1,
                 chat_template=None, image_token: str = "[IMG]", image_break_token: str = "[IMG_BREAK]",
                 image_end_token: str = "[IMG_END]", **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.patch_size = patch_size
        self.spatial_merge_size = spatial_merge_size
        self.image_token = image_token
        self.image_break_token = image_break_token
        self.image_end_token = image_end_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token)

    def _process_images(self, images, **images_kwargs):
        # One [IMG] token stands for a merged patch: the picture is resized to whole merged patches.
        images_kwargs["patch_size"] = self.patch_size * self.spatial_merge_size
        return super()._process_images(images, **images_kwargs)

    def replace_image_token(self, image_inputs: dict, image_idx: int, **kwargs) -> str:
        side = self.patch_size * self.spatial_merge_size
        height, width = (int(v) for v in image_inputs["image_sizes"][image_idx])
        rows = [self.image_token * (width // side) + self.image_break_token] * (height // side)
        rows[-1] = rows[-1][: -len(self.image_break_token)] + self.image_end_token
        return "".join(rows)

    @property
    def model_input_names(self):
        return self.tokenizer.model_input_names + ["pixel_values", "image_sizes"]
