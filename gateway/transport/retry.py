"""Retries before the first byte: the backoff policy and ``Retry-After`` parsing.

Backoff ("full jitter", AWS Architecture Blog, "Exponential Backoff And Jitter", 2015,
https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/)::

    delay(attempt) = uniform(0, min(backoff_max_s, backoff_base_s * 2 ** attempt))

raised to ``Retry-After`` (RFC 9110 section 10.2.3, https://www.rfc-editor.org/rfc/rfc9110#section-10.2.3;
seconds or an HTTP-date; OpenAI's ``retry-after-ms`` first, as its SDK reads it) when the upstream sent one.
``max_retry_after_s`` bounds the time one request spends waiting on ``Retry-After``s in all: a wait that would
pass it is not made, and the upstream's 429 goes to the client at once with its ``Retry-After`` (the client's
SDK retries it; waiting 25 s twice to answer a 429 anyway held a client 50 s, a fresh-user trial).
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Retries before the first byte.

    Attributes:
        retries: extra attempts after the first (0 = no retry).
        backoff_base_s: first backoff ceiling, seconds.
        backoff_max_s: largest backoff ceiling, seconds.
        max_retry_after_s: most seconds one request waits on ``Retry-After`` in all, over its retries; a wait
            that would pass it fails at once with the upstream's answer (429, 503, 529).
    """

    retries: int = 2
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    max_retry_after_s: float = 30.0

    def delay(
        self, attempt: int, retry_after_s: float | None = None, rng: Callable[[], float] = random.random
    ) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (``attempt`` counts from 0): full jitter, at least
        ``retry_after_s``."""
        ceiling = min(self.backoff_max_s, self.backoff_base_s * (2**attempt))
        wait = rng() * ceiling
        if retry_after_s is not None:
            wait = max(wait, retry_after_s)
        return wait


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` in seconds (RFC 9110 10.2.3: delay-seconds or an HTTP-date); None when absent or
    bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # "inf", "nan" or "1e400" is not a delay anyone can wait for
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


def retry_after_from(headers: Mapping[str, str]) -> float | None:
    """Seconds an upstream asked to wait: ``retry-after-ms`` (milliseconds, OpenAI's; read first, as its SDK
    does) or ``Retry-After`` (``parse_retry_after``); None when neither is a usable delay."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            value = float(millis.strip())
        except ValueError:
            value = math.nan
        if math.isfinite(value):
            return max(value, 0.0) / 1000.0
    return parse_retry_after(headers.get("retry-after"))
