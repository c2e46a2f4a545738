"""Settings of the tiers (fields of ``engine.api.EngineConfig``) and building the tier stack from them.

Default: no tiers. A disk tier is not on by default because it would write KV (from which prompt text can
be partly reconstructed) of every tenant to a local directory, up to gigabytes, without anyone asking for
it; ``tiers: [disk]`` (and a directory) turns it on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_hash import HashFn
from engine.kv_tiers.counters import TierCounters
from engine.kv_tiers.disk import DiskTier, TierConfigError
from engine.kv_tiers.entry import KVLayout
from engine.kv_tiers.keys import MIN_SECRET_BYTES, keyed_block_hash, load_or_create_secret
from engine.kv_tiers.policy import TierPolicies
from engine.kv_tiers.redis_tier import RedisTier
from engine.kv_tiers.stack import Tier, TierStack

TIER_NAMES = ("disk", "redis")


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


def check_tier_names(tiers: tuple[str, ...]) -> None:
    """Raise ``TierConfigError("engine.tiers", ...)`` for an unknown or repeated tier name."""
    for name in tiers:
        if name not in TIER_NAMES:
            raise TierConfigError("engine.tiers", f"unknown tier {name!r}; tiers are {list(TIER_NAMES)}")
    if len(set(tiers)) != len(tiers):
        raise TierConfigError("engine.tiers", f"a tier is named twice in {list(tiers)}")


def deployment_hash_fn(tiers: tuple[str, ...], secret: str | None, disk: DiskTierConfig) -> HashFn:
    """The block hash of an engine with tiers: keyed by the deployment secret (``engine.kv_tiers.keys``).

    Without ``secret``, a disk tier keeps one of its own in its directory; Redis needs the secret, since
    every gateway sharing it must hash alike.

    Raises:
        TierConfigError: no secret with a Redis tier, a secret shorter than 16 bytes, or a disk directory
            where the secret cannot be kept.
    """
    if secret is not None:
        raw = secret.encode("utf-8")
        if len(raw) < MIN_SECRET_BYTES:
            raise TierConfigError("engine.deployment_secret", f"must be at least {MIN_SECRET_BYTES} bytes")
        return keyed_block_hash(raw)
    if "redis" in tiers:
        raise TierConfigError(
            "engine.deployment_secret", "is required with a Redis tier (every gateway must hash blocks alike)"
        )
    if disk.directory is None:
        raise TierConfigError("engine.tier_disk.directory", "is required with a disk tier")
    try:
        return keyed_block_hash(load_or_create_secret(disk.directory))
    except OSError as e:
        raise TierConfigError("engine.tier_disk.directory", f"{disk.directory} is not writable ({e})") from e


def build_tier_stack(
    tiers: tuple[str, ...],
    layout: KVLayout,
    *,
    disk: DiskTierConfig,
    redis: RedisTierConfig,
    policies: TierPolicies,
    writeback_capacity: int,
    clock: Callable[[], float] = time.time,
) -> TierStack:
    """The tier stack for ``tiers`` (lookup order disk, then Redis, whatever order they are named in).

    Raises:
        TierConfigError: an unknown tier, a missing or unwritable directory, a Redis URL that does not parse
            (key and reason; an unreachable Redis is only a warning).
    """
    check_tier_names(tiers)
    counters = TierCounters()
    built: list[Tier] = []
    try:
        if "disk" in tiers:
            if disk.directory is None:
                raise TierConfigError("engine.tier_disk.directory", "is required with a disk tier")
            built.append(DiskTier(disk.directory, disk.budget_bytes, policies, counters, clock))
        if "redis" in tiers:
            built.append(
                RedisTier(
                    redis.url,
                    redis.prefix,
                    redis.budget_bytes,
                    policies,
                    counters,
                    clock,
                    timeout_s=redis.timeout_s,
                    retry_s=redis.retry_s,
                )
            )
    except TierConfigError:
        for t in built:
            t.close()
        raise
    return TierStack(layout, built, counters, writeback_capacity)
