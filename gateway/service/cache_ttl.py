"""Choosing a provider cache retention (Anthropic ``5m`` / ``1h``, OpenAI ``in_memory`` / ``24h``) per prefix key
from the reuse intervals the gateway has observed and the model's prices.

The rule (derivation in docs/provider-caching.md). A cache entry written with retention ``t`` lives ``L_t``
seconds and every hit refreshes it for free (Anthropic: "cache hits and refreshes"; OpenAI: kept while in use).
So in steady state the request after an interval ``D`` reads the prefix (price ``r``) when ``D <= L_t`` and writes
it again (price ``w_t``) otherwise. With ``F(L)`` the share of reuse intervals ``<= L``, the expected cost per
request and per prefix token is::

    C_t    = F(L_t) * r + (1 - F(L_t)) * w_t
    C_none = i                                   (no cache marker: plain input price; only where allowed)

and the choice is the option with the smallest ``C``; ties go to the shorter lifetime (less retained data, the
provider's default first), and "none" only when it is strictly cheaper than every retention. For Anthropic
(``r = 0.1 i``, ``w_5m = 1.25 i``, ``w_1h = 2 i``) ``1h`` wins exactly when
``1.9 F(1h) - 1.15 F(5m) > 0.75``: the prefix must come back after 5 minutes (and within the hour) often enough.
OpenAI bills both retentions alike, so ``24h`` wins exactly when some interval falls between the in-memory
lifetime and 24 hours.

``F`` is estimated from intervals with right-censoring: a first arrival still unanswered after ``a`` seconds
counts as a miss for every lifetime ``<= a`` and as unknown for longer ones, so a prefix that never comes back is
learned as such once it is older than the lifetimes in question. A key with at least ``min_samples`` completed
intervals is judged on its own; a younger key borrows the intervals that followed the *first* arrival of other
keys in the same scope (model + tenant), weighted to make up ``min_samples``; with nothing at all the provider's
default retention is used.

Invariants: memory is bounded (``max_keys`` keys, ``per_key`` intervals each, ``pooled`` pooled intervals and
``pending`` unanswered first arrivals per scope, scopes LRU-bounded by ``max_scopes``); the clock is injected;
nothing here holds prompt text. Pure Python.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

NO_CACHE = "none"
"""The choice that places no cache marker at all."""


@dataclass(frozen=True)
class RetentionOption:
    """One retention a request may ask for: its name, planning lifetime in seconds and write price (USD per
    million tokens)."""

    name: str
    lifetime_s: float
    write_price: float


@dataclass(frozen=True)
class Sample:
    """A reuse interval in seconds, or a censored one (``censored``: the prefix had not come back after
    ``seconds``), with a weight (1 for the key's own intervals, less for borrowed ones)."""

    seconds: float
    censored: bool = False
    weight: float = 1.0


@dataclass(frozen=True)
class RetentionChoice:
    """The outcome of ``choose_retention``.

    Attributes:
        retention: the chosen option's name, or ``NO_CACHE``.
        expected_cost: option name -> expected cost per request per million prefix tokens (USD); ``NO_CACHE``
            included only when allowed. Empty when the default was used for want of samples.
        reuse_share: option name -> estimated ``F(L)``, the share of intervals within the option's lifetime.
        samples: total weight of the samples used.
        basis: ``"key"`` (own intervals), ``"blend"`` (own plus borrowed), ``"pooled"`` (borrowed only) or
            ``"default"`` (no samples).
    """

    retention: str
    expected_cost: Mapping[str, float] = field(default_factory=dict)
    reuse_share: Mapping[str, float] = field(default_factory=dict)
    samples: float = 0.0
    basis: str = "default"


def reuse_share(samples: Sequence[Sample], lifetime_s: float) -> float | None:
    """``F(lifetime)``: the weighted share of samples that came back within ``lifetime_s``; a censored sample
    counts as a miss when its age is ``>= lifetime_s`` and is left out otherwise. None when no sample decides."""
    hits = decided = 0.0
    for sample in samples:
        if sample.censored:
            if sample.seconds >= lifetime_s:
                decided += sample.weight
        else:
            decided += sample.weight
            if sample.seconds <= lifetime_s:
                hits += sample.weight
    return None if decided <= 0 else hits / decided


def expected_cost(share: float, option: RetentionOption, read_price: float) -> float:
    """``C_t = F * r + (1 - F) * w_t`` (USD per request per million prefix tokens)."""
    return share * read_price + (1.0 - share) * option.write_price


def choose_retention(
    samples: Sequence[Sample],
    options: Sequence[RetentionOption],
    *,
    input_price: float,
    read_price: float,
    default: str,
    allow_none: bool = False,
    basis: str = "key",
) -> RetentionChoice:
    """The cheapest retention for these reuse intervals (see the module docstring for the rule).

    Args:
        samples: reuse intervals (``Sample``).
        options: the retentions the model supports.
        input_price, read_price: USD per million tokens.
        default: the option used when no sample decides anything.
        allow_none: whether ``NO_CACHE`` (no marker, plain input price) may be chosen.
        basis: recorded in the result.

    Raises:
        ValueError: no options, or ``default`` not among them.
    """
    if not options:
        raise ValueError("choose_retention needs at least one retention option")
    names = [o.name for o in options]
    if default not in names:
        raise ValueError(f"default retention {default!r} is not one of {names}")
    shares: dict[str, float] = {}
    for option in options:
        share = reuse_share(samples, option.lifetime_s)
        if share is not None:
            shares[option.name] = share
    if len(shares) < len(options):
        # An option no sample decides (only young censored samples): undecidable; stay with the default.
        return RetentionChoice(default, {}, shares, sum(s.weight for s in samples), "default")
    costs = {o.name: expected_cost(shares[o.name], o, read_price) for o in options}
    ordered = sorted(options, key=lambda o: (o.lifetime_s, o.name != default))
    best = ordered[0].name
    for option in ordered[1:]:
        if costs[option.name] < costs[best] - 1e-12:
            best = option.name
    if allow_none:
        costs[NO_CACHE] = input_price
        if input_price < costs[best] - 1e-12:
            best = NO_CACHE
    return RetentionChoice(best, costs, shares, sum(s.weight for s in samples), basis)


@dataclass
class _KeyState:
    first: float
    last: float
    intervals: deque[float]


@dataclass
class _ScopeState:
    pooled: deque[float]
    pending: OrderedDict[Hashable, float]


class ReuseTracker:
    """Arrival times per prefix key, and the retention choice they imply.

    ``observe(key, scope)`` records an arrival (call it once per request, before ``choose``); ``choose`` returns
    the ``RetentionChoice`` for the key. ``scope`` groups keys whose first intervals are pooled (model + tenant).
    """

    def __init__(
        self,
        *,
        min_samples: int = 3,
        per_key: int = 64,
        max_keys: int = 100_000,
        pooled: int = 512,
        pending: int = 4096,
        max_scopes: int = 1024,
        horizon_s: float = 86_400.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(min_samples, per_key, max_keys, pooled, pending, max_scopes) < 1 or horizon_s <= 0:
            raise ValueError("ReuseTracker bounds must be positive")
        self.min_samples = min_samples
        self.per_key = per_key
        self.max_keys = max_keys
        self.pooled_size = pooled
        self.pending_size = pending
        self.max_scopes = max_scopes
        self.horizon_s = horizon_s
        self._clock = clock
        self._keys: OrderedDict[tuple[Hashable, Hashable], _KeyState] = OrderedDict()
        self._scopes: OrderedDict[Hashable, _ScopeState] = OrderedDict()

    def _scope(self, scope: Hashable) -> _ScopeState:
        state = self._scopes.get(scope)
        if state is None:
            state = _ScopeState(deque(maxlen=self.pooled_size), OrderedDict())
            self._scopes[scope] = state
            while len(self._scopes) > self.max_scopes:
                self._scopes.popitem(last=False)
        else:
            self._scopes.move_to_end(scope)
        return state

    def _expire_pending(self, state: _ScopeState, now: float) -> None:
        """First arrivals older than the horizon (or beyond the bound) become never-returned pooled samples."""
        while state.pending:
            key, first = next(iter(state.pending.items()))
            if now - first < self.horizon_s and len(state.pending) <= self.pending_size:
                break
            state.pending.popitem(last=False)
            state.pooled.append(math.inf)

    def observe(self, key: Hashable, scope: Hashable = None, now: float | None = None) -> float | None:
        """Record an arrival of ``key`` at ``now`` (default: the clock). Returns the interval since its previous
        arrival in seconds, or None for a first arrival (or one after ``horizon_s``, which starts afresh)."""
        now = self._clock() if now is None else now
        state = self._scope(scope)
        self._expire_pending(state, now)
        full = (scope, key)
        entry = self._keys.get(full)
        if entry is None:
            self._keys[full] = _KeyState(now, now, deque(maxlen=self.per_key))
            state.pending[key] = now
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            return None
        self._keys.move_to_end(full)
        interval = max(0.0, now - entry.last)
        entry.intervals.append(interval)
        entry.last = now
        if key in state.pending:
            del state.pending[key]
            state.pooled.append(interval)
        return interval

    def samples(
        self, key: Hashable, scope: Hashable = None, now: float | None = None
    ) -> tuple[list[Sample], str]:
        """The samples ``choose`` uses for ``key`` and their basis (see the module docstring)."""
        now = self._clock() if now is None else now
        state = self._scope(scope)
        self._expire_pending(state, now)
        entry = self._keys.get((scope, key))
        own = [Sample(s) for s in entry.intervals] if entry is not None else []
        if len(own) >= self.min_samples:
            return own, "key"
        # Pooled first intervals (inf = never came back within the horizon: a miss for every lifetime), then the
        # first arrivals still waiting, censored at their age.
        borrowed = [Sample(s) for s in state.pooled]
        borrowed.extend(
            Sample(now - first, censored=True)
            for pending_key, first in state.pending.items()
            if pending_key != key
        )
        if not borrowed:
            return own, "key" if own else "default"
        weight = (self.min_samples - len(own)) / len(borrowed)
        mixed = own + [Sample(s.seconds, s.censored, weight) for s in borrowed]
        return mixed, "blend" if own else "pooled"

    def choose(
        self,
        key: Hashable,
        scope: Hashable,
        options: Sequence[RetentionOption],
        *,
        input_price: float,
        read_price: float,
        default: str,
        allow_none: bool = False,
        now: float | None = None,
    ) -> RetentionChoice:
        """The retention for ``key``'s next write (``choose_retention`` over ``samples``)."""
        samples, basis = self.samples(key, scope, now)
        if not samples:
            return RetentionChoice(default, basis="default")
        return choose_retention(
            samples,
            options,
            input_price=input_price,
            read_price=read_price,
            default=default,
            allow_none=allow_none,
            basis=basis,
        )

    def __len__(self) -> int:
        return len(self._keys)


def options_for(prices: object, names: Sequence[str] | None = None) -> list[RetentionOption]:
    """``RetentionOption`` list from a ``price_table.ModelPrices`` (all its retentions, or ``names``).

    Raises:
        KeyError: a name the model does not support.
    """
    retentions: Mapping[str, float] = prices.retentions  # type: ignore[attr-defined]
    writes: Mapping[str, float] = prices.cache_write  # type: ignore[attr-defined]
    chosen = list(retentions) if names is None else list(names)
    return [RetentionOption(name, retentions[name], writes[name]) for name in chosen]
