"""The ``engine:`` section of an embedded model: ``EngineConfig``'s fields checked against their annotated types,
and the KV tier settings (tier names, disk and Redis settings, per-level policies, the deployment secret) with
the start-up errors issue 13 names (unwritable directory, unparsable Redis URL, a Redis tier without a secret)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from pathlib import Path
from typing import Any

from engine.api import (
    DECODE_KERNELS,
    DENSE_GEMMS,
    GLUE_KERNELS,
    LINEAR_KERNELS,
    PREFILL_KERNELS,
    EngineConfig,
)
from engine.errors import UnsupportedModelError
from engine.kv_tiers.keys import MIN_SECRET_BYTES
from engine.kv_tiers.policy import DEFAULT_POLICIES, LEVELS, MAX_TTL_S, TierPolicies, TierPolicy
from engine.kv_tiers.settings import TIER_NAMES, DiskTierConfig, RedisTierConfig
from engine.step_threads import check_small_step_threads
from gateway.config.reader import Reader
from gateway.config.schema import ConfigError, EmbeddedModel, GatewayConfig
from gateway.core.json_types import yaml_kind

DTYPES = ("float32", "bfloat16", "float16")
"""``engine.dtype``'s values: the keys of ``engine.async_engine.DTYPES``, which checks them only when the model
loads and which this layer may not import (it imports torch: tests/test_layers.py); a test holds the two equal."""


def parse_engine(reader: Reader, value: Any, where: str, base_dir: Path | None = None) -> EngineConfig:
    """Validate an ``engine:`` mapping against ``EngineConfig``'s fields and their annotated types.

    ``base_dir``: the config file's folder, which a relative ``tier_disk.directory`` is resolved against (as
    every relative path of the config); None leaves it relative to the working directory."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    section = reader.mapping({} if value is None else value, where, set(fields))
    hints = typing.get_type_hints(EngineConfig)
    values: dict[str, Any] = {}
    for key in section:
        if key in _TIER_SECTIONS:
            values[key] = _TIER_SECTIONS[key](reader, section[key], f"{where}.{key}")
        else:
            values[key] = reader.typed(section, where, key, hints[key], None, required=True)
    for key in (
        "block_size",
        "num_blocks",
        "max_batch",
        "max_num_batched_tokens",
        "idle_prefill_chunk_tokens",
    ):
        if key in values and values[key] < 1:
            reader.fail(f"{where}.{key}", f"expected an integer >= 1, got {values[key]}")
    _check_long_prefill_threshold(reader, values, where)
    if "dtype" in values and values["dtype"] not in DTYPES:
        reader.fail(f"{where}.dtype", f"expected one of {', '.join(DTYPES)}, got {values['dtype']!r}")
    if values.get("max_model_len") is not None and values["max_model_len"] < 1:
        # the upper bound is the checkpoint's context window: checked when the model loads (``start_error``)
        reader.fail(
            f"{where}.max_model_len",
            f"expected an integer >= 1 or null (the checkpoint's context window), got {values['max_model_len']}",
        )
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
    if (
        "idle_prefill_min_residency_s" in values
        and not 0 <= values["idle_prefill_min_residency_s"] < math.inf
    ):
        reader.fail(
            f"{where}.idle_prefill_min_residency_s",
            f"expected a finite number >= 0, got {values['idle_prefill_min_residency_s']}",
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
    _check_tiers(reader, values, where, base_dir)
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
        reader.fail(where, f"a tier is named twice in [{', '.join(value)}]")
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
            # checked here as well as by ``TierPolicy``, whose message names Python's None and not the key
            if ttl is not None and not 0 < ttl <= MAX_TTL_S:
                reader.fail(
                    f"{path}.ttl_s",
                    f"must be > 0 and at most {MAX_TTL_S:.0f} (100 years), or null (kept until the budget "
                    f"evicts it), got {ttl}",
                )
            if not 0 < share <= 1:
                reader.fail(f"{path}.budget_share", f"must be in (0, 1], got {share}")
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


def _check_tiers(reader: Reader, values: dict[str, Any], where: str, base_dir: Path | None = None) -> None:
    """What stops a start before the engine loads: tiers without prefix caching, a disk tier without a
    writable directory (a relative one is resolved against ``base_dir`` here), a Redis URL that does not parse
    or names a database that is not a non-negative integer, a Redis tier without a deployment secret. An
    unreachable Redis is not checked here (the tier warns and retries in the background); a Redis that refuses
    the connection (a database past its range) stops the start when the model loads."""
    tiers = values.get("tiers", ())
    _check_unused_tier_settings(reader, values, tiers, where)
    if tiers and values.get("enable_prefix_caching") is False:
        reader.fail(
            f"{where}.tiers",
            f"needs prefix caching, and {where}.enable_prefix_caching is false: the tiers keep the prefix "
            "cache's blocks, so they would do nothing (remove tiers or turn prefix caching on)",
        )
    secret = values.get("deployment_secret")
    if secret is not None and len(secret.encode()) < MIN_SECRET_BYTES:
        reader.fail(f"{where}.deployment_secret", f"expected at least {MIN_SECRET_BYTES} bytes")
    if "disk" in tiers:
        directory = values.get("tier_disk", DiskTierConfig()).directory
        path = f"{where}.tier_disk.directory"
        if directory is None:
            reader.fail(path, "missing required key (a disk tier needs a directory)")
        if base_dir is not None and not os.path.isabs(directory):
            directory = str((base_dir / directory).resolve())
            values["tier_disk"] = dataclasses.replace(values["tier_disk"], directory=directory)
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reader.fail(path, f"cannot create {directory} ({exc.strerror or exc})")
        if not os.access(directory, os.W_OK | os.X_OK):
            reader.fail(path, f"{directory} is not writable")
    if "redis" in tiers:
        reader.redis_url(f"{where}.tier_redis.url", values.get("tier_redis", RedisTierConfig()).url)
        if secret is None:
            reader.fail(
                f"{where}.deployment_secret",
                "missing required key (a Redis tier needs it: every gateway must hash blocks alike)",
            )


def _check_unused_tier_settings(
    reader: Reader, values: dict[str, Any], tiers: tuple[str, ...], where: str
) -> None:
    """Refuse tier settings that nothing would read: ``tier_disk`` / ``tier_redis`` / ``tier_policies.<tier>``
    of a tier ``tiers`` does not name, and ``tier_policies``, ``tier_writeback_capacity`` or
    ``tier_flush_on_close`` without any tier (as a backend's settings are refused on another backend)."""
    named = f"tiers: [{', '.join(tiers)}]" if tiers else "no tiers"
    for tier in TIER_NAMES:
        if f"tier_{tier}" in values and tier not in tiers:
            reader.fail(
                f"{where}.tier_{tier}",
                f"configures the {tier} tier, which {where}.tiers does not name ({named}): add {tier} to tiers "
                "or remove this section",
            )
        if tier in values.get("tier_policies", TierPolicies()).per_tier and tier not in tiers:
            reader.fail(
                f"{where}.tier_policies.{tier}",
                f"configures the {tier} tier, which {where}.tiers does not name ({named}): add {tier} to tiers "
                "or remove this section",
            )
    if not tiers:
        for key in ("tier_policies", "tier_writeback_capacity", "tier_flush_on_close"):
            if key in values:
                reader.fail(
                    f"{where}.{key}",
                    f"is a setting of the KV tiers, and {where}.tiers names none: add tiers or remove it",
                )


def model_start_error(config: GatewayConfig, name: str, exc: Exception) -> ConfigError | None:
    """The ``ConfigError`` of the embedded model ``name`` of ``config`` whose settings failed when it loaded,
    for what only the checkpoint can tell (a ``max_model_len`` beyond its context window, a ``weights`` format
    this CPU has no kernel for, a file that is not a checkpoint); None when ``name`` is not an embedded model of
    ``config``. The key is ``models[i].engine.<setting>`` when the engine's message starts with a setting's
    name (``max_model_len 99999 is not in [1, 8192] ...``, ``engine.weights: ...``), ``models[i].path`` for a
    checkpoint the engine cannot load, else ``models[i]``.

    Args:
        config: the config the app was built from.
        name: the model's name.
        exc: what its load raised (a ``ValueError`` or an ``engine.errors.EngineError``).
    """
    index = next(
        (i for i, m in enumerate(config.models) if m.name == name and isinstance(m, EmbeddedModel)), None
    )
    if index is None:
        return None
    where, message = f"models[{index}]", str(exc)
    if isinstance(exc, UnsupportedModelError):
        return ConfigError(config.source, f"{where}.path", message)
    head, _, rest = message.removeprefix("engine.").partition(" ")
    setting = head.rstrip(":")
    if setting.split(".")[0] in {f.name for f in dataclasses.fields(EngineConfig)}:
        return ConfigError(config.source, f"{where}.engine.{setting}", rest.strip() or message)
    return ConfigError(config.source, where, message)
