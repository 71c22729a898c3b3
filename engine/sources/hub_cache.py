"""Models already on the host in the Hugging Face Hub's cache layout: RunPod's cached models (an endpoint names a
model to cache; the platform puts it under /runpod-volume/huggingface-cache/hub before the worker starts, and its
download is not billed) and the cache huggingface_hub itself uses (HF_HUB_CACHE). A repo id found there, at the
revision asked for, loads from its snapshot folder in place: no network call, no copy.

Layout: `<cache>/models--ORG--NAME/refs/<branch or tag>` holds a commit hash, and
`<cache>/models--ORG--NAME/snapshots/<commit>/` the repo's files (links into `blobs/`).
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger("engine.sources")

RUNPOD_HUB_CACHE = Path("/runpod-volume/huggingface-cache/hub")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def hub_caches() -> list[Path]:
    """Where to look, in order: RunPod's model cache, then huggingface_hub's (HF_HUB_CACHE, read when asked so a
    test or an operator can point it elsewhere)."""
    from huggingface_hub import constants
    own = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME")
                                             else constants.HF_HUB_CACHE)
    return [RUNPOD_HUB_CACHE, Path(own).expanduser()]


def cached_snapshot(repo_id: str, revision: str | None, role: str) -> Path | None:
    """The snapshot folder of `repo_id` at `revision` (a branch, tag or commit; default main) in a Hub cache on
    this host, when it holds every file a `role` ("model", "tokenizer", "adapter") needs; else None."""
    for cache in hub_caches():
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        if not repo.is_dir():
            continue
        commit = _commit(repo, revision or "main")
        if commit is None:
            log.info("%s: the Hub cache %s has no snapshot for revision %s", repo_id, cache, revision or "main")
            continue
        snapshot = repo / "snapshots" / commit
        missing = _missing(snapshot, role)
        if missing is None:
            return snapshot
        log.warning("%s: the cached snapshot %s is incomplete (%s); not using it", repo_id, snapshot, missing)
    return None


def _commit(repo: Path, revision: str) -> str | None:
    if _COMMIT.fullmatch(revision):
        return revision if (repo / "snapshots" / revision).is_dir() else None
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        return commit if _COMMIT.fullmatch(commit) and (repo / "snapshots" / commit).is_dir() else None
    if re.fullmatch(r"[0-9a-f]{7,39}", revision):  # a short commit hash
        found = [p.name for p in (repo / "snapshots").glob(f"{revision}*") if p.is_dir()]
        return found[0] if len(found) == 1 else None
    return None


def _missing(snapshot: Path, role: str) -> str | None:
    """What the snapshot lacks for `role` (None: nothing). Files are links into blobs/, so each must resolve."""
    if not snapshot.is_dir():
        return "no such folder"
    names = {p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()}  # follows links
    if role == "adapter":
        return None if "adapter_config.json" in names else "no adapter_config.json"
    if role == "tokenizer":
        return None if names & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} else \
            "no tokenizer files"
    if any(name.endswith(".gguf") for name in names):
        return None
    if "config.json" not in names:
        return "no config.json"
    for index in (n for n in names if n.endswith(".index.json")):
        try:
            shards = set(json.loads((snapshot / index).read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"{index} is unreadable"
        if shards - names:
            return f"{len(shards - names)} weight shard(s) of {index}"
    return None if any(name.endswith(_WEIGHTS) for name in names) else "no weight files"
