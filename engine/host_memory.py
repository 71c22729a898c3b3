"""Giving freed host memory back to the system once the engine is idle.

glibc's allocator keeps freed blocks for reuse: after a burst of long prompts (KV-cache growth, prefix-cache
entries, activations) the process keeps gigabytes it no longer uses, and the machine sees them as taken.
`malloc_trim` returns the free pages of every arena. It costs a walk over the free lists, so it runs when the
engine has been idle for a moment, once per idle period, never between the steps of running requests.
Elsewhere than glibc (musl, macOS) this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

log = logging.getLogger("engine")

IDLE_BEFORE_TRIM_S = 0.5  # a pause between two requests is not idleness worth trimming for


def _load_malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()
_lock = threading.Lock()
_idle_since: float | None = None
_trimmed = False


def release() -> bool:
    """Return free heap pages to the system now; whether anything could be done."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def release_if_idle(idle: bool = True) -> None:
    """Called by the engine loop on each pass: `idle` when it has nothing to run. Trims once per idle period,
    after IDLE_BEFORE_TRIM_S of idleness."""
    global _idle_since, _trimmed
    with _lock:
        now = time.monotonic()
        if not idle:
            _idle_since, _trimmed = None, False
            return
        if _idle_since is None:
            _idle_since = now
        if _trimmed or now - _idle_since < IDLE_BEFORE_TRIM_S:
            return
        _trimmed = True
    started = time.perf_counter()
    if release():
        log.debug("idle: returned free host memory to the system in %.1f ms", (time.perf_counter() - started) * 1e3)
