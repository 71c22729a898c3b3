"""A compact forward pass for Llama-shaped decoders on the paged path.

A decode step of a small model on CPU spends a third of its time outside the matrix products: transformers'
layer code goes through decorators, keyword plumbing, config lookups, the attention registry and a cache object
per layer, about 25 Python calls per layer on top of the tensor operations. For the families whose layer is
exactly norm -> q/k/v -> rotary -> attention -> o_proj -> residual -> norm -> MLP -> residual (Llama, Mistral,
Qwen2, Qwen3 and the many checkpoints built on them) this runs the same tensor operations on the same modules
directly, with the rotary embedding applied to queries and keys in one operation. The runner checks it against
the model's own forward through the paged cache at start-up and keeps the model's own forward where the two
differ, so it can only be used where it computes what transformers computes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module

from engine.executor.attention import DecodeAttention, decode_attention, layer_window, paged_attention
from engine.cpu.fusion import gated_mlp_forward
from engine.executor.kv_cache import StepCache

# The model classes whose decoder layers have the structure above (Qwen3 adds a norm over each query and key head
# before the rotary embedding; SmolLM3 leaves the rotary embedding out of some layers; the MLP may be a mixture of
# experts). Most pass their attention module's `sliding_window` to the attention function; Mistral and Mixtral
# pass their config's.
_FAMILIES = {"LlamaForCausalLM", "MistralForCausalLM", "MinistralForCausalLM", "MixtralForCausalLM",
             "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "SmolLM3ForCausalLM"}
# Decoders served without a causal-LM class of their own (engine/vision/encoder.py's DecoderWithHead): Qwen2-VL's
# and Qwen2.5-VL's are Qwen2's layers with multimodal rotary positions, which their own rotary embedding turns
# into one cos/sin per token (the compact forward calls it with the step's [3, 1, tokens] positions).
_DECODERS = {"Qwen2VLTextModel", "Qwen2_5_VLTextModel"}
_WINDOW_FROM_CONFIG = {"MistralAttention", "MixtralAttention"}


def _window(attention: torch.nn.Module) -> int | None:
    """The window the model's own attention forward passes, resolved as the engine's attention resolves it."""
    source = attention.config if type(attention).__name__ in _WINDOW_FROM_CONFIG else attention
    return layer_window(attention, getattr(source, "sliding_window", None))


def _rms_weights(norm: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, epsilon) of a plain RMS norm (weight times the normalised value), else None."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if (type(norm).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(eps, float)):
        return weight.detach(), eps
    return None


def _rows_product(module: torch.nn.Module, dtype: torch.dtype | None):
    """A linear layer's product of contiguous rows [tokens, in] of `dtype`: its kernel call with the layer's own
    arguments bound (`direct`: engine/cpu/packed_linear.py, engine/cpu/bf16_weights.py,
    engine/cpu/quantized_weights.py) where it has one, else its forward."""
    direct = getattr(module, "direct", None)
    call = direct(dtype) if callable(direct) and dtype is not None else None
    return call or module.forward


def _has_hooks(model: torch.nn.Module) -> bool:
    """Hooks (accelerate's device placement, adapters) run only through Module.__call__, which this skips."""
    if any(getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class _Layer:
    __slots__ = ("index", "attention", "input_norm", "qkv", "q_norm", "k_norm", "rotary", "o_proj", "post_norm",
                 "mlp", "gate_up", "down", "intermediate", "heads", "kv_heads", "head_dim", "scaling", "window",
                 "input_rms", "post_rms", "rows")

    def __init__(self, layer: torch.nn.Module, dtype: torch.dtype | None = None):
        attention = layer.self_attn
        self.index = attention.layer_idx
        self.attention = attention
        # Bound forwards, not the modules: the layout and fusion rewrites replaced them per instance.
        self.input_norm = layer.input_layernorm.forward
        self.qkv = attention.qkv_proj.forward
        self.q_norm = attention.q_norm.forward if hasattr(attention, "q_norm") else None
        self.k_norm = attention.k_norm.forward if hasattr(attention, "k_norm") else None
        self.rotary = getattr(attention, "use_rope", True)
        self.o_proj = attention.o_proj.forward
        self.post_norm = layer.post_attention_layernorm.forward
        self.mlp = layer.mlp.forward
        # A SiLU-gated MLP that fusion.py merged runs inline (its module calls and attribute lookups are a visible
        # share of a one-row step); any other MLP (mixtures of experts...) through its own forward.
        mlp = layer.mlp
        inline = (getattr(mlp.forward, "__func__", None) is gated_mlp_forward
                  and type(mlp.act_fn).__name__ in ("SiLU", "SiLUActivation"))
        self.gate_up = mlp.gate_up_proj.forward if inline else None
        self.down = mlp.down_proj.forward if inline else None
        # The fused path's products of 2-D rows of the model's type (q/k/v, o, and gate/up and down when inline).
        self.rows = (_rows_product(attention.qkv_proj, dtype), _rows_product(attention.o_proj, dtype),
                     _rows_product(mlp.gate_up_proj, dtype) if inline else None,
                     _rows_product(mlp.down_proj, dtype) if inline else None)
        self.intermediate = (mlp.gate_proj.out_features, mlp.up_proj.out_features) if inline else None
        self.head_dim = attention.head_dim
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.scaling = attention.scaling
        self.window = _window(attention)
        self.input_rms = _rms_weights(layer.input_layernorm)
        self.post_rms = _rms_weights(layer.post_attention_layernorm)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: StepCache) -> torch.Tensor:
        tokens = x.shape[1]  # x: [1, tokens, hidden], the shape the model's own modules take (MoE blocks need it)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(self.input_norm(x)).view(tokens, heads + 2 * kv_heads, dim)
        qk = qkv[:, :heads + kv_heads]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :heads]), self.k_norm(qkv[:, heads:heads + kv_heads])), dim=1)
        if self.rotary:
            # Queries and keys together, as transformers' apply_rotary_pos_emb computes each:
            # x * cos + rotate_half(x) * sin.
            half = dim // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
        keys, values = qk[:, heads:], qkv[:, heads + kv_heads:]
        cache.write(self.index, keys, values)
        out = paged_attention(self.attention, qk[:, :heads].transpose(0, 1).unsqueeze(0),
                              keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0), self.scaling,
                              window=self.window)
        x = x + self.o_proj(out.reshape(1, tokens, -1))
        if self.gate_up is None:
            return x + self.mlp(self.post_norm(x))
        gate, up = self.gate_up(self.post_norm(x)).split_with_sizes(self.intermediate, -1)
        return x + self.down(F.silu(gate) * up)

    def fused(self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
              cache: StepCache, kernels, next_rms: tuple[torch.Tensor, float],
              attend: DecodeAttention | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer through the native kernels (engine/cpu/native_kernels.py): x is the residual stream [tokens,
        hidden] and `normed` its input norm; returns the new residual stream and its norm by `next_rms` (the next
        layer's input norm, or the final one), so each residual add runs in one pass with the norm after it.
        `attend`: the step's decode attention where it is decode rows alone (attention.decode_attention),
        else paged_attention."""
        tokens = x.shape[0]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        qkv_rows, o_rows, gate_up_rows, down_rows = self.rows
        qkv = qkv_rows(normed).view(tokens, heads + 2 * kv_heads, dim)
        if self.q_norm is not None:
            qkv[:, :heads] = self.q_norm(qkv[:, :heads])
            qkv[:, heads:heads + kv_heads] = self.k_norm(qkv[:, heads:heads + kv_heads])
        k_pool, v_pool, slots = cache.write_target(self.index)
        kernels.rope_and_cache_(qkv, cos if self.rotary else None, sin if self.rotary else None, heads, kv_heads,
                                k_pool, v_pool, slots)
        if attend is not None:
            out = attend(self.index, qkv[:, :heads], self.scaling, self.window)
        else:
            out = paged_attention(self.attention, qkv[:, :heads].transpose(0, 1).unsqueeze(0),
                                  qkv[:, heads:heads + kv_heads].transpose(0, 1).unsqueeze(0),
                                  qkv[:, heads + kv_heads:].transpose(0, 1).unsqueeze(0), self.scaling,
                                  window=self.window)
        y = o_rows(out.reshape(tokens, -1))
        normed = kernels.add_rms_norm_(y, x, *self.post_rms)
        x = y
        if gate_up_rows is None:  # the model's own MLP block, which takes [1, tokens, hidden]
            y = self.mlp(normed.unsqueeze(0))[0]
        else:
            y = down_rows(kernels.silu_mul(gate_up_rows(normed), self.intermediate[0]))
        return y, kernels.add_rms_norm_(y, x, *next_rms)


class _NativeStack:
    """The layers of a step of decode rows through the kernels' DecodeStack (native/decode_stack.cpp): the
    same kernel calls _Layer.fused makes, in one call from Python (each call from Python has a fixed cost besides
    its work, and a layer makes nine)."""

    def __init__(self, stack, indices: list[int]):
        self.stack, self.indices = stack, indices
        self._pools_of = None  # the cache whose pools the stack holds

    @classmethod
    def build(cls, layers: list[_Layer], next_rms: list[tuple[torch.Tensor, float]], kernels) -> "_NativeStack | None":
        """The stack of `layers` where each is the plain fused layer and its four products are the kernels' own
        (engine/cpu/*: `direct`), else None (query and key norms, other MLPs and adapters keep the layer path)."""
        product = getattr(kernels, "Product", None)
        if product is None or not layers or any(
                layer.q_norm is not None or layer.gate_up is None or not all(isinstance(p, product) for p in layer.rows)
                for layer in layers):
            return None
        stack = kernels.DecodeStack()
        for layer, (next_w, next_eps) in zip(layers, next_rms):
            post_w, post_eps = layer.post_rms
            scale = layer.scaling if layer.scaling is not None else layer.head_dim ** -0.5
            stack.add(*layer.rows, post_w, post_eps, next_w, next_eps, layer.heads, layer.kv_heads, layer.head_dim,
                      layer.intermediate[0], scale, layer.window or 0, bool(layer.rotary))
        return cls(stack, [layer.index for layer in layers])

    def __call__(self, x: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 attend: DecodeAttention) -> tuple[torch.Tensor, torch.Tensor]:
        if attend.cache is not self._pools_of:
            self.stack.set_pools(*attend.pools(self.indices))
            self._pools_of = attend.cache
        return self.stack.run(x, normed, cos, sin, attend.slots, attend.offsets, attend.blocks, attend.lengths)


class CompactDecoder:
    """The model's forward on the paged path: `decoder(ids, positions, cache, keep)` returns the logits of the
    packed positions `keep`, [1, len(keep), vocab], as `model(..., logits_to_keep=keep)` does."""

    def __init__(self, model: torch.nn.Module, kernels=None):
        inner = model.model
        self.embed = inner.embed_tokens.forward
        self.rotary = inner.rotary_emb
        # The residual stream's; an embedding read from a kernel's copy names it (its `weight` decodes the table).
        dtype = getattr(inner.embed_tokens, "weight_dtype", None) or getattr(
            getattr(inner.embed_tokens, "weight", None), "dtype", None)
        self.layers = [_Layer(layer, dtype) for layer in inner.layers]
        self.norm = inner.norm.forward
        self.head = model.lm_head.forward
        self.head_rows = _rows_product(model.lm_head, dtype)
        final_rms = _rms_weights(inner.norm)
        # The native kernels where every norm is a plain RMS norm and the MLP's gate and up halves are equal.
        if kernels is not None and final_rms is not None and all(
                layer.input_rms and layer.post_rms and (layer.intermediate is None
                                                        or layer.intermediate[0] == layer.intermediate[1])
                for layer in self.layers):
            self.kernels = kernels
            self.next_rms = [layer.input_rms for layer in self.layers[1:]] + [final_rms]
        else:
            self.kernels, self.next_rms = None, []
        # Steps of decode rows run every layer in one native call where the layers allow it.
        self.stack = _NativeStack.build(self.layers, self.next_rms, kernels) if self.kernels is not None else None

    @classmethod
    def build(cls, model: torch.nn.Module, kernels=None) -> tuple["CompactDecoder | None", str]:
        """The compact forward for this model (through `kernels`, engine/cpu/native_kernels.py's, where given and the
        model's norms and MLP suit them), or None and why not."""
        name = type(model).__name__
        inner = getattr(model, "model", None)
        if name not in _FAMILIES and type(inner).__name__ not in _DECODERS:
            return None, f"no compact forward for {name}"
        layers = getattr(inner, "layers", None)
        if layers is None or not all(hasattr(inner, a) for a in ("embed_tokens", "rotary_emb", "norm")):
            return None, "the model lacks the usual embed_tokens, rotary_emb, layers and norm"
        if _has_hooks(model):
            return None, "the model has forward hooks"
        for layer in layers:
            if not all(hasattr(layer, a) for a in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")):
                return None, "a decoder layer lacks the usual attention, norms and MLP"
            attention = layer.self_attn
            if not hasattr(attention, "qkv_proj"):
                return None, "a layer's query, key and value projections are not fused (engine/cpu/fusion.py)"
            if hasattr(attention, "q_norm") != hasattr(attention, "k_norm"):
                return None, "a layer normalises queries or keys but not both"
            head_dim = attention.head_dim
            if (attention.q_proj.out_features % head_dim or attention.k_proj.out_features % head_dim
                    or attention.v_proj.out_features != attention.k_proj.out_features or head_dim % 2):
                return None, "a layer's projections do not split into whole heads"
        return cls(model, kernels), ""

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: StepCache,
                 keep: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)  # [1, tokens, hidden]
        cos, sin = self.rotary(hidden, positions)  # [1, tokens, head_dim]
        if self.kernels is not None:
            cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [tokens, head_dim]
            x = hidden[0]  # [tokens, hidden]
            normed = self.kernels.rms_norm(x, *self.layers[0].input_rms)
            attend = decode_attention(hidden.dtype)
            if attend is not None and self.stack is not None:
                x, normed = self.stack(x, normed, cos, sin, attend)
            else:
                for layer, next_rms in zip(self.layers, self.next_rms):
                    x, normed = layer.fused(x, normed, cos, sin, cache, self.kernels, next_rms, attend)
            return self.head_rows(normed.index_select(0, keep)).unsqueeze(0)
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # broadcast over heads
        x = hidden
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        return self.head(self.norm(x.index_select(1, keep)))
