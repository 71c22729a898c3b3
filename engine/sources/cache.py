"""Remote model folders (S3, Hugging Face Hub) copied once into the local cache under BASE_PATH.

A cache entry is a folder keyed by source and revision. It is filled in a temporary folder and renamed into
place when complete (see `base.building`), and it ends with a manifest of every file's size and ETag.
On a later start a complete entry is used as it is: no listing, no download, no network call. The manifest
only has to show that the local copy is whole (every file present with its recorded size); it does not
notice new content at the source, which is why the revision is part of the key.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

from engine.sources.base import ModelSourceError, building

log = logging.getLogger("engine.sources")

MANIFEST_NAME = ".llm-worker-manifest.json"
_MANIFEST_VERSION = 1
# Files that make a folder usable as a tokenizer source when it has no config.json.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_PROGRESS_INTERVAL_S = 5.0


@dataclass(frozen=True)
class RemoteFile:
    size: int
    etag: str | None = None  # S3 ETag or Hub blob id: what the source says this content is


def entry_path(cache_dir: Path, kind: str, readable: str, key: Iterable[str | None]) -> Path:
    """The cache folder of one source: a readable name for people browsing the volume, plus a hash of
    everything that identifies the content (endpoint, location, revision) so distinct sources never share it."""
    digest = hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:12]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", readable).strip("-.")[:80]
    return cache_dir / "models" / kind / f"{slug}-{digest}"


def unsafe_path_reason(relative: str) -> str | None:
    """Why a remote file name cannot be written under the target folder, or None when it can. Names come from
    the bucket's owner, not from us: `../`, absolute paths and empty parts could write anywhere."""
    if "\x00" in relative:
        return "contains a NUL byte"
    if relative.startswith("/"):
        return "is an absolute path"
    parts = relative.split("/")
    if ".." in parts:
        return "contains '..'"
    if "" in parts or "." in parts:
        return "has an empty or '.' path part"
    if relative == MANIFEST_NAME:
        return "collides with the cache manifest"
    return None


def required_files_problem(names: Iterable[str], role: str) -> str | None:
    """What is missing for the folder to be loadable as `role` ("model", "tokenizer" or "adapter"), or None."""
    names = set(names)
    if role == "adapter":  # a PEFT adapter folder (engine/lora/adapters.py)
        return None if "adapter_config.json" in names else \
            f"no adapter_config.json among its {len(names)} files ({', '.join(sorted(names)[:8])})"
    ggufs = [n for n in names if n.endswith(".gguf") and "/" not in n]
    if "config.json" in names or len(ggufs) == 1:
        return None
    if role == "tokenizer" and names.intersection(_TOKENIZER_FILES):
        return None
    shown = ", ".join(sorted(names)[:8]) + (", ..." if len(names) > 8 else "")
    wanted = "config.json" if role == "model" else "tokenizer files (tokenizer.json, tokenizer_config.json, ...)"
    return f"no {wanted} among its {len(names)} files ({shown})"


class TransferProgress:
    """Bytes received so far, logged every few seconds, and the totals at the end. Thread-safe: transfer
    threads report into it."""

    def __init__(self, label: str, total_bytes: int):
        self.label = label
        self.total = total_bytes
        self.done = 0
        self.started = time.monotonic()
        self._last_log = self.started
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.done += count
            self._maybe_log()

    def set(self, done: int) -> None:
        with self._lock:
            self.done = done
            self._maybe_log()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log >= _PROGRESS_INTERVAL_S:
            self._last_log = now
            percent = 100 * self.done / self.total if self.total else 100
            log.info("%s: %s of %s (%.0f%%), %s/s", self.label, _size(self.done), _size(self.total), percent,
                     _size(self.done / max(now - self.started, 1e-9)))

    def finish(self, files: int) -> None:
        seconds = time.monotonic() - self.started
        log.info("%s: downloaded %d files, %s in %.1f s (%s/s)", self.label, files, _size(self.total), seconds,
                 _size(self.total / max(seconds, 1e-9)))


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


def manifest_intact(folder: Path) -> bool:
    """Whether every file the manifest lists is present with its recorded size (a few stat calls; no reads)."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8"))
        files = manifest["files"]
        return all((folder / name).stat().st_size == entry["size"] for name, entry in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_manifest(folder: Path, source: str, revision: str | None, files: Mapping[str, RemoteFile]) -> None:
    manifest = {"version": _MANIFEST_VERSION, "source": source, "revision": revision,
                "downloaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": {name: {"size": f.size, "etag": f.etag} for name, f in sorted(files.items())}}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def fetch_into_cache(target: Path, *, source: str, revision: str | None, role: str,
                     list_files: Callable[[], Mapping[str, RemoteFile]],
                     download: Callable[[Path, Mapping[str, RemoteFile], TransferProgress], None]) -> Path:
    """The cache entry `target` for a remote folder, downloading it first unless a complete copy is there.

    `list_files` names the remote files (relative paths) with their sizes; `download` writes them under the
    folder it is given, reporting bytes to the progress. Raises ModelSourceError naming `source` and the cause.
    """
    with building(target, complete=manifest_intact) as scratch:
        if scratch is None:
            log.info("%s: using the cached copy in %s", source, target)
            return target
        files = list_files()
        if not files:
            raise ModelSourceError(f"cannot download {source}: it holds no files")
        for name in files:
            reason = unsafe_path_reason(name)
            if reason is not None:
                raise ModelSourceError(f"cannot download {source}: refusing file {name!r}, which {reason}")
        problem = required_files_problem(files, role)
        if problem is not None:
            raise ModelSourceError(f"cannot load {source} as a {role}: {problem}")
        progress = TransferProgress(source, sum(f.size for f in files.values()))
        log.info("%s: downloading %d files (%s) into %s", source, len(files), _size(progress.total), target)
        download(scratch, files, progress)
        for name, remote in files.items():
            local = scratch / name
            got = local.stat().st_size if local.is_file() else None
            if got != remote.size:
                raise ModelSourceError(f"cannot download {source}: {name} arrived with {got} bytes, expected "
                                       f"{remote.size}")
        _write_manifest(scratch, source, revision, files)
        progress.finish(len(files))
    return target
