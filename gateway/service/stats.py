"""Gateway statistics: per-model request counters, rule applications, top prefix groups, and the engine's own
counters, aggregated into the ``/admin/stats`` document (``/metrics`` reads the same snapshot).

Invariants:
- Counters are only ever raised, by ``record_*`` calls made once per request by ``gateway.service.pipeline``:
  ``record_rules`` once when the request is canonicalized, then exactly one of ``record_finish`` (the
  backend's final usage), ``record_abort`` (client went away) or ``record_error`` (an error response); a
  request that ended before its ``Finish`` after output started (cancelled, failed mid-stream) is also priced
  once with ``record_unfinished`` (its cost only: the token counters stay what clients were told).
- ``prompt_tokens`` / ``cached_tokens`` / ``completion_tokens`` are what clients were told in ``usage``;
  ``prefill_tokens`` and ``blocks`` come from the engine's own counters (``engine.api.EngineStats``), which it
  keeps itself so they cannot drift from the block pool.
- Prefix groups never hold prompt text: only the prefix key (a hash, see ``gateway.service.registry``) and
  counts.

Derived values:
- ``hit_rate = cached_tokens / prompt_tokens`` (0 when no prompt tokens).
- Embedded models: ``prefill_tokens`` = tokens the engine computed; ``prefill_tokens_saved`` = its prefix-hit
  tokens; ``prefill_seconds_saved`` = the engine's own running sum (``EngineStats.prefill_seconds_saved``): each
  request's prefix-hit tokens at the mean prefill rate (``prefill_seconds / prefill_tokens``) measured when
  it was admitted, so it never goes down when the rate changes later (a Prometheus counter). An estimate:
  attention makes late tokens dearer than early ones, so it slightly overstates savings on short prompts and
  understates them on long ones; a hit before the engine measured any prefill adds 0.
- Upstream models: the provider computes, so ``prefill_tokens = prompt_tokens - cached_tokens`` as reported,
  ``prefill_tokens_saved = cached_tokens``, and ``prefill_seconds_saved`` is null (no rate is measurable).
- Models with prices (``gateway.config.price_table``): cost paid, saved by cache reads, write premium and write
  waste per model, prefix key and tenant (``gateway.service.cost_ledger``; ``cost_usd`` (input paid) / ``cost_saved_usd`` /
  ``output_cost_usd`` per model), the table's ``prices_checked`` date, and the providers' own miss reasons folded into miss-cause
  counters (``provider_cache_misses``, ``gateway.service.provider_diagnostics``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.api import EngineStats, Histogram
from engine.stats import TTFT_BUCKETS_S, HistogramBuilder
from gateway.config.price_table import ModelPrices
from gateway.core.cache_usage import CacheUsage, CacheUsageError
from gateway.core.events import BackendUsage
from gateway.service.cost_ledger import CostLedger, RequestCost
from gateway.service.miss_counters import MissCounters
from gateway.service.miss_explanation import map_provider_cause
from gateway.service.provider_diagnostics import (
    ANTHROPIC_MISS_REASONS,
    ProviderDiagnostic,
    count_provider_miss,
)


@dataclass
class ModelCounters:
    """Counters of one model (tokens, seconds, dollars). ``rules_requests``: requests at least one rule
    rewrote; ``ttft_hit`` / ``ttft_miss``: gateway TTFT (seconds) of requests with / without cached tokens."""

    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cache_creation_tokens: int = 0
    completion_tokens: int = 0
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0
    cost_usd: float = 0.0
    cost_saved_usd: float = 0.0
    rules_requests: int = 0
    output_cost_usd: float = 0.0
    rules: Counter[str] = field(default_factory=Counter)
    ttft_hit: HistogramBuilder = field(default_factory=lambda: HistogramBuilder(TTFT_BUCKETS_S))
    ttft_miss: HistogramBuilder = field(default_factory=lambda: HistogramBuilder(TTFT_BUCKETS_S))
    errors: Counter[int] = field(default_factory=Counter)


@dataclass
class PrefixGroup:
    """One prefix group's counts. ``overcount`` bounds how much ``requests`` may exceed the truth."""

    key: str
    model: str
    tenant: str = ""
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    overcount: int = 0


