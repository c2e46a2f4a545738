"""The ``engine:`` section of an embedded model: ``EngineConfig``'s fields checked against their annotated types,
and the KV tier settings (tier names, disk and Redis settings, per-level policies, the deployment secret) with
the start-up errors issue 13 names (unwritable directory, unparsable Redis URL, a Redis tier without a secret)."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

import redis

from engine.api import (
    DECODE_KERNELS,
    DENSE_GEMMS,
    GLUE_KERNELS,
    LINEAR_KERNELS,
    PREFILL_KERNELS,
    EngineConfig,
)
from engine.kv_tiers.keys import MIN_SECRET_BYTES
from engine.kv_tiers.policy import DEFAULT_POLICIES, LEVELS, TierPolicies, TierPolicy
from engine.kv_tiers.settings import TIER_NAMES, DiskTierConfig, RedisTierConfig
from engine.step_threads import check_small_step_threads
from gateway.config.reader import Reader
from gateway.core.json_types import yaml_kind


def parse_engine(reader: Reader, value: Any, where: str) -> EngineConfig:
    """Validate an ``engine:`` mapping against ``EngineConfig``'s fields and their annotated types."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    section = reader.mapping({} if value is None else value, where, set(fields))
    hints = typing.get_type_hints(EngineConfig)
    values: dict[str, Any] = {}
    for key in section:
        if key in _TIER_SECTIONS:
            values[key] = _TIER_SECTIONS[key](reader, section[key], f"{where}.{key}")
        else:
            values[key] = reader.typed(section, where, key, hints[key], None, required=True)
    for key in ("block_size", "num_blocks", "max_batch", "max_num_batched_tokens"):
        if key in values and values[key] < 1:
            reader.fail(f"{where}.{key}", f"expected an integer >= 1, got {values[key]}")
    _check_long_prefill_threshold(reader, values, where)
    if values.get("num_threads") is not None and values["num_threads"] < 1:
        reader.fail(f"{where}.num_threads", f"expected an integer >= 1 or null, got {values['num_threads']}")
    if "small_step_threads" in values:
        try:
            check_small_step_threads(values["small_step_threads"])
        except ValueError:
            reader.fail(
                f"{where}.small_step_threads",
                f"expected 'auto', 'off' or an integer >= 1, got {values['small_step_threads']!r}",
            )
    if "decode_kernel" in values and values["decode_kernel"] not in DECODE_KERNELS:
        reader.fail(
            f"{where}.decode_kernel",
            f"expected one of {', '.join(DECODE_KERNELS)}, got {values['decode_kernel']!r}",
        )
    if "prefill_kernel" in values and values["prefill_kernel"] not in PREFILL_KERNELS:
        reader.fail(
            f"{where}.prefill_kernel",
            f"expected one of {', '.join(PREFILL_KERNELS)}, got {values['prefill_kernel']!r}",
        )
    if "linear_kernel" in values and values["linear_kernel"] not in LINEAR_KERNELS:
        reader.fail(
            f"{where}.linear_kernel",
            f"expected one of {', '.join(LINEAR_KERNELS)}, got {values['linear_kernel']!r}",
        )
    if "dense_gemm" in values and values["dense_gemm"] not in DENSE_GEMMS:
        reader.fail(
            f"{where}.dense_gemm",
            f"expected one of {', '.join(DENSE_GEMMS)}, got {values['dense_gemm']!r}",
        )
    if "glue_kernel" in values and values["glue_kernel"] not in GLUE_KERNELS:
        reader.fail(
            f"{where}.glue_kernel",
            f"expected one of {', '.join(GLUE_KERNELS)}, got {values['glue_kernel']!r}",
        )
    if "max_pinned_fraction" in values and not 0 <= values["max_pinned_fraction"] <= 1:
        reader.fail(
            f"{where}.max_pinned_fraction",
            f"expected a number in [0, 1], got {values['max_pinned_fraction']}",
        )
    if "tier_writeback_capacity" in values and values["tier_writeback_capacity"] < 1:
        reader.fail(
            f"{where}.tier_writeback_capacity",
            f"expected an integer >= 1, got {values['tier_writeback_capacity']}",
        )
    _check_tiers(reader, values, where)
    return EngineConfig(**values)


def _check_long_prefill_threshold(reader: Reader, values: dict[str, Any], where: str) -> None:
    """``engine.long_prefill_token_threshold``: null (half the budget), 0 (off) or below ``max_num_batched_tokens``
    (``engine.scheduler``: a long prefill keeps at least one token of every step)."""
    threshold = values.get("long_prefill_token_threshold")
    if threshold is None:
        return
    budget = values.get("max_num_batched_tokens", EngineConfig.max_num_batched_tokens)
    if not 0 <= threshold < budget:
        reader.fail(
            f"{where}.long_prefill_token_threshold",
            f"expected null, 0 (off) or an integer in [1, {budget - 1}] (below max_num_batched_tokens {budget}), "
            f"got {threshold}",
        )


