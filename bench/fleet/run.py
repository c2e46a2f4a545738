"""One fleet run and the measures of it: replicas, gateways, sessions, faults, then hit rate, load and TTFT.

A run starts ``n_replicas`` stub replicas (``bench.fleet.replica``) on loopback, the last one absent until it
*joins* at 25 % of the expected duration; replica 3 is *killed* at 50 % (everything in flight on it fails) and
*restarted* empty at 70 %. ``n_gateways`` bench routers share nothing but the replicas; each request goes to
a gateway drawn at random (a load balancer without stickiness). Sessions (``bench.fleet.workload``) run
concurrently; the run ends when every session has finished or ``deadline_s`` has passed (then the rest counts
as errors).

Measures (real seconds unless named):
- token hit rate: sum of ``cached_tokens`` / sum of ``prompt_tokens`` over successful requests, as reported by
  the replicas;
- share of single: that hit rate over the hit rate of one ``PrefixLRU`` with the fleet's total capacity
  replaying the same successful prompts in send order (no timing: an upper bound for any placement);
- load: per replica, the time-averaged number of requests in it (residence seconds / up seconds); the run's
  figure is max / mean over replicas; also max / mean of requests served;
- TTFT: client send to first content byte, failovers included; p50 / p99 in engine seconds (real seconds /
  ``time_scale``) so they read against the real engine's 1.1 s cold TTFT.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import redis.asyncio as aioredis

from bench.fleet.replica import EngineTiming, PrefixLRU, StubReplica
from bench.fleet.router import BackendRouter, BenchRouter, Outcome
from bench.fleet.tokens import encode_chat
from bench.fleet.workload import Session, WorkloadConfig, build_sessions, mean_turns
from gateway.config.schema import RoutingShareConfig
from gateway.transport.routing_policy import block_hashes


@dataclass(frozen=True)
class RunConfig:
    """One cell of the bench matrix."""

    policy: str
    n_gateways: int
    load: float  # offered uncached work / fleet capacity at batch 1 (0.2: far from saturation)
    n_replicas: int = 8
    capacity_tokens: int = 8_000
    faults: bool = True
    load_factor: float = 1.25
    share: bool = True  # several cache-aware gateways exchange their index through Redis
    overlap_weight: float = 1.0  # cache-aware: Dynamo's overlap score weight
    redis_url: str = "redis://127.0.0.1:6379/0"
    deadline_s: float = 120.0
    timing: EngineTiming = field(default_factory=EngineTiming)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]) of a non-empty list; 0.0 for an empty one."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def mean_prompt_tokens(
    sessions: list[Session], max_tokens: int, encode: Callable[[Sequence[dict]], list[int]] = encode_chat
) -> float:
    """Mean prompt tokens of the requests the sessions will send (a reply counted as ``2 * max_tokens``);
    ``encode`` renders and tokenizes chat messages (``encode_chat`` or the simulator's memoized equal)."""
    total, n = 0, 0
    for s in sessions:
        base = len(encode([{"role": "system", "content": s.system}]))
        history = 0
        for user in s.user_messages:
            history += len(encode([{"role": "user", "content": user}]))
            total += base + history
            history += 2 * max_tokens
            n += 1
    return total / max(n, 1)


def single_cache_hit_rate(prompts: list[list[int]], capacity_tokens: int) -> float:
    """Token hit rate of one ``PrefixLRU`` of ``capacity_tokens`` over ``prompts`` in order."""
    cache = PrefixLRU(capacity_tokens)
    hit = total = 0
    for ids in prompts:
        hashes = block_hashes(ids)
        hit += cache.lookup(ids, hashes)
        cache.insert(ids, hashes)
        total += len(ids)
    return hit / max(total, 1)


async def run_once(cfg: RunConfig) -> dict:
    """Run one cell; returns its measures (see the module docstring)."""
    wl = cfg.workload
    timing = cfg.timing
    probe_sessions = build_sessions(wl, 1.0)
    mean_tokens = mean_prompt_tokens(probe_sessions, wl.max_tokens)
    cost_real = timing.request_cost_s(round(mean_tokens), 0, wl.max_tokens) * timing.time_scale
    request_rate = cfg.load * cfg.n_replicas / cost_real
    sessions = build_sessions(wl, request_rate / mean_turns(wl))
    expected_s = sessions[-1].start_s + 1e-9

    replicas = [StubReplica(f"r{i}", cfg.capacity_tokens, timing) for i in range(cfg.n_replicas)]
    joining = replicas[-1] if cfg.faults else None
    failing = replicas[3] if cfg.faults and cfg.n_replicas > 4 else None
    up_since: dict[str, float] = {}
    up_total: dict[str, float] = {r.name: 0.0 for r in replicas}
    for r in replicas:
        if r is not joining:
            await r.start()
            up_since[r.name] = time.monotonic()

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(10.0, connect=2.0))
    urls = [r.base_url for r in replicas]
    model = f"fleet-{uuid.uuid4().hex[:12]}"
    share = None
    if cfg.share and cfg.policy == "cache_aware" and cfg.n_gateways > 1:
        share = RoutingShareConfig(redis_url=cfg.redis_url, interval_s=0.1, timeout_s=0.2, retry_after_s=1.0)
    routers: list[BenchRouter | BackendRouter] = [
        BenchRouter(urls, cfg.policy, client, load_factor=cfg.load_factor)
        if cfg.policy == "cache_aware_kv"
        else BackendRouter(urls, cfg.policy, client, model=model, share=share, load_factor=cfg.load_factor)
        for _ in range(cfg.n_gateways)
    ]
    for router in routers:
        if hasattr(router.policy, "overlap_weight"):
            router.policy.overlap_weight = cfg.overlap_weight
        router.start()

    rng = random.Random(wl.seed + 1)
    outcomes: list[tuple[float, list[dict], Outcome]] = []
    t0 = time.monotonic()

    async def session(s: Session, srng: random.Random) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.monotonic() - t0)))
        history = [{"role": "system", "content": s.system}]
        for user in s.user_messages:
            messages = history + [{"role": "user", "content": user}]
            router = routers[srng.randrange(len(routers))]
            sent = time.monotonic()
            outcome = await router.complete(messages, wl.max_tokens)
            outcomes.append((sent, messages, outcome))
            history = messages + ([{"role": "assistant", "content": outcome.content}] if outcome.ok else [])
            await asyncio.sleep(srng.expovariate(1 / wl.think_s))

    async def faults() -> None:
        if joining is not None:
            await asyncio.sleep(0.25 * expected_s)
            await joining.start()
            up_since[joining.name] = time.monotonic()
        if failing is not None:
            await asyncio.sleep(max(0.0, 0.5 * expected_s - (time.monotonic() - t0)))
            await failing.kill()
            up_total[failing.name] += time.monotonic() - up_since.pop(failing.name)
            await asyncio.sleep(max(0.0, 0.7 * expected_s - (time.monotonic() - t0)))
            await failing.start()
            up_since[failing.name] = time.monotonic()

    tasks = [asyncio.create_task(session(s, random.Random(rng.random()))) for s in sessions]
    fault_task = asyncio.create_task(faults())
    done, pending = await asyncio.wait(tasks, timeout=cfg.deadline_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.gather(fault_task, return_exceptions=True)
    wall = time.monotonic() - t0
    unfinished = sum(len(s.user_messages) for s in sessions) - len(outcomes)
    now = time.monotonic()
    for name, since in up_since.items():
        up_total[name] += now - since
    totals = {r.name: r.totals() for r in replicas}
    for router in routers:
        await router.close()
    await client.aclose()
    if share is not None:
        with contextlib.suppress(Exception):
            r = aioredis.Redis.from_url(cfg.redis_url)
            async for key in r.scan_iter(f"prefixgate:route:{model}:*"):
                await r.delete(key)
            await r.aclose()
    for r in replicas:
        await r.kill()

    ok = [(sent, msgs, o) for sent, msgs, o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for _, _, o in ok)
    cached = sum(o.cached_tokens for _, _, o in ok)
    hit_rate = cached / max(prompt, 1)
    single = single_cache_hit_rate(
        [encode_chat(msgs) for _, msgs, _ in sorted(ok, key=lambda x: x[0])],
        cfg.capacity_tokens * cfg.n_replicas,
    )
    loads = [totals[n]["residence_s"] / up_total[n] for n in totals if up_total[n] > 0]
    served = [totals[n]["served"] / up_total[n] for n in totals if up_total[n] > 0]
    ttfts = [o.ttft_s / timing.time_scale for _, _, o in ok]
    return {
        "policy": cfg.policy,
        "gateways": cfg.n_gateways,
        "load": cfg.load,
        "requests": len(outcomes) + unfinished,
        "ok": len(ok),
        "errors": len(outcomes) - len(ok) + unfinished,
        # Bench routers count their failovers; the backend retries inside (not counted here).
        "failovers": sum(r.failovers for r in routers)
        if all(isinstance(r, BenchRouter) for r in routers)
        else None,
        "hit_rate": hit_rate,
        "single_hit_rate": single,
        "share_of_single": hit_rate / single if single > 0 else 0.0,
        "max_over_mean_load": max(loads) / statistics.mean(loads)
        if loads and statistics.mean(loads) > 0
        else 0.0,
        "max_over_mean_served": max(served) / statistics.mean(served)
        if served and statistics.mean(served) > 0
        else 0.0,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "wall_s": wall,
        "request_rate": request_rate,
    }
