"""The cache-aware index shared by several gateways through Redis, with bounded staleness.

``RoutingShare`` is attached to one upstream's ``CacheAwarePolicy``. Each placement this gateway makes
(replica, block hashes) goes into a bounded outbox; every ``interval_s`` one pipelined exchange writes the
outbox to Redis and reads what every gateway wrote since the last exchange:

- per replica one sorted set ``{prefix}{upstream}:{replica}`` of block hashes scored by the time they were
  last routed there (milliseconds since the epoch), trimmed to the index's capacity (``ZREMRANGEBYRANK``:
  the oldest go first, like the local LRU) and expiring ``ttl_s`` after the last write;
- read back with ``ZRANGEBYSCORE`` from a little before the last exchange (``2 * interval_s`` of slack for
  other gateways' clocks and delays; re-reading a hash is harmless) into the policy's approximate index.

So another gateway's placement is seen here at most ``interval_s`` plus one exchange later. Redis is an
accelerator, never a dependency: an error, a refused connection or a reply slower than ``timeout_s`` is
counted and Redis is left alone for ``retry_after_s`` (routing goes on with the local index; the outbox keeps
the newest ``outbox_limit`` placements for when it is back). Nothing here raises to the request path. Load
(in-flight counts) stays per gateway: each gateway bounds its own share of every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from gateway.transport.routing_policy import CacheAwarePolicy

DEFAULT_PREFIX = "prefixgate:route:"


@dataclass
class RoutingShareStats:
    """Counters (cumulative): exchanges done, placements written, hashes read, errors, skipped exchanges,
    placements dropped from a full outbox."""

    exchanges: int = 0
    written: int = 0
    read: int = 0
    errors: int = 0
    skipped: int = 0
    dropped: int = 0


class RoutingShare:
    """Exchange one upstream's cache-aware placements with other gateways through Redis.

    Args:
        policy: the upstream's ``CacheAwarePolicy`` (its ``approx`` index is read into; its placements are
            recorded through ``policy.on_route``).
        upstream: the upstream's name (part of every key; gateways serving the same upstream share it).
        url: a redis-py URL; ignored when ``client`` is given.
        client: a ready ``redis.asyncio.Redis`` (tests).
        interval_s: seconds between exchanges.
        timeout_s: connect and read timeout of each Redis call.
        retry_after_s: seconds Redis is left alone after a failure.
        ttl_s: a replica's set expires this long after its last write.
        outbox_limit: most placements waiting to be written.
        prefix: prefix of every key.
        clock: wall-clock seconds (``time.time``; scores must agree across processes).
    """

    def __init__(
        self,
        policy: CacheAwarePolicy,
        upstream: str,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        client: aioredis.Redis | None = None,
        interval_s: float = 0.2,
        timeout_s: float = 0.05,
        retry_after_s: float = 5.0,
        ttl_s: float = 3600.0,
        outbox_limit: int = 10_000,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.policy = policy
        self.upstream = upstream
        self.interval_s = interval_s
        self.retry_after_s = retry_after_s
        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = prefix
        self._clock = clock
        self._client = client or aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._outbox: deque[tuple[str, tuple[int, ...], int]] = deque(maxlen=outbox_limit)
        self._last_read_ms: int | None = None
        self._paused_until = float("-inf")
        self._task: asyncio.Task | None = None
        self.stats = RoutingShareStats()
        policy.on_route.append(self.record)

    def key(self, replica: str) -> str:
        """The sorted set of ``replica``'s block hashes."""
        return f"{self.prefix}{self.upstream}:{replica}"

    def record(self, replica: str, blocks: tuple[int, ...]) -> None:
        """Queue one placement for the next exchange (the oldest queued one is dropped when full)."""
        if not blocks:
            return
        if len(self._outbox) == self._outbox.maxlen:
            self.stats.dropped += 1
        self._outbox.append((replica, blocks, int(self._clock() * 1000)))

    async def exchange(self) -> bool:
        """One write + read round trip. Returns False (and changes nothing) when Redis is paused or failed."""
        if time.monotonic() < self._paused_until:
            self.stats.skipped += 1
            return False
        pending = list(self._outbox)
        now_ms = int(self._clock() * 1000)
        since = (
            self._last_read_ms - int(2 * self.interval_s * 1000) if self._last_read_ms is not None else "-inf"
        )
        cap = self.policy.approx.capacity_blocks
        replicas = self.policy.replicas
        try:
            pipe = self._client.pipeline(transaction=False)
            touched: set[str] = set()
            for replica, blocks, at_ms in pending:
                pipe.zadd(self.key(replica), {str(b): at_ms for b in blocks})
                touched.add(replica)
            for replica in touched:
                pipe.zremrangebyrank(self.key(replica), 0, -(cap + 1))
                pipe.pexpire(self.key(replica), self.ttl_ms)
            for replica in replicas:
                pipe.zrangebyscore(self.key(replica), since, "+inf")
            results = await pipe.execute()
        except (TimeoutError, redis.RedisError, OSError):
            self.stats.errors += 1
            self._paused_until = time.monotonic() + self.retry_after_s
            return False
        for _ in pending:
            self._outbox.popleft()
        self.stats.written += len(pending)
        for replica, hashes in zip(replicas, results[-len(replicas) :], strict=True):
            blocks = []
            for h in hashes or ():
                with contextlib.suppress(ValueError, TypeError):
                    blocks.append(int(h))
            if blocks:
                self.policy.approx.add(replica, reversed(blocks))
                self.stats.read += len(blocks)
        self._last_read_ms = now_ms
        self.stats.exchanges += 1
        return True

    def start(self) -> None:
        """Run ``exchange`` every ``interval_s`` in the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # never let one bad exchange stop sharing
                await self.exchange()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        """Stop exchanging and close the Redis connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self._client.aclose()
