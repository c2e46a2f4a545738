"""Choosing a provider cache retention (Anthropic ``5m`` / ``1h``, OpenAI ``in_memory`` / ``24h``) per prefix key
from the reuse intervals the gateway has observed and the model's prices.

The rule (derivation in docs/provider-caching.md). A cache entry written with retention ``t`` lives ``L_t``
seconds and every hit refreshes it for free (Anthropic: "cache hits and refreshes"; OpenAI: kept while in use).
A request whose breakpoint covers ``B`` prefix tokens, ``W`` of them new (all of them on a key's first
request), writes ``W`` now at ``w_t``; its choice also decides the next request of the key: it reads the ``B``
tokens (price ``r``) when it comes within ``L_t``, writes them again (``w_t``) when it comes later, and costs
nothing when it never comes. With ``F(L)`` the token-weighted share of reuse intervals ``<= L``, ``N`` the share
that never came back and ``g = W / B``, per prefix token::

    C_t    = g * w_t + F(L_t) * r + (1 - F(L_t) - N) * w_t
    C_none = g * i + (1 - N) * i                  (no marker: plain input now and next time; where allowed)

and the choice is the option with the smallest ``C``. Ties go to an option that dominates the others (write
price no higher, lifetime no shorter), else to the shorter lifetime (the provider's default first); "none" only
when strictly cheaper than every retention. For Anthropic (``r = 0.1 i``, ``w_5m = 1.25 i``, ``w_1h = 2 i``) and
a prefix that does not grow and always comes back (``g = N = 0``), ``1h`` wins exactly when
``1.9 F(1h) - 1.15 F(5m) > 0.75``: the prefix must come back after 5 minutes (and within the hour) often enough; growth (``g > 0``) charges the dearer write on
every new token, so a fast-growing history needs a larger share of long returns. OpenAI bills both retentions
alike, so ``24h`` dominates ``in_memory`` wherever the model supports it.

Samples: each arrival of a key after the first gives ``(interval, B of the previous arrival)``; the last arrival
of a key that has not come back within ``horizon_s`` (24 hours) becomes a never-returned sample (infinite
interval), so a prefix that never comes back, or a one-off kind of prefix, is learned as such. Samples are
weighted by their prefix tokens (a miss on a long prefix costs more). A key is judged on its own samples plus
those of its scope (model + tenant + kind of breakpoint: keys of a scope reuse alike), the scope's weighing as
much as ``prior_samples`` of the key's own; a key with no samples takes its scope's; with nothing at all, the
dominant retention if there is one, else the provider's default.

Invariants: memory is bounded (``max_keys`` keys, ``per_key`` samples each, ``pooled`` samples and ``pending``
waiting arrivals per scope, scopes LRU-bounded by ``max_scopes``); the clock is injected; nothing here holds
prompt text. Pure Python.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.core.cache_usage import NO_CACHE


@dataclass(frozen=True)
class RetentionOption:
    """One retention a request may ask for: its name, planning lifetime in seconds and write price (USD per
    million tokens)."""

    name: str
    lifetime_s: float
    write_price: float


@dataclass(frozen=True)
class Sample:
    """A reuse interval in seconds (``math.inf``: never came back) and its weight (prefix tokens, scaled)."""

    seconds: float
    weight: float = 1.0


@dataclass(frozen=True)
class RetentionChoice:
    """The outcome of ``choose_retention``.

    Attributes:
        retention: the chosen option's name, or ``NO_CACHE``.
        expected_cost: option name -> expected cost per prefix token (USD per million tokens); ``NO_CACHE``
            included only when allowed. Empty when the default was used for want of samples.
        reuse_share: option name -> estimated ``F(L)``.
        growth: the ``g`` used.
        samples: total weight of the samples used.
        basis: ``"key"`` (own samples), ``"blend"`` (own plus scope), ``"pooled"`` (scope only) or
            ``"default"`` (no samples).
    """

    retention: str
    expected_cost: Mapping[str, float] = field(default_factory=dict)
    reuse_share: Mapping[str, float] = field(default_factory=dict)
    growth: float = 0.0
    samples: float = 0.0
    basis: str = "default"


def reuse_share(samples: Sequence[Sample], lifetime_s: float) -> float | None:
    """``F(lifetime)``: the weighted share of samples that came back within ``lifetime_s``; None without samples."""
    total = sum(s.weight for s in samples)
    if total <= 0:
        return None
    return sum(s.weight for s in samples if s.seconds <= lifetime_s and not math.isinf(s.seconds)) / total


def never_share(samples: Sequence[Sample]) -> float:
    """``N``: the weighted share of samples that never came back (0 without samples)."""
    total = sum(s.weight for s in samples)
    return 0.0 if total <= 0 else sum(s.weight for s in samples if math.isinf(s.seconds)) / total


def expected_cost(
    share: float, option: RetentionOption, read_price: float, growth: float = 0.0, never: float = 0.0
) -> float:
    """``C_t = g * w_t + F * r + (1 - F - N) * w_t`` (USD per million prefix tokens)."""
    return (
        growth * option.write_price + share * read_price + max(0.0, 1.0 - share - never) * option.write_price
    )


def _dominant(options: Sequence[RetentionOption]) -> RetentionOption | None:
    """The option whose write price is no higher and lifetime no shorter than every other's, if any."""
    for option in sorted(options, key=lambda o: (-o.lifetime_s, o.write_price)):
        if all(option.write_price <= o.write_price and option.lifetime_s >= o.lifetime_s for o in options):
            return option
    return None


