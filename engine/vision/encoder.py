"""Vision-language models whose text decoder the paged engine runs: the decoder seen as a causal LM of its own,
and the image encoder that turns a prompt's images into the embedding rows of its image-token positions.

A family qualifies when its images enter the decoder only as embeddings scattered into the image-token
positions and the decoder's attention over them is causal (LLaVA, LLaVA-NeXT, Idefics3 and Mistral 3 over a
Llama-like decoder; Qwen2-VL and Qwen2.5-VL, whose decoder takes multimodal rotary positions). Others run on the
fallback loop with the whole model's forward: Gemma 3 and PaliGemma attend bidirectionally over an image, Qwen3-VL
adds vision features into its decoder's first layers.

Multimodal rotary positions (mrope) give each token three components (time, height, width). The model's own
forward computes them for a prompt (its get_rope_index), and the stop below captures them with the embeddings;
after the prompt every token's three components are its index plus the prompt's constant shift (`rope_delta`),
which is where the runner puts decode steps and text-only prompts (a shift of 0).

The encoder runs the model's own multimodal forward up to the decoder (vision tower, projector, the family's
scatter of the features into the prompt's embeddings) and stops there, so the rows are exactly those
transformers' forward would feed the decoder (the decoder's place in it is taken by a stop). It runs on the caller's thread (the API layer's worker thread),
not the engine's, so one request's images never hold up other requests' steps.
"""
from __future__ import annotations

import hashlib

import torch

PAGED_FAMILIES = ("llava", "llava_next", "idefics3", "smolvlm", "mistral3", "qwen2_vl", "qwen2_5_vl")
_PAGED_DECODERS = ("llama", "mistral", "qwen2", "qwen3", "qwen2_vl_text", "qwen2_5_vl_text")


def paged_vision_refusal(model_config) -> str | None:
    """Why a vision-language model's decoder cannot run on the paged engine, or None when it can."""
    family = getattr(model_config, "model_type", None)
    decoder = getattr(model_config.get_text_config(), "model_type", None)
    if family not in PAGED_FAMILIES:
        return (f"a vision-language model ({family}) whose images need more than embeddings in a causal decoder; "
                f"the whole model's forward runs on prompts with images")
    if decoder not in _PAGED_DECODERS:
        return f"a vision-language model whose decoder ({decoder}) is not one the paged path serves with images"
    return None


def decoder_of(model) -> torch.nn.Module:
    """The text decoder inside a vision-language model (`language_model`, or Idefics3's `text_model`)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def text_view(model) -> torch.nn.Module:
    """The model's decoder and head as a causal LM of the decoder's own class, sharing their weights (built on
    the meta device, then given the real modules), for the paged engine to run; a DecoderWithHead where the
    decoder's configuration has no causal-LM class (the Qwen VL text decoders)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text_config = model.config.get_text_config()
    if type(text_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return DecoderWithHead(decoder_of(model), model.lm_head, model.generation_config).eval()
    with torch.device("meta"):
        view = AutoModelForCausalLM.from_config(text_config)
    view.model = decoder_of(model)
    view.lm_head = model.lm_head
    view.config = view.model.config
    view.generation_config = model.generation_config
    view.eval()
    return view


class DecoderWithHead(torch.nn.Module):
    """A text decoder and the head over its last hidden states, called as a causal LM is (the runner's
    keywords: input_ids or inputs_embeds, position_ids, the cache, logits_to_keep)."""

    def __init__(self, decoder: torch.nn.Module, head: torch.nn.Module, generation_config):
        super().__init__()
        self.model = decoder
        self.lm_head = head
        self.config = decoder.config
        self.generation_config = generation_config

    @property
    def base_model(self) -> torch.nn.Module:  # the decoder, as transformers' models name it (pooling reads it)
        return self.model

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, past_key_values=None,
                use_cache=None, logits_to_keep=0, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
                         past_key_values=past_key_values, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), past_key_values=out.past_key_values)


class _Captured(Exception):
    def __init__(self, embeds: torch.Tensor, position_ids: torch.Tensor | None):
        self.embeds = embeds
        self.position_ids = position_ids


class _StopAtDecoder(torch.nn.Module):
    """Stands in for the decoder inside the multimodal model: it lends the decoder's embedding table (the
    multimodal forward embeds the prompt with it) and stops the forward where the decoder would start. The
    paged engine holds the decoder itself (text_view), so its steps never come here, and the decoder keeps no
    hooks (which would keep the engine off its compact forward)."""

    def __init__(self, decoder: torch.nn.Module):
        super().__init__()
        self._decoder = [decoder]  # a plain list: not a submodule, its weights stay the decoder's alone

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._decoder[0].get_input_embeddings()

    def forward(self, *args, inputs_embeds=None, position_ids=None, **kwargs):
        raise _Captured(inputs_embeds, position_ids)


class ImageEncoder:
    """A prompt's image rows: the embeddings its image-token positions take, from the whole model's own
    multimodal forward, stopped where the decoder would start. Take the decoder (text_view) before making
    one: the model's decoder is replaced by the stop."""

    def __init__(self, model):
        self.model = model
        self.image_token_id = getattr(model.config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = model.config.image_token_index
        inner = model.model
        name = "language_model" if hasattr(inner, "language_model") else "text_model"
        setattr(inner, name, _StopAtDecoder(getattr(inner, name)))

    @torch.inference_mode()
    def encode(self, ids: list[int], tensors: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(positions, rows, rotary): the prompt positions holding image tokens, the embeddings they take, and
        for a multimodal-rotary decoder the prompt's [3, tokens] rotary positions (None for 1-D positions)."""
        device = self.model.device
        input_ids = torch.tensor([ids], device=device)
        try:
            self.model.model(input_ids=input_ids, **{k: v.to(device) for k, v in tensors.items()})
        except _Captured as captured:
            embeds, position_ids = captured.embeds, captured.position_ids
        else:
            raise RuntimeError("the vision-language model never reached its decoder")
        mask = input_ids[0] == self.image_token_id
        rotary = None
        if position_ids is not None and position_ids.dim() == 3:
            # [3, 1, tokens] (time, height, width); a leading row of 1-D text positions, where given, is not rotary.
            rotary = position_ids[-3:, 0].cpu()
        return mask.nonzero().flatten().cpu(), embeds[0][mask].detach(), rotary


def row_keys(rows: torch.Tensor) -> list[int]:
    """A prefix-cache key for each image row, from its content: negative, so never a token id; the same image
    (the same rows) gives the same keys, a different one different keys."""
    data = rows.float().cpu().numpy()
    return [-1 - int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=7).digest(), "little") for row in data]
