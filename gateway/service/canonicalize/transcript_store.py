"""The canonical transcript memory shared through Redis, so several gateways agree on what was sent.

``RedisTranscriptStore`` implements ``rules.transcript.TranscriptStore``: every entry is kept in the
process's own ``InProcessTranscriptStore`` and written to Redis (``SET key value PX ttl``); a lookup asks
the local store first and Redis (one ``MGET``) only for what it lacks, copying what Redis returns into the
local store. Redis is an accelerator, never a dependency: a Redis error, a refused connection or a reply
slower than ``socket_timeout_s`` is counted (``errors``) and, for ``retry_after_s`` seconds, Redis is not
asked again (``skipped``); the request goes on with the local store only. Nothing here raises to the
caller.

Keys are ``{prefix}{hex of the 32-byte transcript key}``; values are the entries' bytes
(``TranscriptEntry.encode``: framed zlib-compressed JSON, ``rules.transcript_entry``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from rules.transcript import InProcessTranscriptStore

DEFAULT_PREFIX = "prefixgate:transcript:"


@dataclass
class RedisStoreStats:
    """Counters of a ``RedisTranscriptStore`` (cumulative).

    Attributes:
        redis_hits: keys found in Redis (not in the local store).
        redis_misses: keys asked of Redis and not found there.
        writes: entries written to Redis.
        errors: Redis calls that failed or timed out (each starts a ``retry_after_s`` pause).
        skipped: calls not made because Redis was paused after an error.
    """

    redis_hits: int = 0
    redis_misses: int = 0
    writes: int = 0
    errors: int = 0
    skipped: int = 0


class RedisTranscriptStore:
    """Transcript entries in this process and in Redis.

    Args:
        url: a redis-py URL (``redis://host:6379/0``); ignored when ``client`` is given.
        client: a ready ``redis.Redis`` (tests); its own timeouts apply.
        local: the in-process store in front of Redis (default: ``InProcessTranscriptStore()``); its TTL is
            also the Redis entries' TTL.
        prefix: prefix of every Redis key (separates deployments and tests).
        socket_timeout_s: connect and read timeout of each Redis call, in seconds.
        retry_after_s: seconds Redis is left alone after a failed call.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        client: redis.Redis | None = None,
        local: InProcessTranscriptStore | None = None,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout_s: float = 0.05,
        retry_after_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.local = local if local is not None else InProcessTranscriptStore()
        self.prefix = prefix
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._client = (
            client
            if client is not None
            else redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry_on_timeout=False,
                health_check_interval=0,
            )
        )
        self._paused_until = float("-inf")
        self._lock = threading.Lock()
        self.stats = RedisStoreStats()

    def _key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _available(self) -> bool:
        with self._lock:
            if self._clock() < self._paused_until:
                self.stats.skipped += 1
                return False
            return True

    def _failed(self) -> None:
        with self._lock:
            self.stats.errors += 1
            self._paused_until = self._clock() + self.retry_after_s

    def _call(self, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, result) or (False, None) when Redis is paused, failed or timed out."""
        if not self._available():
            return False, None
        try:
            return True, fn()
        except (redis.RedisError, OSError):
            self._failed()
            return False, None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """See ``rules.transcript.TranscriptStore.get_many``: the local store first, then one ``MGET``."""
        found = self.local.get_many(keys)
        missing = [i for i, value in enumerate(found) if value is None]
        if not missing:
            return found
        ok, values = self._call(lambda: self._client.mget([self._key(keys[i]) for i in missing]))
        if not ok or not isinstance(values, list) or len(values) != len(missing):
            return found
        for i, value in zip(missing, values, strict=True):
            if isinstance(value, bytes):
                found[i] = value
                self.local.put(keys[i], value)
                self.stats.redis_hits += 1
            else:
                self.stats.redis_misses += 1
        return found

    def put(self, key: bytes, value: bytes) -> None:
        """See ``rules.transcript.TranscriptStore.put``: the local store, then Redis with the same TTL."""
        self.local.put(key, value)
        ttl_ms = max(1, int(self.local.ttl_s * 1000))
        ok, _ = self._call(lambda: self._client.set(self._key(key), value, px=ttl_ms))
        if ok:
            self.stats.writes += 1

    def close(self) -> None:
        """Close the Redis connections (the local store stays usable)."""
        try:
            self._client.close()
        except (redis.RedisError, OSError):
            self._failed()