def choose_retention(
    samples: Sequence[Sample],
    options: Sequence[RetentionOption],
    *,
    input_price: float,
    read_price: float,
    default: str,
    growth: float = 0.0,
    allow_none: bool = False,
    basis: str = "key",
) -> RetentionChoice:
    """The cheapest retention for these reuse intervals (see the module docstring for the rule).

    Args:
        samples: reuse intervals (``Sample``).
        options: the retentions the model supports.
        input_price, read_price: USD per million tokens.
        default: the option used when no sample decides anything and none dominates.
        growth: ``g = W / B``, the share of the prefix written now (>= 0).
        allow_none: whether ``NO_CACHE`` (no marker, plain input price) may be chosen.
        basis: recorded in the result.

    Raises:
        ValueError: no options, ``default`` not among them, or a negative growth.
    """
    if not options:
        raise ValueError("choose_retention needs at least one retention option")
    names = [o.name for o in options]
    if default not in names:
        raise ValueError(f"default retention {default!r} is not one of {names}")
    if growth < 0:
        raise ValueError(f"growth must be >= 0, got {growth}")
    shares = {o.name: reuse_share(samples, o.lifetime_s) for o in options}
    return decide_retention(
        shares,
        never_share(samples),
        sum(s.weight for s in samples),
        options,
        input_price=input_price,
        read_price=read_price,
        default=default,
        growth=growth,
        allow_none=allow_none,
        basis=basis,
    )


def decide_retention(
    shares: Mapping[str, float | None],
    never: float,
    weight: float,
    options: Sequence[RetentionOption],
    *,
    input_price: float,
    read_price: float,
    default: str,
    growth: float = 0.0,
    allow_none: bool = False,
    basis: str = "key",
) -> RetentionChoice:
    """``choose_retention`` from the shares ``F(L)`` per option name already estimated (None: no sample) and the
    never-returned share ``N``, with the samples' total ``weight`` recorded. Same rule, same errors."""
    if not options:
        raise ValueError("choose_retention needs at least one retention option")
    names = [o.name for o in options]
    if default not in names:
        raise ValueError(f"default retention {default!r} is not one of {names}")
    if growth < 0:
        raise ValueError(f"growth must be >= 0, got {growth}")
    dominant = _dominant(options)
    if any(shares.get(o.name) is None for o in options):
        return RetentionChoice(dominant.name if dominant else default, growth=growth, basis="default")
    costs = {o.name: expected_cost(shares[o.name], o, read_price, growth, never) for o in options}  # type: ignore[arg-type]
    low = min(costs.values())
    tied = [o for o in options if costs[o.name] <= low + 1e-12]
    winner = _dominant(tied)
    if winner is None:
        winner = min(tied, key=lambda o: (o.lifetime_s, o.name != default))
    best = winner.name
    if allow_none:
        costs[NO_CACHE] = (growth + 1.0 - never) * input_price
        if costs[NO_CACHE] < low - 1e-12:
            best = NO_CACHE
    return RetentionChoice(best, costs, dict(shares), growth, weight, basis)  # type: ignore[arg-type]


