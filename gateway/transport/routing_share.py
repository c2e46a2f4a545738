"""What several gateways share for routing through Redis, with bounded staleness: load and the cache-aware index.

``RoutingShare`` is attached to one upstream's routing policy. Every ``interval_s`` one pipelined exchange
writes this gateway's state to Redis and reads the other gateways':

- load (every policy): one hash ``{prefix}{upstream}:load`` with a field per gateway (a random id per
  process) holding ``{"t": ms since the epoch, "inflight": {replica: count}}``; the fields of the other
  gateways not older than ``load_stale_s`` are summed into the ring's ``remote_load``, which the load bound
  of every policy adds to this gateway's own counts (``AffinityRing.load``). A gateway that stops writing
  (crashed, cut from Redis) drops out of the sum after ``load_stale_s``; its field expires after ``ttl_s``.
- the index (``cache_aware`` only): each placement this gateway makes (replica, block hashes) goes into a
  bounded outbox, written to and read back from:

- per replica one sorted set ``{prefix}{upstream}:{replica}`` of block hashes scored by the time they were
  last routed there (milliseconds since the epoch), trimmed to the index's capacity (``ZREMRANGEBYRANK``:
  the oldest go first, like the local LRU) and expiring ``ttl_s`` after the last write;
- read back with ``ZRANGEBYSCORE`` from a little before the last exchange (``2 * interval_s`` of slack for
  other gateways' clocks and delays; re-reading a hash is harmless) into the policy's approximate index;
- a placement retracted (its attempt failed, ``PendingLease.not_served``) leaves the replica's set (``ZREM``)
  and goes into a second sorted set ``{prefix}{upstream}:{replica}:retracted`` (members ``{hash}:{gateway}``,
  scored by the time of the retraction; trimmed and expiring like the first); a gateway that reads another's
  retraction removes those hashes from its own index unless it read a placement of the same hash at that time
  or later (the retry that was served there);
- a replica seen answering as a new instance (``CacheAwarePolicy.replica_renewed``: it restarted, its RAM cache
  empty) loses every hash scored before that moment from its set (``ZREMRANGEBYSCORE``), and the moment and
  the instance's name are written to the hash ``{prefix}{upstream}:renewed`` (field: the replica, value
  ``"{ms} {instance}"``), in one script that does neither when the hash already names that instance (another
  gateway renewed it first: its placements on the new instance since then stay); a gateway that reads a
  moment newer than the last it knew for a replica forgets that replica in its own index too, then takes the
  hashes scored from that moment on, and knows the instance (``ReplicaInstances.learn``: its own first answer
  from it is no restart). A gateway's first exchange only learns the moments (its index is read from the
  sets, already trimmed).

So another gateway's placement or load is seen here at most ``interval_s`` plus one exchange later. Redis is
an accelerator, never a dependency: an error, a refused connection or a reply slower than ``timeout_s`` is
counted, the other gateways' load is forgotten (the local view: each gateway bounds its own share again) and
Redis is left alone for ``retry_after_s`` (routing goes on with the local index; the outbox keeps the newest
``outbox_limit`` placements for when it is back). Nothing here raises to the request path.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from gateway.transport.replica_instances import ReplicaInstances
from gateway.transport.routing_policy import CacheAwarePolicy, RoutingPolicy

DEFAULT_PREFIX = "prefixgate:route:"

# KEYS: 1 the replica's set, 2 the renewed hash. ARGV: 1 the replica, 2 ms, 3 the new instance ("" = unnamed),
# 4 the hash's TTL in ms. Returns 1 when it renewed, 0 when the hash already named that instance.
_RENEW = """
local cur = redis.call('HGET', KEYS[2], ARGV[1])
if cur and ARGV[3] ~= '' then
  local space = string.find(cur, ' ', 1, true)
  if space and string.sub(cur, space + 1) == ARGV[3] then return 0 end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. ' ' .. ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
