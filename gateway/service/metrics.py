"""``/metrics``: the ``/admin/stats`` counters in the Prometheus text format, through ``prometheus-client``.

A per-app ``CollectorRegistry`` holds one custom collector that reads the same snapshot as ``/admin/stats``
at scrape time, so the two can never disagree and several apps (tests) never share global metrics.
Prefix groups are left out on purpose (one series per prefix key would be unbounded cardinality).
Format: https://prometheus.io/docs/instrumenting/exposition_formats/.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api import EngineStats, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = (
    ("requests", "Requests the backend finished."),
    ("aborted", "Requests whose client disconnected before the end."),
    ("prompt_tokens", "Prompt tokens reported in usage."),
    (
        "cached_tokens",
        "Prompt tokens served from a prefix cache (usage.prompt_tokens_details.cached_tokens).",
    ),
    ("cache_creation_tokens", "Prompt tokens written to a provider cache."),
    ("completion_tokens", "Generated tokens reported in usage."),
    ("prefill_tokens", "Prompt tokens actually computed (prefilled)."),
    ("prefill_tokens_saved", "Prompt tokens not computed thanks to the prefix cache."),
    ("evictions", "Cached KV blocks evicted."),
    ("inflight_shared_tokens", "Prefill tokens saved by in-flight sharing."),
    ("preemptions", "Running requests preempted."),
    ("forks", "Sequences forked from a computed prompt (n > 1 choices: n - 1 per request)."),
    ("forked_prefill_tokens_saved", "Prompt tokens the n > 1 forks shared instead of prefilling."),
    ("idle_prefills", "Conversations' next turns prefilled while the engine was idle (idle_reply_prefill)."),
    ("idle_prefill_tokens", "Tokens computed by idle prefills (also in prefill_tokens)."),
    (
        "idle_prefills_yielded",
        "Times an idle prefill stepped aside for a request (resumed later from its cache).",
    ),
    ("idle_prefills_dropped", "Idle prefills dropped rather than evict blocks used since their reply."),
)


class StatsCollector(Collector):
    """Yields gateway and engine metrics from ``snapshot()`` and ``engine_stats()`` at every scrape.

    Args:
        snapshot: returns the ``/admin/stats`` document.
        engine_stats: returns model name -> ``EngineStats`` (None for upstream models).
    """

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        engine_stats: Callable[[], Mapping[str, EngineStats | None]],
    ) -> None:
        self._snapshot = snapshot
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        doc = self._snapshot()
        models: dict[str, dict[str, Any]] = doc["models"]
        for key, help_text in _COUNTERS:
            family = CounterMetricFamily(f"prefixgate_{key}", help_text, labels=["model"])
            for name, m in models.items():
                family.add_metric([name], m[key])
            yield family
        yield _gauge("prefixgate_hit_rate", "cached_tokens / prompt_tokens.", models, lambda m: m["hit_rate"])
        saved = CounterMetricFamily(
            "prefixgate_prefill_seconds_saved",
            "Estimated prefill seconds saved: each request's prefix-hit tokens at the mean prefill rate measured "
            "when it was admitted (never revised).",
            labels=["model"],
        )
        for name, m in models.items():
            if m["prefill_seconds_saved"] is not None:
                saved.add_metric([name], m["prefill_seconds_saved"])
        yield saved
        blocks = GaugeMetricFamily("prefixgate_blocks", "KV blocks by state.", labels=["model", "state"])
        for name, m in models.items():
            for state in ("total", "used", "cached", "free"):
                blocks.add_metric([name, state], m["blocks"][state])
        yield blocks
        rules = CounterMetricFamily(
            "prefixgate_rule_applications", "Times each rule rewrote a request.", labels=["model", "rule"]
        )
        for name, m in models.items():
            for rule, count in m["rules"].items():
                rules.add_metric([name, rule], count)
        yield rules
        errors = CounterMetricFamily(
            "prefixgate_errors", "Error responses by HTTP status.", labels=["status"]
        )
        for status, count in doc["errors"].items():
            errors.add_metric([status], count)
        yield errors
        yield from _cache_miss_metrics(doc.get("cache_misses"))
        yield from _kv_event_metrics(models)
        yield from _routing_share_metrics(models)
        yield from _replica_metrics(models)
        yield from _transcript_metrics(doc.get("transcript"))
        yield from _usage_families(doc)
        yield from self._engine_histograms()

    def _engine_histograms(self) -> Iterator[Metric]:
        stats = {name: s for name, s in self._engine_stats().items() if s is not None}
        yield from tier_metrics(stats)
        for attr, help_text in (
            ("ttft", "Engine time to first token (seconds)."),
            ("tpot", "Engine time per output token (seconds)."),
        ):
            family = HistogramMetricFamily(f"prefixgate_engine_{attr}_seconds", help_text, labels=["model"])
            for name, s in stats.items():
                histogram: Histogram = getattr(s, attr)
                family.add_metric([name], _buckets(histogram), histogram.sum)
            yield family


_TIER_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("hit_tokens", "prefixgate_tier_hit_tokens", "Prompt tokens a lookup found in the tier."),
    (
        "miss_tokens",
        "prefixgate_tier_miss_tokens",
        "Tokens of the blocks a lookup asked the tier for and it did not serve: blocks a lower tier then served, "
        "and the one block where the lookup stopped (no tier had it); the rest of the prompt is never asked for, "
        "so hit / (hit + miss) is not a prompt-token hit rate.",
    ),
    ("bytes_written", "prefixgate_tier_written_bytes", "Bytes of entries written to the tier."),
    ("writes", "prefixgate_tier_writes", "Entries written to the tier."),
    ("write_errors", "prefixgate_tier_write_errors", "Writes that failed (disk full, Redis down or slow)."),
    ("write_refused", "prefixgate_tier_write_refused", "Writes Redis refused (maxmemory)."),
    ("read_errors", "prefixgate_tier_read_errors", "Reads that failed (counted as misses)."),
    ("evicted", "prefixgate_tier_evicted", "Entries dropped to keep a level inside its byte budget."),
    (
        "skipped_down",
        "prefixgate_tier_skipped_down",
        "Operations skipped while the tier waits to retry an unreachable backend (Redis down).",
    ),
    (
        "admin_errors",
        "prefixgate_tier_admin_errors",
        "Admin operations (listing, dropping cached prefixes) the tier could not complete (named in the answer).",
    ),
)
"""``engine.kv_tiers.counters`` per-tier names -> metric name (``_total`` added) and help."""


def tier_metrics(stats: Mapping[str, EngineStats]) -> Iterator[Metric]:
    """The KV tiers' counters (``EngineStats.tier_counters``, names of ``engine.kv_tiers.counters``) per model:
    per tier hits, misses, bytes, writes, failures and operations skipped while down (each from 0), and whether
    it is up; expirations per tier and level; entries rejected by cause; write-back queue drops; blocks loaded
    back; pinned blocks; the load-back latency histogram."""
    per_tier = {
        suffix: CounterMetricFamily(name, help_text, labels=["model", "tier"])
        for suffix, name, help_text in _TIER_COUNTERS
    }
    expired = CounterMetricFamily(
        "prefixgate_tier_expired",
        "Entries found older than their level's TTL.",
        labels=["model", "tier", "level"],
    )
    rejected = CounterMetricFamily(
        "prefixgate_tier_rejected",
        "Tier entries refused by the integrity check, by cause.",
        labels=["model", "cause"],
    )
    dropped = CounterMetricFamily(
        "prefixgate_tier_writes_dropped",
        "Blocks dropped because the write-back queue was full.",
        labels=["model"],
    )
    loaded = CounterMetricFamily(
        "prefixgate_tier_loaded_blocks", "Blocks loaded back into the pool.", labels=["model"]
    )
    pinned = GaugeMetricFamily("prefixgate_pinned_blocks", "KV blocks held in RAM by pins.", labels=["model"])
    up = GaugeMetricFamily(
        "prefixgate_tier_up",
        "1 while the tier's backend answers, 0 while it waits to retry an unreachable one (Redis down).",
        labels=["model", "tier"],
    )
    latency = HistogramMetricFamily(
        "prefixgate_tier_load_seconds", "Load-back latency from the tiers (seconds).", labels=["model"]
    )
    for model, s in stats.items():
        pinned.add_metric([model], s.pinned_blocks)
        if s.tier_load_seconds is not None:
            latency.add_metric([model], _buckets(s.tier_load_seconds), s.tier_load_seconds.sum)
        for name, value in sorted(s.tier_counters.items()):
            parts = name.split(".")
            if parts == ["writeback", "dropped"]:
                dropped.add_metric([model], value)
            elif parts == ["loaded_blocks"]:
                loaded.add_metric([model], value)
            elif parts[0] == "rejected" and len(parts) == 2:
                rejected.add_metric([model, parts[1]], value)
            elif len(parts) == 3 and parts[1] == "expired":
                expired.add_metric([model, parts[0], parts[2]], value)
            elif len(parts) == 2 and parts[1] in per_tier:
                per_tier[parts[1]].add_metric([model, parts[0]], value)
            elif len(parts) == 2 and parts[1] == "up":
                up.add_metric([model, parts[0]], value)
    yield from per_tier.values()
    yield from (expired, rejected, dropped, loaded, pinned, latency, up)


def _cache_miss_metrics(doc: dict[str, Any] | None) -> Iterator[Metric]:
    """Misses by cause (``gateway.service.miss_explanation.MISS_CAUSES``) and the stable tokens they cost."""
    if not doc:
        return
    misses = CounterMetricFamily(
        "prefixgate_cache_misses",
        "Requests whose cached prefix stopped short, by cause.",
        labels=["model", "cause"],
    )
    tokens = CounterMetricFamily(
        "prefixgate_cache_missed_tokens",
        "Stable prompt tokens not served from the cache, by miss cause.",
        labels=["model", "cause"],
    )
    explained = CounterMetricFamily(
        "prefixgate_cache_explained", "Chat requests whose cache result was explained.", labels=["model"]
    )
    for model, counters in doc["models"].items():
        explained.add_metric([model], counters["requests"])
        for cause, count in counters["by_cause"].items():
            misses.add_metric([model, cause], count)
            tokens.add_metric([model, cause], counters["missed_tokens_by_cause"][cause])
    yield explained
    yield misses
    yield tokens
    unexplained = CounterMetricFamily(
        "prefixgate_cache_explain_errors", "Requests left unexplained after an internal failure."
    )
    unexplained.add_metric([], doc["errors"])
    yield unexplained


def _routing_share_metrics(models: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The Redis routing shares' counters (``models[name]["routing_share"]``, docs/routing.md)."""
    shares = {name: m["routing_share"] for name, m in models.items() if m.get("routing_share")}
    if not shares:
        return
    counters = CounterMetricFamily(
        "prefixgate_routing_share",
        "Routing share counters: exchanges with Redis, placements written, placements retracted (their "
        "attempt failed), hashes other gateways retracted that this one forgot, replica renewals read from "
        "other gateways, hashes read, errors, exchanges skipped while Redis is left alone, placements "
        "dropped from a full outbox.",
        labels=["model", "counter"],
    )
    up = GaugeMetricFamily(
        "prefixgate_routing_share_up", "1 while the last exchange with Redis succeeded.", labels=["model"]
    )
    peers = GaugeMetricFamily(
        "prefixgate_routing_share_gateways",
        "Other gateways whose load was counted at the last exchange.",
        labels=["model"],
    )
    for name, share in shares.items():
        for key, value in share.items():  # every counter of ``RoutingShareStats.snapshot``
            if key not in ("up", "gateways"):  # gauges, below
                counters.add_metric([name, key], value)
        up.add_metric([name], int(share["up"]))
        peers.add_metric([name], share["gateways"])
    yield from (counters, up, peers)


