"""Settings of the tiers (fields of ``engine.api.EngineConfig``); plain data, no torch, no I/O.

Default: no tiers. A disk tier is not on by default because it would write the KV of every tenant's prompts
(from which prompt text can be partly reconstructed) to a local directory, up to gigabytes, without anyone
asking for it; ``tiers: [disk]`` and a directory turn it on.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

TIER_NAMES = ("disk", "redis")
"""The tiers below the RAM pool, in lookup order."""


@dataclass(frozen=True)
class DiskTierConfig:
    """``engine.tier_disk``.

    Attributes:
        directory: where the disk tier keeps its caches (None: required when ``disk`` is in ``tiers``).
        budget_bytes: the tier's byte budget (entries plus SQLite files), shared by levels.
    """

    directory: str | None = None
    budget_bytes: int = 8 << 30


@dataclass(frozen=True)
class RedisTierConfig:
    """``engine.tier_redis``.

    Attributes:
        url: ``redis://host:port/db``.
        prefix: key prefix of this deployment (every gateway of one deployment uses the same).
        budget_bytes: the deployment's byte budget in Redis, shared by levels.
        timeout_s: socket timeout of every Redis call (a slow Redis must not slow a request).
        retry_s: after a connection error or a timeout, seconds before the tier tries again.
    """

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "prefixgate"
    budget_bytes: int = 1 << 30
    timeout_s: float = 0.25
    retry_s: float = 2.0


def redis_url_db_problem(url: str) -> str | None:
    """What is wrong with the database a Redis URL names, or None (none named: database 0, or a non-negative
    integer). ``redis-py`` ignores a path it cannot read as a number (``redis://host:6379/abc`` silently uses
    database 0) and takes a negative one; both are refused here. A database past the server's ``databases``
    setting is only known to the server (refused at start)."""
    parts = urlsplit(url)
    candidates = []
    if parts.scheme != "unix":
        path = unquote(parts.path).strip("/")
        if path:
            candidates.append(("path", path))
    for value in parse_qs(parts.query).get("db", []):
        candidates.append(("db= query argument", value))
    for where, value in candidates:
        if not (value.isascii() and value.isdigit()):
            return (
                f"the database ({where} {value!r}) must be a non-negative integer, as in redis://host:6379/0"
            )
    return None