return 1
"""

logger = logging.getLogger(__name__)


@dataclass
class RoutingShareStats:
    """Counters (cumulative): exchanges done, placements written, placements retracted (their attempt
    failed), hashes other gateways retracted that this one then forgot (``retractions_read``), renewals read (another gateway saw a replica answer as a new instance: this one forgot what it
    credited there), hashes read, errors, skipped exchanges, placements dropped from a full outbox;
    ``gateways``: other gateways whose load was counted at the last exchange."""

    exchanges: int = 0
    written: int = 0
    retracted: int = 0
    retractions_read: int = 0
    renewals_read: int = 0
    read: int = 0
    errors: int = 0
    skipped: int = 0
    dropped: int = 0
    gateways: int = 0

    def snapshot(self, up: bool) -> dict[str, int | bool]:
        """The counters for ``/admin/stats`` (``models[name]["routing_share"]``), with ``up``: whether the last
        exchange reached Redis."""
        return {**dataclasses.asdict(self), "up": up}


class RoutingShare:
    """Exchange one upstream's load (and cache-aware placements) with other gateways through Redis.

    Args:
        policy: the upstream's routing policy; its ring's ``inflight`` is written and its ``remote_load`` set.
            For a ``CacheAwarePolicy`` the ``approx`` index is read into too and its placements are recorded
            through ``policy.on_route`` (and retracted through ``policy.on_unroute``).
        upstream: the upstream's name (part of every key; gateways serving the same upstream share it).
        url: a redis-py URL; ignored when ``client`` is given.
        client: a ready ``redis.asyncio.Redis`` (tests).
        interval_s: seconds between exchanges.
        timeout_s: connect and read timeout of each Redis call.
        retry_after_s: seconds Redis is left alone after a failure.
        ttl_s: a replica's set expires this long after its last write.
        outbox_limit: most placements (and retractions) waiting to be written.
        load_stale_s: another gateway's load older than this is ignored (default ``max(1, 5 * interval_s)``).
        prefix: prefix of every key.
        clock: wall-clock seconds (``time.time``; scores must agree across processes).
        instances: the instance names the upstream backend saw per replica; a renewal read from another
            gateway teaches it the new instance's name.
    """

    def __init__(
        self,
        policy: RoutingPolicy,
        upstream: str,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        client: aioredis.Redis | None = None,
        interval_s: float = 0.2,
        timeout_s: float = 0.05,
        retry_after_s: float = 5.0,
        ttl_s: float = 3600.0,
        outbox_limit: int = 10_000,
        load_stale_s: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.time,
        instances: ReplicaInstances | None = None,
    ) -> None:
        self.policy = policy
        self.upstream = upstream
        self.interval_s = interval_s
        self.retry_after_s = retry_after_s
        self.ttl_ms = int(ttl_s * 1000)
        self.load_stale_ms = int(
            1000 * (load_stale_s if load_stale_s is not None else max(1.0, 5 * interval_s))
        )
        self.gateway_id = uuid.uuid4().hex
        self.prefix = prefix
        self._clock = clock
        self._client = client or aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._outbox: deque[tuple[str, str, tuple[int, ...], int, str]] = deque(maxlen=outbox_limit)
        """(operation, replica, block hashes, ms since the epoch, instance): ``add`` a placement, ``remove`` a
        retraction, ``renew`` a replica's new instance (its hashes scored before the ms go)."""
        self.instances = instances
        self._renewed_ms: dict[str, int] | None = None
        """Per replica, the latest renewal moment this gateway knows (None before the first exchange)."""
        self._last_read_ms: int | None = None
        self._paused_until = float("-inf")
        self._task: asyncio.Task | None = None
        self.stats = RoutingShareStats()
        self.up = True
        """Whether the last exchange reached Redis (True before the first: nothing failed yet)."""
        self._index = policy if isinstance(policy, CacheAwarePolicy) else None
        if self._index is not None:
            self._index.on_route.append(self.record)
            self._index.on_unroute.append(self.retract)
            self._index.on_renew.append(self.renewed)

    def key(self, replica: str) -> str:
        """The sorted set of ``replica``'s block hashes."""
        return f"{self.prefix}{self.upstream}:{replica}"

    def load_key(self) -> str:
        """The hash of every gateway's in-flight counts (one field per gateway)."""
        return f"{self.prefix}{self.upstream}:load"

    def renewed_key(self) -> str:
        """The hash of each replica's latest renewal moment (ms since the epoch)."""
        return f"{self.prefix}{self.upstream}:renewed"

    def _queue(self, op: str, replica: str, blocks: tuple[int, ...], at_ms: int, instance: str = "") -> None:
        if len(self._outbox) == self._outbox.maxlen:
            self.stats.dropped += 1
        self._outbox.append((op, replica, blocks, at_ms, instance))

    def record(self, replica: str, blocks: tuple[int, ...]) -> None:
        """Queue one placement for the next exchange (the oldest queued one is dropped when full)."""
        if blocks:
            self._queue("add", replica, blocks, int(self._clock() * 1000))

    def retracted_key(self, replica: str) -> str:
        """The sorted set of the hashes retracted from ``replica`` (members ``{hash}:{gateway id}``)."""
        return f"{self.key(replica)}:retracted"

    def retract(self, replica: str, blocks: tuple[int, ...]) -> None:
        """Queue the removal of a failed attempt's blocks from ``replica``'s shared set
        (``PendingLease.not_served``). It is written after every placement queued before it, so a later
        placement of the same blocks (the retry served there) stands; a gateway that read the placement before
        forgets it when it reads the retraction (before, it kept it until its LRU dropped it)."""
        if blocks:
            self._queue("remove", replica, blocks, int(self._clock() * 1000))

    def renewed(self, replica: str, keep: tuple[int, ...], instance: str = "") -> None:
        """Queue ``replica``'s renewal (it answered as ``instance``, new to it, ``CacheAwarePolicy.replica_renewed``):
        its shared hashes scored before now go (unless another gateway renewed it for that instance first),
        then ``keep`` (the request that showed it) is placed anew."""
        now_ms = int(self._clock() * 1000)
        self._queue("renew", replica, (), now_ms, instance)
        if self._renewed_ms is not None:
            self._renewed_ms[replica] = max(now_ms, self._renewed_ms.get(replica, 0))
        if keep:
            self._queue("add", replica, keep, now_ms)

    async def exchange(self) -> bool:
        """One write + read round trip. Returns False when Redis is paused or failed (then the other gateways'
        load is forgotten and the index is left as it is)."""
        ring = self.policy.ring
        if time.monotonic() < self._paused_until:
            self.stats.skipped += 1
            ring.remote_load = {}
            return False
        pending = list(self._outbox)
        now_ms = int(self._clock() * 1000)
        since = (
            self._last_read_ms - int(2 * self.interval_s * 1000) if self._last_read_ms is not None else "-inf"
        )
        replicas = self.policy.replicas
        mine = json.dumps({"t": now_ms, "inflight": {r: n for r, n in ring.inflight.items() if n}})
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.hset(self.load_key(), self.gateway_id, mine)
            pipe.pexpire(self.load_key(), self.ttl_ms)
            pipe.hgetall(self.load_key())
            if self._index is not None:
                cap = self._index.approx.capacity_blocks
                touched: set[str] = set()
                for op, replica, blocks, at_ms, instance in pending:
                    if op == "remove":
                        pipe.zrem(self.key(replica), *(str(b) for b in blocks))
                        gone = self.retracted_key(replica)
                        pipe.zadd(gone, {f"{b}:{self.gateway_id}": at_ms for b in blocks})
                        pipe.zremrangebyrank(gone, 0, -(cap + 1))
                        pipe.pexpire(gone, self.ttl_ms)
                    elif op == "renew":
                        pipe.eval(  # a renewal is rare: the script's text each time
                            _RENEW,
                            2,
                            self.key(replica),
                            self.renewed_key(),
                            replica,
                            at_ms,
                            instance,
                            self.ttl_ms,
                        )
                    else:
                        pipe.zadd(self.key(replica), {str(b): at_ms for b in blocks})
                    touched.add(replica)
                for replica in touched:
                    pipe.zremrangebyrank(self.key(replica), 0, -(cap + 1))
                    pipe.pexpire(self.key(replica), self.ttl_ms)
                pipe.hgetall(self.renewed_key())
                for replica in replicas:
                    pipe.zrangebyscore(self.key(replica), since, "+inf", withscores=True)
                for replica in replicas:
                    pipe.zrangebyscore(self.retracted_key(replica), since, "+inf", withscores=True)
            results = await pipe.execute()
        except (TimeoutError, redis.RedisError, OSError) as exc:
            self.stats.errors += 1
            self._paused_until = time.monotonic() + self.retry_after_s
            ring.remote_load = {}
            if self.up:  # logged once per outage: routing goes on with this gateway's own view
                logger.warning(
                    "routing_share for %s: Redis failed (%s); routing on this gateway's own load and index, "
                    "retrying in %.0f s",
                    self.upstream,
                    type(exc).__name__,
                    self.retry_after_s,
                )
            self.up = False
            return False
        ring.remote_load = self._remote_load(results[2], now_ms)
        if self._index is not None:
            for _ in pending:
                self._outbox.popleft()
            self.stats.written += sum(op == "add" for op, *_ in pending)
            self.stats.retracted += sum(op == "remove" for op, *_ in pending)
            n = len(replicas)
            renewed = self._read_renewals(results[-2 * n - 1])
            placed, retracted = results[-2 * n : -n], results[-n:]
            for replica, hashes, gone in zip(replicas, placed, retracted, strict=True):
                self._read_back(replica, hashes, gone, renewed.get(replica))
        self._last_read_ms = now_ms
        self.stats.exchanges += 1
        if not self.up:
            logger.info(
                "routing_share for %s: Redis reached again; sharing load and placements", self.upstream
            )
        self.up = True
        return True

    def _read_back(self, replica: str, placed: object, retracted: object, renewed_ms: int | None) -> None:
        """Apply one replica's shared index since the last read to the local one: a renewal read now clears
        it first (and placements scored before it are skipped), placements are added, and the hashes other
        gateways retracted are removed unless placed there at the retraction's time or later. Malformed
        members are ignored."""
        index = self._index
        assert index is not None
        if renewed_ms is not None:
            index.approx.clear(replica)
            self.stats.renewals_read += 1
        latest: dict[int, float] = {}
        blocks = []
        for item in placed if isinstance(placed, list) else ():
            with contextlib.suppress(ValueError, TypeError, IndexError):
                h, score = int(item[0]), float(item[1])
                latest[h] = score
                if renewed_ms is None or score >= renewed_ms:
                    blocks.append(h)
        forget = []
        own = f":{self.gateway_id}".encode()
        for item in retracted if isinstance(retracted, list) else ():
            with contextlib.suppress(ValueError, TypeError, AttributeError, IndexError):
                member, score = bytes(item[0]), float(item[1])
                if member.endswith(own):  # this gateway's own: taken back when its attempt failed
                    continue
                h = int(member.split(b":", 1)[0])
                if score > latest.get(h, float("-inf")):
                    forget.append(h)
        if blocks:
            index.approx.add(replica, reversed(blocks))
            self.stats.read += len(blocks)
        if forget:
            index.approx.remove(replica, forget)
            self.stats.retractions_read += len(forget)

    def _read_renewals(self, fields: object) -> dict[str, int]:
        """The replicas whose renewal moment in ``fields`` (the renewed hash: ``"{ms} {instance}"``) is newer
        than this gateway knew, with that moment; none at the first exchange, which only learns them. Each
        instance named is learned (``instances``). Malformed fields are ignored."""
        latest: dict[str, int] = {}
        known = set(self.policy.replicas)
        for replica, raw in (fields or {}).items() if isinstance(fields, dict) else ():
            name = replica.decode() if isinstance(replica, bytes) else str(replica)
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                text = raw.decode() if isinstance(raw, bytes) else str(raw)
                ms, _, instance = text.partition(" ")
                if name in known:
                    latest[name] = int(ms)
                    if self.instances is not None and instance:
                        self.instances.learn(name, instance)
        if self._renewed_ms is None:
            self._renewed_ms = latest
            return {}
        fresh = {r: ms for r, ms in latest.items() if ms > self._renewed_ms.get(r, 0)}
        self._renewed_ms.update(fresh)
        return fresh

    def _remote_load(self, fields: object, now_ms: int) -> dict[str, int]:
        """Sum of the other gateways' fresh in-flight counts per known replica (malformed fields ignored)."""
        total: dict[str, int] = {}
        gateways = 0
        known = set(self.policy.replicas)
        for gateway, raw in (fields or {}).items() if isinstance(fields, dict) else ():
            gid = gateway.decode() if isinstance(gateway, bytes) else str(gateway)
            if gid == self.gateway_id:
                continue
            try:
                entry = json.loads(raw)
                fresh = now_ms - int(entry["t"]) <= self.load_stale_ms
                counts = entry["inflight"] if fresh else {}
                items = [(r, int(n)) for r, n in counts.items() if r in known and int(n) > 0]
            except (ValueError, TypeError, KeyError, AttributeError):
                continue
            gateways += fresh
            for replica, n in items:
                total[replica] = total.get(replica, 0) + n
        self.stats.gateways = gateways
        return total

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
        """Stop exchanging, withdraw this gateway's load and close the Redis connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.policy.ring.remote_load = {}
        with contextlib.suppress(Exception):
            await self._client.hdel(self.load_key(), self.gateway_id)
        with contextlib.suppress(Exception):
            await self._client.aclose()