class PrefixGroups:
    """Top prefix groups by requests in bounded memory: the Space-Saving algorithm (Metwally, Agrawal and
    El Abbadi, "Efficient Computation of Frequent and Top-k Elements in Data Streams", ICDT 2005).

    Exact while at most ``capacity`` distinct keys were seen. Beyond that, a new key replaces the group with
    the fewest requests and inherits its count (+1) as ``requests`` and that count as ``overcount``; token
    sums of a replaced group start from the new request.
    """

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._groups: dict[str, PrefixGroup] = {}

    def record(self, key: str, model: str, prompt_tokens: int, cached_tokens: int, tenant: str = "") -> None:
        """Count one finished request of prefix group ``key`` (of ``tenant``, the cache salt)."""
        group = self._groups.get(key)
        if group is None:
            if len(self._groups) >= self.capacity:
                smallest = min(self._groups.values(), key=lambda g: g.requests)
                del self._groups[smallest.key]
                group = PrefixGroup(
                    key=key,
                    model=model,
                    tenant=tenant,
                    requests=smallest.requests,
                    overcount=smallest.requests,
                )
            else:
                group = PrefixGroup(key=key, model=model, tenant=tenant)
            self._groups[key] = group
        group.requests += 1
        group.prompt_tokens += prompt_tokens
        group.cached_tokens += cached_tokens

    def top(self, n: int, model: str | None = None) -> list[dict[str, Any]]:
        """The ``n`` groups with most requests (ties: more cached tokens, then key), optionally of one
        model."""
        groups = [g for g in self._groups.values() if model is None or g.model == model]
        groups.sort(key=lambda g: (-g.requests, -g.cached_tokens, g.key))
        return [
            {
                "prefix_key": g.key,
                "model": g.model,
                "tenant": g.tenant,
                "requests": g.requests,
                "prompt_tokens": g.prompt_tokens,
                "cached_tokens": g.cached_tokens,
                "hit_rate": _ratio(g.cached_tokens, g.prompt_tokens),
                "overcount": g.overcount,
            }
            for g in groups[:n]
        ]


