"""The routing settings of one upstream model entry: ``routing``, ``routing_share``, ``kv_events`` and
``cache_aware``.

Each bad value is a ``ConfigError`` naming its key; ``kv_events`` and ``cache_aware`` need
``routing: cache_aware`` (the only policy with an index), ``routing_share`` works with every policy (load is
shared; the index too with ``cache_aware``).
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

from gateway.config.reader import Reader
from gateway.config.schema import (
    KV_EVENT_TOKENIZERS,
    KV_EVENT_TRANSPORTS,
    ROUTING_POLICIES,
    CacheAwareConfig,
    KVEventsConfig,
    RoutingShareConfig,
)


def parse_routing(reader: Reader, raw: dict, where: str) -> dict[str, Any]:
    """``{"routing", "routing_share", "kv_events", "cache_aware"}`` of the model entry ``raw`` at ``where``.

    Raises:
        ConfigError: an unknown policy, a bad ``routing_share``, ``kv_events`` or ``cache_aware`` value, or
            ``kv_events`` or ``cache_aware`` without ``routing: cache_aware``.
    """
    routing = reader.typed(raw, where, "routing", str, "consistent_hash")
    if routing not in ROUTING_POLICIES:
        reader.fail(f"{where}.routing", f"expected one of {', '.join(ROUTING_POLICIES)}, got {routing!r}")
    base_url = raw.get("base_url")
    replicas = len(base_url) if isinstance(base_url, list) else 1
    kv_events = _parse_kv_events(reader, raw.get("kv_events"), f"{where}.kv_events", replicas)
    if kv_events is not None and routing != "cache_aware":
        reader.fail(
            f"{where}.kv_events", f"feeds the cache-aware index: needs routing: cache_aware, not {routing!r}"
        )
    cache_aware = _parse_cache_aware(reader, raw.get("cache_aware"), f"{where}.cache_aware")
    if cache_aware is not None and routing != "cache_aware":
        reader.fail(f"{where}.cache_aware", f"configures routing: cache_aware, not {routing!r}")
    return {
        "routing": routing,
        "routing_share": _parse_routing_share(reader, raw.get("routing_share"), f"{where}.routing_share"),
        "kv_events": kv_events,
        "cache_aware": cache_aware,
    }


def _parse_cache_aware(reader: Reader, value: Any, where: str) -> CacheAwareConfig | None:
    """``cache_aware:`` a mapping of ``CacheAwareConfig``'s fields; absent = None (the defaults)."""
    if value is None:
        return None
    default = CacheAwareConfig()
    section = reader.mapping(value, where, {f.name for f in dataclasses.fields(CacheAwareConfig)})
    out: dict[str, Any] = {}
    for key, kind, low, high in (
        ("index_blocks", int, 1, None),
        ("cache_threshold", float, 0.0, 1.0),
        ("overlap_weight", float, 0.0, None),
        ("balance_abs_threshold", int, 0, None),
        ("load_weight", float, 0.0, None),
    ):
        number = reader.typed(section, where, key, kind, getattr(default, key))
        if number < low or (high is not None and number > high):
            bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
            reader.fail(f"{where}.{key}", f"expected a number {bounds}, got {number}")
        out[key] = number
    return CacheAwareConfig(**out)


def _parse_routing_share(reader: Reader, value: Any, where: str) -> RoutingShareConfig | None:
    """``routing_share: redis://...`` (a URL) or a mapping of ``RoutingShareConfig``'s fields; absent = None."""
    if value is None:
        return None
    value = reader.resolve_env(value, where)
    if isinstance(value, str):
        value = {"redis_url": value}
    default = RoutingShareConfig()
    section = reader.mapping(value, where, {f.name for f in dataclasses.fields(RoutingShareConfig)})
    url = reader.redis_url(
        f"{where}.redis_url", reader.typed(section, where, "redis_url", str, default.redis_url)
    )
    numbers = {}
    for key in ("interval_s", "timeout_s", "retry_after_s"):
        numbers[key] = reader.typed(section, where, key, float, getattr(default, key))
        if not numbers[key] > 0:
            reader.fail(f"{where}.{key}", f"expected a positive number of seconds, got {numbers[key]}")
    return RoutingShareConfig(redis_url=url, **numbers)


