"""The dashboard's data document (``GET /admin/dashboard/data``): the stats history's series plus the current
state of the panels that are not time series.

Built from what the gateway already counts (``Gateway.stats_snapshot``, ``GatewayStats.ttft_histograms``,
the prefix catalog of ``gateway.service.cache_warm.list_cached``, the replicas of each upstream); it keeps no
counter of its own. Invariant: no prompt text ever: prefix groups are named by their prefix key (a hash,
``gateway.service.registry``), learned slots by shape and counts, replicas by their redacted base URL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.service.cache_warm import list_cached
from gateway.service.gateway import Gateway
from gateway.service.timeseries import StatsHistory

TOP_PREFIXES = 10
"""Prefix groups listed on the page."""


def dashboard_document(gateway: Gateway, history: StatsHistory) -> dict[str, Any]:
    """The page's data: ``series`` (``StatsHistory.series``), ``totals``, ``ttft`` (histograms split by hit
    and miss), ``prefixes`` (top groups), ``replicas``, ``learned`` (slots awaiting review), ``tiers``.

    Takes a history sample first when the last is older than its interval, so the page sees fresh rates
    even without the sampling task.
    """
    history.maybe_sample()
    doc = gateway.stats_snapshot()
    return {
        "series": history.series(),
        "totals": _totals(doc),
        "ttft": _ttft(gateway),
        "prefixes": _prefixes(gateway, doc),
        "replicas": _replicas(doc),
        "learned": _learned(doc),
        "tiers": _tiers(doc),
    }


def _totals(doc: Mapping[str, Any]) -> dict[str, Any]:
    costs = doc.get("costs") or {}
    return {
        "requests": doc["requests"],
        "rules_requests": doc.get("rules_requests", 0),
        "prompt_tokens": doc["prompt_tokens"],
        "cached_tokens": doc["cached_tokens"],
        "hit_rate": doc["hit_rate"],
        "tokens_saved": doc["prefill_tokens_saved"],
        "prefill_seconds_saved": doc["prefill_seconds_saved"],
        "usd_saved": doc.get("cost_saved_usd"),
        "usd_paid": doc.get("cost_usd"),
        "cache_creation_tokens": doc["cache_creation_tokens"],
        "write_waste_usd": (
            sum(m.get("write_waste_usd", 0.0) for m in costs["by_model"].values())
            if costs.get("by_model")
            else None
        ),
        "blocks": dict(doc["blocks"]),
        "evictions": doc["evictions"],
        "models": list(doc["models"]),
    }


def _ttft(gateway: Gateway) -> dict[str, Any]:
    """Per-bucket (not cumulative) request counts of the gateway TTFT, all models summed, hit and miss."""
    histograms = gateway.stats.ttft_histograms()
    buckets: list[float] = []
    hit: list[int] = []
    miss: list[int] = []
    for pair in histograms.values():
        for name, out in (("hit", hit), ("miss", miss)):
            h = pair[name]
            buckets = list(h.buckets)
            counts = [*h.counts, h.count]  # the last entry is the +Inf bucket
            per_bucket = [c - (counts[i - 1] if i else 0) for i, c in enumerate(counts)]
            if not out:
                out.extend([0] * len(per_bucket))
            for i, n in enumerate(per_bucket):
                out[i] += n
    return {"buckets_s": buckets, "hit": hit, "miss": miss}


def _prefixes(gateway: Gateway, doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Top prefix groups by requests, with the level the prefix catalog lists them at and the tokens cached for
    them now: the most any one place (RAM or a tier) holds of the prefix's leading blocks."""
    cached: dict[str, dict[str, Any]] = {}
    for row in list_cached(gateway, prefix_key=None, tenant=None, model=None):
        best = cached.get(row["prefix_key"])
        if best is None or max(row["tiers"].values(), default=0) > max(best["tiers"].values(), default=0):
            cached[row["prefix_key"]] = row
    rows = []
    for group in doc["prefixes"][:TOP_PREFIXES]:
        row = cached.get(group["prefix_key"])
        rows.append(
            {
                "prefix_key": group["prefix_key"],
                "model": group["model"],
                "tenant": group.get("tenant", ""),
                "level": row["level"] if row else None,
                "cached_now_tokens": max(row["tiers"].values(), default=0) if row else None,
                "requests": group["requests"],
                "prompt_tokens": group["prompt_tokens"],
                "cached_tokens": group["cached_tokens"],
                "hit_rate": group["hit_rate"],
            }
        )
    return rows


def _replicas(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every upstream replica: state, in flight, failures in a row, requests sent and share of its model's
    requests (the affinity spread), requests it took from another home replica."""
    rows = []
    for model, m in doc["models"].items():
        replicas = m.get("replicas") or {}
        total = sum(r.get("requests", 0) for r in replicas.values())
        for url, r in replicas.items():
            rows.append(
                {
                    "model": model,
                    "replica": url,
                    "state": r["state"],
                    "inflight": r["inflight"],
                    "failures": r["failures"],
                    "requests": r.get("requests", 0),
                    "share": r.get("requests", 0) / total if total else None,
                    "away": r.get("away"),
                }
            )
    return rows


def _learned(doc: Mapping[str, Any]) -> dict[str, Any]:
    learned = doc.get("learned") or {}
    slots = [
        {
            "id": row["id"],
            "model": row["model"],
            "tenant": row["tenant"],
            "distinct_values": row["distinct_values"],
            "observations": row["observations"],
        }
        for row in learned.get("slots") or []
        if row.get("state") == "slot"
    ]
    return {"mode": learned.get("mode"), "awaiting_review": len(slots), "slots": slots}


def _tiers(doc: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Model -> the KV tiers' counters (``engine.kv_tiers.counters`` names), for the tiers table."""
    return {
        name: dict((m.get("engine") or {}).get("tier_counters") or {})
        for name, m in doc["models"].items()
        if (m.get("engine") or {}).get("tier_counters")
    }