DEFAULT_LIFETIMES: tuple[float, ...] = (300.0, 3_600.0, 86_400.0)
"""The lifetimes a tracker keeps running shares for: every retention of the shipped table (5m / in_memory /
implicit, 1h / explicit / disk, 24h)."""


class _Window:
    """A bounded window of (interval, weight) samples with running totals: all, and within each lifetime."""

    def __init__(self, maxlen: int, lifetimes: Sequence[float]) -> None:
        self.items: deque[tuple[float, float]] = deque()
        self.maxlen = maxlen
        self.lifetimes = lifetimes
        self.total = 0.0
        self.never = 0.0
        self.within = [0.0] * len(lifetimes)

    def _apply(self, seconds: float, weight: float) -> None:
        self.total += weight
        if math.isinf(seconds):
            self.never += weight
        for i, lifetime in enumerate(self.lifetimes):
            if seconds <= lifetime:
                self.within[i] += weight

    def add(self, seconds: float, weight: float) -> None:
        if len(self.items) >= self.maxlen:
            old_seconds, old_weight = self.items.popleft()
            self._apply(old_seconds, -old_weight)
        self.items.append((seconds, weight))
        self._apply(seconds, weight)

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class _KeyState:
    last: float
    tokens: int
    prev_tokens: int | None = None
    interval: float | None = None
    samples: _Window | None = None


@dataclass
class _ScopeState:
    pooled: _Window
    pending: OrderedDict[Hashable, tuple[float, int]]