def _parse_tier_names(reader: Reader, value: Any, where: str) -> tuple[str, ...]:
    """``engine.tiers``: a list of distinct names from ``TIER_NAMES``."""
    if not isinstance(value, list):
        reader.fail(where, f"expected a list of tier names ({', '.join(TIER_NAMES)}), got {yaml_kind(value)}")
    for index, name in enumerate(value):
        if name not in TIER_NAMES:
            reader.fail(f"{where}[{index}]", f"expected one of {', '.join(TIER_NAMES)}, got {name!r}")
    if len(set(value)) != len(value):
        reader.fail(where, f"a tier is named twice in {value}")
    return tuple(value)


def _parse_plain(cls: type, reader: Reader, value: Any, where: str) -> Any:
    """A mapping checked against the scalar fields of the frozen dataclass ``cls``."""
    fields = {f.name for f in dataclasses.fields(cls)}
    section = reader.mapping({} if value is None else value, where, fields)
    hints = typing.get_type_hints(cls)
    values = {key: reader.typed(section, where, key, hints[key], None, required=True) for key in section}
    for key in ("budget_bytes",):
        if key in values and values[key] < 1:
            reader.fail(f"{where}.{key}", f"expected an integer >= 1, got {values[key]}")
    for key in ("timeout_s", "retry_s"):
        if key in values and not values[key] > 0:
            reader.fail(f"{where}.{key}", f"expected a number > 0, got {values[key]}")
    return cls(**values)


def _parse_tier_policies(reader: Reader, value: Any, where: str) -> TierPolicies:
    """``engine.tier_policies``: ``default_level`` and, per tier, per level ``{ttl_s, budget_share}``."""
    section = reader.mapping({} if value is None else value, where, {"default_level", *TIER_NAMES})
    default_level = reader.typed(section, where, "default_level", str, "history")
    if default_level not in LEVELS:
        reader.fail(f"{where}.default_level", f"expected one of {', '.join(LEVELS)}, got {default_level!r}")
    per_tier: dict[str, dict[str, TierPolicy]] = {}
    for tier in TIER_NAMES:
        if tier not in section:
            continue
        levels = reader.mapping(
            {} if section[tier] is None else section[tier], f"{where}.{tier}", set(LEVELS)
        )
        per_tier[tier] = {}
        for level, raw in levels.items():
            path = f"{where}.{tier}.{level}"
            body = reader.mapping(raw, path, {"ttl_s", "budget_share"})
            default = DEFAULT_POLICIES[level]
            ttl = reader.typed(body, path, "ttl_s", float | None, default.ttl_s)
            share = reader.typed(body, path, "budget_share", float, default.budget_share)
            try:
                per_tier[tier][level] = TierPolicy(ttl_s=ttl, budget_share=share)
            except ValueError as exc:
                reader.fail(path, str(exc))
    try:
        return TierPolicies(per_tier=per_tier, default_level=default_level)
    except ValueError as exc:
        reader.fail(where, str(exc))


_TIER_SECTIONS: dict[str, typing.Callable[[Reader, Any, str], Any]] = {
    "tiers": _parse_tier_names,
    "tier_disk": lambda reader, value, where: _parse_plain(DiskTierConfig, reader, value, where),
    "tier_redis": lambda reader, value, where: _parse_plain(RedisTierConfig, reader, value, where),
    "tier_policies": _parse_tier_policies,
}
"""``engine:`` keys whose values are nested sections, each with its parser."""


def _check_tiers(reader: Reader, values: dict[str, Any], where: str) -> None:
    """What stops a start before the engine loads: a disk tier without a writable directory, a Redis URL that
    does not parse, a Redis tier without a deployment secret. An unreachable Redis is not checked here (the
    tier warns and retries in the background)."""
    tiers = values.get("tiers", ())
    secret = values.get("deployment_secret")
    if secret is not None and len(secret.encode()) < MIN_SECRET_BYTES:
        reader.fail(f"{where}.deployment_secret", f"expected at least {MIN_SECRET_BYTES} bytes")
    if "disk" in tiers:
        directory = values.get("tier_disk", DiskTierConfig()).directory
        path = f"{where}.tier_disk.directory"
        if directory is None:
            reader.fail(path, "missing required key (a disk tier needs a directory)")
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reader.fail(path, f"cannot create {directory} ({exc.strerror or exc})")
        if not os.access(directory, os.W_OK | os.X_OK):
            reader.fail(path, f"{directory} is not writable")
    if "redis" in tiers:
        url = values.get("tier_redis", RedisTierConfig()).url
        try:
            redis.connection.parse_url(url)
        except ValueError as exc:
            reader.fail(f"{where}.tier_redis.url", f"not a Redis URL ({exc})")
        if secret is None:
            reader.fail(
                f"{where}.deployment_secret",
                "missing required key (a Redis tier needs it: every gateway must hash blocks alike)",
            )
