"""Host memory of a long-running worker: freed memory back to the system once the engine is idle, and the
model's objects out of the garbage collector's way.

glibc's allocator keeps freed blocks for reuse: after a burst of long prompts (KV-cache growth, prefix-cache
entries, activations) the process keeps gigabytes it no longer uses, and the machine sees them as taken.
`malloc_trim` returns the free pages of every arena. It costs a walk over the free lists, so it runs when the
engine has been idle for a moment, once per idle period, never between the steps of running requests.
Elsewhere than glibc (musl, macOS) this does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import time
from typing import Callable

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


def release() -> bool:
    """Return free heap pages to the system now; whether anything could be done."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class IdleRelease:
    """One per generation loop: each loop judges its own idleness. (A process may hold several engines; with one
    shared record, two loops reporting their different step counts in turn looked forever busy, and nothing was
    ever given back.)"""

    def __init__(self, on_idle: Callable[[], None] | None = None):
        self._on_idle = on_idle  # the loop's own memory to give back at the same moment (free KV blocks)
        self._last_work: int | None = None
        self._idle_since = 0.0
        self._trimmed = True  # nothing to give back before any work

    def tick(self, work_done: int) -> None:
        """Called by the loop on each pass with a count of the work it has done so far (its steps): while the
        count stands still the loop is idle. Once per idle period, after IDLE_BEFORE_TRIM_S of idleness (a client's
        next request usually follows at once and must not wait behind the release), it gives the loop's own memory
        back and trims the heap."""
        now = time.monotonic()
        if work_done != self._last_work:
            self._last_work, self._idle_since, self._trimmed = work_done, now, False
            return
        if self._trimmed or now - self._idle_since < IDLE_BEFORE_TRIM_S:
            return
        self._trimmed = True
        started = time.perf_counter()
        _collect_load_garbage()
        if self._on_idle is not None:
            self._on_idle()
        if release():
            log.debug("idle: returned free host memory to the system in %.1f ms", (time.perf_counter() - started) * 1e3)


_collect_pending = False  # the load's garbage was frozen with the model; collected at the first idle moment


def freeze_long_lived() -> None:
    """Move every object alive now (the loaded model, tokenizer and libraries: hundreds of thousands of them) out
    of the collector's full passes. A request body of 100k small lists triggers full collections, and each one
    walked all of them, so parsing that body took many times longer, with the event loop held throughout.
    The full collection that frees the load's own garbage first walks those same objects (a quarter of a second
    for the embedded model), so it waits for the engine's first idle moment instead of delaying the start."""
    global _collect_pending
    gc.freeze()
    _collect_pending = True


def _collect_load_garbage() -> None:
    global _collect_pending
    if _collect_pending:
        _collect_pending = False
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def thaw() -> None:
    """Hand the frozen objects back to the collector (an engine closed: its model, caches and threads' state).
    It never looks at frozen objects, so their reference cycles would hold every closed engine's memory for the
    life of the process (1 GB per start of the embedded model); the next start freezes what is alive then."""
    global _collect_pending
    _collect_pending = False
    gc.unfreeze()
    gc.collect()
