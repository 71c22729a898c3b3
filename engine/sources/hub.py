"""Hugging Face Hub repo ids ("org/name"): the repo's files downloaded into the cache with huggingface_hub.

HF_TOKEN (or a stored login) opens private and gated repos; HF_ENDPOINT points at a mirror; HF_HUB_OFFLINE
forbids network calls, so only a copy already in the cache can be used.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Iterator, Mapping

import huggingface_hub
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import (GatedRepoError, HFValidationError, HfHubHTTPError, OfflineModeIsEnabled,
                                    RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.utils import disable_progress_bars, validate_repo_id

from engine.sources.base import ModelSourceError
from engine.sources.cache import RemoteFile, TransferProgress, entry_path, fetch_into_cache

log = logging.getLogger("engine.sources")

# Weight formats transformers does not need when the repo also has safetensors (repos often carry several).
_OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".ot", ".onnx", ".onnx_data",
                          ".tflite", ".gguf", ".mlmodel", ".npz")
_WATCH_INTERVAL_S = 1.0

# At DEBUG the HTTP clients log request details; the token must not reach the log.
for _name in ("httpx", "httpx2", "httpcore", "urllib3"):
    logging.getLogger(_name).setLevel(logging.INFO)


def is_repo_id(text: str) -> bool:
    if text.count("/") > 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def fetch(repo_id: str, *, revision: str | None, cache_dir: Path, role: str) -> Path:
    """The local copy of the repo at `revision` (a branch, tag or commit; default main), downloaded into the cache
    unless a complete copy is there. A branch is fetched once: set a new revision to fetch anew."""
    endpoint = constants.ENDPOINT
    revision = revision or constants.DEFAULT_REVISION  # unset and "main" are one cache entry
    target = entry_path(cache_dir, "hf", f"{repo_id}@{revision}", [endpoint, repo_id, revision])
    api = HfApi()
    listed: dict[str, str] = {}

    def list_files() -> dict[str, RemoteFile]:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
        listed["sha"] = info.sha
        files = {s.rfilename: RemoteFile(s.size, s.lfs.sha256 if s.lfs else s.blob_id) for s in info.siblings or []}
        if any(name.endswith(".safetensors") for name in files):
            files = {name: f for name, f in files.items() if not name.endswith(_OTHER_WEIGHT_SUFFIXES)}
        return files

    def download(scratch: Path, files: Mapping[str, RemoteFile], progress: TransferProgress) -> None:
        disable_progress_bars()  # progress goes to the log instead of terminal bars
        with _watching(scratch, progress):
            # The commit just listed, so the files match the listing even if the branch moves meanwhile.
            snapshot_download(repo_id, revision=listed["sha"], local_dir=scratch, allow_patterns=list(files))
        shutil.rmtree(scratch / ".cache", ignore_errors=True)  # huggingface_hub's bookkeeping for local_dir

    try:
        return fetch_into_cache(target, source=repo_id, revision=revision, role=role, list_files=list_files,
                                download=download)
    except ModelSourceError:
        raise
    except Exception as exc:  # one line naming the source and the cause
        message = f"cannot download {repo_id} from the Hugging Face Hub ({endpoint}): {_cause(exc, revision, target)}"
        raise ModelSourceError(_redact(message)) from exc


@contextlib.contextmanager
def _watching(folder: Path, progress: TransferProgress) -> Iterator[None]:
    """Report the bytes under `folder` while huggingface_hub downloads into it (it takes no byte callback)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(_WATCH_INTERVAL_S):
            progress.set(_bytes_under(folder))

    thread = threading.Thread(target=watch, name="download-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    progress.set(progress.total)


def _bytes_under(folder: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):  # files and folders are renamed as they complete
        for path in folder.rglob("*"):
            with contextlib.suppress(OSError):
                if path.is_file():
                    total += path.stat().st_size
    return total


def _cause(exc: BaseException, revision: str | None, target: Path) -> str:
    if isinstance(exc, OfflineModeIsEnabled):
        return f"offline mode is on (HF_HUB_OFFLINE) and no complete copy is cached in {target}"
    if isinstance(exc, GatedRepoError):
        return "the repository is gated: accept its terms on the Hub and set HF_TOKEN to a token with access"
    if isinstance(exc, RepositoryNotFoundError):
        return "no such repository, or it is private and HF_TOKEN is unset or lacks access"
    if isinstance(exc, RevisionNotFoundError):
        return f"the repository has no revision {revision!r}"
    first_line = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, HfHubHTTPError):
        return f"HTTP error: {first_line}"
    return f"{type(exc).__name__}: {first_line}"


def _redact(text: str) -> str:
    token = os.environ.get("HF_TOKEN") or huggingface_hub.get_token()
    return text.replace(token, "***") if token else text
