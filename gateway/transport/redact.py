"""Keeping secrets out of error texts and stats: API keys (known ones verbatim, and anything shaped like an
OpenAI or Anthropic key, a Bearer token or an ``api_key=...`` value) become ``[REDACTED]``; replica URLs lose
user-info and query string. Every message the transport builds passes through ``redact``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

import httpx

REDACTED = "[REDACTED]"


_KEY_PATTERN = re.compile(
    r"sk-ant-[A-Za-z0-9_\-]{6,}"  # Anthropic keys
    r"|sk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_\-]{12,}"  # OpenAI keys
    r"|(?i:bearer)\s+[A-Za-z0-9._\-~+/]{8,}=*"  # Authorization: Bearer <token>
    # key=..., "api_key": "..."
    r"|(?i:(?:x-api-key|api[_-]?key|access[_-]?token)[\"']?\s*[:=]\s*[\"']?)[^\s\"',;}&]{6,}"
)
_KEY_PREFIX = re.compile(r"(?i:(?:x-api-key|api[_-]?key|access[_-]?token)[\"']?\s*[:=]\s*[\"']?)")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every known secret and anything shaped like an API key replaced by ``[REDACTED]``.

    Known secrets (resolved ``api_key`` values) are removed verbatim; then OpenAI (``sk-...``), Anthropic
    (``sk-ant-...``) keys, ``Bearer`` tokens and ``api_key=...`` / ``"x-api-key": "..."`` values are masked.
    """
    for secret in secrets:
        if secret and len(secret) >= 4:
            # verbatim, stripped, and as repr() shows it inside an exception text (``\\n`` for a newline)
            for form in {secret, secret.strip(), repr(secret)[1:-1]}:
                if len(form) >= 4:
                    text = text.replace(form, REDACTED)

    def mask(match: re.Match[str]) -> str:
        prefix = _KEY_PREFIX.match(match.group(0))
        if prefix:
            return prefix.group(0) + REDACTED
        if match.group(0).lower().startswith("bearer"):
            return "Bearer " + REDACTED
        return REDACTED

    return _KEY_PATTERN.sub(mask, text)


@functools.lru_cache(maxsize=1024)
def redact_url(url: str) -> str:
    """A URL without user-info or query string (names of replicas in stats and logs). Memoized: the same few
    replica URLs come back on every request, and parsing one costs more than the rest of the call."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(username=None, password=None, query=None, fragment=None))


def redact_json(value: Any, secrets: tuple[str, ...]) -> Any:
    """A JSON value with ``redact`` applied to every string in it."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: redact_json(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_json(v, secrets) for v in value]
    return value
