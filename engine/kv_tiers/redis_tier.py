"""The Redis tier: KV block entries shared by every gateway of a deployment, one Redis key per block.

Keys, under the deployment's prefix ``p`` (``EngineConfig.tier_redis.prefix``):

- ``{p}:kv:{tier key}``: the entry bytes (``engine.kv_tiers.entry``), with a Redis TTL (``PX``) of its
  level's TTL, so Redis drops it by itself;
- ``{p}:lru:{level}``: sorted set, entry key -> time of its last write (the level's eviction order: least
  recently *written* first; a read does not refresh it, see below);
- ``{p}:bytes:{level}``: bytes the level's entries take (its share of the budget is enforced on it);
- ``{p}:meta``: hash, entry key -> ``"{level} {bytes} {expires_at}"``.

A write is one Lua script (atomic, one round trip, safe with several gateways on one Redis): it first drops
the level's entries older than its TTL (on the writer's clock) from the bookkeeping, replaces an older
copy of the key, stores the entry, and then evicts the level's least recently written block entries until the
level is back inside its share of the budget (prefix records are never evicted: ``engine.kv_tiers.catalog``). A read is one pipelined ``GET`` + ``HGET``; an entry past
its expiry on the reader's clock is a miss (``redis.expired.{level}``) and is dropped; an entry Redis
already dropped by its own TTL (the ``GET`` finds nothing, the meta hash still has it) has its bookkeeping
removed there and then (counted as expired when past its expiry). ``sweep_expired`` (the writer thread's
housekeeping, every few seconds) removes the bookkeeping of up to 64 expired entries per level in one script,
so ``redis.bytes`` follows Redis' own expiry and every level's expirations are counted, not only those of
the level being written.

Why reads do not refresh the eviction order: a read loads the block into the RAM pool, which writes it down
again when it evicts it (refreshing its place then), and a chain is read head to tail, so refreshing on read
would make a chain's tail newer than its head, and a full level would drop the head first, after which a
lookup (which stops at the first missing block) serves nothing of the chain.

Redis never costs a request: every call has short socket timeouts and no retries. A connection error or a
timeout counts (``redis.write_errors`` / ``redis.read_errors``) and marks the tier *down* for
``retry_s`` seconds, during which operations are skipped at once (``redis.skipped_down``); the first call
after that tries again, so the tier comes back when Redis does. A write refused because Redis is at
``maxmemory`` is counted as ``redis.write_refused`` (the tier stays up). A URL that does not parse or
names a database that is not a non-negative integer, or a server that refuses the connection at start (a
database past its ``databases``, a wrong password), is a ``TierConfigError`` at start; an unreachable Redis at
start is a warning. Failed writes are logged once per cause, then summed up (``FailureLog``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.kv_tiers.catalog import RECORD_KEY_PREFIX
from engine.kv_tiers.counters import TierCounters
from engine.kv_tiers.disk import TierConfigError
from engine.kv_tiers.failure_log import FailureLog
from engine.kv_tiers.policy import LEVELS, TierPolicies
from engine.kv_tiers.settings import redis_url_db_problem

log = logging.getLogger(__name__)

_DOWN_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_REFUSED_AT_START = (
    redis.exceptions.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.ResponseError,
)
"""What a Redis that answers says to a connection it will never accept (checked before ``_DOWN_ERRORS``:
the first two are ``ConnectionError`` subclasses): a database past its ``databases``, a wrong password."""
SWEEP_LIMIT = 64
"""Most expired entries of one level ``sweep_expired`` removes per call."""

# Both scripts start with a shebang: Redis 7 then refuses the whole script (before it runs) when it is at
# maxmemory, instead of running it half (scripts without one are not checked for memory at all).
# KEYS: 1 entry key, 2 level lru zset, 3 level bytes counter, 4 meta hash
# ARGV: 1 value, 2 ttl ms (0 = none), 3 now, 4 expires_at ("" = never), 5 level, 6 level budget,
#       7 prefix, 8 ttl s ("" = none), 9 the Redis key head of prefix records (never evicted by the budget)
_FORGET = """
local function forget(meta, prefix, member)
  local m = redis.call('HGET', meta, member)
  if m then
    local lv, size = string.match(m, '^(%S+) (%d+)')
    redis.call('ZREM', prefix .. ':lru:' .. lv, member)
    redis.call('DECRBY', prefix .. ':bytes:' .. lv, tonumber(size))
    redis.call('HDEL', meta, member)
  end
  return m
