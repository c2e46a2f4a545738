"""Building the tier stack and the deployment's block hash from the engine's tier settings
(``engine.kv_tiers.settings``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from engine.block_hash import HashFn
from engine.kv_tiers.counters import TierCounters
from engine.kv_tiers.disk import EMPTY_LEVEL_BYTES, DiskTier, TierConfigError
from engine.kv_tiers.entry import BlockMeta, KVLayout, encode_entry
from engine.kv_tiers.keys import MIN_SECRET_BYTES, keyed_block_hash, load_or_create_secret
from engine.kv_tiers.policy import LEVELS, TierPolicies
from engine.kv_tiers.redis_tier import RedisTier
from engine.kv_tiers.settings import TIER_NAMES, DiskTierConfig, RedisTierConfig
from engine.kv_tiers.stack import Tier, TierStack


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
            or a Redis that refuses the connection, a budget whose smallest level cannot hold one block (key
            and reason; an unreachable Redis is only a warning).
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
        check_budgets(layout, policies, disk, redis, [t.name for t in built])
    except TierConfigError:
        for t in built:
            t.close()
        raise
    return TierStack(layout, built, counters, writeback_capacity)


def entry_nbytes(layout: KVLayout) -> int:
    """Bytes of one block's tier entry (KV payload and header, with an empty tenant)."""
    meta = BlockMeta(b"\0" * 32, None, tuple(range(layout.block_size)), (layout.model_id, ""))
    return len(encode_entry(layout, meta, torch.zeros(layout.block_shape, dtype=layout.torch_dtype)))


def check_budgets(
    layout: KVLayout, policies: TierPolicies, disk: DiskTierConfig, redis: RedisTierConfig, tiers: list[str]
) -> None:
    """Refuse a tier whose byte budget leaves a level less than one block entry (every write of that level
    would fail): the message gives the entry's size and the smallest budget that holds one per level.

    Raises:
        TierConfigError: ``engine.tier_{name}.budget_bytes``.
    """
    entry = entry_nbytes(layout)
    for name in tiers:
        budget = disk.budget_bytes if name == "disk" else redis.budget_bytes
        overhead = EMPTY_LEVEL_BYTES if name == "disk" else 0
        needed = entry + overhead
        shares = {lv: policies.policy(name, lv).budget_share for lv in LEVELS}
        short = [lv for lv, share in shares.items() if int(budget * share) < needed]
        if not short:
            continue
        least = max(math.ceil(needed / share) for share in shares.values())
        level = short[0]
        extra = f" plus {overhead} bytes of the level's SQLite file" if overhead else ""
        raise TierConfigError(
            f"engine.tier_{name}.budget_bytes",
            f"{budget} leaves the {level} level {int(budget * shares[level])} bytes ({shares[level]:g} of it), "
            f"less than one KV block ({entry} bytes per entry at block_size {layout.block_size}{extra}): every "
            f"write would fail; give at least {least} bytes",
        )
