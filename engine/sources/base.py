"""What every model source shares: its error, the local folder it resolves to, and building a cache entry
once, atomically, even across processes that share the folder."""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from filelock import FileLock, Timeout

log = logging.getLogger("engine.sources")


class ModelSourceError(RuntimeError):
    """A model source cannot be used; the message names the source and the cause."""


@dataclass(frozen=True)
class LocalModel:
    """Model files on local disk. `gguf_file` is set when the folder holds a GGUF file to convert."""
    path: Path
    name: str  # the id the model is served under by default
    gguf_file: str | None = None


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
