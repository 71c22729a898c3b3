"""Download the configured model ahead of time into a folder that then serves it with no network call.

    python -m engine.sources.prefetch [--into DIR] [--model SOURCE] [--revision REV] [--tokenizer SOURCE]
                              [--tokenizer-revision REV]

With BAKE_STARTUP_VERDICTS set (a build argument), it then loads the model once so the start-up probes' verdicts
are baked in too (engine/startup_cache.py); worth it where the build machine's CPU is the workers'.

Defaults come from the worker's own variables: BAKED_MODEL_DIR, MODEL_NAME, MODEL_REVISION, TOKENIZER_NAME,
TOKENIZER_REVISION. The Dockerfile runs it at build time to bake a model into the image. It downloads through
the same code as the worker (so S3 and Hub sources take the same credentials) and records each source in
DIR/baked-models.json; a worker started with BAKED_MODEL_DIR=DIR and the same MODEL_NAME / MODEL_REVISION
loads from DIR before it considers any network source.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from engine.sources import store as model_store


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.sources.prefetch",
                                     description="Download a model into a folder the worker loads it from offline.")
    parser.add_argument("--into", type=Path, default=_env("BAKED_MODEL_DIR"),
                        help="destination folder (default: $BAKED_MODEL_DIR)")
    parser.add_argument("--model", default=_env("MODEL_NAME"), help="default: $MODEL_NAME")
    parser.add_argument("--revision", default=_env("MODEL_REVISION"), help="default: $MODEL_REVISION")
    parser.add_argument("--tokenizer", default=_env("TOKENIZER_NAME"), help="default: $TOKENIZER_NAME")
    parser.add_argument("--tokenizer-revision", default=_env("TOKENIZER_REVISION"),
                        help="default: $TOKENIZER_REVISION")
    args = parser.parse_args(argv)
    if args.into is None:
        parser.error("no destination: pass --into or set BAKED_MODEL_DIR")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    into = Path(args.into).resolve()
    for source, revision, role in ((args.model, args.revision, "model"),
                                   (args.tokenizer, args.tokenizer_revision, "tokenizer")):
        if source is None and role == "tokenizer":
            continue
        try:
            local = model_store.resolve(source, revision=revision, cache_dir=into, baked_dir=into, role=role)
        except model_store.ModelSourceError as exc:
            print(f"prefetch: {exc}", file=sys.stderr)
            return 1
        if local.gguf_file:
            # GGUF weights (the embedded default among them) are converted once here, not at every cold start.
            from engine.sources.gguf import local_folder
            print(f"prefetch: converted {local.name} into {local_folder(local, into, into)}", file=sys.stderr)
            continue
        if local.path.resolve().is_relative_to(into):
            model_store.record_baked(into, source, revision, local.path)
            print(f"prefetch: {source} is in {local.path}", file=sys.stderr)
        else:  # a local path: nothing to download, the worker reads it where it is
            print(f"prefetch: {source} is a local path; nothing to download", file=sys.stderr)
    if os.environ.get("BAKE_STARTUP_VERDICTS"):
        _bake_verdicts(args, into)
    return 0


def _bake_verdicts(args, into: Path) -> None:
    """Load the model once with the worker's default settings, so the start-up probes' verdicts
    (engine/startup_cache.py) land in DIR/startup-verdicts: a worker on a machine like the builder (same CPU,
    threads and versions) then starts without probing, even on an empty volume. Another CPU simply misses."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=args.model, revision=args.revision, tokenizer=args.tokenizer,
                                      tokenizer_revision=args.tokenizer_revision, cache_dir=into,
                                      baked_model_dir=into, startup_cache=True))
    asyncio.run(engine.start())
    engine.close()
    print(f"prefetch: start-up verdicts baked into {into / 'startup-verdicts'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
