"""Per-key limits and per-key / per-tenant usage: what ``/admin/stats`` shows under ``keys`` and ``tenants``.

Limits are token buckets (capacity = the per-minute limit, refilled continuously at limit / 60 per second),
on an injectable monotonic clock:
- ``rpm``: each request takes 1 token; an empty bucket answers 429 with ``Retry-After`` = the seconds until
  one token is back.
- ``tpm``: a request is admitted while the bucket holds at least one token; when it ends, its prompt +
  completion tokens are charged (the bucket may go negative, which delays later requests: the tokens are
  only known afterwards). ``Retry-After`` = the seconds until the bucket is back to one token.
- ``budget_usd``: a request of a priced model reserves an estimate of its cost when it is admitted
  (``reserve``: its prompt tokens at the input price plus its output cap at the output price,
  ``gateway.service.usage_estimate``); a key whose spend plus reservations would pass its budget gets 429
  ``insufficient_quota`` (no Retry-After: a budget does not refill). When the request ends (finished,
  cancelled or failed) its reservation is released (``release``) and its actual cost charged. Spend is what
  the request cost by the price table (``gateway.service.cost_ledger.RequestCost.spend``: uncached input,
  cache reads and cache writes at their rates, plus output tokens at the output price); models without
  prices cost nothing.

A request that ends before its ``Finish`` (the client left, or the backend failed mid-stream) is charged too
(``record_finish(..., finished=False)``): its prompt and the tokens generated before it ended count in the
usage counters, the tpm bucket and the spend, but not in ``requests`` (finished requests).

Invariants: state exists only for configured keys (built at start-up) and for tenants of finished
requests: a request refused before it ran (401, 403, 404, 429) never creates a tenant's entry (a 429 is
counted on its tenant's entry only when that exists), so neither a flood of invalid keys nor one of refused
requests grows it. The callers count a request under ``gateway.core.tenants.accounting_tenant`` (its tenant
less a body's ``cache_salt``), so the salts a client invents take no rows. The tenants of configured keys
always have their own entry; other tenants (a trusted key's header sub-tenants, the open mode's header
tenants) are bounded by ``max_tenants``, the rest counted under ``OTHER_TENANTS``: one key can never push
another key's tenant into ``(other)``. Labels are key names and tenant names, never keys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.errors import QuotaExceededError, RateLimitError
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

    def give_back(self, amount: float, now: float) -> None:
        """Return ``amount`` tokens taken by mistake (never above ``capacity``)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass
class UsageCounters:
    """Usage of one key or tenant: finished requests; tokens and spend in USD charged, those of requests that
    ended before their ``Finish`` (cancelled, failed mid-stream) included."""

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
    reserved_usd: float = 0.0
    """The cost estimates held by this key's requests in flight (``ClientUsage.reserve``)."""
    reservations: int = 0
    """How many requests hold one (``reserved_usd`` is reset to exactly 0 when none does)."""