class GatewayStats:
    """All gateway-side counters. Single-threaded: called from the event loop only.

    Args:
        prices: model name -> provider prices (None when unknown); also fixes the model order of snapshots.
        prefix_capacity: prefix groups tracked (Space-Saving capacity).
        top_prefixes: groups listed in a snapshot, overall and per model.
        prices_checked: the price table's ``checked`` date, shown in snapshots.
        ledger: the cost ledger (default: a new one on the monotonic clock).
    """

    def __init__(
        self,
        prices: Mapping[str, ModelPrices | None],
        prefix_capacity: int = 1024,
        top_prefixes: int = 20,
        prices_checked: str | None = None,
        ledger: CostLedger | None = None,
    ):
        self._prices = dict(prices)
        self.prices_checked = prices_checked
        self.ledger = ledger if ledger is not None else CostLedger()
        self.provider_misses = MissCounters()
        self.models: dict[str, ModelCounters] = {name: ModelCounters() for name in prices}
        self.errors: Counter[int] = Counter()
        self.prefixes = PrefixGroups(prefix_capacity)
        self.top_prefixes = top_prefixes

    def prices(self, model: str) -> ModelPrices | None:
        """The prices of ``model`` (None when it has none, or is not configured)."""
        return self._prices.get(model)

    def record_rules(self, model: str, applied: Mapping[str, int]) -> None:
        """Add one request's rule applications (rule id -> times applied)."""
        if any(applied.values()):
            self.models[model].rules_requests += 1
        self.models[model].rules.update({rule: count for rule, count in applied.items() if count})

    def record_finish(
        self,
        model: str,
        usage: BackendUsage,
        ttft_s: float | None,
        prefix_key: str,
        tenant: str = "",
        retention: str | None = None,
        cache_miss_reason: str | None = None,
    ) -> RequestCost | None:
        """Count a request the backend finished, with the usage the client was told; returns its cost (None when
        the model has no prices or the counts cannot be priced).

        Args:
            retention: the cache retention the request asked for (its writes are booked under it unless the
                usage splits them).
            cache_miss_reason: the provider's own miss reason, counted in ``provider_cache_misses``.
        """
        counters = self.models[model]
        counters.requests += 1
        counters.prompt_tokens += usage.prompt_tokens
        counters.cached_tokens += usage.cached_tokens
        counters.cache_creation_tokens += usage.cache_creation_tokens
        counters.completion_tokens += usage.completion_tokens
        if ttft_s is not None:
            counters.ttft_seconds_sum += ttft_s
            counters.ttft_count += 1
            (counters.ttft_hit if usage.cached_tokens > 0 else counters.ttft_miss).observe(ttft_s)
        if prefix_key:
            self.prefixes.record(prefix_key, model, usage.prompt_tokens, usage.cached_tokens, tenant)
        if cache_miss_reason:
            cause = ANTHROPIC_MISS_REASONS.get(cache_miss_reason, map_provider_cause(cache_miss_reason))
            diagnostic = ProviderDiagnostic("upstream", cache_miss_reason, cause)
            count_provider_miss(self.provider_misses, diagnostic, usage.cached_tokens, usage.prompt_tokens)
        return self._price(model, usage, prefix_key, tenant, retention)

    def record_unfinished(
        self, model: str, usage: BackendUsage, prefix_key: str, tenant: str = ""
    ) -> RequestCost | None:
        """Price a request that ended before its ``Finish`` (the client left, or the backend failed after the
        output started) at the usage it is charged (``gateway.service.usage_estimate.unfinished_usage``): its
        cost counts in ``cost_usd`` / ``output_cost_usd`` and the cost ledger; the token counters, which are
        what clients were told in ``usage``, are left alone. Returns its cost (None when unpriced)."""
        return self._price(model, usage, prefix_key, tenant, None)

    def _price(
        self, model: str, usage: BackendUsage, prefix_key: str, tenant: str, retention: str | None
    ) -> RequestCost | None:
        """Book ``usage``'s cost in the ledger and the model's cost counters (None when the model has no prices
        or the counts cannot be priced)."""
        prices = self._prices.get(model)
        if prices is None:
            return None
        counters = self.models[model]
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        written = min(usage.cache_creation_tokens, usage.prompt_tokens - cached)
        writes: dict[str | None, int] = dict(usage.cache_writes) if usage.cache_writes else {}
        if not writes and written:
            writes = {retention if retention in prices.cache_write else None: written}
        try:
            cost = self.ledger.record(
                model=model,
                prices=prices,
                usage=CacheUsage(usage.prompt_tokens, cached, writes),
                tenant=tenant,
                key=prefix_key,
                entry_key=prefix_key,
                completion_tokens=usage.completion_tokens,
            )
        except CacheUsageError:
            return None
        counters.cost_usd += cost.paid
        counters.cost_saved_usd += cost.saved
        counters.output_cost_usd += cost.output
        return cost

    def record_abort(self, model: str) -> None:
        """Count a request whose client disconnected before the end (what it consumed until then is priced by
        ``record_unfinished``)."""
        self.models[model].aborted += 1

    def record_error(self, model: str | None, status: int) -> None:
        """Count an error response (per model when the request named a configured model)."""
        self.errors[status] += 1
        if model in self.models:
            self.models[model].errors[status] += 1

    def ttft_histograms(self) -> dict[str, dict[str, Histogram]]:
        """Model -> ``{"hit": h, "miss": h}``: gateway TTFT (seconds, ``engine.stats.TTFT_BUCKETS_S``) of
        requests that had cached prompt tokens and of those that had none."""
        return {
            name: {"hit": c.ttft_hit.snapshot(), "miss": c.ttft_miss.snapshot()}
            for name, c in self.models.items()
        }

    def snapshot(self, engine_stats: Mapping[str, EngineStats | None]) -> dict[str, Any]:
        """The ``/admin/stats`` document.

        Args:
            engine_stats: model name -> its engine's counters (None for upstream backends).
        """
        models = {name: self._model_snapshot(name, engine_stats.get(name)) for name in self.models}
        total = _sum_models(list(models.values()))
        total["ttft_mean_s"] = self._ttft_mean_s()
        total["errors"] = {str(status): count for status, count in sorted(self.errors.items())}
        total["prefixes"] = self.prefixes.top(self.top_prefixes)
        total["models"] = models
        total["prices_checked"] = self.prices_checked
        costs = self.ledger.snapshot()
        total["costs"] = costs
        for name, doc in models.items():
            if name in costs["by_model"]:
                doc["write_premium_usd"] = costs["by_model"][name]["write_premium_usd"]
                doc["write_waste_usd"] = costs["by_model"][name]["write_waste_usd"]
        total["provider_cache_misses"] = self.provider_misses.snapshot()
        return total

    def _ttft_mean_s(self) -> float | None:
        """Mean gateway TTFT (seconds) over every model's requests that measured one, each request weighing
        the same (not a mean of the models' means); None before any."""
        count = sum(c.ttft_count for c in self.models.values())
        return sum(c.ttft_seconds_sum for c in self.models.values()) / count if count else None

    def _model_snapshot(self, name: str, engine: EngineStats | None) -> dict[str, Any]:
        c = self.models[name]
        doc: dict[str, Any] = {
            "requests": c.requests,
            "aborted": c.aborted,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "cache_creation_tokens": c.cache_creation_tokens,
            "completion_tokens": c.completion_tokens,
            "rules_requests": c.rules_requests,
            "hit_rate": _ratio(c.cached_tokens, c.prompt_tokens),
            "ttft_mean_s": c.ttft_seconds_sum / c.ttft_count if c.ttft_count else None,
        }
        doc.update(_engine_fields(engine) if engine is not None else _upstream_fields(c))
        if self._prices.get(name) is not None:
            doc["cost_usd"] = round(c.cost_usd, 9)
            doc["cost_saved_usd"] = round(c.cost_saved_usd, 9)
            doc["output_cost_usd"] = round(c.output_cost_usd, 9)
        doc["rules"] = dict(sorted(c.rules.items()))
        doc["errors"] = {str(status): count for status, count in sorted(c.errors.items())}
        doc["prefixes"] = self.prefixes.top(self.top_prefixes, model=name)
        return doc


