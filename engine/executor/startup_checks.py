"""The runner's start-up checks: what each layer keeps in the cache (shapes), whether recurrent layers continue
a prompt in chunks, whether a 16-bit KV cache keeps the model's logits, and which compact forward computes the
model's own logits. Each runs a few real steps through the runner; verdicts are kept across starts on the same
machine, model and code (engine/startup_cache.py)."""
from __future__ import annotations

import logging
import os

import torch

from engine.core.block_manager import BLOCK_SIZE, blocks_for
from engine.cpu import native_kernels, quantized_weights
from engine.executor.compact_decoder import CompactDecoder
from engine.executor.kv_cache import ForwardCache, LayerShape
from engine.executor.state_cache import StateKey, StateShape, with_left_context
from engine.executor.step import DecodeRow, PrefillChunk

log = logging.getLogger("engine")


class PagedPathUnsupported(RuntimeError):
    """The model's forward pass does not keep its state in the paged cache (the fallback path serves it)."""


def cache_argument(model) -> str:
    """The keyword a model's forward takes its cache by (Mamba-style models: cache_params)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache_params" if "cache_params" in params and "past_key_values" not in params else "past_key_values"


def logits_match(expected: torch.Tensor, got: torch.Tensor, tolerance: float) -> bool:
    """Same shape, and every logit within `tolerance` of the largest expected one (the start-up probes' test)."""
    scale = expected.float().abs().max().item()
    return got.shape == expected.shape and torch.allclose(got.float(), expected.float(), rtol=0.0,
                                                          atol=tolerance * scale)


class ShapeProbe(ForwardCache):
    """A cache that only records what each layer keeps (start-up probe): the key/value shapes an attention layer
    writes, the state shapes a recurrent or convolution layer keeps (one sequence's worth)."""

    def __init__(self):
        self.layers: dict[int, LayerShape] = {}
        self.states: dict[StateKey, StateShape] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.layers[layer_idx] = LayerShape(key_states.shape[1], key_states.shape[-1], value_states.shape[-1],
                                            key_states.device)
        return key_states, value_states

    def has_previous_state(self, layer_idx=None, state_idx=None) -> bool:
        return False

    def is_recording_past(self, layer_idx) -> bool:
        return False

    def get_conv_state(self, layer_idx, state_idx=0):
        return None

    get_recurrent_state = get_conv_state

    def update_conv_state(self, conv_states, layer_idx, state_idx=0, conv_kernel_size=None, **kwargs):
        width = conv_kernel_size or conv_states.shape[-1]
        self.states[("conv", layer_idx, state_idx)] = StateShape((*conv_states.shape[1:-1], width),
                                                                 conv_states.dtype, conv_states.device)
        return with_left_context(conv_states, None, width)

    def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        self.states[("recurrent", layer_idx, state_idx)] = StateShape(
            tuple(recurrent_states.shape[1:]), recurrent_states.dtype, recurrent_states.device)
        return recurrent_states


# A 16-bit KV cache chosen by DTYPE=auto serves where the probe's logits stay this close (a fraction of the largest
# logit) to a full-precision cache's: several times what float16 keys and values change on the embedded model, far
# below what a wrong or overflowing cache does (docs/cpu-kernels.md).
KV_ROUNDING_TOLERANCE = 2e-3
# Two forwards of a model whose layers take 8-bit integer activations (QUANTIZED_ACTIVATIONS=int8) differ by up to
# about a tenth of the largest logit when inputs a float32 rounding apart round to neighbouring 8-bit steps, and
# 30 layers compound it (the native kernels' norms against PyTorch's, a 16-bit cache: the avx2 build's forward
# landed just past 1e-1 on the embedded model); a wrong forward or an overflowing cache moves the logits by about
# their whole range.
EIGHT_BIT_ACTIVATION_TOLERANCE = 2.5e-1
# The compact forward's check against the model's own under a 16-bit KV cache: a few units in the last place of
# the stored type (float16's is 2^-11 of a value, bfloat16's 2^-8), relative to the largest logit.
_STORED_KV_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


class StartupChecks:
    """The checks of one runner, run while it is built."""

    def __init__(self, runner):
        self.runner = runner

    def kept(self, check: str, run):
        """The verdict of `run` (a check of this model's forward), reused from an earlier start that ran the same
        forward: the same types, kernels binary and integer activations (the store's key holds the rest)."""
        r = self.runner
        if r.verdicts is None:
            return run()
        kernels = native_kernels.active() if r.platform.cpu_fast_paths else None
        built = getattr(kernels, "__file__", None) or ""
        stamp = os.stat(built).st_mtime_ns if built and os.path.isfile(built) else 0
        name = (f"{check}:{r.dtype}:{r.kv_dtype}:{built}:{stamp}:"
                f"{int(quantized_weights.rounds_activations(r.model))}"
                f"{int(quantized_weights.eight_bit_activations(r.model))}:{len(r.layer_shapes)}")
        return r.verdicts.get(name, run)

    def probe_steps(self) -> list[tuple[list[DecodeRow], list[PrefillChunk]]]:
        """Three steps over blocks 0 to 3 that cover each attention path: prompts from position 0, a decode row
        beside a chunk continuing its sequence, then a step of decode rows alone (the compact forward's decode
        stack; the start-up checks' probe)."""
        r = self.runner
        vocab = min(97, r.model.config.get_text_config().vocab_size - 1)
        first = [1 + (i * 37) % vocab for i in range(21)]
        second = [1 + (i * 53) % vocab for i in range(30)]
        blocks_first, blocks_second = [0, 1], [2, 3]
        return [([], [PrefillChunk(first[:20], 0, blocks_first, "all"),
                      PrefillChunk(second[:12], 0, blocks_second, "last")]),
                ([DecodeRow(first[20], 20, blocks_first)], [PrefillChunk(second[12:], 12, blocks_second, "all")]),
                ([DecodeRow(second[5], 21, blocks_first), DecodeRow(first[7], 30, blocks_second)], [])]

    def run_probe(self) -> list[torch.Tensor | None]:
        """The probe's logits through the runner's cache, its blocks cleared first as the engine clears a block
        before its first use (a decode row gathered to a longer row's length reads unwritten slots, masked out)."""
        r = self.runner
        r.kv.zero_blocks(0, 4)
        return [r.execute(*step) for step in self.probe_steps()]

    @torch.inference_mode()
    def kv_rounding_differs(self) -> str:
        """Why the 16-bit cache would not serve this model ('' where it does): the probe's logits through it
        against those through a cache in the model's own type, within KV_ROUNDING_TOLERANCE of the largest."""
        r = self.runner
        if r.kv.num_blocks < 4:
            return "the KV cache is too small to check it"
        rounded = self.run_probe()
        kept, r.kv = r.kv, r.new_cache(r.dtype, 4)
        try:
            exact = self.run_probe()
        finally:
            r.kv = kept
        tolerance = KV_ROUNDING_TOLERANCE
        if quantized_weights.eight_bit_activations(self.runner.model):
            tolerance = EIGHT_BIT_ACTIVATION_TOLERANCE
        if not all(logits_match(e, r, tolerance) for e, r in zip(exact, rounded)):
            return "its logits differ from a full-precision cache's on the start-up probe"
        return ""

    @torch.inference_mode()
    def layer_shapes(self) -> tuple[dict[int, LayerShape], dict[StateKey, StateShape]]:
        r = self.runner
        probe = ShapeProbe()
        ids = torch.zeros((1, 2), dtype=torch.long, device=r.device)
        r.model(input_ids=ids, position_ids=torch.arange(2, device=r.device).view(1, 2),
                   use_cache=True, logits_to_keep=1, **{cache_argument(r.model): probe})
        if not probe.layers and not probe.states:
            raise PagedPathUnsupported("the model wrote no keys, values or recurrent state to the cache")
        if getattr(r.model, "_is_stateful", False) and not probe.states:
            raise PagedPathUnsupported("the model keeps recurrent state outside the cache")
        return probe.layers, probe.states

    @torch.inference_mode()
    def prefill_continues(self) -> bool:
        """Whether the model's recurrent layers carry a state into a multi-token pass (Mamba-2, gated delta nets and
        short convolutions do; Mamba-1's scan starts from zero whatever the cache holds): a prompt computed in
        two chunks must give the logits it gives whole, up to rounding."""
        r = self.runner
        ids = [1 + (i * 37) % 97 for i in range(24)]
        blocks = list(range(min(r.kv.num_blocks, blocks_for(len(ids)))))
        if len(blocks) * BLOCK_SIZE < len(ids) and r.layer_shapes:
            return False
        r.prefill_continues = True  # lets the passes below start past position 0
        whole = r.execute([], [PrefillChunk(ids, 0, blocks, "last", state_slot=0)])
        r.execute([], [PrefillChunk(ids[:10], 0, blocks, "none", state_slot=0)])
        split = r.execute([], [PrefillChunk(ids[10:], 10, blocks, "last", state_slot=0)])
        return logits_match(whole, split, 0.02)

    @torch.inference_mode()
    def compact_decoder(self) -> tuple[CompactDecoder | None, str]:
        """The compact forward (compact_decoder.py) where the model has its structure and computes the same logits
        through the paged cache: the probe's steps (probe_steps) run with the model's own forward, then again with
        the compact one. On CPU it first tries the compact forward through the native kernels (native_kernels.py),
        then without."""
        r = self.runner
        kernels = native_kernels.active() if r.platform.cpu_fast_paths else None
        decoder, why = CompactDecoder.build(r.model, kernels)
        if decoder is None:
            return None, why
        if len({s.device for s in r.layer_shapes.values()}) > 1:
            return None, "its layers are spread over several devices"
        if r.kv.num_blocks < 4:
            return None, "the KV cache is too small to check it"

        def check() -> str:
            """'kernels' or 'plain' for the compact forward that computes the model's logits, else why none does."""
            own = self.run_probe()
            why = self._differs(decoder, own)
            if not why:
                return "kernels" if decoder.kernels is not None else "plain"
            if decoder.kernels is not None:
                log.warning("compact forward through the native kernels: %s; trying it without them", why)
                why = self._differs(CompactDecoder(r.model), own)
            return why or "plain"

        verdict = self.kept(f"compact_forward:{int(decoder.kernels is not None)}", check)
        if verdict == "kernels":
            return decoder, ""
        if verdict == "plain":
            return (decoder if decoder.kernels is None else CompactDecoder(r.model)), ""
        return None, verdict

    def _differs(self, decoder: CompactDecoder, own: list) -> str:
        """Why `decoder` does not compute the model's own logits `own` on the probe ('' where it does)."""
        r = self.runner
        r.compact = decoder
        try:
            compact = self.run_probe()
        except Exception as exc:  # a shape it does not expect (a partial rotary embedding...): the model's own
            return f"it failed on this model ({type(exc).__name__}: {exc})"
        finally:
            r.compact = None
        tolerance = 1e-4 if r.dtype == torch.float32 else 2e-2
        if r.kv.dtype in (torch.float16, torch.bfloat16) and r.kv.dtype != r.dtype:
            # Keys and values stored in 16 bits under wider activations: two forwards that differ by a float32
            # rounding (an FMA, another summation order: PyTorch's AVX2 kernels against the avx2 build's) can
            # round a cached key to neighbouring 16-bit values, and every later step reads it.
            tolerance = max(tolerance, _STORED_KV_TOLERANCE[r.kv.dtype])
        if quantized_weights.rounds_activations(r.model):
            tolerance = max(tolerance, 2e-3)
        if quantized_weights.eight_bit_activations(r.model):
            tolerance = max(tolerance, EIGHT_BIT_ACTIVATION_TOLERANCE)
        if not all(logits_match(expected, got, tolerance) for expected, got in zip(own, compact)):
            return "its logits differ from the model's own forward"
        return ""
