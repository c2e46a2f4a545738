"""Provider prompt caching (issue 15): a synthetic month of traffic against a simulated provider that bills by the
shipped price table, with prefixgate's retention choices vs always-5m, always-1h and no caching.

Workloads (30 days, seeded; times in seconds; daytime 08-20 h):

- ``chat-a``: a busy chat app; 3,000-token system prompt; conversations every ~90 s by day, ~30 min by night;
  1-12 turns (mean 4), think time log-normal (median 45 s); each turn adds 500 tokens.
- ``chat-b``: a quiet internal assistant; 6,000-token system prompt; a conversation every ~15 min by day; 1-3
  turns, think time median 90 s.
- ``agent``: a coding agent; 8,000 tokens of tools + system; a task every ~20 min by day: 3-25 tool steps 4-15 s
  apart, tool results log-normal (median 1,500 tokens); then the user reviews (median 8 min) and follows up
  (60 %, up to 3 times) with another 2-10 steps.
- ``batch-a``: nightly at 02:00, 300 unique 6,000-token documents behind a shared 1,500-token instruction, one
  question each, 2 s apart (the documents never come back).
- ``batch-b``: daily at 06:00, 50 documents x 5 questions, 3 s apart.
- ``adhoc``: by day every ~10 min, a unique 4,000-token document behind a 2,000-token system prompt; 25 % get a
  follow-up question after a median 20 min.

Each request carries breakpoints in prompt order (the stable prefix, then the history / document), each with the
key its reuse is tracked by (the stable prefix key, the conversation or document) and a scope (tenant + kind) for
new keys. The simulated provider is Anthropic's (https://platform.claude.com/docs/en/build-with-claude/
prompt-caching): a request reads the longest live entry among the prefixes it contains (a hit refreshes that
entry), writes every breakpoint past it at its TTL (tokens between breakpoints billed at the TTL of the
breakpoint that ends them), bills the rest as input, ignores prefixes below the model's minimum and refuses a 1h
breakpoint after a 5m one. Entries that expire unread are write waste (their write premium). Policies:
``none``, ``always-5m``, ``always-1h`` and ``prefixgate`` (``gateway.service.cache_ttl.ReuseTracker`` per
breakpoint key, "none" allowed, an earlier 5m lifted to 1h when a later breakpoint takes 1h). The same month runs
against an OpenAI model (``in_memory`` vs ``24h``, no "none": caching is automatic).

Target: ``cost_vs_best_fixed`` (prefixgate's cost / the cheaper of always-5m and always-1h) <= 0.9.
Run: ``python -m bench.providers``; prints tables, then one JSON line (last).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.config.price_table import ModelPrices, load_price_table
from gateway.core.cache_usage import CacheUsage
from gateway.service.cache_ttl import NO_CACHE, ReuseTracker, options_for
from gateway.service.cost_ledger import request_cost

DAY = 86_400.0
HOUR = 3_600.0


@dataclass(frozen=True)
class Breakpoint:
    """A cache breakpoint: the entry it writes (a prefix id), the prefix tokens up to it, its reuse key, scope."""

    entry: str
    tokens: int
    key: str
    scope: str


@dataclass(frozen=True)
class Request:
    """One request: time, workload, prompt tokens, breakpoints (prompt order) and the earlier entries its prompt
    contains (read candidates: ``(entry, tokens)``)."""

    t: float
    workload: str
    tokens: int
    breakpoints: tuple[Breakpoint, ...]
    reads: tuple[tuple[str, int], ...] = ()


def _daytime(t: float) -> bool:
    return 8 * HOUR <= t % DAY < 20 * HOUR


def _poisson(rng: random.Random, days: int, day_gap: float, night_gap: float | None) -> Iterator[float]:
    t = 0.0
    end = days * DAY
    while True:
        gap = day_gap if _daytime(t) else night_gap
        if gap is None:
            t = (t // DAY) * DAY + 8 * HOUR + (DAY if t % DAY >= 20 * HOUR else 0)
            continue
        t += rng.expovariate(1.0 / gap)
        if t >= end:
            return
        if gap == night_gap and _daytime(t) or gap == day_gap and not _daytime(t):
            continue  # crossed a day/night edge: redraw at the new rate
        yield t


def _conversations(
    rng: random.Random, name: str, days: int, system: int, day_gap: float, night_gap: float | None,
    max_turns: int, mean_turns: float, think_median: float, turn_tokens: int,
) -> Iterator[Request]:  # fmt: skip
    sys_bp = Breakpoint(f"{name}:sys", system, f"{name}:sys", f"{name}/sys")
    for c, start in enumerate(_poisson(rng, days, day_gap, night_gap)):
        turns = min(max_turns, 1 + int(rng.expovariate(1.0 / max(mean_turns - 1, 1e-9))))
        t = start
        for n in range(1, turns + 1):
            history = system + turn_tokens * (n - 1)
            bps = [sys_bp]
            reads: list[tuple[str, int]] = [(sys_bp.entry, system)]
            if n >= 2:
                bps.append(Breakpoint(f"{name}:{c}:{n - 1}", history, f"{name}:{c}", f"{name}/history"))
            if n >= 3:
                reads.append((f"{name}:{c}:{n - 2}", history - turn_tokens))
            yield Request(t, name, history + turn_tokens // 3, tuple(bps), tuple(reads))
            t += rng.lognormvariate(math.log(think_median), 1.2)


def _agents(rng: random.Random, days: int) -> Iterator[Request]:
    system = 8_000
    sys_bp = Breakpoint("agent:sys", system, "agent:sys", "agent/sys")
    for s, start in enumerate(_poisson(rng, days, 20 * 60, None)):
        t, tokens, step, previous = start, system + 300, 0, None
        rounds = 1 + sum(1 for _ in range(3) if rng.random() < 0.6)
        for r in range(rounds):
            for _ in range(rng.randint(3, 25) if r == 0 else rng.randint(2, 10)):
                entry = f"agent:{s}:{step}"
                reads = [(sys_bp.entry, system)] + ([previous] if previous else [])
                bps = (sys_bp, Breakpoint(entry, tokens, f"agent:{s}", "agent/history"))
                yield Request(t, "agent", tokens + 50, bps, tuple(reads))
                previous = (entry, tokens)
                tokens += 150 + int(rng.lognormvariate(math.log(1_500), 0.6))
                step += 1
                t += rng.uniform(4, 15)
            t += rng.lognormvariate(math.log(8 * 60), 0.8)
            tokens += 300


def _batches(rng: random.Random, days: int) -> Iterator[Request]:
    for d in range(days):
        instr = Breakpoint("batch-a:instr", 1_500, "batch-a:instr", "batch-a/instr")
        t = d * DAY + 2 * HOUR
        for i in range(300):
            doc = Breakpoint(f"batch-a:{d}:{i}", 7_500, f"batch-a:{d}:{i}", "batch-a/doc")
            yield Request(t, "batch-a", 7_600, (instr, doc), ((instr.entry, 1_500),))
            t += 2
        t = d * DAY + 6 * HOUR
        instr_b = Breakpoint("batch-b:instr", 1_200, "batch-b:instr", "batch-b/instr")
        for i in range(50):
            doc = Breakpoint(f"batch-b:{d}:{i}", 1_200 + 5_000, f"batch-b:{d}:{i}", "batch-b/doc")
            for _ in range(5):
                yield Request(t, "batch-b", 6_300, (instr_b, doc), ((instr_b.entry, 1_200),))
                t += 3


def _adhoc(rng: random.Random, days: int) -> Iterator[Request]:
    sys_bp = Breakpoint("adhoc:sys", 2_000, "adhoc:sys", "adhoc/sys")
    for i, t in enumerate(_poisson(rng, days, 10 * 60, None)):
        doc = Breakpoint(f"adhoc:{i}", 6_000, f"adhoc:{i}", "adhoc/doc")
        yield Request(t, "adhoc", 6_100, (sys_bp, doc), ((sys_bp.entry, 2_000),))
        if rng.random() < 0.25:
            later = t + rng.lognormvariate(math.log(20 * 60), 0.7)
            yield Request(later, "adhoc", 6_200, (sys_bp, doc), ((sys_bp.entry, 2_000),))


def month_of_traffic(days: int = 30, seed: int = 15) -> list[Request]:
    """Every workload's requests for ``days`` days, in time order (deterministic for a seed)."""
    rng = random.Random(seed)
    requests: list[Request] = []
    requests += _conversations(rng, "chat-a", days, 3_000, 90, 30 * 60, 12, 4, 45, 500)
    requests += _conversations(rng, "chat-b", days, 6_000, 15 * 60, None, 3, 1.8, 90, 500)
    requests += _agents(rng, days)
    requests += _batches(rng, days)
    requests += _adhoc(rng, days)
    requests.sort(key=lambda r: r.t)
    return requests