def _endpoints(reader: Reader, section: dict, where: str, key: str, replicas: int) -> tuple[str, ...]:
    """``section[key]``: a list of ZeroMQ endpoints (``tcp://host:port`` or ``ipc://path``), one per replica."""
    value = section.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        reader.fail(f"{where}.{key}", f"expected a list of ZeroMQ endpoints, got {type(value).__name__}")
    out = []
    for index, endpoint in enumerate(value):
        endpoint = reader.resolve_env(endpoint, f"{where}.{key}[{index}]")
        if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")) or "*" in endpoint:
            reader.fail(
                f"{where}.{key}[{index}]",
                f"expected a tcp://host:port or ipc://path endpoint to connect to, got {endpoint!r}",
            )
        out.append(endpoint)
    if out and len(out) != replicas:
        reader.fail(f"{where}.{key}", f"expected one endpoint per base_url ({replicas}), got {len(out)}")
    return tuple(out)


def _parse_kv_events(reader: Reader, value: Any, where: str, replicas: int) -> KVEventsConfig | None:
    """``kv_events: true`` (the defaults) or a mapping of ``KVEventsConfig``'s fields; absent or false = None.

    ``replicas`` is the number of ``base_url`` entries (``zmq`` needs one endpoint per replica).
    """
    if value is None or value is False:
        return None
    default = KVEventsConfig()
    section = reader.mapping(
        {} if value is True else value, where, {f.name for f in dataclasses.fields(KVEventsConfig)}
    )
    transport = reader.typed(section, where, "transport", str, default.transport)
    if transport not in KV_EVENT_TRANSPORTS:
        reader.fail(
            f"{where}.transport", f"expected one of {', '.join(KV_EVENT_TRANSPORTS)}, got {transport!r}"
        )
    endpoints = _endpoints(reader, section, where, "endpoints", replicas)
    replay = _endpoints(reader, section, where, "replay_endpoints", replicas)
    topic = reader.typed(section, where, "topic", str, default.topic)
    if transport == "zmq" and not endpoints:
        reader.fail(f"{where}.endpoints", "transport: zmq needs one publisher endpoint per base_url")
    if transport == "http":
        for key in ("endpoints", "replay_endpoints", "topic"):
            if key in section:
                reader.fail(f"{where}.{key}", "is a transport: zmq setting (this one is http)")
    path = reader.typed(section, where, "path", str, default.path)
    if not path.startswith("/") or any(ch in path for ch in " ?#\r\n"):
        reader.fail(f"{where}.path", f"expected a URL path starting with '/', got {path!r}")
    tokenizer = reader.typed(section, where, "tokenizer", str, default.tokenizer)
    if tokenizer not in KV_EVENT_TOKENIZERS:
        reader.fail(
            f"{where}.tokenizer", f"expected one of {', '.join(KV_EVENT_TOKENIZERS)}, got {tokenizer!r}"
        )
    fmt = reader.typed(section, where, "message_format", str, default.message_format)
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(fmt) if name is not None}
    except ValueError as exc:
        reader.fail(f"{where}.message_format", f"not a format string: {exc}")
    if fields != {"role", "content"}:
        reader.fail(
            f"{where}.message_format",
            f"expected exactly the fields {{role}} and {{content}}, got {', '.join(sorted(fields)) or 'none'}",
        )
    block_size = reader.typed(section, where, "block_size", int, default.block_size)
    if block_size < 1:
        reader.fail(f"{where}.block_size", f"expected an integer >= 1, got {block_size}")
    return KVEventsConfig(
        transport=transport,
        path=path,
        tokenizer=tokenizer,
        message_format=fmt,
        block_size=block_size,
        endpoints=endpoints,
        replay_endpoints=replay,
        topic=topic,
    )
