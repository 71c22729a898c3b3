"""Credentials out of text that is logged or shown: passwords in URLs, and the values of secret settings.

A URL can carry `user:password@` (an S3 endpoint, a proxy, a model source), and error messages of the libraries
below quote URLs as they were given. Everything the worker prints passes through `redact`.
"""
from __future__ import annotations

import os
import re

# scheme://userinfo@ : greedy up to the last @ before the host, so a password with an unescaped @ goes too.
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s'\"<>]*@")
# Environment variables whose values are secrets wherever they appear.
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL", re.IGNORECASE)
_MIN_SECRET_CHARS = 6  # shorter values ("1", "true") would redact ordinary words


def redact_urls(text: str) -> str:
    """`text` with the user and password of every URL replaced by ***."""
    return _URL_USERINFO.sub(r"\g<scheme>***@", text)


def secret_values() -> list[str]:
    """Values of the environment's secret variables (AWS_SECRET_ACCESS_KEY, HF_TOKEN, ...), longest first."""
    values = {value for name, value in os.environ.items()
              if _SECRET_NAME.search(name) and len(value) >= _MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    """`text` without URL credentials and without any of `secrets` (default: the environment's secrets)."""
    text = redact_urls(text)
    for secret in secret_values() if secrets is None else secrets:
        if secret and secret in text:
            text = text.replace(secret, "***")
    return text
