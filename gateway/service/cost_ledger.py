"""Per-request cache cost, and the running account of cost paid, saved and wasted per model, prefix key and
tenant.

For one request with ``P`` prompt tokens of which ``R`` were read from the provider's cache and ``W_t`` written
with retention ``t`` (prices per million tokens from ``price_table.ModelPrices``)::

    paid          = (P - R - sum W_t) * input + R * cache_read + sum W_t * write_t
    saved         = R * (input - cache_read)                 what the cache reads saved
    write_premium = sum W_t * (write_t - input)              what the cache writes cost on top of input
    uncached      = P * input                                the same prompt with no cache at all

so ``paid = uncached - saved + write_premium``. The ``C`` completion (output) tokens cost ``output = C * output``
(0 for a model with no output price), and a request's **spend** (what a key's budget is charged) is
``paid + output``. **Write waste** is the premium of writes that were never read
before they expired: each write is kept as an outstanding region ``[R, R + W)`` of its prefix key with an expiry
``now + lifetime_t``; a later request of the same model, tenant and prefix key that reads ``R' > start`` before
the expiry consumes the part of the region below ``R'`` (the rest stays outstanding); a region still outstanding
at its expiry is wasted: ``tokens * (write_t - input)`` is added to ``write_waste`` (and the tokens to
``wasted_write_tokens``) of the model, key and tenant that wrote it. Regions of one request are laid out
longest-retention first (Anthropic's 1h-before-5m order).

Invariants: dollars are floats in USD; the outstanding regions are bounded by ``max_regions`` (the oldest are
dropped and counted in ``dropped_regions``, never counted as waste); the clock is injected; no prompt text is
held. Thread-safe (one lock). Pure Python, no HTTP.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from gateway.config.price_table import TOKENS_PER_PRICE_UNIT, ModelPrices
from gateway.core.cache_usage import CacheUsage, CacheUsageError

COST_HEADER = "x-prefixgate-cost"
"""The response header ``RequestCost.header_value`` fills."""


@dataclass(frozen=True)
class RequestCost:
    """One request's cost in USD (see the module docstring for the formulas): ``paid``, ``saved``,
    ``write_premium`` and ``uncached`` are input-side; ``output`` is the completion tokens'."""

    paid: float
    saved: float
    write_premium: float
    uncached: float
    output: float = 0.0

    @property
    def spend(self) -> float:
        """What the request cost in all: input paid plus output (USD)."""
        return self.paid + self.output

    def header_value(self) -> str:
        """``paid=0.00123400; saved=0.00045600; write_premium=0.00000000; output=0.00100000`` (USD, 8
        decimals; ``paid`` is input only)."""
        return (
            f"paid={self.paid:.8f}; saved={self.saved:.8f}; write_premium={self.write_premium:.8f}; "
            f"output={self.output:.8f}"
        )


def request_cost(prices: ModelPrices, usage: CacheUsage, completion_tokens: int = 0) -> RequestCost:
    """The cost of one request: its input tokens (by cache class) and its ``completion_tokens`` output tokens.

    Raises:
        CacheUsageError: counts that cannot be priced (``CacheUsage.check``), or negative completion tokens.
    """
    usage.check(prices)
    if completion_tokens < 0:
        raise CacheUsageError("usage: completion tokens must be >= 0")
    plain = usage.prompt_tokens - usage.cache_read_tokens - usage.written
    writes = sum(tokens * prices.write_price(ret) for ret, tokens in usage.cache_write_tokens.items())
    premium = sum(
        tokens * (prices.write_price(ret) - prices.input) for ret, tokens in usage.cache_write_tokens.items()
    )
    unit = TOKENS_PER_PRICE_UNIT
    return RequestCost(
        paid=(plain * prices.input + usage.cache_read_tokens * prices.cache_read + writes) / unit,
        saved=usage.cache_read_tokens * (prices.input - prices.cache_read) / unit,
        write_premium=premium / unit,
        uncached=usage.prompt_tokens * prices.input / unit,
        output=completion_tokens * (prices.output or 0.0) / unit,
    )


