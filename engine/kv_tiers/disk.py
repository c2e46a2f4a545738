"""The disk tier: KV block entries in ``diskcache`` caches on a local directory, one cache per level.

Layout: ``{directory}/{level}/`` is a ``diskcache.Cache`` whose ``size_limit`` is the level's share of the
tier's byte budget and whose eviction policy is least-recently-used (a read refreshes an entry). After every
write the level's cache is culled until its volume (entries plus its SQLite file) is back under its share, so
the budget holds after each write, not eventually. An entry's tag is its expiry time on the tier's clock; on
the real clock diskcache also holds it (``expire=``): such an entry reads as absent once it expires, and
``sweep_expired`` (every write, and the writer thread when idle) removes it and counts it once in
``disk.expired.{level}``; on another clock (tests) a read past the tag deletes and counts it.

Failures never reach a request: a write that fails (disk full, unwritable directory, SQLite busy) is
skipped and counted (``disk.write_errors``); a read that fails is a miss (``disk.read_errors``). Only a
directory that cannot be created or written at start is an error (``TierConfigError``).
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import diskcache

from engine.errors import EngineError
from engine.kv_tiers.catalog import RECORD_KEY_PREFIX
from engine.kv_tiers.counters import TierCounters
from engine.kv_tiers.failure_log import FailureLog
from engine.kv_tiers.policy import LEVELS, TierPolicies

log = logging.getLogger(__name__)

_FAILURES = (OSError, sqlite3.Error, diskcache.Timeout)

EMPTY_LEVEL_BYTES = 32 << 10
"""Bytes of an empty level's SQLite file (``diskcache``), counted in its volume and so in its budget."""