def _engine_fields(engine: EngineStats) -> dict[str, Any]:
    return {
        "backend": "embedded",
        "prefill_tokens": engine.prefill_tokens,
        "prefill_tokens_saved": engine.prefix_hit_tokens,
        "prefill_seconds": engine.prefill_seconds,
        "prefill_seconds_saved": engine.prefill_seconds_saved,
        "blocks": {
            "total": engine.blocks_total,
            "used": engine.blocks_used,
            "cached": engine.blocks_cached,
            "free": engine.blocks_free,
        },
        "evictions": engine.evictions,
        "inflight_shared_tokens": engine.inflight_shared_tokens,
        "preemptions": engine.preemptions,
        "forks": engine.forks,
        "forked_prefill_tokens_saved": engine.forked_prefill_tokens_saved,
        "idle_prefills": engine.idle_prefills,
        "idle_prefill_tokens": engine.idle_prefill_tokens,
        "idle_prefills_yielded": engine.idle_prefills_yielded,
        "idle_prefills_dropped": engine.idle_prefills_dropped,
        "engine": {
            "requests": engine.requests,
            "prompt_tokens": engine.prompt_tokens,
            "prefix_query_tokens": engine.prefix_query_tokens,
            "prefix_hit_tokens": engine.prefix_hit_tokens,
            "decode_tokens": engine.decode_tokens,
            "decode_seconds": engine.decode_seconds,
            "running": engine.running,
            "waiting": engine.waiting,
            "pinned_blocks": engine.pinned_blocks,
            "tier_counters": dict(engine.tier_counters),
            "tier_load_seconds": (
                None
                if engine.tier_load_seconds is None
                else {"count": engine.tier_load_seconds.count, "sum": engine.tier_load_seconds.sum}
            ),
        },
    }


def _upstream_fields(c: ModelCounters) -> dict[str, Any]:
    return {
        "backend": "upstream",
        "prefill_tokens": max(c.prompt_tokens - c.cached_tokens, 0),
        "prefill_tokens_saved": c.cached_tokens,
        "prefill_seconds": None,
        "prefill_seconds_saved": None,
        "blocks": {"total": 0, "used": 0, "cached": 0, "free": 0},
        "evictions": 0,
        "inflight_shared_tokens": 0,
        "preemptions": 0,
        "forks": 0,
        "forked_prefill_tokens_saved": 0,
        "idle_prefills": 0,
        "idle_prefill_tokens": 0,
        "idle_prefills_yielded": 0,
        "idle_prefills_dropped": 0,
    }


_SUMMED = (
    "requests",
    "rules_requests",
    "aborted",
    "prompt_tokens",
    "cached_tokens",
    "cache_creation_tokens",
    "completion_tokens",
    "prefill_tokens",
    "prefill_tokens_saved",
    "evictions",
    "inflight_shared_tokens",
    "preemptions",
    "forks",
    "forked_prefill_tokens_saved",
    "idle_prefills",
    "idle_prefill_tokens",
    "idle_prefills_yielded",
    "idle_prefills_dropped",
)


def _sum_models(models: list[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {key: sum(m[key] for m in models) for key in _SUMMED}
    total["hit_rate"] = _ratio(total["cached_tokens"], total["prompt_tokens"])
    total["prefill_seconds_saved"] = sum(m["prefill_seconds_saved"] or 0.0 for m in models)
    total["blocks"] = {k: sum(m["blocks"][k] for m in models) for k in ("total", "used", "cached", "free")}
    if any("cost_usd" in m for m in models):
        total["cost_usd"] = round(sum(m.get("cost_usd", 0.0) for m in models), 9)
        total["cost_saved_usd"] = round(sum(m.get("cost_saved_usd", 0.0) for m in models), 9)
        total["output_cost_usd"] = round(sum(m.get("output_cost_usd", 0.0) for m in models), 9)
    rules: Counter[str] = Counter()
    for m in models:
        rules.update(m["rules"])
    total["rules"] = dict(sorted(rules.items()))
    return total


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else 0.0