class ClientUsage:
    """Limits and usage of every configured key, and usage per tenant. Called from the event loop only.

    Args:
        keys: the configured client keys.
        clock: monotonic seconds (tests inject a fake).
        max_tenants: distinct tenants counted separately besides the configured keys' tenants (which
            always are).
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
        self._configured = frozenset(state.key.tenant for state in self._keys.values())
        self._tenants: dict[str, UsageCounters] = {}
        self._others = 0  # entries of tenants outside ``_configured`` (bounded by ``max_tenants``)

    def state_size(self) -> int:
        """Entries held (keys + tenants): constant under a flood of requests with invalid keys."""
        return len(self._keys) + len(self._tenants)

    def admit(self, key: ClientKey, tenant: str | None = None) -> None:
        """Let one request of ``key`` in, or refuse it; a refusal is counted for the key and for ``tenant``
        (the tenant the request counts under, when known) when that tenant has an entry already (a refused
        request never creates one).

        Raises:
            RateLimitError: 429 ``rate_limit_exceeded`` with ``retry_after_s`` (rpm or tpm exhausted), or
                ``QuotaExceededError`` (429 ``insufficient_quota``: spend plus the reservations of requests in
                flight reached the budget; no ``retry_after_s``). Nothing is taken on refusal.
        """
        state = self._keys[key.name]
        now = self._clock()
        if key.budget_usd is not None and state.usage.spend_usd + state.reserved_usd >= key.budget_usd:
            self._refused(state, tenant)
            raise self._budget_error(state)
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

    def has_budget(self, key_name: str) -> bool:
        """Whether key ``key_name`` ("" in open mode: no) has a ``budget_usd``."""
        state = self._keys.get(key_name)
        return state is not None and state.key.budget_usd is not None

    def reserve(self, key_name: str, tenant: str, amount_usd: float) -> None:
        """Hold ``amount_usd`` (a request's cost estimate) against the budget of key ``key_name`` until
        ``release``; a key without a budget holds nothing.

        Raises:
            QuotaExceededError: spend + reservations + ``amount_usd`` would pass the budget (429
                ``insufficient_quota``, counted in ``rate_limited``); the rpm token ``admit`` took for the
                request is given back, so a refusal takes nothing.
        """
        state = self._keys.get(key_name)
        if state is None or state.key.budget_usd is None:
            return
        if state.usage.spend_usd + state.reserved_usd + amount_usd > state.key.budget_usd:
            if state.rpm is not None:
                state.rpm.give_back(1.0, self._clock())
            self._refused(state, tenant)
            raise self._budget_error(state, amount_usd)
        state.reserved_usd += amount_usd
        state.reservations += 1

    def release(self, key_name: str, amount_usd: float) -> None:
        """Release a reservation ``reserve`` made (the request ended; its actual cost is charged by
        ``record_finish``)."""
        state = self._keys.get(key_name)
        if state is None or state.key.budget_usd is None or state.reservations == 0:
            return
        state.reservations -= 1
        state.reserved_usd = max(0.0, state.reserved_usd - amount_usd) if state.reservations else 0.0

    @staticmethod
    def _budget_error(state: _KeyState, amount_usd: float | None = None) -> QuotaExceededError:
        """The 429 of a budget: spent (or held by requests in flight), or too small for ``amount_usd``."""
        key = state.key
        budget = key.budget_usd or 0.0
        left = max(0.0, budget - state.usage.spend_usd - state.reserved_usd)
        if amount_usd is not None and left > 0:
            return QuotaExceededError(
                f"Key {key.name!r} has {left:.6f} USD of its budget of {budget} USD left (spend and requests "
                f"in flight), and this request may cost up to {amount_usd:.6f} USD (its prompt at the input "
                "price plus max_tokens at the output price): lower max_tokens or raise the budget."
            )
        if state.reserved_usd > 0:
            return QuotaExceededError(
                f"Key {key.name!r} has spent or reserved its budget of {budget} USD (requests in flight "
                "reserve their estimated cost)."
            )
        return QuotaExceededError(f"Key {key.name!r} has spent its budget of {budget} USD.")

    def _refused(self, state: _KeyState, tenant: str | None) -> None:
        state.usage.rate_limited += 1
        counters = self._tenants.get(tenant) if tenant is not None else None
        if counters is not None:
            counters.rate_limited += 1

    def record_tenant_header_ignored(self, key: ClientKey) -> None:
        """Count an ``x-prefixgate-tenant`` header sent with an untrusted key (ignored)."""
        self._keys[key.name].tenant_header_ignored += 1

    def record_finish(
        self,
        key_name: str,
        tenant: str,
        model: str,
        usage: BackendUsage,
        cost: float = 0.0,
        finished: bool = True,
    ) -> None:
        """Charge a request of key ``key_name`` ("" in open mode: tenant only) its tokens (usage counters and
        tpm bucket) and ``cost`` (USD for its input and output, ``gateway.service.cost_ledger.RequestCost.spend``;
        0 when unpriced), and count it in ``requests`` when ``finished`` (False: it ended before its
        ``Finish``, cancelled or failed, and ``usage`` is what it consumed until then)."""
        counters = [self._tenant(tenant)]
        state = self._keys.get(key_name)
        if state is not None:
            counters.append(state.usage)
            if state.tpm is not None:
                state.tpm.take(usage.prompt_tokens + usage.completion_tokens, self._clock())
        for c in counters:
            c.requests += 1 if finished else 0
            c.prompt_tokens += usage.prompt_tokens
            c.cached_tokens += usage.cached_tokens
            c.completion_tokens += usage.completion_tokens
            c.spend_usd += cost

    def _tenant(self, tenant: str) -> UsageCounters:
        """The counters of ``tenant``, made when missing: a configured key's tenant always gets its own, any
        other its own while fewer than ``max_tenants`` others have one, else ``OTHER_TENANTS``'s."""
        counters = self._tenants.get(tenant)
        if counters is not None:
            return counters
        if tenant not in self._configured:
            if self._others >= self.max_tenants:
                return self._tenants.setdefault(OTHER_TENANTS, UsageCounters())
            self._others += 1
        counters = self._tenants[tenant] = UsageCounters()
        return counters

    def snapshot(self) -> dict[str, Any]:
        """``{"keys": name -> counters + tenant, limits, ``reserved_usd`` (the cost estimates of its requests in
        flight), tenant_header_ignored; "tenants": tenant -> counters}``."""
        keys = {}
        for name, state in self._keys.items():
            doc = state.usage.as_dict()
            doc.update(
                tenant=state.key.tenant,
                trusted=state.key.trusted,
                rpm=state.key.rpm,
                tpm=state.key.tpm,
                budget_usd=state.key.budget_usd,
                reserved_usd=round(state.reserved_usd, 9),
                tenant_header_ignored=state.tenant_header_ignored,
            )
            keys[name] = doc
        tenants = {name: c.as_dict() for name, c in sorted(self._tenants.items())}
        return {"keys": keys, "tenants": tenants}