@dataclass
class _Entry:
    expiry: float
    lifetime: float
    premium: float  # USD of the write premium, wasted if never read
    read: bool = False


@dataclass
class Bill:
    """What a policy paid over the month."""

    paid: float = 0.0
    saved: float = 0.0
    write_premium: float = 0.0
    write_waste: float = 0.0
    read_tokens: int = 0
    write_tokens: int = 0
    requests: int = 0
    by_workload: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class SimulatedProvider:
    """Anthropic-style prompt cache billed by ``prices`` (see the module docstring)."""

    def __init__(self, prices: ModelPrices, min_tokens: int) -> None:
        self.prices = prices
        self.min_tokens = min_tokens
        self.entries: dict[str, _Entry] = {}
        self.bill = Bill()

    def _live(self, entry: str, now: float) -> bool:
        found = self.entries.get(entry)
        if found is None:
            return False
        if found.expiry < now:
            self._expire(entry)
            return False
        return True

    def _expire(self, entry: str) -> None:
        found = self.entries.pop(entry)
        if not found.read:
            self.bill.write_waste += found.premium

    def send(self, request: Request, ttls: Sequence[str | None]) -> CacheUsage:
        """Bill ``request`` with ``ttls`` (one per breakpoint; None = no marker)."""
        now, prices = request.t, self.prices
        marked = [(bp, ttl) for bp, ttl in zip(request.breakpoints, ttls, strict=True) if ttl is not None]
        lifetimes = [prices.retentions[ttl] for _, ttl in marked]
        if any(a < b for a, b in zip(lifetimes, lifetimes[1:], strict=False)):
            raise ValueError("a longer TTL after a shorter one: the provider refuses the request")
        read, hit = 0, None
        if marked:  # without any marker nothing is looked up
            for entry, tokens in (*request.reads, *((bp.entry, bp.tokens) for bp, _ in marked)):
                if tokens >= self.min_tokens and tokens > read and self._live(entry, now):
                    read, hit = tokens, entry
        if hit is not None:
            found = self.entries[hit]
            found.read = True
            found.expiry = now + found.lifetime  # a hit refreshes the entry
        writes: dict[str | None, int] = {}
        position = read
        for bp, ttl in marked:
            if bp.tokens <= position or bp.tokens < self.min_tokens:
                continue
            if bp.entry in self.entries and self._live(bp.entry, now):
                position = bp.tokens
                continue
            tokens = bp.tokens - position
            writes[ttl] = writes.get(ttl, 0) + tokens
            premium = tokens * (prices.write_price(ttl) - prices.input) / 1e6
            lifetime = prices.retentions[ttl]
            self.entries[bp.entry] = _Entry(now + lifetime, lifetime, premium)
            position = bp.tokens
        usage = CacheUsage(request.tokens, read, writes)
        cost = request_cost(prices, usage)
        bill = self.bill
        bill.paid += cost.paid
        bill.saved += cost.saved
        bill.write_premium += cost.write_premium
        bill.read_tokens += read
        bill.write_tokens += usage.written
        bill.requests += 1
        bill.by_workload[request.workload] += cost.paid
        return usage

    def close(self) -> Bill:
        """Expire every remaining entry (unread ones are waste) and return the bill."""
        for entry in list(self.entries):
            self._expire(entry)
        return self.bill


