"""Torch work that runs beside the engine's thread (an image's encoder pass, an adapter read at runtime) runs on a
thread of its own that ends with it.

Each thread that runs a parallel torch operation keeps an OpenMP team of its own for as long as it lives, and
libgomp counts every team's threads: while a process holds more of them than it has cores, every team waits at its
barriers by sleeping instead of spinning. A pooled worker thread (asyncio.to_thread's) that had once encoded an
image kept its team idle for good, and the engine's steps then took up to twice as long.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


async def in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a new thread, awaited; the thread (and any OpenMP team it made) ends when fn returns."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the caller was cancelled meanwhile
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed while fn ran: nobody is waiting
            pass

    threading.Thread(target=run, name="torch-apart", daemon=True).start()
    return await future