@dataclass
class CostTotals:
    """Running totals for one model, prefix key or tenant (USD and tokens)."""

    requests: int = 0
    paid: float = 0.0
    saved: float = 0.0
    write_premium: float = 0.0
    write_waste: float = 0.0
    uncached: float = 0.0
    output: float = 0.0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    wasted_write_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (dollars rounded to 8 decimals)."""
        return {
            "requests": self.requests,
            "cost_paid_usd": round(self.paid, 8),
            "cost_saved_usd": round(self.saved, 8),
            "write_premium_usd": round(self.write_premium, 8),
            "write_waste_usd": round(self.write_waste, 8),
            "uncached_cost_usd": round(self.uncached, 8),
            "output_cost_usd": round(self.output, 8),
            "cache_read_tokens": self.cache_read_tokens,
            "cache_write_tokens": self.cache_write_tokens,
            "wasted_write_tokens": self.wasted_write_tokens,
        }


@dataclass
class _Region:
    start: int
    end: int
    expiry: float
    premium_per_token: float
    owners: tuple[str, str, str]  # model, api key, tenant


class CostLedger:
    """Cost paid, saved and write waste per model, prefix key and tenant (see the module docstring).

    ``record`` prices a request and updates the account; ``snapshot`` sweeps expired writes into waste and
    returns the totals.
    """

    def __init__(
        self, *, max_regions: int = 100_000, max_keys: int = 1024, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_regions < 1 or max_keys < 1:
            raise ValueError("max_regions and max_keys must be >= 1")
        self.max_regions = max_regions
        self.max_keys = max_keys
        self.evicted_keys = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._regions: OrderedDict[int, tuple[Hashable, _Region]] = OrderedDict()
        self._by_entry: dict[Hashable, dict[int, _Region]] = {}
        self._expiries: list[tuple[float, int]] = []
        self._next_id = 0
        self.dropped_regions = 0
        self.by_model: dict[str, CostTotals] = {}
        self.by_key: OrderedDict[str, CostTotals] = OrderedDict()
        self.by_tenant: dict[str, CostTotals] = {}

    def _totals(self, owners: tuple[str, str, str]) -> list[CostTotals]:
        model, key, tenant = owners
        by_key = self.by_key.get(key)
        if by_key is None:
            by_key = self.by_key[key] = CostTotals()
            while len(self.by_key) > self.max_keys:  # least recently charged key first
                self.by_key.popitem(last=False)
                self.evicted_keys += 1
        else:
            self.by_key.move_to_end(key)
        return [
            self.by_model.setdefault(model, CostTotals()),
            by_key,
            self.by_tenant.setdefault(tenant, CostTotals()),
        ]

    def _remove(self, region_id: int) -> None:
        entry, _ = self._regions.pop(region_id)
        regions = self._by_entry.get(entry)
        if regions is not None:
            regions.pop(region_id, None)
            if not regions:
                del self._by_entry[entry]

    def _sweep(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] < now:
            _, rid = heapq.heappop(self._expiries)
            if rid not in self._regions:
                continue  # already read or dropped
            _, region = self._regions[rid]
            tokens = region.end - region.start
            for totals in self._totals(region.owners):
                totals.write_waste += tokens * region.premium_per_token / TOKENS_PER_PRICE_UNIT
                totals.wasted_write_tokens += tokens
            self._remove(rid)

    def record(
        self,
        *,
        model: str,
        prices: ModelPrices,
        usage: CacheUsage,
        tenant: str = "",
        key: str = "",
        entry_key: Hashable = None,
        now: float | None = None,
        completion_tokens: int = 0,
    ) -> RequestCost:
        """Price one request, consume the outstanding writes its cache read covers, and keep its own writes.

        Args:
            model: the gateway model name (stats label).
            prices: the model's prices.
            usage: the provider's token counts.
            tenant, key: stats labels (the tenant, the prefix key: a hash, never prompt text).
            entry_key: what identifies the cached prefix across requests (the prefix key); reads match writes of
                the same model, tenant and entry key.
            now: seconds on the ledger's clock (default: the clock).
            completion_tokens: the request's output tokens (priced at ``prices.output``).

        Raises:
            CacheUsageError: counts that cannot be priced.
        """
        cost = request_cost(prices, usage, completion_tokens)
        now = self._clock() if now is None else now
        owners = (model, key, tenant)
        entry = (model, tenant, entry_key)
        with self._lock:
            self._sweep(now)
            read = usage.cache_read_tokens
            for rid, region in list(self._by_entry.get(entry, {}).items()):
                if region.start >= read:
                    continue
                if region.end <= read:
                    self._remove(rid)
                else:
                    region.start = read
            start = read
            ordered = sorted(
                usage.cache_write_tokens.items(),
                key=lambda item: -prices.retentions[item[0] or prices.default_retention],
            )
            for retention, tokens in ordered:
                if tokens <= 0:
                    continue
                name = retention or prices.default_retention
                region = _Region(
                    start,
                    start + tokens,
                    now + prices.retentions[name],
                    prices.write_price(name) - prices.input,
                    owners,
                )
                start += tokens
                self._regions[self._next_id] = (entry, region)
                self._by_entry.setdefault(entry, {})[self._next_id] = region
                heapq.heappush(self._expiries, (region.expiry, self._next_id))
                self._next_id += 1
                while len(self._regions) > self.max_regions:
                    self._remove(next(iter(self._regions)))
                    self.dropped_regions += 1
            for totals in self._totals(owners):
                totals.requests += 1
                totals.paid += cost.paid
                totals.saved += cost.saved
                totals.write_premium += cost.write_premium
                totals.uncached += cost.uncached
                totals.output += cost.output
                totals.cache_read_tokens += usage.cache_read_tokens
                totals.cache_write_tokens += usage.written
        return cost

    def sweep(self, now: float | None = None) -> None:
        """Count every write expired by ``now`` as waste."""
        with self._lock:
            self._sweep(self._clock() if now is None else now)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """``{"by_model", "by_key", "by_tenant"}`` of ``CostTotals.to_dict`` (``by_key``: the ``max_keys`` most
        recently charged prefix keys), plus ``outstanding_writes`` (regions not yet read nor expired),
        ``dropped_regions`` and ``evicted_keys``; expired writes are swept first."""
        with self._lock:
            self._sweep(self._clock() if now is None else now)
            return {
                "by_model": {k: v.to_dict() for k, v in self.by_model.items()},
                "by_key": {k: v.to_dict() for k, v in self.by_key.items()},
                "by_tenant": {k: v.to_dict() for k, v in self.by_tenant.items()},
                "outstanding_writes": len(self._regions),
                "dropped_regions": self.dropped_regions,
                "evicted_keys": self.evicted_keys,
            }
