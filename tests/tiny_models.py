"""Tiny random models built on the spot, saved with the embedded model's tokenizer (or a BPE tokenizer trained
here): one per transformers family for the family tests, a small Llama for the source and template tests, a
Llama whose weights are exact GGUF blocks. Random weights say gibberish, but deterministically under greedy."""
from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import torch
import transformers

from engine import SamplingParams


VOCAB = 49152  # the embedded model's tokenizer


WINDOW = 12  # sliding windows shorter than the longer prompts


NEW_TOKENS = 10


_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)


_MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


# model_type -> config overrides (on top of _SMALL). Sliding-window families get a window shorter than the prompts.
FAST_FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      sliding_window=WINDOW, use_sliding_window=True, max_window_layers=2),
    "qwen3": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma": {},
    "gemma2": dict(sliding_window=WINDOW, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "cohere": {},
    "cohere2": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "phi": {},
    "phi3": {},
    "starcoder2": dict(sliding_window=WINDOW),
    "gpt2": {},
    "gpt_bigcode": {},
    "gpt_neox": {},
    "olmo": {},
    "olmo2": {},
    "stablelm": {},
    "granite": {},
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(num_key_value_heads=4, head_dim=None, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1),
    "deepseek_v3": dict(num_key_value_heads=4, head_dim=None, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                        n_group=1, topk_group=1),
    "gpt_oss": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                    num_experts_per_tok=2),
    "smollm3": {},
    "glm": {},
    "glm4": {},
    "helium": {},
    "ministral": dict(sliding_window=WINDOW),
    "exaone4": dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64),
    "biogpt": {},
}


# Families with recurrent or convolution layers (state-space, linear attention, short convolutions; all but Mamba
# next to attention layers): the paged engine keeps each sequence's state in a slot of its own.
HYBRID_FAMILIES: dict[str, dict] = {
    "mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8, head_dim=None),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, num_experts_per_tok=1, mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2,
                  head_dim=None),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "lfm2": dict(layer_types=["conv", "full_attention"], block_ff_dim=96, head_dim=None),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
                             mamba_n_groups=1, num_local_experts=2, num_experts_per_tok=1, head_dim=None),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=8, n_groups=1, expand=2),
    "falcon_mamba": dict(state_size=8, expand=2, conv_kernel=4, time_step_rank=8, head_dim=None),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                  head_dim=None),
    "falcon_h1": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_d_ssm=128),
    "nemotron_h": dict(hybrid_override_pattern="M*", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8,
                       n_groups=1, layers_block_type=None),
    # one attention block shared by the hybrid layers
    "zamba2": dict(mamba_d_state=8, mamba_headdim=16, mamba_ngroups=1, n_mamba_heads=8, num_hidden_layers=4,
                   layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
                   hybrid_layer_ids=[1, 3], num_mem_blocks=1, head_dim=None),
    # Zamba 1: its shared block is tied from layer 2, the first hybrid layer it expects
    "zamba": dict(mamba_d_state=8, mamba_dt_rank=8, mamba_expand=2, n_mamba_heads=2, num_hidden_layers=6,
                  attn_layer_period=3, attn_layer_offset=2, head_dim=None),
}


MAMBA1_FAMILIES = {"mamba", "falcon_mamba", "jamba", "zamba"}  # their scan restarts from zero: prompts prefill whole


# Families whose attention does not dispatch through transformers' AttentionInterface: the fallback path.
FALLBACK_FAMILIES: dict[str, dict] = {
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None),
    "gptj": dict(rotary_dim=8, head_dim=None),
    "codegen": dict(rotary_dim=8, head_dim=None),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW, head_dim=None),
    "bloom": dict(head_dim=None),
    "mpt": dict(head_dim=None),
    "xglm": dict(head_dim=None),
}


def build_model(model_type: str, overrides: dict, folder, tokenizer_folder):
    """A tiny random model of this family saved to `folder`; its weights are drawn wide enough that greedy
    choices are decisive (a random model at the usual 0.02 scale has nearly flat logits)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {key: value for key, value in {**_SMALL, **overrides}.items() if value is not None}
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    for f in tokenizer_folder.iterdir():
        shutil.copy(f, folder / f.name)
    return model


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, VOCAB) for _ in range(n)] for n in (5, 23, 70)]


def reference(model, ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def family_greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, n=n)


def build_small_model(folder: Path, *, chat_template: str | None = None) -> Path:
    """A randomly initialised Llama (2 layers, about 18 MB of float32 weights, so the S3 transfer of its weights
    file goes in several parts) with a byte-level BPE tokenizer trained here. Its text is gibberish, but it is a
    real model: transformers loads it and the engine generates from it, deterministically under greedy decoding."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The capital of France is Paris.", "Hello world, small models say odd things.",
              "Templates render messages into prompts; {{ braces }} stay text.", "One two three four five six."]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                           unk_token="<unk>")
    if chat_template is not None:
        hf_tokenizer.chat_template = chat_template

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=384, intermediate_size=1536,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Float32 weights as transformers expands Q4_1 blocks: fl(fl(q * d) + m), d and m half-precision."""
    gen = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    q = torch.randint(0, 16, (out_features, blocks, 32), generator=gen).float()
    d = (torch.rand(out_features, blocks, 1, generator=gen) * 0.02).half().float()
    m = (-torch.rand(out_features, blocks, 1, generator=gen) * 0.1).half().float()
    q[:, :, 0], q[:, :, 1] = 0, 15  # Q4_1 maps each block's minimum to 0 and its maximum to 15
    return (q * d + m).view(out_features, in_features)


def q8_0_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Float32 weights as transformers expands Q8_0 blocks: fl(q * d), d half-precision."""
    gen = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    q = torch.randint(-127, 128, (out_features, blocks, 32), generator=gen).float()
    q[:, :, 0] = 127  # Q8_0 maps each block's largest magnitude to 127 steps
    d = (torch.rand(out_features, blocks, 1, generator=gen) * 0.01).half().float()
    return (q * d).view(out_features, in_features)


def tiny_llama(exact_blocks: bool) -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    if exact_blocks:
        for i, module in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
            module.weight.data = q4_1_weight(*module.weight.shape, seed=i)
    return model
