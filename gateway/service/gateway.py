"""The running gateway's services (one per app): config, model registry, canonicalizer (rules, transcript
memory, learned slots), miss explanations, stats, metrics. The stats document asks each backend for its engine
counters and replicas (``Backend`` capabilities)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from engine.api import EngineStats
from gateway.config.schema import GatewayConfig
from gateway.core.keys import KeyTable
from gateway.service.cache_explain import CacheExplanations
from gateway.service.canonicalize import Canonicalizer
from gateway.service.limits import ClientUsage
from gateway.service.registry import ModelRegistry
from gateway.service.shutdown import ShutdownDrain
from gateway.service.stats import GatewayStats
from gateway.service.timeseries import StatsHistory


@dataclass
class Gateway:
    """Everything a request handler needs.

    Attributes:
        config: the validated config.
        registry: model name -> backend.
        canonicalizer: the configured rules, the transcript memory and the slot learner.
        stats: gateway-side counters.
        cache: the miss explanations (``x-prefixgate-cache``) and their counters by cause.
        metrics: this app's Prometheus registry (reads ``stats_snapshot`` at scrape time).
        created: Unix time the gateway was built (the ``created`` of ``/v1/models`` entries).
        keys: the client keys (empty: the gateway runs open).
        clients: per-key limits and per-key / per-tenant usage.
        history: periodic samples of the stats document (the dashboard's charts).
        drain: the requests in flight a shutdown ends after its grace period (``gateway.service.shutdown``).
    """

    config: GatewayConfig
    registry: ModelRegistry
    canonicalizer: Canonicalizer
    stats: GatewayStats
    cache: CacheExplanations | None = None
    metrics: CollectorRegistry | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    keys: KeyTable = field(default_factory=KeyTable)
    clients: ClientUsage = field(default_factory=lambda: ClientUsage(()))
    history: StatsHistory | None = None
    drain: ShutdownDrain = field(default_factory=ShutdownDrain)

    def engine_stats(self) -> dict[str, EngineStats | None]:
        """Model name -> its engine's counters (None for backends without an engine, or not started)."""
        result: dict[str, EngineStats | None] = {}
        for name, backend in self.registry.items():
            result[name] = backend.engine_stats()
        return result

    def stats_snapshot(self) -> dict[str, Any]:
        """The ``/admin/stats`` document; upstream models also get ``replicas``: base URL (without credentials
        or query string) -> ``{"state", "inflight", "failures"}`` of the prefix-affinity ring, and with
        ``kv_events`` configured ``kv_events`` (the feed's counters, ``Backend.kv_events``), and those with
        ``routing_share`` ``routing_share`` (exchanges, placements written and read, errors, ``up``). Also:
        ``rule_packs`` (the configured packs), ``transcript`` (memory, store and Redis counters), ``learned``
        (mode, footprint, and each learned slot's shape and counts, never a value) and ``cache_misses`` (per
        model, misses by cause and by segment)."""
        doc = self.stats.snapshot(self.engine_stats())
        doc.update(self.canonicalizer.stats())
        if self.cache is not None:
            doc["cache_misses"] = self.cache.snapshot()
        doc.update(self.clients.snapshot())
        for name, backend in self.registry.items():
            replicas = backend.replicas()
            if replicas is not None and name in doc["models"]:
                doc["models"][name]["replicas"] = replicas
            kv_events = backend.kv_events()
            if kv_events is not None and name in doc["models"]:
                doc["models"][name]["kv_events"] = kv_events
            share = backend.routing_share_stats()
            if share is not None and name in doc["models"]:
                doc["models"][name]["routing_share"] = share
        return doc