class ReuseTracker:
    """Arrivals per prefix key, and the retention choice they imply.

    ``observe(key, scope, tokens=B)`` records an arrival (once per request, before ``choose``); ``choose`` returns
    the ``RetentionChoice`` for the key's write.
    ``scope`` groups keys that reuse alike (model + tenant + kind of breakpoint).
    """

    def __init__(
        self,
        *,
        prior_samples: float = 32.0,
        per_key: int = 64,
        max_keys: int = 100_000,
        pooled: int = 2048,
        pending: int = 8192,
        max_scopes: int = 1024,
        horizon_s: float = 86_400.0,
        lifetimes: Sequence[float] = DEFAULT_LIFETIMES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min(per_key, max_keys, pooled, pending, max_scopes) < 1 or horizon_s <= 0 or prior_samples < 0:
            raise ValueError("ReuseTracker bounds must be positive")
        self.prior_samples = prior_samples
        self.per_key = per_key
        self.max_keys = max_keys
        self.pooled_size = pooled
        self.pending_size = pending
        self.max_scopes = max_scopes
        self.horizon_s = horizon_s
        self.lifetimes = tuple(lifetimes)
        self._clock = clock
        self._keys: OrderedDict[tuple[Hashable, Hashable], _KeyState] = OrderedDict()
        self._scopes: OrderedDict[Hashable, _ScopeState] = OrderedDict()

    def _scope(self, scope: Hashable, now: float) -> _ScopeState:
        state = self._scopes.get(scope)
        if state is None:
            state = _ScopeState(_Window(self.pooled_size, self.lifetimes), OrderedDict())
            self._scopes[scope] = state
            while len(self._scopes) > self.max_scopes:
                self._scopes.popitem(last=False)
        else:
            self._scopes.move_to_end(scope)
        # Arrivals not answered within the horizon (or beyond the bound) are never-returned samples.
        while state.pending:
            key, (last, tokens) = next(iter(state.pending.items()))
            if now - last <= self.horizon_s and len(state.pending) <= self.pending_size:
                break
            state.pending.popitem(last=False)
            state.pooled.add(math.inf, max(tokens, 1))
            entry = self._keys.get((scope, key))
            if entry is not None and entry.last == last and entry.samples is not None:
                entry.samples.add(math.inf, max(tokens, 1))
        return state

    def observe(
        self, key: Hashable, scope: Hashable = None, now: float | None = None, tokens: int = 0
    ) -> float | None:
        """Record an arrival of ``key`` at ``now`` (default: the clock) whose breakpoint covers ``tokens`` prefix
        tokens. Returns the interval since the key's previous arrival in seconds, or None for a first arrival."""
        now = self._clock() if now is None else now
        state = self._scope(scope, now)
        full = (scope, key)
        entry = self._keys.get(full)
        state.pending.pop(key, None)
        state.pending[key] = (now, tokens)
        if entry is None:
            self._keys[full] = _KeyState(now, tokens, samples=_Window(self.per_key, self.lifetimes))
            while len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
            return None
        self._keys.move_to_end(full)
        interval = max(0.0, now - entry.last)
        window = entry.samples
        assert window is not None
        if not window.items or not (math.isinf(window.items[-1][0]) and interval > self.horizon_s):
            window.add(interval, max(entry.tokens, 1))
            state.pooled.add(interval, max(entry.tokens, 1))
        entry.prev_tokens, entry.tokens, entry.interval, entry.last = entry.tokens, tokens, interval, now
        return interval

    def samples(
        self, key: Hashable, scope: Hashable = None, now: float | None = None
    ) -> tuple[list[Sample], str]:
        """The weighted samples ``choose`` uses for ``key`` and their basis (see the module docstring)."""
        now = self._clock() if now is None else now
        state = self._scope(scope, now)
        entry = self._keys.get((scope, key))
        own = [Sample(s, w) for s, w in entry.samples.items] if entry is not None and entry.samples else []
        pooled = [Sample(s, w) for s, w in state.pooled.items]
        if not pooled:
            return own, "key" if own else "default"
        if not own:
            return pooled, "pooled"
        own_mean = sum(s.weight for s in own) / len(own)
        scale = self.prior_samples * own_mean / sum(s.weight for s in pooled)
        return own + [Sample(s.seconds, s.weight * scale) for s in pooled], "blend"

    def growth(self, key: Hashable, scope: Hashable = None) -> float:
        """``g = W / B`` at the key's latest arrival: 1 for a first arrival (all of it is new), else the prefix
        tokens added since the previous arrival over the prefix tokens; 0 when tokens are unknown (0). A miss's
        rewrite of all ``B`` is the ``(1 - F - N) * w_t`` term, not growth."""
        entry = self._keys.get((scope, key))
        if entry is None or entry.tokens <= 0:
            return 0.0
        if entry.prev_tokens is None:
            return 1.0
        return max(0, entry.tokens - entry.prev_tokens) / entry.tokens

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
        """The retention for ``key``'s write at its latest arrival (the rule over the same samples as ``samples``,
        from running sums), with the key's ``growth``.

        Raises:
            ValueError: an option whose lifetime is not one of the tracker's ``lifetimes``.
        """
        now = self._clock() if now is None else now
        state = self._scope(scope, now)
        entry = self._keys.get((scope, key))
        own = (
            entry.samples if entry is not None and entry.samples is not None and len(entry.samples) else None
        )
        pooled = state.pooled if len(state.pooled) else None
        if own is not None and pooled is not None:
            scale = self.prior_samples * (own.total / len(own)) / pooled.total
            basis = "blend"
        else:
            scale, basis = 1.0, "key" if own is not None else "pooled" if pooled is not None else "default"
        shares: dict[str, float | None] = {}
        weight = (own.total if own else 0.0) + (scale * pooled.total if pooled else 0.0)
        never = (own.never if own else 0.0) + (scale * pooled.never if pooled else 0.0)
        for option in options:
            if option.lifetime_s not in self.lifetimes:
                raise ValueError(f"lifetime {option.lifetime_s} s is not tracked ({self.lifetimes})")
            i = self.lifetimes.index(option.lifetime_s)
            within = (own.within[i] if own else 0.0) + (scale * pooled.within[i] if pooled else 0.0)
            shares[option.name] = within / weight if weight > 0 else None
        choice = decide_retention(
            shares,
            never / weight if weight > 0 else 0.0,
            weight,
            options,
            input_price=input_price,
            read_price=read_price,
            default=default,
            growth=self.growth(key, scope),
            allow_none=allow_none,
            basis=basis,
        )
        return choice

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