end
"""
"""A Lua function the scripts share: remove an entry's bookkeeping (its level's LRU member and byte count, its
meta field), returning its meta record (nil when it had none)."""

_WRITE = (
    "#!lua\n"
    + _FORGET
    + """local key, lru, bytes_key, meta = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local value, ttl_ms, now, expires_at = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local level, budget, prefix, ttl_s = ARGV[5], tonumber(ARGV[6]), ARGV[7], ARGV[8]
local record_head = ARGV[9]
local function drop(member)
  forget(meta, prefix, member)
  return redis.call('DEL', member)
end
local expired = 0
if ttl_s ~= '' then
  local old = redis.call('ZRANGEBYSCORE', lru, '-inf', '(' .. (now - tonumber(ttl_s)), 'LIMIT', 0, 64)
  for _, member in ipairs(old) do drop(member); expired = expired + 1 end
end
drop(key)
if ttl_ms > 0 then
  redis.call('SET', key, value, 'PX', ttl_ms)
else
  redis.call('SET', key, value)
end
local size = string.len(value)
redis.call('ZADD', lru, now, key)
redis.call('HSET', meta, key, level .. ' ' .. size .. ' ' .. expires_at)
local total = redis.call('INCRBY', bytes_key, size)
local evicted, rank = 0, 0
while total > budget do
  local victim = redis.call('ZRANGE', lru, rank, rank)
  if #victim == 0 then break end
  if string.sub(victim[1], 1, string.len(record_head)) == record_head then
    rank = rank + 1
  else
    drop(victim[1])
    evicted = evicted + 1
    total = tonumber(redis.call('GET', bytes_key) or '0')
  end
end
return {evicted, expired}
"""
)

# KEYS: 1 entry key, 2 meta hash. ARGV: 1 prefix, 2 "gone" (only the bookkeeping of an entry Redis dropped:
# nothing when the key exists again, e.g. another gateway wrote it meanwhile; 1 when there was bookkeeping) or ""
_DROP = (
    "#!lua flags=allow-oom\n"
    + _FORGET
    + """if ARGV[2] == 'gone' and redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local m = forget(KEYS[2], ARGV[1], KEYS[1])
local deleted = redis.call('DEL', KEYS[1])
if ARGV[2] == 'gone' then
  if m then return 1 else return 0 end