def _kv_event_metrics(models: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The KV event feeds' counters (``models[name]["kv_events"]``, docs/routing.md): events by kind, engine
    blocks mapped and skipped by reason, and replicas connected / in sync."""
    feeds = {name: m["kv_events"] for name, m in models.items() if m.get("kv_events")}
    if not feeds:
        return
    counters = CounterMetricFamily(
        "prefixgate_kv_events",
        "KV event feed counters: connects, batches, events applied, refused, lost, gaps, replays, ...",
        labels=["model", "transport", "counter"],
    )
    skipped = CounterMetricFamily(
        "prefixgate_kv_event_blocks_skipped",
        "Engine blocks of KV events the gateway could not map onto its own hashes, by reason.",
        labels=["model", "reason"],
    )
    mapped = CounterMetricFamily(
        "prefixgate_kv_event_blocks_mapped", "Engine blocks of KV events mapped.", labels=["model"]
    )
    replicas = GaugeMetricFamily(
        "prefixgate_kv_event_replicas",
        "Replicas whose KV event stream is connected (up) and in sync (synced).",
        labels=["model", "state"],
    )
    for name, feed in feeds.items():
        for key, value in feed.items():
            if isinstance(value, int) and not isinstance(value, bool) and key != "mapped_blocks":
                counters.add_metric([name, feed["transport"], key], value)
        if "skipped_blocks" in feed:
            mapped.add_metric([name], feed["mapped_blocks"])
            for reason, count in feed["skipped_blocks"].items():
                skipped.add_metric([name, reason], count)
            for state in ("up", "synced"):
                replicas.add_metric([name, state], sum(r[state] for r in feed["replicas"].values()))
    yield counters
    yield skipped
    yield mapped
    yield replicas


REPLICA_STATES = ("up", "half_open", "down")
"""A replica's breaker states (``gateway.transport.affinity``)."""


def _replica_metrics(models: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """The upstream replicas of each model (``models[name]["replicas"]``, the ring's ``snapshot``): breaker
    state (1 for the state it is in, 0 for the others), requests in flight, failures in a row, requests sent
    and how many went away from their home replica (spilled by load or health; not exported where the routing
    has no homes), restarts seen in its answers (``x-prefixgate-instance``), labelled by base URL (without
    credentials or query string)."""
    rings = {name: m["replicas"] for name, m in models.items() if m.get("replicas")}
    if not rings:
        return
    labels = ["model", "replica"]
    state = GaugeMetricFamily(
        "prefixgate_upstream_replica_state",
        "Breaker state of an upstream replica: 1 for its state (up, half_open, down), 0 for the others.",
        labels=[*labels, "state"],
    )
    inflight = GaugeMetricFamily(
        "prefixgate_upstream_replica_inflight", "Requests in flight to an upstream replica.", labels=labels
    )
    failures = GaugeMetricFamily(
        "prefixgate_upstream_replica_failures", "Failures in a row of an upstream replica.", labels=labels
    )
    requests = CounterMetricFamily(
        "prefixgate_upstream_replica_requests", "Requests sent to an upstream replica.", labels=labels
    )
    away = CounterMetricFamily(
        "prefixgate_upstream_replica_away",
        "Requests an upstream replica served for another home replica (spilled by load or health).",
        labels=labels,
    )
    restarts = CounterMetricFamily(
        "prefixgate_upstream_replica_restarts",
        "Answers of an upstream replica that named an instance new to its URL (x-prefixgate-instance: it "
        "restarted, and the routing index forgot what it credited there).",
        labels=labels,
    )
    for name, replicas in rings.items():
        for replica, doc in replicas.items():
            restarts.add_metric([name, replica], doc.get("restarts", 0))
            for known in REPLICA_STATES:
                state.add_metric([name, replica, known], 1 if doc.get("state") == known else 0)
            inflight.add_metric([name, replica], doc.get("inflight", 0))
            failures.add_metric([name, replica], doc.get("failures", 0))
            requests.add_metric([name, replica], doc.get("requests", 0))
            if doc.get("away") is not None:  # None: the routing has no home replicas
                away.add_metric([name, replica], doc["away"])
    yield from (state, inflight, failures, requests, away, restarts)


def _transcript_metrics(doc: dict[str, Any] | None) -> Iterator[Metric]:
    """The canonical transcript memory's lookups and hits, and Redis errors."""
    if not doc:
        return
    memory = doc["memory"]
    family = CounterMetricFamily(
        "prefixgate_transcript", "Canonical transcript memory events.", labels=["event"]
    )
    for event in ("lookups", "hits", "rejected", "stored"):
        family.add_metric([event], memory[event])
    redis = doc.get("redis")
    if redis is not None:
        for event in ("errors", "skipped", "redis_hits", "writes"):
            family.add_metric([f"redis_{event}" if not event.startswith("redis_") else event], redis[event])
    yield family


_USAGE = (
    ("requests", "Requests finished"),
    ("prompt_tokens", "Prompt tokens charged (usage; counted for requests cancelled or failed mid-stream)"),
    ("cached_tokens", "Prompt tokens served from a prefix cache"),
    (
        "completion_tokens",
        "Generated tokens charged (usage; counted for requests cancelled or failed mid-stream)",
    ),
    ("spend_usd", "Spend in USD, input and output (priced models)"),
    ("rate_limited", "Requests refused with 429 by a key's limits (per tenant: by the limits of its keys)"),
)


def _usage_families(doc: dict[str, Any]) -> Iterator[Metric]:
    """Per client key (label: the key's name, never the key) and per tenant (``gateway.service.limits``)."""
    for scope, label in (("keys", "key"), ("tenants", "tenant")):
        entries: dict[str, dict[str, Any]] = doc.get(scope, {})
        for field, help_text in _USAGE:
            family = CounterMetricFamily(
                f"prefixgate_{label}_{field}", f"{help_text}, per {label}.", labels=[label]
            )
            for name, counters in entries.items():
                family.add_metric([name], counters[field])
            yield family
    ignored = CounterMetricFamily(
        "prefixgate_key_tenant_header_ignored",
        "x-prefixgate-tenant headers ignored because the key is not trusted.",
        labels=["key"],
    )
    for name, counters in doc.get("keys", {}).items():
        ignored.add_metric([name], counters["tenant_header_ignored"])
    yield ignored
    reserved = GaugeMetricFamily(
        "prefixgate_key_reserved_usd",
        "Cost estimates in USD held against the key's budget by its requests in flight.",
        labels=["key"],
    )
    for name, counters in doc.get("keys", {}).items():
        reserved.add_metric([name], counters["reserved_usd"])
    yield reserved


def _gauge(
    name: str, help_text: str, models: dict[str, dict[str, Any]], value: Callable[[dict], float]
) -> Metric:
    family = GaugeMetricFamily(name, help_text, labels=["model"])
    for model, m in models.items():
        family.add_metric([model], value(m))
    return family


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    """Cumulative ``(le, count)`` pairs ending with ``+Inf`` = total count, as Prometheus requires."""
    pairs = [
        (_le(bound), float(count)) for bound, count in zip(histogram.buckets, histogram.counts, strict=True)
    ]
    if not pairs or pairs[-1][0] != "+Inf":
        pairs.append(("+Inf", float(histogram.count)))
    return pairs


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def build_registry(
    snapshot: Callable[[], dict[str, Any]], engine_stats: Callable[[], Mapping[str, EngineStats | None]]
) -> CollectorRegistry:
    """A fresh registry holding one ``StatsCollector`` (never the process-global default registry)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(snapshot, engine_stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)
