"""Per-key limits and per-key / per-tenant usage: what ``/admin/stats`` shows under ``keys`` and ``tenants``.

Limits are token buckets (capacity = the per-minute limit, refilled continuously at limit / 60 per second),
on an injectable monotonic clock:
- ``rpm``: each request takes 1 token; an empty bucket answers 429 with ``Retry-After`` = the seconds until
  one token is back.
- ``tpm``: a request is admitted while the bucket holds at least one token; when it finishes, its prompt +
  completion tokens are charged (the bucket may go negative, which delays later requests: the tokens are
  only known afterwards). ``Retry-After`` = the seconds until the bucket is back to one token.
- ``budget_usd``: once a key's spend reaches it, requests get 429 ``insufficient_quota`` (no Retry-After:
  a budget does not refill). Spend is what the request cost by the price table
  (``gateway.service.cost_ledger.RequestCost.spend``: uncached input, cache reads and cache writes at their
  rates, plus output tokens at the output price); models without prices cost nothing.

Invariants: state exists only for configured keys (built at start-up) and for tenants of admitted requests,
the latter bounded by ``max_tenants`` (the rest counted under ``OTHER_TENANTS``), so requests with invalid
keys never grow it. Labels are key names and tenant names, never keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.errors import RateLimitError
from gateway.core.events import BackendUsage
from gateway.core.keys import ClientKey

OTHER_TENANTS = "(other)"
"""The tenant label of usage past ``max_tenants`` distinct tenants (bounded stats cardinality)."""


class TokenBucket:
    """A token bucket: ``capacity`` tokens, refilled at ``rate_per_s`` (may go negative through ``charge``).

    Args:
        capacity: most tokens held (> 0).
        rate_per_s: tokens added per second (> 0).
        now: the clock reading at creation (seconds); the bucket starts full.
    """

    def __init__(self, capacity: float, rate_per_s: float, now: float) -> None:
        if capacity <= 0 or rate_per_s <= 0:
            raise ValueError("capacity and rate_per_s must be > 0")
        self.capacity = float(capacity)
        self.rate_per_s = float(rate_per_s)
        self.level = float(capacity)
        self._last = now

    def _refill(self, now: float) -> None:
        if now > self._last:
            self.level = min(self.capacity, self.level + (now - self._last) * self.rate_per_s)
            self._last = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds ``amount`` tokens (0.0 when it does now)."""
        self._refill(now)
        return max(0.0, (amount - self.level) / self.rate_per_s)

    def take(self, amount: float, now: float) -> None:
        """Remove ``amount`` tokens (the level may go below zero)."""
        self._refill(now)
        self.level -= amount


@dataclass
class UsageCounters:
    """Usage of one key or tenant: finished requests, tokens as reported in ``usage``, spend in USD."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    spend_usd: float = 0.0
    rate_limited: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready counters."""
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "spend_usd": round(self.spend_usd, 9),
            "rate_limited": self.rate_limited,
        }


@dataclass
class _KeyState:
    key: ClientKey
    usage: UsageCounters = field(default_factory=UsageCounters)
    rpm: TokenBucket | None = None
    tpm: TokenBucket | None = None
    tenant_header_ignored: int = 0