end
return deleted
"""
)

# KEYS: 1 meta hash. ARGV: 1 prefix, 2 now, 3 limit per level, then (level, ttl s) pairs.
# Returns the entries removed per level, in the order given.
_SWEEP = (
    "#!lua flags=allow-oom\n"
    + _FORGET
    + """local meta, prefix, now, limit = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV, 2 do
  local lru = prefix .. ':lru:' .. ARGV[i]
  local old = redis.call('ZRANGEBYSCORE', lru, '-inf', '(' .. (now - tonumber(ARGV[i + 1])), 'LIMIT', 0, limit)
  for _, member in ipairs(old) do
    forget(meta, prefix, member)
    redis.call('ZREM', lru, member)
    redis.call('DEL', member)
  end
  table.insert(out, #old)
end
return out
"""
)


def safe_url(url: str) -> str:
    """``url`` without its password (for messages and logs)."""
    try:
        kw = redis.connection.parse_url(url)
    except ValueError:
        return "<unparsable URL>"
    if "path" in kw:
        return f"unix://{kw['path']} db {kw.get('db', 0)}"
    return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)} db {kw.get('db', 0)}"


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A Redis client with short timeouts and no retries (a slow Redis must not slow a request).

    Raises:
        TierConfigError: the URL does not parse or names a database that is not a non-negative integer
            (``engine.tier_redis.url``).
    """
    problem = redis_url_db_problem(url)
    if problem is not None:
        raise TierConfigError("engine.tier_redis.url", problem)
    try:
        return redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
    except (ValueError, TypeError) as e:
        raise TierConfigError("engine.tier_redis.url", f"does not parse ({e})") from e


class RedisTier:
    """KV block entries in Redis with per-level TTLs and byte budgets (see the module docstring).

    Args:
        url: ``redis://host:port/db``.
        prefix: the deployment's key prefix (every key this tier touches starts with it).
        budget_bytes: the tier's byte budget (> 0), shared between levels by ``policies``.
        policies: per-level policies (``policies.policy("redis", level)``).
        counters: where to count.
        clock: seconds, for TTLs and LRU order (default ``time.time``; every gateway's clock should agree).
        timeout_s: socket connect / read timeout of every call.
        retry_s: how long the tier stays down after a connection error or a timeout.

    Raises:
        TierConfigError: the URL does not parse, an empty prefix, a budget that is not positive, or a server
            that refuses the connection (a database out of its range, a wrong password).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        prefix: str,
        budget_bytes: int,
        policies: TierPolicies,
        counters: TierCounters,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 0.25,
        retry_s: float = 2.0,
    ) -> None:
        if not prefix:
            raise TierConfigError("engine.tier_redis.prefix", "must not be empty")
        if budget_bytes <= 0:
            raise TierConfigError("engine.tier_redis.budget_bytes", f"must be > 0, got {budget_bytes}")
        self.client = connect(url, timeout_s)
        self.prefix = prefix
        self.budget_bytes = budget_bytes
        self.policies = policies
        self.counters = counters
        self.clock = clock
        self.retry_s = retry_s
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.failures = FailureLog(log, self.name)
        """Warnings of failed writes: the first per cause, then one summary line per interval."""
        self.sweep_interval_s = 1.0
        """Shortest time between two sweeps (``sweep_expired`` runs after every burst of writes)."""
        self._swept_at = float("-inf")
        self._write = self.client.register_script(_WRITE)
        self._drop = self.client.register_script(_DROP)
        self._sweep = self.client.register_script(_SWEEP)
        try:
            self.client.ping()
        except _REFUSED_AT_START as e:
            self.client.close()
            raise TierConfigError(
                "engine.tier_redis.url", f"the Redis server at {safe_url(url)} refused the connection ({e})"
            ) from e
        except _DOWN_ERRORS as e:
            log.warning("Redis tier at %s is unreachable (%s); it will retry in the background", url, e)
            self._mark_down()

    # ---- availability ---------------------------------------------------------------------------------
    @property
    def is_down(self) -> bool:
        """True while the tier waits before trying an unreachable Redis again."""
        return time.monotonic() < self._down_until

    def _mark_down(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.retry_s

    def _skip(self) -> bool:
        if self.is_down:
            self.counters.add("redis.skipped_down")
            return True
        return False

    def entry_key(self, key: str) -> str:
        """The Redis key of tier key ``key``."""
        return f"{self.prefix}:kv:{key}"

    # ---- reads ----------------------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The entry under ``key``, or None (absent, expired, Redis down or slow)."""
        if self._skip():
            return None
        rkey = self.entry_key(key)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.get(rkey)
            pipe.hget(f"{self.prefix}:meta", rkey)
            value, meta = pipe.execute()
        except _DOWN_ERRORS as e:
            self.counters.add("redis.read_errors")
            log.debug("Redis tier read failed: %s", e)
            self._mark_down()
            return None
        except redis.RedisError as e:
            self.counters.add("redis.read_errors")
            log.debug("Redis tier read failed: %s", e)
            return None
        if value is None:
            if meta is not None:  # Redis dropped it (its TTL) and the bookkeeping still counts it
                level, _, expires_at = meta.decode().split(" ")
                if self._drop_key(rkey, gone=True) and expires_at and self.clock() >= float(expires_at):
                    self.counters.add(f"redis.expired.{level}")
            return None
        if meta is not None:
            level, _, expires_at = meta.decode().split(" ")
            if expires_at and self.clock() >= float(expires_at):
                self.counters.add(f"redis.expired.{level}")
                self._drop_key(rkey)
                return None
        return bytes(value)

    # ---- writes ---------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes, levels: frozenset[str]) -> bool:
        """Store ``data`` under ``key`` in the level (of ``levels``) with the longest policy.

        Returns:
            True when written; False when skipped, refused or failed (counted).
        """
        if self._skip():
            return False
        level, policy = self.policies.resolve(self.name, levels)
        budget = int(self.budget_bytes * policy.budget_share)
        if len(data) > budget:
            self.counters.add("redis.write_errors")
            self.failures.failed(
                "write skipped",
                f"an entry of {len(data)} bytes is larger than the {level} level's budget ({budget} bytes): "
                "raise engine.tier_redis.budget_bytes",
            )
            return False
        now = self.clock()
        ttl = policy.ttl_s
        try:
            evicted, expired = self._write(
                keys=[
                    self.entry_key(key),
                    f"{self.prefix}:lru:{level}",
                    f"{self.prefix}:bytes:{level}",
                    f"{self.prefix}:meta",
                ],
                args=[
                    data,
                    0 if ttl is None else max(1, int(ttl * 1000)),
                    repr(now),
                    "" if ttl is None else repr(now + ttl),
                    level,
                    budget,
                    self.prefix,
                    "" if ttl is None else repr(ttl),
                    self.entry_key(RECORD_KEY_PREFIX),
                ],
            )
        except _DOWN_ERRORS as e:
            self.counters.add("redis.write_errors")
            self.failures.failed("write skipped (unreachable or slow)", e)
            self._mark_down()
            return False
        except redis.ResponseError as e:
            if "OOM" in str(e) or "maxmemory" in str(e):
                self.counters.add("redis.write_refused")
                self.failures.failed("write refused (maxmemory)", e)
            else:
                self.counters.add("redis.write_errors")
                self.failures.failed("write refused", e)
            return False
        except redis.RedisError as e:
            self.counters.add("redis.write_errors")
            self.failures.failed("write failed", e)
            return False
        self.counters.add("redis.writes")
        self.counters.add("redis.bytes_written", len(data))
        if evicted:
            self.counters.add("redis.evicted", int(evicted))
        if expired:
            self.counters.add(f"redis.expired.{level}", int(expired))
        return True

    def delete(self, key: str) -> bool:
        """Remove ``key`` (and its bookkeeping). Returns True when an entry was removed."""
        return self._drop_key(self.entry_key(key))

    def _drop_key(self, rkey: str, gone: bool = False) -> bool:
        """Remove an entry and its bookkeeping; with ``gone``, only the bookkeeping of an entry Redis already
        dropped (nothing when the key exists again). Returns True when something was removed."""
        if self._skip():
            return False
        try:
            dropped = self._drop(
                keys=[rkey, f"{self.prefix}:meta"], args=[self.prefix, "gone" if gone else ""]
            )
            return dropped == 1
        except _DOWN_ERRORS:
            self.counters.add("redis.write_errors")
            self._mark_down()
        except redis.RedisError:
            self.counters.add("redis.write_errors")
        return False

    def sweep_expired(self) -> int:
        """Remove the bookkeeping (and key, if Redis still has it) of up to ``SWEEP_LIMIT`` expired entries of
        every level with a TTL, in one script, and count them per level (``redis.expired.{level}``): Redis drops
        the keys by itself, and without this their bytes stayed counted until their own level was written
        again. Called by the writer thread after a burst of writes and when idle, at most once per
        ``sweep_interval_s``; also logs the summary of failed writes once its interval has passed. Returns how
        many went; a failure is counted (``redis.write_errors``), nothing raised."""
        self.failures.flush()
        if self.is_down or time.monotonic() - self._swept_at < self.sweep_interval_s:
            return 0
        self._swept_at = time.monotonic()
        ttls = [(lv, self.policies.policy(self.name, lv).ttl_s) for lv in LEVELS]
        ttls = [(lv, ttl) for lv, ttl in ttls if ttl is not None]
        if not ttls:
            return 0
        args: list[str | int] = [self.prefix, repr(self.clock()), SWEEP_LIMIT]
        for lv, ttl in ttls:
            args += [lv, repr(ttl)]
        try:
            gone = self._sweep(keys=[f"{self.prefix}:meta"], args=args)
        except _DOWN_ERRORS:
            self.counters.add("redis.write_errors")
            self._mark_down()
            return 0
        except redis.RedisError:
            self.counters.add("redis.write_errors")
            return 0
        for (lv, _), n in zip(ttls, gone, strict=True):
            if n:
                self.counters.add(f"redis.expired.{lv}", int(n))
        return sum(int(n) for n in gone)

    # ---- introspection --------------------------------------------------------------------------------
    def level_bytes(self, level: str) -> int:
        """Bytes the level's entries take (its bookkeeping counter)."""
        return int(self.client.get(f"{self.prefix}:bytes:{level}") or 0)

    def level_limit(self, level: str) -> int:
        """The level's byte budget."""
        return int(self.budget_bytes * self.policies.policy(self.name, level).budget_share)

    def nbytes(self) -> int:
        """Bytes of every level's entries; 0 while Redis is down."""
        if self.is_down:
            return 0
        try:
            values = self.client.mget([f"{self.prefix}:bytes:{lv}" for lv in LEVELS])
        except (redis.RedisError, OSError):
            return 0
        return sum(int(v or 0) for v in values)

    def keys(self) -> Iterator[tuple[str, str]]:
        """``(level, tier key)`` of every entry this deployment has (admin listing; O(entries)).

        Raises:
            redis.ConnectionError: the tier is down (waiting to retry), or Redis failed (then it is marked
                down); the admin paths (``TierStack``) report the tier as skipped.
        """
        start = len(self.prefix) + len(":kv:")
        self._check_up()
        try:
            for rkey, meta in self.client.hscan_iter(f"{self.prefix}:meta"):
                yield meta.decode().split(" ")[0], rkey.decode()[start:]
        except _DOWN_ERRORS:
            self._mark_down()
            raise

    def _check_up(self) -> None:
        if self._skip():
            raise redis.ConnectionError("the Redis tier is down (it retries after retry_s)")

    def peek(self, key: str) -> tuple[bool, float | None]:
        """Whether ``key`` is stored (and unexpired on the tier's clock), and its expiry (None = never)."""
        return self.peek_many([key])[0]

    def peek_many(self, keys: Sequence[str]) -> list[tuple[bool, float | None]]:
        """``peek`` of each key, in one pipelined round trip (every key absent while the tier is down or when
        the call fails: counted as a read error)."""
        absent: list[tuple[bool, float | None]] = [(False, None)] * len(keys)
        if not keys or self._skip():
            return absent
        meta_key = f"{self.prefix}:meta"
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                rkey = self.entry_key(key)
                pipe.exists(rkey)
                pipe.hget(meta_key, rkey)
            replies = pipe.execute()
        except _DOWN_ERRORS:
            self.counters.add("redis.read_errors")
            self._mark_down()
            return absent
        except redis.RedisError:
            self.counters.add("redis.read_errors")
            return absent
        now = self.clock()
        out: list[tuple[bool, float | None]] = []
        for exists, meta in zip(replies[0::2], replies[1::2], strict=True):
            expires_at = meta.decode().split(" ")[2] if meta is not None else ""
            if not exists or (expires_at and now >= float(expires_at)):
                out.append((False, None))
            else:
                out.append((True, float(expires_at) if expires_at else None))
        return out

    def scan_heads(self, head_bytes: int = 4096) -> Iterator[tuple[str, bytes]]:
        """``(tier key, first head_bytes bytes of its entry)`` of every entry of this deployment (admin:
        listing, dropping by tenant or model; O(entries), one ``GETRANGE`` each).

        Raises:
            redis.ConnectionError: as ``keys``.
        """
        start = len(self.prefix) + len(":kv:")
        self._check_up()
        try:
            for rkey, _ in self.client.hscan_iter(f"{self.prefix}:meta"):
                head = self.client.getrange(rkey, 0, head_bytes - 1)
                if head:
                    yield rkey.decode()[start:], bytes(head)
        except _DOWN_ERRORS:
            self._mark_down()
            raise

    def clear(self) -> None:
        """Remove every key under the prefix (tests, admin)."""
        for k in self.client.scan_iter(match=f"{self.prefix}:*", count=500):
            self.client.delete(k)

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()
