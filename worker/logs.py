"""Log lines the worker writes: one line per event, with the job it belongs to.

    2026-11-22T03:13:39.123Z INFO openai_compat job=a1b2c3 request done request=chatcmpl-... prompt_tokens=37 ...

The job id comes from a context variable set for the duration of each job, so every line logged while
serving a job (its errors and tracebacks too) names it. Prompt and output text are logged only at DEBUG.
"""
from __future__ import annotations

import contextvars
import logging
import sys
import time

from engine import redact

current_job = contextvars.ContextVar("current_job", default="-")


class _JobFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.job = current_job.get()
        return True


class _Formatter(logging.Formatter):
    """UTC timestamps; and no line leaves with a credential in it (library errors quote URLs with passwords)."""
    converter = time.gmtime

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))

    def formatTime(self, record, datefmt=None):  # noqa: N802 - logging's API
        return time.strftime("%Y-%m-%dT%H:%M:%S", self.converter(record.created)) + f".{int(record.msecs):03d}Z"


def configure(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_JobFilter())
    handler.setFormatter(_Formatter("%(asctime)s %(levelname)s %(name)s job=%(job)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Libraries chatty at INFO (HTTP access lines, weight-loading progress) stay at WARNING.
    for name in ("aiohttp.access", "httpx", "urllib3", "filelock", "botocore", "s3transfer"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


def fields(**values) -> str:
    """`key=value` pairs for a log message, in the order given."""
    return " ".join(f"{key}={value}" for key, value in values.items())