class TierConfigError(EngineError):
    """A tier cannot start: ``key`` is the config key at fault, ``reason`` why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class DiskTier:
    """KV block entries on a local disk, per-level byte budgets and TTLs.

    Args:
        directory: where the caches live (created if missing).
        budget_bytes: the tier's byte budget (> 0), shared between levels by ``policies``.
        policies: per-level policies (``policies.policy("disk", level)``).
        counters: where to count.
        clock: seconds, for TTLs (default ``time.time``; tests pass a fake one).

    Raises:
        TierConfigError: the directory cannot be created or written, or the budget is not positive.
    """

    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        budget_bytes: int,
        policies: TierPolicies,
        counters: TierCounters,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if budget_bytes <= 0:
            raise TierConfigError("engine.tier_disk.budget_bytes", f"must be > 0, got {budget_bytes}")
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.policies = policies
        self.counters = counters
        self.clock = clock
        self._real_time = clock is time.time
        self.failures = FailureLog(log, self.name)
        """Warnings of failed writes: the first per cause, then one summary line per interval."""
        self._caches: dict[str, diskcache.Cache] = {}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
            for level in LEVELS:
                limit = int(budget_bytes * policies.policy(self.name, level).budget_share)
                self._caches[level] = diskcache.Cache(
                    str(self.directory / level),
                    size_limit=limit,
                    eviction_policy="least-recently-used",
                    cull_limit=0,  # culled by ``put`` itself, to the limit
                    timeout=1.0,
                )
        except _FAILURES as e:
            self.close()
            raise TierConfigError(
                "engine.tier_disk.directory", f"{self.directory} is not writable ({e})"
            ) from e

    # ---- reads ----------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The entry stored under ``key`` in any level, or None (absent, expired, or the read failed)."""
        for level, cache in self._caches.items():
            try:
                found = cache.get(key, default=None, tag=True)
            except _FAILURES as e:
                self.counters.add("disk.read_errors")
                log.debug("disk tier read failed: %s", e)
                return None
            value, expires_at = found if isinstance(found, tuple) else (None, None)
            if value is None:
                continue
            if expires_at is not None and self.clock() >= expires_at:
                self.counters.add(f"disk.expired.{level}")
                self._delete_in(cache, key)
                return None
            return bytes(value)
        return None

    # ---- writes ---------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes, levels: frozenset[str]) -> bool:
        """Store ``data`` under ``key`` in the level (of ``levels``) with the longest policy.

        Returns:
            True when written; False when the write failed (counted; the tier stays usable).
        """
        level, policy = self.policies.resolve(self.name, levels)
        cache = self._caches[level]
        expires_at = None if policy.ttl_s is None else self.clock() + policy.ttl_s
        if len(data) > cache.size_limit:
            self.counters.add("disk.write_errors")
            self.failures.failed(
                "write skipped",
                f"an entry of {len(data)} bytes is larger than the {level} level's budget ({cache.size_limit} "
                "bytes): raise engine.tier_disk.budget_bytes",
            )
            return False
        try:
            self.sweep_expired()
            for other, c in self._caches.items():
                if other != level:
                    c.delete(key)
            cache.set(key, data, expire=policy.ttl_s if self._real_time else None, tag=expires_at)
            if cache.volume() > cache.size_limit:
                self.counters.add("disk.evicted", cull_to_limit(cache))
        except _FAILURES as e:
            self.counters.add("disk.write_errors")
            self.failures.failed("write skipped", e)
            return False
        self.counters.add("disk.writes")
        self.counters.add("disk.bytes_written", len(data))
        return True

    def sweep_expired(self) -> int:
        """Remove the entries diskcache holds as expired (real clock only) and count them per level
        (``disk.expired.{level}``): without this they read as absent and were never counted. Returns how many
        went; a failure is counted (``disk.write_errors``) and leaves them for the next sweep. Also logs the
        summary of failed writes once its interval has passed (``FailureLog.flush``)."""
        self.failures.flush()
        if not self._real_time:
            return 0
        total = 0
        for level, cache in self._caches.items():
            try:
                gone = cache.expire()
            except _FAILURES:
                self.counters.add("disk.write_errors")
                continue
            if gone:
                self.counters.add(f"disk.expired.{level}", gone)
                total += gone
        return total

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every level. Returns True when something was removed."""
        return any([self._delete_in(c, key) for c in self._caches.values()])

    def _delete_in(self, cache: diskcache.Cache, key: str) -> bool:
        try:
            return bool(cache.delete(key))
        except _FAILURES:
            self.counters.add("disk.write_errors")
            return False

    # ---- introspection --------------------------------------------------------------------------------
    def keys(self) -> Iterator[tuple[str, str]]:
        """``(level, key)`` of every entry (admin listing; O(entries))."""
        for level, cache in self._caches.items():
            for key in cache.iterkeys():
                yield level, key

    def peek(self, key: str) -> tuple[bool, float | None]:
        """Whether ``key`` is stored (and unexpired on the tier's clock), and its expiry (None = never).
        Refreshes nothing, reads no value."""
        now = self.clock()
        for cache in self._caches.values():
            try:
                found = cache.get(key, default=None, read=True, tag=True)
            except _FAILURES:
                self.counters.add("disk.read_errors")
                return False, None
            value, expires_at = found if isinstance(found, tuple) else (None, None)
            if value is None:
                continue
            if hasattr(value, "close"):
                value.close()
            if expires_at is not None and now >= expires_at:
                return False, None
            return True, expires_at
        return False, None

    def peek_many(self, keys: Sequence[str]) -> list[tuple[bool, float | None]]:
        """``peek`` of each key."""
        return [self.peek(key) for key in keys]

    def scan_heads(self, head_bytes: int = 4096) -> Iterator[tuple[str, bytes]]:
        """``(key, first head_bytes bytes of its entry)`` of every entry (admin: listing, dropping by tenant
        or model; O(entries), reads only the heads of entries kept as files)."""
        for cache in self._caches.values():
            for key in list(cache.iterkeys()):
                try:
                    value = cache.get(key, default=None, read=True)
                except _FAILURES:
                    self.counters.add("disk.read_errors")
                    continue
                if value is None:
                    continue
                if isinstance(value, bytes | bytearray):
                    yield key, bytes(value[:head_bytes])
                else:
                    with value:
                        yield key, value.read(head_bytes)

    def level_bytes(self, level: str) -> int:
        """Bytes the level's cache takes on disk (entries plus its SQLite file)."""
        return self._caches[level].volume()

    def level_limit(self, level: str) -> int:
        """The level's byte budget."""
        return self._caches[level].size_limit

    def nbytes(self) -> int:
        """Bytes the tier takes on disk (every level)."""
        return sum(c.volume() for c in self._caches.values())

    def clear(self) -> None:
        """Remove every entry (tests, admin)."""
        for cache in self._caches.values():
            cache.clear()

    def close(self) -> None:
        """Close the SQLite connections (the entries stay)."""
        for cache in self._caches.values():
            cache.close()


def cull_to_limit(cache: diskcache.Cache) -> int:
    """Evict ``cache``'s least recently used block entries one at a time (diskcache's own order:
    ``access_time``) until its volume is within its ``size_limit``; returns how many were removed. Prefix
    records are never evicted (``engine.kv_tiers.catalog.is_record_key``: a few KB each, bounded by the
    catalog's ``max_entries``); with only records left, the level stays over its share by their bytes.

    diskcache's ``Cache.cull`` removes ten entries per pass: a level holding fewer than ten lost them all, the
    chain head just written included (chains are written deepest first so that the head is the newest), and a
    restart then served nothing; a larger level kept fewer entries than fit. Reads diskcache's SQLite table
    (``Cache._sql``; the same query its own cull runs, one row at a time); the tier's keys are strings, stored
    as they are."""
    removed = 0
    for _ in range(len(cache) + 1):
        if cache.volume() <= cache.size_limit:
            break
        row = cache._sql(
            "SELECT key FROM Cache WHERE substr(key, 1, ?) != ? ORDER BY access_time LIMIT 1",
            (len(RECORD_KEY_PREFIX), RECORD_KEY_PREFIX),
        ).fetchone()
        if row is None or not cache.delete(row[0]):
            break
        removed += 1
    return removed
