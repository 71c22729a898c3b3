"""Tiny random vision-language models built from transformers' config classes, each saved with a processor
assembled from the embedded model's tokenizer (its image tokens added as special tokens), the family's image
processor at a small size (the PIL backend: no torchvision), and a chat template that places the image tokens.
The Qwen VL families' and SmolVLM 2's processors are saved as transformers saves them without their video
processor (it needs torchvision, which this CPU install does not have), and Mistral 3's processor files are
written from their parts (PixtralProcessor needs torchvision too), so AutoProcessor cannot load these folders, as
it cannot load the real ones here: the worker has to load them without it.
Random weights say gibberish, but deterministically under greedy."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
import transformers

# A chat template in the processors' style: content is a list of parts, {"type": "image"} marks an image.
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
            "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ IMAGE }}"
            "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0)
_MEAN = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def _tokenizer(tokenizer_folder: Path, tokens: list[str]):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_folder)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    return tokenizer


def _vocab(tokenizer) -> int:
    return (len(tokenizer) + 63) // 64 * 64


def _llava(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, ["<image>"])
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=transformers.LlamaConfig(
        vocab_size=_vocab(tok), **_TEXT), image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1)
    images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                **_MEAN)
    processor = transformers.LlavaProcessor(images, tok, patch_size=14, vision_feature_select_strategy="default",
                                            num_additional_image_tokens=1, image_token="<image>",
                                            chat_template=TEMPLATE.replace("IMAGE", "'<image>'"))
    return transformers.LlavaForConditionalGeneration(config), processor


def _llava_next(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, ["<image>"])
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)
    pinpoints = [[28, 28], [28, 56], [56, 28]]
    config = transformers.LlavaNextConfig(vision_config=vision, text_config=transformers.LlamaConfig(
        vocab_size=_vocab(tok), **_TEXT), image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1, image_grid_pinpoints=pinpoints)
    images = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                     image_grid_pinpoints=pinpoints, **_MEAN)
    processor = transformers.LlavaNextProcessor(images, tok, patch_size=14, vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1, image_token="<image>",
                                                chat_template=TEMPLATE.replace("IMAGE", "'<image>'"))
    return transformers.LlavaNextForConditionalGeneration(config), processor


def _idefics3(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, ["<fake_token_around_image>", "<image>", "<global-img>"])
    vision = transformers.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=28, patch_size=7)
    config = transformers.Idefics3Config(vision_config=vision, text_config=transformers.LlamaConfig(
        vocab_size=_vocab(tok), **_TEXT), image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    images = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 28}, max_image_size={"longest_edge": 28},
                                                    do_image_splitting=False, **_MEAN)
    processor = transformers.Idefics3Processor(images, tok, image_seq_len=4,
                                               chat_template=TEMPLATE.replace("IMAGE", "'<image>'"))
    return transformers.Idefics3ForConditionalGeneration(config), processor


def _gemma3(tokenizer_folder):
    names = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_folder, extra_special_tokens=names)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=28, patch_size=7)
    text = transformers.Gemma3TextConfig(vocab_size=_vocab(tok), **_TEXT, initializer_range=0.5,
                                         layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    config = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                                       image_token_id=tok.image_token_id, boi_token_id=tok.boi_token_id,
                                       eoi_token_id=tok.eoi_token_id, initializer_range=0.5)
    images = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, **_MEAN)
    processor = transformers.Gemma3Processor(images, tok, image_seq_length=4,
                                             chat_template=TEMPLATE.replace("IMAGE", "'<start_of_image>'"))
    return transformers.Gemma3ForConditionalGeneration(config), processor


def _paligemma(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, ["<image>"])
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=28, patch_size=14, projection_dim=64)
    text = transformers.GemmaConfig(vocab_size=_vocab(tok), **_TEXT, initializer_range=0.5)
    config = transformers.PaliGemmaConfig(vision_config=vision, text_config=text,
                                          image_token_id=tok.convert_tokens_to_ids("<image>"), projection_dim=64)
    config.vision_config.projection_dim = 64
    images = transformers.SiglipImageProcessorPil(size={"height": 28, "width": 28}, **_MEAN)
    images.image_seq_length = 4
    processor = transformers.PaliGemmaProcessor(images, tok, chat_template=TEMPLATE.replace("IMAGE", "'<image>'"))
    return transformers.PaliGemmaForConditionalGeneration(config), processor


_QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_QWEN_TEMPLATE = TEMPLATE.replace("IMAGE", "'<|vision_start|><|image_pad|><|vision_end|>'")


def images_only(base):
    """A processor class (Qwen's, SmolVLM's) without its video processor (which needs torchvision): the test's own
    way to build and load the family's processor (image processor, tokenizer, chat template), for the folders and
    for the reference `generate` runs."""
    signature = inspect.signature(base.__init__)
    signature = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "video_processor"])
    settings = list(signature.parameters)

    class ImagesOnly(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        __init__.__signature__ = signature  # saving writes the settings __init__'s signature names

        @staticmethod
        def validate_init_kwargs(processor_config, valid_kwargs):  # saved settings reach __init__'s **kwargs
            return base.validate_init_kwargs(processor_config, [*valid_kwargs, *settings])
    ImagesOnly.__name__ = base.__name__
    return ImagesOnly


def _qwen_text(tok):
    # Multimodal rotary positions: the head's 8 frequency pairs split over time, height and width. Weights of
    # 0.5 spread (as Gemma's and Mistral's here): at the default 0.02 the attention is so even that the tokens and
    # logprobs hardly depend on the positions, and wrong rotary positions would go unseen.
    return dict(vocab_size=_vocab(tok), **{**_TEXT, "max_position_embeddings": 1024}, initializer_range=0.5,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 4]})


def _qwen_images():
    # Up to 640x640 pixels, so a large picture has more image tokens than its 512-pixel `detail: low` view.
    return transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=640 * 640, patch_size=14,
                                                 merge_size=2, temporal_patch_size=2, **_MEAN)


def _qwen_ids(tok) -> dict:
    return dict(image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
                vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
                vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))


def _qwen2_vl(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, _QWEN_TOKENS)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = transformers.Qwen2VLConfig(vision_config=vision, text_config=_qwen_text(tok), **_qwen_ids(tok))
    processor = images_only(transformers.Qwen2VLProcessor)(_qwen_images(), tok, chat_template=_QWEN_TEMPLATE)
    return transformers.Qwen2VLForConditionalGeneration(config), processor


def _qwen2_5_vl(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, _QWEN_TOKENS)
    # Window attention in the vision tower: block 0 attends within 56-pixel windows, block 1 over the image.
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=_qwen_text(tok), **_qwen_ids(tok))
    processor = images_only(transformers.Qwen2_5_VLProcessor)(_qwen_images(), tok,
                                                                    chat_template=_QWEN_TEMPLATE)
    return transformers.Qwen2_5_VLForConditionalGeneration(config), processor


def _qwen3_vl(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, _QWEN_TOKENS)
    # Deepstack: the first block's features are also added into the decoder's first layer at the image positions.
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    text = _qwen_text(tok)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                               "mrope_interleaved": True}
    config = transformers.Qwen3VLConfig(vision_config=vision, text_config=text, **_qwen_ids(tok))
    images = transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 32 * 32 * 4, "longest_edge": 640 * 640},
                                                   patch_size=16, merge_size=2, temporal_patch_size=2, **_MEAN)
    processor = images_only(transformers.Qwen3VLProcessor)(images, tok, chat_template=_QWEN_TEMPLATE)
    return transformers.Qwen3VLForConditionalGeneration(config), processor


def _smolvlm(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, ["<fake_token_around_image>", "<image>", "<global-img>"])
    vision = transformers.SmolVLMVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=28, patch_size=7)
    config = transformers.SmolVLMConfig(vision_config=vision, text_config=transformers.LlamaConfig(
        vocab_size=_vocab(tok), **_TEXT), image_token_id=tok.convert_tokens_to_ids("<image>"), scale_factor=2)
    # Image splitting on: a picture larger than 28 pixels becomes tiles plus a global view, so the image-token
    # count follows its size.
    images = transformers.SmolVLMImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28},
                                                   do_image_splitting=True, **_MEAN)
    processor = images_only(transformers.SmolVLMProcessor)(images, tok, image_seq_len=4,
                                                           chat_template=TEMPLATE.replace("IMAGE", "'<image>'"))
    return transformers.SmolVLMForConditionalGeneration(config), processor


class _PixtralFolder:
    """What a Mistral 3 checkpoint's folder holds for its processor: the image processor's and tokenizer's files,
    processor_config.json (PixtralProcessor's settings) and the chat template. transformers' PixtralProcessor
    cannot be imported without torchvision in 5.23, so the files are written from their parts."""

    def __init__(self, images, tokenizer, settings: dict, chat_template: str):
        self.images, self.tokenizer, self.settings, self.chat_template = images, tokenizer, settings, chat_template

    def save_pretrained(self, folder: Path) -> None:
        self.images.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        (Path(folder) / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor",
                                                                        **self.settings}, indent=2))
        (Path(folder) / "chat_template.jinja").write_text(self.chat_template)


def _mistral3(tokenizer_folder):
    tok = _tokenizer(tokenizer_folder, ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=56, patch_size=7, head_dim=16)
    text = transformers.MistralConfig(vocab_size=_vocab(tok), **_TEXT, initializer_range=0.5)
    config = transformers.Mistral3Config(vision_config=vision, text_config=text, spatial_merge_size=2,
                                         image_token_index=tok.convert_tokens_to_ids("[IMG]"))
    images = transformers.PixtralImageProcessorPil(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14},
                                                   **_MEAN)
    settings = {"patch_size": 7, "spatial_merge_size": 2, "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]",
                "image_end_token": "[IMG_END]"}
    processor = _PixtralFolder(images, tok, settings, TEMPLATE.replace("IMAGE", "'[IMG]'"))
    return transformers.Mistral3ForConditionalGeneration(config), processor


class PixtralReference:
    """Mistral 3's processor for the reference runs, written in the test from transformers' parts (PixtralProcessor
    needs torchvision here): transformers' PIL image processor and tokenizer, and each [IMG] placeholder expanded
    into Pixtral's id grid by hand: a row of [IMG] ids per row of merged patches, each row closed by [IMG_BREAK],
    the last by [IMG_END]."""

    def __init__(self, folder: Path):
        self.image_processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        settings = json.loads((Path(folder) / "processor_config.json").read_text())
        self.side = settings["patch_size"] * settings["spatial_merge_size"]
        self.chat_template = (Path(folder) / "chat_template.jinja").read_text()
        self.ids = [self.tokenizer.convert_tokens_to_ids(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]")]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=tokenize,
                                                  add_generation_prompt=add_generation_prompt)

    def __call__(self, text, images, return_tensors="pt", add_special_tokens=False):
        image, brk, end = self.ids
        pixels = self.image_processor(images[0], patch_size={"height": self.side, "width": self.side},
                                      return_tensors="pt")
        pieces = text[0].split("[IMG]")
        ids = self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
        for piece, (height, width) in zip(pieces[1:], pixels["image_sizes"].tolist()):
            grid = ([image] * (width // self.side) + [brk]) * (height // self.side)
            grid[-1] = end
            ids += grid + self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([ids])
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
                "pixel_values": pixels["pixel_values"], "image_sizes": pixels["image_sizes"]}


FAMILIES = {"llava": _llava, "llava_next": _llava_next, "idefics3": _idefics3, "gemma3": _gemma3,
            "paligemma": _paligemma, "smolvlm": _smolvlm, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl,
            "qwen3_vl": _qwen3_vl, "mistral3": _mistral3}


def build(family: str, tokenizer_folder: Path, folder: Path) -> Path:
    """The family's tiny model and processor saved to `folder` (a MODEL_NAME the worker loads)."""
    torch.manual_seed(0)
    model, processor = FAMILIES[family](tokenizer_folder)
    model.eval()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def reference_processor(folder: Path):
    """transformers' processor for a saved folder, as a reference run loads it: AutoProcessor, except for the
    Qwen families, whose AutoProcessor needs torchvision for the video processor."""
    model_type = transformers.AutoConfig.from_pretrained(folder).model_type
    if model_type == "qwen2_vl":
        return images_only(transformers.Qwen2VLProcessor).from_pretrained(folder, backend="pil")
    if model_type == "qwen2_5_vl":
        return images_only(transformers.Qwen2_5_VLProcessor).from_pretrained(folder, backend="pil")
    if model_type == "qwen3_vl":
        return images_only(transformers.Qwen3VLProcessor).from_pretrained(folder, backend="pil")
    if model_type == "smolvlm":
        return images_only(transformers.SmolVLMProcessor).from_pretrained(folder, backend="pil")
    if model_type == "mistral3":
        return PixtralReference(folder)
    return transformers.AutoProcessor.from_pretrained(folder, backend="pil")