Policy = Callable[[Request], list[str | None]]


def fixed(ttl: str | None) -> Callable[[], Policy]:
    """A policy that marks every breakpoint with ``ttl`` (None: no caching)."""
    return lambda: lambda request: [ttl] * len(request.breakpoints)


def prefixgate(prices: ModelPrices, allow_none: bool) -> Callable[[], Policy]:
    """prefixgate's choice: a ``ReuseTracker`` per breakpoint key, the 1h-before-5m order enforced by lifting."""
    options = options_for(prices)
    longest = max(prices.retentions, key=prices.retentions.__getitem__)

    def make() -> Policy:
        tracker = ReuseTracker(horizon_s=max(prices.retentions.values()), clock=lambda: 0.0)

        def policy(request: Request) -> list[str | None]:
            chosen: list[str | None] = []
            for bp in request.breakpoints:
                tracker.observe(bp.key, bp.scope, now=request.t, tokens=bp.tokens)
                choice = tracker.choose(
                    bp.key,
                    bp.scope,
                    options,
                    input_price=prices.input,
                    read_price=prices.cache_read,
                    default=prices.default_retention,
                    allow_none=allow_none,
                    now=request.t,
                )
                chosen.append(None if choice.retention == NO_CACHE else choice.retention)
            for i in range(len(chosen) - 2, -1, -1):  # a later longer TTL lifts the earlier markers
                later = [prices.retentions[c] for c in chosen[i + 1 :] if c is not None]
                if chosen[i] is not None and later and max(later) > prices.retentions[chosen[i]]:
                    chosen[i] = longest
            return chosen

        return policy

    return make


