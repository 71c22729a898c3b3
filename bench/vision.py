"""Image requests per second on a tiny vision-language model, at 1 and 8 concurrent requests, and the vision
encoder's share of the model's forward time.

    python bench/vision.py [--family llava] [--requests 16] [--max-tokens 16]

Builds the family's tiny random model (tests/vision_models.py, with the embedded model's tokenizer) in a
temporary folder and serves it in-process through the job router, as the handler does: each request is a chat
request with one distinct PNG data URL, so decoding, the processor, the vision tower at prefill and the decode
steps are all in the figure. The encoder's share is the time spent in the vision tower and projector over the
time spent in the model: on the paged path the engine's steps plus the encoding (which runs on the API
layer's threads), on the fallback path the whole model's forward passes.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


class _Timer:
    """Wall time spent inside a module's forward (hooks; a start per thread, as images encode on several)."""

    def __init__(self, module):
        self.total = 0.0
        self._local = threading.local()
        self._lock = threading.Lock()
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_):
        self._local.started = time.perf_counter()

    def _post(self, *_):
        with self._lock:
            self.total += time.perf_counter() - self._local.started


class _StepTimer:
    """Wall time of the paged engine's steps (the runner's execute; the compact forward bypasses module hooks)."""

    def __init__(self, runner):
        self.total = 0.0
        execute = runner.execute

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return execute(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - started
        runner.execute = timed


def _data_url(seed: int) -> str:
    from PIL import Image
    image = Image.fromarray(np.random.RandomState(seed).randint(0, 255, (64, 80, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llava")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine import EngineConfig
    from engine.loader import model_folder
    from vision_models import build

    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    AutoTokenizer.from_pretrained(model_folder(EngineConfig())).save_pretrained(work / "tokenizer")
    folder = build(args.family, work / "tokenizer", work / args.family)
    os.environ.update(MODEL_NAME=str(folder), DTYPE="float32", MAX_NUM_SEQS="8")

    from engine import AsyncEngine
    from openai_compat.jobs import JobRouter
    from openai_compat.serving import OpenAIServing
    from worker.settings import load_settings

    settings = load_settings()
    engine = AsyncEngine(settings.engine_config())
    router = JobRouter(OpenAIServing(engine, settings.serving_config()), settings.serving_config())
    urls = [_data_url(seed) for seed in range(args.requests * 2 + 1)]

    async def run() -> None:
        await engine.start()
        encoder = engine.vision.encoder
        paged = encoder is not None  # the decoder on the paged engine, images encoded on the API's threads
        vlm = encoder.model if paged else engine.loaded_model.model
        whole = _StepTimer(engine.engine.runner) if paged else _Timer(vlm)
        inner = vlm.model
        towers = ("vision_tower", "vision_model", "visual", "multi_modal_projector", "connector")  # visual: Qwen2-VL's
        vision = [_Timer(getattr(inner, name)) for name in towers if getattr(inner, name, None) is not None]

        async def one(url: str) -> None:
            job = {"openai_route": "/v1/chat/completions", "openai_input": {
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "Describe the picture."}]}],
                "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}}
            (out,) = [part async for part in router.run(job)]
            assert "error" not in out, out

        await one(urls[-1])  # warm-up
        for concurrency in (1, 8):
            whole.total = 0.0
            for timer in vision:
                timer.total = 0.0
            batch = urls[(concurrency > 1) * args.requests:][:args.requests]
            started = time.perf_counter()
            for at in range(0, len(batch), concurrency):
                await asyncio.gather(*(one(url) for url in batch[at:at + concurrency]))
            elapsed = time.perf_counter() - started
            encoding = sum(t.total for t in vision)
            model_time = whole.total + encoding if paged else whole.total
            share = encoding / model_time if model_time else 0.0
            print(f"{args.family} ({'paged' if paged else 'fallback'}): concurrency {concurrency}: "
                  f"{len(batch) / elapsed:.2f} image requests/s ({len(batch)} requests of {args.max_tokens} tokens "
                  f"in {elapsed:.2f} s); vision encoder {share:.1%} of the model's time")

    asyncio.run(run())
    engine.close()


if __name__ == "__main__":
    main()
