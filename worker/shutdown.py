"""SIGTERM on the platform: take no new jobs, let running jobs finish within a grace period, then exit 0.

The runpod SDK's own SIGTERM handler only stops its job-fetch loop; the process then lingers in a job-take long
poll (up to 90 s) and waits for running jobs without any limit, while the platform kills it when its own patience
ends, cutting whatever is still running without a word. This wraps the SDK's handler: the SDK stops fetching
as before, and a drain thread waits until the SDK has no job in progress (results posted included) or the grace
period is over, logs every job it had to cut, and exits 0.

The SDK's heartbeat is a daemon child process (multiprocessing), which Python ends only at a normal interpreter
exit; the worker leaves through os._exit (here and after a device failure) or a kill, and the child went on
telling the platform that a gone worker was alive. `exit_process` ends the children first, and
`children_die_with_the_worker` makes the kernel end them when the worker dies any other way.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from typing import Callable

log = logging.getLogger("handler")

_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: exit_process still ends the children on the usual paths
        return
    if os.getppid() != parent:  # the worker died before the request took effect
        os._exit(0)


def children_die_with_the_worker() -> None:
    """Every process this one forks from now on gets SIGTERM when the worker's process dies, however it dies.
    Call it from the main thread: the kernel ties the signal to the thread that forked the child."""
    parent = os.getpid()
    os.register_at_fork(after_in_child=lambda: _die_with_parent(parent))


def exit_process(code: int) -> None:
    """os._exit, after ending the processes multiprocessing started (the SDK's heartbeat among them)."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=2)
        if child.is_alive():
            child.kill()
    os._exit(code)


def sdk_jobs_in_progress() -> list[str]:
    """Ids of the jobs the SDK holds: taken and not yet finished, posting the result included."""
    from runpod.serverless.modules.worker_state import JobsProgress
    for _ in range(5):
        try:
            return sorted(str(job) for job in list(JobsProgress()))
        except RuntimeError:  # the set changed while it was copied (the SDK's loop runs on another thread)
            continue
    return []


class GracefulShutdown:
    def __init__(self, grace_s: float, jobs: Callable[[], list[str]] = sdk_jobs_in_progress,
                 exit: Callable[[int], None] = exit_process):
        self.grace_s = grace_s
        self._jobs = jobs
        self._exit = exit
        self._installed = False
        self._drainer: threading.Thread | None = None

    def install(self) -> None:
        """Wrap the SIGTERM handler in place (the SDK's, which must be installed already). Main thread only."""
        if self._installed:
            return
        self._installed = True
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum, frame):
            if callable(previous):
                previous(signum, frame)  # the SDK: fetch no more jobs
            if self._drainer is None:
                self._drainer = threading.Thread(target=self.drain, name="shutdown-drain", daemon=True)
                self._drainer.start()

        signal.signal(signal.SIGTERM, on_sigterm)

    def join(self) -> None:
        """When the SDK's loop has ended on its own after SIGTERM: let the drain finish its report (and exit)."""
        if self._drainer is not None:
            self._drainer.join()

    def drain(self) -> None:
        running = self._jobs()
        log.info("SIGTERM: taking no new jobs; %d running%s, waiting up to %.0f s for them", len(running),
                 f" ({', '.join(running)})" if running else "", self.grace_s)
        deadline = time.monotonic() + self.grace_s
        while running and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            running = self._jobs()
        if running:
            log.warning("shutdown: cut %d jobs still running after the %.0f s grace period: %s", len(running),
                        self.grace_s, ", ".join(running))
        else:
            log.info("shutdown: every running job finished; exiting")
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(0)
