"""Tiny random vision-language models built from transformers' config classes, each saved with a processor
assembled from the embedded model's tokenizer (its image tokens added as special tokens), the family's image
processor at a small size (the PIL backend: no torchvision), and a chat template that places the image tokens.
Qwen2-VL's and Pixtral's (Mistral 3) processors need torchvision in transformers 5.23, which this CPU install
does not have, so they are not built here.
Random weights say gibberish, but deterministically under greedy."""
from __future__ import annotations

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


FAMILIES = {"llava": _llava, "llava_next": _llava_next, "idefics3": _idefics3, "gemma3": _gemma3, "paligemma": _paligemma}


def build(family: str, tokenizer_folder: Path, folder: Path) -> Path:
    """The family's tiny model and processor saved to `folder` (a MODEL_NAME the worker loads)."""
    torch.manual_seed(0)
    model, processor = FAMILIES[family](tokenizer_folder)
    model.eval()
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