class ClientUsage:
    """Limits and usage of every configured key, and usage per tenant. Called from the event loop only.

    Args:
        keys: the configured client keys.
        clock: monotonic seconds (tests inject a fake).
        max_tenants: distinct tenants counted separately.
    """

    def __init__(
        self,
        keys: Iterable[ClientKey],
        clock: Callable[[], float] = time.monotonic,
        max_tenants: int = 1024,
    ) -> None:
        self._clock = clock
        self.max_tenants = max_tenants
        now = clock()
        self._keys: dict[str, _KeyState] = {}
        for key in keys:
            state = _KeyState(key)
            if key.rpm is not None:
                state.rpm = TokenBucket(key.rpm, key.rpm / 60.0, now)
            if key.tpm is not None:
                state.tpm = TokenBucket(key.tpm, key.tpm / 60.0, now)
            self._keys[key.name] = state
        self._tenants: dict[str, UsageCounters] = {}

    def state_size(self) -> int:
        """Entries held (keys + tenants): constant under a flood of requests with invalid keys."""
        return len(self._keys) + len(self._tenants)

    def admit(self, key: ClientKey, tenant: str | None = None) -> None:
        """Let one request of ``key`` in, or refuse it; a refusal is counted for the key and for ``tenant``
        (the request's tenant, when known).

        Raises:
            RateLimitError: 429 ``rate_limit_exceeded`` with ``retry_after_s`` (rpm or tpm exhausted), or 429
                ``insufficient_quota`` (budget spent; no ``retry_after_s``). Nothing is taken on refusal.
        """
        state = self._keys[key.name]
        now = self._clock()
        if key.budget_usd is not None and state.usage.spend_usd >= key.budget_usd:
            self._refused(state, tenant)
            raise RateLimitError(
                f"Key {key.name!r} has spent its budget of {key.budget_usd} USD.", code="insufficient_quota"
            )
        waits = []
        if state.rpm is not None:
            waits.append(("requests per minute", key.rpm, state.rpm.wait_s(1.0, now)))
        if state.tpm is not None:
            waits.append(("tokens per minute", key.tpm, state.tpm.wait_s(1.0, now)))
        blocked = [(what, limit, wait) for what, limit, wait in waits if wait > 0]
        if blocked:
            self._refused(state, tenant)
            what, limit, wait = max(blocked, key=lambda item: item[2])
            error = RateLimitError(
                f"Rate limit reached for key {key.name!r}: {limit} {what}. Try again in {math.ceil(wait)}s."
            )
            error.retry_after_s = wait
            raise error
        if state.rpm is not None:
            state.rpm.take(1.0, now)

    def _refused(self, state: _KeyState, tenant: str | None) -> None:
        state.usage.rate_limited += 1
        if tenant is not None:
            self._tenant(tenant).rate_limited += 1

    def record_tenant_header_ignored(self, key: ClientKey) -> None:
        """Count an ``x-prefixgate-tenant`` header sent with an untrusted key (ignored)."""
        self._keys[key.name].tenant_header_ignored += 1

    def record_finish(
        self, key_name: str, tenant: str, model: str, usage: BackendUsage, cost: float = 0.0
    ) -> None:
        """Count a finished request of key ``key_name`` ("" in open mode: tenant only) and charge its tokens and
        ``cost`` (USD for its input and output, ``gateway.service.cost_ledger.RequestCost.spend``; 0 when
        unpriced)."""
        counters = [self._tenant(tenant)]
        state = self._keys.get(key_name)
        if state is not None:
            counters.append(state.usage)
            if state.tpm is not None:
                state.tpm.take(usage.prompt_tokens + usage.completion_tokens, self._clock())
        for c in counters:
            c.requests += 1
            c.prompt_tokens += usage.prompt_tokens
            c.cached_tokens += usage.cached_tokens
            c.completion_tokens += usage.completion_tokens
            c.spend_usd += cost

    def _tenant(self, tenant: str) -> UsageCounters:
        counters = self._tenants.get(tenant)
        if counters is None:
            if len(self._tenants) >= self.max_tenants:
                tenant = OTHER_TENANTS
            counters = self._tenants.setdefault(tenant, UsageCounters())
        return counters

    def snapshot(self) -> dict[str, Any]:
        """``{"keys": name -> counters + tenant, limits, tenant_header_ignored; "tenants": tenant -> counters}``."""
        keys = {}
        for name, state in self._keys.items():
            doc = state.usage.as_dict()
            doc.update(
                tenant=state.key.tenant,
                trusted=state.key.trusted,
                rpm=state.key.rpm,
                tpm=state.key.tpm,
                budget_usd=state.key.budget_usd,
                tenant_header_ignored=state.tenant_header_ignored,
            )
            keys[name] = doc
        tenants = {name: c.as_dict() for name, c in sorted(self._tenants.items())}
        return {"keys": keys, "tenants": tenants}
