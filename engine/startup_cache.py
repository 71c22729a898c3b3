"""Start-up verdicts kept across processes: what the probes and checks at load time found (the dtype, the layouts,
whether the native kernels and the compact forward agree with PyTorch), so that the next start on the same
machine, model and code takes them instead of timing and checking again (docs/deployment.md, Cold start).

Every verdict is a function of the CPU, the model's files, the versions of torch and transformers and the
engine's own sources, so a file holds the verdicts of one such combination, named by a digest of it: another CPU
(a worker on a different machine sharing the network volume), another model or changed code simply misses and
probes again. The file also records the parts of its key and is checked against them on reading. A file that
cannot be read, parsed or matched is ignored (probed again, then rewritten); files are written whole through a
temporary file and a rename, so a reader never sees a partial one.

Lookups record what they served (`hits`) and computed (`misses`); the log line at the end of a load says which.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from engine import devices

log = logging.getLogger("engine.startup_cache")

FORMAT = 1
_ENGINE = Path(__file__).resolve().parent
_digest_lock = threading.Lock()
_sources: str | None = None


def _sources_digest() -> str:
    """The engine's own sources (Python and native): a verdict found by other code is not trusted."""
    global _sources
    with _digest_lock:
        if _sources is None:
            digest = hashlib.sha256()
            for path in sorted(p for p in _ENGINE.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
                digest.update(str(path.relative_to(_ENGINE)).encode() + b"\0" + path.read_bytes() + b"\0")
            _sources = digest.hexdigest()[:16]
        return _sources


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (its timings and kernels' results depend on both)."""
    info = devices.cpuinfo()
    fields = [f"{name}\t: {info[name]}" for name in ("model name", "flags") if name in info] or [platform.processor()]
    return hashlib.sha256("\n".join([*fields, platform.machine()]).encode()).hexdigest()[:12]


def machine_identity() -> dict[str, Any]:
    """What every verdict depends on besides the model: the CPU (model name and feature flags), the threads the
    probes ran with, the library versions and the engine's sources."""
    import torch

    return {"cpu": _cpu_identity(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": _version("transformers"), "python": platform.python_version(),
            "sources": _sources_digest()}


def model_identity(folder: Path) -> dict[str, Any]:
    """The model's files as loaded: the folder, each file's size and modification time (a re-download or
    re-conversion changes them), and the configuration's content."""
    folder = folder.resolve()
    files = []
    for path in sorted(folder.iterdir()):
        if path.is_file():
            stat = path.stat()
            files.append([path.name, stat.st_size, stat.st_mtime_ns])
    config = folder / "config.json"
    config_digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16] if config.is_file() else ""
    return {"folder": str(folder), "files": files, "config": config_digest}


class Verdicts:
    """The verdicts of one key, read from `folder` (None: kept in this process only). `get(name, compute)`
    returns the stored value or computes, keeps and returns it (values are JSON data); `save()` writes them."""

    def __init__(self, folder: Path | None, identity: dict[str, Any], label: str, baked: Path | None = None):
        self.identity = {"format": FORMAT, **identity}
        self.label = label
        self.hits: list[str] = []
        self.misses: list[str] = []
        self._lock = threading.Lock()
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:24]
        name = f"{label}-{digest}.json"
        self.path = None if folder is None else folder / "startup-verdicts" / name
        # Verdicts baked into the image (python -m engine.sources.prefetch) serve where the volume has none yet.
        self._values: dict[str, Any] = self._read(self.path)
        if not self._values and baked is not None and self.path is not None:
            self._values = self._read(baked / "startup-verdicts" / name)

    def _read(self, path: Path | None) -> dict[str, Any]:
        if path is None or not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("identity") != self.identity:
                raise ValueError("its key does not match")
            values = data["verdicts"]
            if not isinstance(values, dict):
                raise ValueError("no verdicts")
            return values
        except (OSError, ValueError, KeyError, TypeError) as exc:  # corrupt or foreign: probe again, rewrite
            log.warning("start-up verdicts: ignoring %s (%s); probing again", path, exc)
            return {}

    def cached(self, name: str) -> tuple[bool, Any]:
        """Whether a verdict `name` is stored, and its value (counted as reused when it is)."""
        with self._lock:
            if name in self._values:
                if name not in self.hits:
                    self.hits.append(name)
                return True, self._values[name]
        return False, None

    def get(self, name: str, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if name in self._values:
                if name not in self.hits:
                    self.hits.append(name)
                return self._values[name]
        value = compute()
        with self._lock:
            self.misses.append(name)
            self._values[name] = value
        return value

    def save(self) -> None:
        """Write the file anew where something was probed (once, at the end of a load), through a temporary file
        and a rename; a volume that cannot be written only costs the next start its probes."""
        if self.path is None or not self.misses:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"identity": self.identity, "verdicts": self._values}, indent=1, sort_keys=True)
            handle, scratch = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            try:
                os.fchmod(handle, 0o644)  # mkstemp's 0600 would hide it from workers running as another user
                with os.fdopen(handle, "w", encoding="utf-8") as file:
                    file.write(text)
                os.replace(scratch, self.path)
            except BaseException:
                os.unlink(scratch)
                raise
        except OSError as exc:
            log.warning("start-up verdicts: cannot write %s (%s)", self.path, exc)

    def summary(self) -> str:
        where = self.path if self.path is not None else "this process only"
        return (f"{len(self.hits)} reused, {len(self.misses)} probed ({', '.join(self.misses) or 'none'}); {where}")


def open_verdicts(cache_dir: Path | None, label: str, folder: Path | None = None,
                  baked: Path | None = None, settings: dict[str, Any] | None = None) -> Verdicts:
    """The verdict store for this machine (and the model in `folder`, when given; and `settings` that change what
    the probes compare, such as the kernels' variant) under `cache_dir`, falling back to one baked under
    `baked`."""
    identity = {**machine_identity(), **(settings or {})}
    if folder is not None:
        identity["model"] = model_identity(folder)
    return Verdicts(cache_dir, identity, label, baked)


def in_memory() -> Verdicts:
    """A store that keeps nothing across processes (the cache is off): every verdict is probed."""
    return Verdicts(None, {}, "none")


if __name__ == "__main__":  # pragma: no cover - a quick look at this machine's key
    json.dump(machine_identity(), sys.stdout, indent=1)