def run(
    requests: list[Request], prices: ModelPrices, policies: dict[str, Callable[[], Policy]]
) -> dict[str, Bill]:
    """Each policy over the same requests, each against a fresh simulated provider."""
    minimum = prices.min_cacheable_tokens or 1024
    bills = {}
    for name, make in policies.items():
        provider, policy = SimulatedProvider(prices, minimum), make()
        for request in requests:
            provider.send(request, policy(request))
        bills[name] = provider.close()
    return bills


def _table(title: str, bills: dict[str, Bill], workloads: list[str]) -> None:
    print(f"\n{title}")
    print(
        f"{'policy':<12}{'cost $':>12}{'saved $':>12}{'premium $':>12}{'waste $':>10}{'read Mtok':>11}{'write Mtok':>11}"
    )
    for name, b in bills.items():
        print(
            f"{name:<12}{b.paid:>12.2f}{b.saved:>12.2f}{b.write_premium:>12.2f}{b.write_waste:>10.2f}"
            f"{b.read_tokens / 1e6:>11.1f}{b.write_tokens / 1e6:>11.1f}"
        )
    print(f"\n{'cost $ by workload':<20}" + "".join(f"{w:>10}" for w in workloads))
    for name, b in bills.items():
        print(f"{name:<20}" + "".join(f"{b.by_workload.get(w, 0.0):>10.2f}" for w in workloads))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--model", default="claude-sonnet-4-5", help="Anthropic model of the price table")
    ap.add_argument("--openai-model", default="gpt-5.6")
    args = ap.parse_args()
    table = load_price_table()
    requests = month_of_traffic(args.days, args.seed)
    workloads = sorted({r.workload for r in requests})
    print(f"{len(requests)} requests over {args.days} days; price table checked {table.checked}")

    anthropic = table.lookup(args.model, "anthropic")
    bills = run(
        requests,
        anthropic,
        {
            "none": fixed(None),
            "always-5m": fixed("5m"),
            "always-1h": fixed("1h"),
            "prefixgate": prefixgate(anthropic, allow_none=True),
        },
    )
    _table(f"{args.model} (Anthropic, min {anthropic.min_cacheable_tokens} tokens)", bills, workloads)
    best_fixed = min(bills["always-5m"].paid, bills["always-1h"].paid)

    openai = table.lookup(args.openai_model, "openai")
    openai_bills = run(
        requests,
        openai,
        {
            "in_memory": fixed("in_memory"),
            "24h": fixed("24h"),
            "prefixgate": prefixgate(openai, allow_none=False),
        },
    )
    _table(f"{args.openai_model} (OpenAI prompt_cache_retention)", openai_bills, workloads)
    openai_best = min(openai_bills["in_memory"].paid, openai_bills["24h"].paid)

    out = {
        "bench": "providers",
        "days": args.days,
        "requests": len(requests),
        "prices_checked": table.checked,
        "model": args.model,
        "cost_none_usd": round(bills["none"].paid, 2),
        "cost_always_5m_usd": round(bills["always-5m"].paid, 2),
        "cost_always_1h_usd": round(bills["always-1h"].paid, 2),
        "cost_prefixgate_usd": round(bills["prefixgate"].paid, 2),
        "write_waste_5m_usd": round(bills["always-5m"].write_waste, 2),
        "write_waste_1h_usd": round(bills["always-1h"].write_waste, 2),
        "write_waste_prefixgate_usd": round(bills["prefixgate"].write_waste, 2),
        "cost_vs_best_fixed": round(bills["prefixgate"].paid / best_fixed, 4),
        "openai_model": args.openai_model,
        "openai_cost_vs_best_fixed": round(openai_bills["prefixgate"].paid / openai_best, 4),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
