"""One log line per request, in logfmt (``key=value`` pairs), on the ``prefixgate.request`` logger.

The line carries the model, the client key's name and the tenant (cache salt), token counts (prompt / cached /
completion), TTFT, duration, status and finish reason. It never carries prompt or completion text, API keys (a
key's configured name only), admin tokens or the ``user`` field. Values a client chose (model, tenant header in
open mode) are quoted with every control character escaped: one request is always exactly one line.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

logger = logging.getLogger("prefixgate.request")


@dataclass
class RequestRecord:
    """What is logged about one request. Times are seconds; token counts are tokens.

    ``status`` is the HTTP status sent, or 499 when the client closed the connection before the end.
    """

    request_id: str
    path: str
    status: int
    model: str | None = None
    key: str | None = None
    """The configured name of the client key that authenticated the request (never the key itself)."""
    tenant: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    duration_s: float | None = None
    finish_reason: str | None = None
    error_code: str | None = None
    prefix_key: str | None = None
    rules_applied: int | None = None
    upstream_request_id: str | None = None
    """The upstream's id for its answer (``ChatRequest.upstream_request_id``), for a provider ticket."""


CLIENT_CLOSED = 499
"""Status logged for a request whose client disconnected mid-stream (nginx's convention)."""


def format_record(record: RequestRecord) -> str:
    """The logfmt line: fields in a fixed order, ``None`` fields left out, seconds as milliseconds."""
    parts = [f"request_id={record.request_id}", f"path={record.path}", f"status={record.status}"]
    for name in ("model", "key", "tenant"):
        value = getattr(record, name)
        if value is not None:
            parts.append(f"{name}={_quote(value)}")
    parts.append(f"stream={'true' if record.stream else 'false'}")
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        value = getattr(record, name)
        if value is not None:
            parts.append(f"{name}={value}")
    if record.ttft_s is not None:
        parts.append(f"ttft_ms={record.ttft_s * 1000:.1f}")
    if record.duration_s is not None:
        parts.append(f"duration_ms={record.duration_s * 1000:.1f}")
    for name in ("finish_reason", "error_code", "prefix_key", "rules_applied", "upstream_request_id"):
        value = getattr(record, name)
        if value is not None:
            parts.append(f"{name}={_quote(str(value))}")
    return " ".join(parts)


def log_request(record: RequestRecord) -> None:
    """Emit the record's line at INFO (4xx/5xx at WARNING)."""
    level = logging.WARNING if record.status >= 400 and record.status != CLIENT_CLOSED else logging.INFO
    if logger.isEnabledFor(level):  # the line is built only when it is written
        logger.log(level, format_record(record))


_PLAIN = re.compile(r"[A-Za-z0-9_.:/-]+")
"""A value written bare: ASCII letters and digits, ``-_.:/`` (one C scan instead of a Python test per character)."""


def _quote(value: str) -> str:
    """``value`` bare when it is plain (ASCII letters, digits, ``-_.:/``), else a JSON string: quotes,
    backslashes and control characters (newlines included) escaped."""
    if _PLAIN.fullmatch(value):
        return value
    return json.dumps(value)  # ASCII only: no raw U+2028 or other line breaks either
