"""The fleet in virtual time: a discrete-event simulation of replicas, gateways and sessions, CPU-noise free.

Why: the real-time run (``bench.fleet.run``) puts 8 HTTP replicas, the gateways and hundreds of clients in
one event loop, 25 times faster than the engine. On a shared 2-core machine its clock is the CPU: at a load
average of 14 the "low" load cell measured TTFT p50 of 50-115 engine seconds against a 1.1 s cold prefill,
i.e. the event loop, not the simulated replicas, was saturated, and every figure (hit rate included, since
placements depend on timing) moved with the machine's other work. Here time is a number: nothing waits on
the CPU, the same config gives the same placements on any machine, and a load level means what it says.

What is real: every routing decision is the gateway's own code, unchanged. Each gateway is an
``AffinityRing`` (clocked by the virtual clock) with the policy of ``gateway.transport.routing_policy``
(``make_policy``), acquired and released exactly as ``gateway.transport.upstream_http.open_response`` does
(lease at send, ``report_success`` and ``prefill_done`` at the first byte, ``report_failure`` on a refused
or reset connection before it, a retry after ``RetryPolicy.delay``, release at the end); the approximate
index gets the blocks ``gateway.backends.upstream.routing_blocks`` computes from the request body; several
gateways share load and the index through the real Redis with ``gateway.transport.routing_share.RoutingShare``
(its ``exchange`` awaited every ``share_interval_s`` of virtual time, its clock the virtual one), and
``cache_aware_kv`` gateways take each replica's KV event batches (vLLM's shape, the stub's) through
``CacheAwarePolicy.apply_kv_events`` after ``kv_event_delay_s``.

What is simulated: the replicas, with the stub replica's scheduler and cost model
(``bench.fleet.replica``: one prefill at a time for the uncached tokens, batched decode up to 8, the
embedded engine's measured per-token costs, ``PrefixLRU`` of 16-token blocks with the same hashes), and the
network (``network_s`` each way). Times are engine seconds throughout.

Invariants: a replica's state changes only through its events, tagged with its *life* (a kill starts a new
one, so a step scheduled before a kill never lands after it); a lease is released exactly once per attempt;
a request that got its first token is never retried (like the gateway: a cut stream is an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import random
import statistics
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import redis.asyncio as aioredis

from bench.fleet.replica import EngineTiming, PrefixLRU, _word
from bench.fleet.run import mean_prompt_tokens, percentile
from bench.fleet.tokens import _encoding
from bench.fleet.workload import Session, WorkloadConfig, build_sessions, mean_turns
from gateway.backends.upstream import routing_blocks
from gateway.transport.affinity import AffinityRing, Lease
from gateway.transport.retry import RetryPolicy
from gateway.transport.routing_policy import (
    CacheAwarePolicy,
    RouteRequest,
    RoutingPolicy,
    block_hashes,
    make_policy,
)
from gateway.transport.routing_share import RoutingShare

POLICY_NAMES = ("round_robin", "least_load", "consistent_hash", "cache_aware", "cache_aware_kv")
"""Policies of the matrix; ``cache_aware_kv`` is ``cache_aware`` with the replicas' KV events."""


@dataclass(frozen=True)
class SimConfig:
    """One cell of the matrix. Times are engine seconds.

    Attributes:
        policy: one of ``POLICY_NAMES``.
        n_gateways: gateways; each request goes to one drawn at random (a load balancer without stickiness).
        load: offered work over the fleet's capacity, work counted with nothing cached and decode at batch
            1 (``EngineTiming.request_cost_s(prompt, 0, max_tokens)``): 1.0 keeps every replica busy without
            any cache hit; the busy share each policy really reaches is measured (``util``).
        n_replicas: replicas (the last joins at 25 % of the run when ``faults``).
        capacity_tokens: prefix cache tokens per replica.
        faults: the last replica joins at 25 %, replica 3 is killed at 50 % and restarted empty at 70 %.
        load_factor: the ring's bound ``c``.
        share: several gateways share load and the cache-aware index through Redis (``RoutingShare``).
        share_interval_s: seconds between a gateway's exchanges (``routing_share.interval_s``).
        redis_url: the Redis of the exchange.
        network_s: one-way latency gateway <-> replica.
        kv_event_delay_s: a KV event batch reaches the gateways this long after the replica's change.
        cooldown_s: the ring's first cool-down (``ring.cooldown_s``).
        max_cooldown_s: the ring's longest cool-down.
        retries: retries before the first byte (``RetryPolicy.retries``).
        think_s: mean think time between a session's turns (exponential).
        policy_options: keyword options of ``CacheAwarePolicy`` (cache-aware policies only).
        timing: the replicas' cost model.
        workload: the traffic's shape.
    """

    policy: str
    n_gateways: int
    load: float
    n_replicas: int = 8
    capacity_tokens: int = 8_000
    faults: bool = True
    load_factor: float = 1.25
    share: bool = True
    share_interval_s: float = 0.2
    redis_url: str = "redis://127.0.0.1:6379/0"
    network_s: float = 0.001
    kv_event_delay_s: float = 0.005
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    retries: int = 2
    think_s: float = 2.0
    policy_options: tuple[tuple[str, object], ...] = ()
    timing: EngineTiming = field(default_factory=EngineTiming)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)


@lru_cache(maxsize=65_536)
def _message_tokens(role: str, content: str) -> tuple[int, ...]:
    return tuple(_encoding().encode(f"<|{role}|>{content}\n", disallowed_special=()))


def chat_tokens(messages: Sequence[dict]) -> list[int]:
    """``bench.fleet.tokens.encode_chat(messages)``, memoized per message.

    Equal to encoding the whole rendering: every message ends with ``\\n`` and the next starts with ``<|``,
    and no piece of cl100k's pre-tokenizer spans that boundary (tested against ``encode_chat``).
    """
    out: list[int] = []
    for m in messages:
        out.extend(_message_tokens(m["role"], m["content"]))
    return out


class Clock:
    """The virtual clock and its event heap (engine seconds)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], object]) -> None:
        """Run ``fn`` at time ``t`` (not before now); ties run in the order they were scheduled."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def after(self, dt: float, fn: Callable[[], object]) -> None:
        """Run ``fn`` ``dt`` seconds from now."""
        self.at(self.now + dt, fn)

    def pop(self) -> Callable[[], object] | None:
        """Advance to the next event and return it (None when there is none)."""
        if not self._heap:
            return None
        self.now, _, fn = heapq.heappop(self._heap)
        return fn


@dataclass
class _Seq:
    ids: list[int]
    hashes: list[int]
    max_tokens: int
    on_first: Callable[[int], None]
    on_done: Callable[[int], None]
    on_fail: Callable[[bool], None]  # argument: the first token was already sent
    generated: int = 0
    cached: int = 0


class SimReplica:
    """The stub replica's scheduler on the virtual clock (``bench.fleet.replica.SimEngine``'s rules).

    Args:
        name: its URL (the ring's replica name).
        capacity_tokens: prefix cache capacity.
        timing: cost model.
        clock: the virtual clock.
        max_batch: most sequences decoding at once.
    """

    def __init__(
        self, name: str, capacity_tokens: int, timing: EngineTiming, clock: Clock, max_batch: int = 8
    ) -> None:
        self.name = name
        self.capacity_tokens = capacity_tokens
        self.timing = timing
        self.clock = clock
        self.max_batch = max_batch
        self.up = False
        self.life = 0
        self.cache = PrefixLRU(capacity_tokens)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.prefilling: _Seq | None = None
        self.busy = False
        self.subscribers: list[Callable[[dict], None]] = []  # KV event batches
        self.on_lost: list[Callable[[], None]] = []  # KV event stream lost (kill)
        self.served = 0
        self.busy_s = 0.0
        self.up_s = 0.0
        self.residence_s = 0.0  # integral of requests inside (queued, prefilling, decoding) over up time
        self._inside = 0
        self._mark = 0.0

    def _account(self) -> None:
        now = self.clock.now
        if self.up:
            self.residence_s += self._inside * (now - self._mark)
            self.up_s += now - self._mark
        self._mark = now

    def start(self) -> None:
        """Start serving with an empty cache; subscribers get ``AllBlocksCleared`` (a new subscription)."""
        self._account()
        self.up = True
        self.life += 1
        self.cache = PrefixLRU(self.capacity_tokens)
        self._publish([{"type": "AllBlocksCleared"}])

    def kill(self) -> None:
        """Crash: every queued or prefilling request fails before its first byte, every decoding one after."""
        self._account()
        self.up = False
        self.life += 1
        before = list(self.waiting) + ([self.prefilling] if self.prefilling else [])
        after = list(self.running)
        self.waiting.clear()
        self.running.clear()
        self.prefilling = None
        self.busy = False
        self._inside = 0
        for seq in before:
            seq.on_fail(False)
        for seq in after:
            seq.on_fail(True)
        for lost in self.on_lost:
            lost()

    def submit(self, seq: _Seq) -> bool:
        """Queue ``seq``; False when the replica is down (connection refused)."""
        if not self.up:
            return False
        self._account()
        self._inside += 1
        self.waiting.append(seq)
        self._kick()
        return True

    def _publish(self, events: list[dict]) -> None:
        if events:
            batch = {"ts": self.clock.now, "events": events}
            for deliver in self.subscribers:
                deliver(batch)

    def _kick(self) -> None:
        if self.busy or not self.up:
            return
        life = self.life
        if self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.popleft()
            seq.cached = self.cache.lookup(seq.ids, seq.hashes)
            duration = (len(seq.ids) - seq.cached) * self.timing.prefill_s_per_token
            self.prefilling = seq
            self.busy = True
            self.clock.after(duration, lambda: self._prefilled(seq, life, duration))
        elif self.running:
            duration = self.timing.decode_step_s(len(self.running))
            self.busy = True
            self.clock.after(duration, lambda: self._decoded(life, duration))

    def _prefilled(self, seq: _Seq, life: int, duration: float) -> None:
        if life != self.life:
            return
        self.busy = False
        self.busy_s += duration
        self.prefilling = None
        stored, removed = self.cache.insert(seq.ids, seq.hashes)
        events: list[dict] = []
        if stored:
            first = seq.hashes.index(stored[0])
            parent = seq.hashes[first - 1] if first > 0 else None
            events.append({"type": "BlockStored", "block_hashes": stored, "parent_block_hash": parent})
        if removed:
            events.append({"type": "BlockRemoved", "block_hashes": removed})
        self._publish(events)
        seq.generated = 1
        seq.on_first(seq.cached)
        if seq.max_tokens <= 1:
            self._finish(seq)
        else:
            self.running.append(seq)
        self._kick()

    def _decoded(self, life: int, duration: float) -> None:
        if life != self.life:
            return
        self.busy = False
        self.busy_s += duration
        for seq in list(self.running):
            seq.generated += 1
            if seq.generated >= seq.max_tokens:
                self.running.remove(seq)
                self._finish(seq)
        self._kick()

    def _finish(self, seq: _Seq) -> None:
        self._account()
        self._inside -= 1
        self.served += 1
        seq.on_done(seq.generated)

    def close(self) -> None:
        """End of the run: close the books (up time and residence up to now)."""
        self._account()


@dataclass
class Outcome:
    """One request's result (engine seconds)."""

    ok: bool
    sent: float
    ids: list[int]
    hashes: list[int]
    ttft_s: float = 0.0
    cached_tokens: int = 0
    replica: str = ""
    attempts: int = 0
    error: str = ""


class SimGateway:
    """One gateway: a ring, a policy, and (when sharing) a ``RoutingShare`` through Redis.

    Args:
        urls: replica names.
        cfg: the cell.
        clock: the virtual clock.
        upstream: the upstream name of the Redis keys (unique per run).
        epoch: wall-clock seconds at virtual time 0 (``RoutingShare``'s scores).
        rng: this gateway's retry jitter.
    """

    def __init__(
        self,
        urls: list[str],
        cfg: SimConfig,
        clock: Clock,
        upstream: str,
        epoch: float,
        rng: random.Random,
    ) -> None:
        self.ring = AffinityRing(
            urls,
            load_factor=cfg.load_factor,
            cooldown_s=cfg.cooldown_s,
            max_cooldown_s=cfg.max_cooldown_s,
            clock=lambda: clock.now,
        )
        kv = cfg.policy == "cache_aware_kv"
        name = "cache_aware" if kv else cfg.policy
        options = dict(cfg.policy_options) if name == "cache_aware" else {}
        if kv:
            options["use_kv_events"] = True
        self.policy: RoutingPolicy = make_policy(name, self.ring, **options)
        self.kv = kv
        self.retry = RetryPolicy(retries=cfg.retries)
        self.rng = rng
        self.share: RoutingShare | None = None
        if cfg.share and cfg.n_gateways > 1:
            self.share = RoutingShare(
                self.policy,
                upstream,
                url=cfg.redis_url,
                interval_s=cfg.share_interval_s,
                timeout_s=0.5,
                retry_after_s=5.0,
                clock=lambda: epoch + clock.now,
            )


async def simulate(cfg: SimConfig) -> dict:
    """Run one cell; returns its measures.

    Measures: ``hit_rate`` (cached / prompt tokens over successful requests, as the replicas counted them);
    ``single_hit_rate`` (one ``PrefixLRU`` with the fleet's total capacity replaying the same prompts in send
    order: a bound for any placement) and ``share_of_single``; ``max_over_mean_load`` (per replica, the time
    average of requests inside it over its up time, ``load_by_replica``; max over mean) and
    ``max_over_mean_served`` (requests
    served per up second); ``util`` (mean busy share of the replicas); TTFT p50 / p99 (send to first token at
    the gateway, retries included); ``errors`` (failed or cut requests) and ``retries``.
    """
    wl = cfg.workload
    timing = cfg.timing
    clock = Clock()
    probe = build_sessions(wl, 1.0)
    mean_tokens = mean_prompt_tokens(probe, wl.max_tokens, chat_tokens)
    cost = timing.request_cost_s(round(mean_tokens), 0, wl.max_tokens)
    request_rate = cfg.load * cfg.n_replicas / cost
    sessions = build_sessions(wl, request_rate / mean_turns(wl))
    expected_s = sessions[-1].start_s

    urls = [f"http://replica-{i}/v1" for i in range(cfg.n_replicas)]
    replicas = [SimReplica(u, cfg.capacity_tokens, timing, clock) for u in urls]
    by_url = dict(zip(urls, replicas, strict=True))
    upstream = f"fleet-sim-{uuid.uuid4().hex[:12]}"
    epoch = time.time()
    rng = random.Random(wl.seed + 1)
    gateways = [
        SimGateway(urls, cfg, clock, upstream, epoch, random.Random(rng.random()))
        for _ in range(cfg.n_gateways)
    ]
    for g in gateways:
        if g.kv:
            assert isinstance(g.policy, CacheAwarePolicy)
            for r in replicas:
                _subscribe(r, g.policy, clock, cfg.kv_event_delay_s)

    joining = replicas[-1] if cfg.faults else None
    failing = replicas[3] if cfg.faults and cfg.n_replicas > 4 else None
    for r in replicas:
        if r is not joining:
            r.start()
    if joining is not None:
        clock.at(0.25 * expected_s, joining.start)
    if failing is not None:
        clock.at(0.5 * expected_s, failing.kill)
        clock.at(0.7 * expected_s, failing.start)

    outcomes: list[Outcome] = []
    live = {"sessions": len(sessions)}
    model = "fleet"

    def send(g: SimGateway, ids: list[int], hashes: list[int], body: dict, key: str, done) -> None:
        sent = clock.now
        blocks: tuple[int, ...] = ()
        if g.policy.wants_blocks:
            blocks = tuple(hashes) if g.kv else routing_blocks(body, model)
        route = RouteRequest(key=key, blocks=blocks)

        def attempt(n: int) -> None:
            lease: Lease = g.policy.acquire(route)  # type: ignore[assignment]
            replica = by_url[lease.replica]
            state = {"first": False}

            def first(cached: int) -> None:
                def seen() -> None:
                    state["first"] = True
                    state["cached"] = cached
                    state["ttft"] = clock.now - sent
                    g.ring.report_success(lease.replica)
                    prefill_done = getattr(lease, "prefill_done", None)
                    if prefill_done is not None:
                        prefill_done()

                clock.after(cfg.network_s, seen)

            def finished(generated: int) -> None:
                def seen() -> None:
                    lease.release()
                    outcomes.append(
                        Outcome(True, sent, ids, hashes, state["ttft"], state["cached"], lease.replica, n + 1)
                    )
                    done(generated)

                clock.after(cfg.network_s, seen)

            def failed(after_first: bool) -> None:
                def seen() -> None:
                    g.ring.report_failure(lease.replica)
                    lease.release()
                    if after_first or n >= cfg.retries:
                        why = "stream cut" if after_first else "no replica answered"
                        outcomes.append(Outcome(False, sent, ids, hashes, attempts=n + 1, error=why))
                        done(None)
                    else:
                        clock.after(g.retry.delay(n, rng=g.rng.random), lambda: attempt(n + 1))

                clock.after(cfg.network_s, seen)

            seq = _Seq(ids, hashes, wl.max_tokens, first, finished, failed)
            clock.after(cfg.network_s, lambda: replica.submit(seq) or failed(False))

        attempt(0)

    def run_session(s: Session, srng: random.Random) -> None:
        history = [{"role": "system", "content": s.system}]
        key = f"{model}:{hash_key(s.system)}"
        turns = iter(s.user_messages)

        def next_turn() -> None:
            user = next(turns, None)
            if user is None:
                live["sessions"] -= 1
                return
            messages = history + [{"role": "user", "content": user}]
            ids = chat_tokens(messages)
            hashes = block_hashes(ids)
            body = {"model": model, "messages": messages, "max_tokens": wl.max_tokens, "stream": True}
            g = gateways[srng.randrange(len(gateways))]

            def done(generated: int | None) -> None:
                if generated is not None:
                    seed = hashes[-1] if hashes else len(ids)
                    reply = "".join(_word(seed, i) for i in range(1, generated + 1))
                    history[:] = messages + [{"role": "assistant", "content": reply}]
                clock.after(srng.expovariate(1 / cfg.think_s), next_turn)

            send(g, ids, hashes, body, key, done)

        next_turn()

    for s in sessions:
        srng = random.Random(rng.random())
        clock.at(s.start_s, lambda s=s, srng=srng: run_session(s, srng))
    shares = [g.share for g in gateways if g.share is not None]
    for i, share in enumerate(shares):
        _schedule_share(share, clock, cfg.share_interval_s * (1 + i / len(shares)), live)

    try:
        while (fn := clock.pop()) is not None:
            result = fn()
            if asyncio.iscoroutine(result):
                await result
    finally:
        for share in shares:
            await share.close()
        if shares:
            with contextlib.suppress(Exception):
                client = aioredis.Redis.from_url(cfg.redis_url)
                async for k in client.scan_iter(f"{shares[0].prefix}{upstream}:*"):
                    await client.delete(k)
                await client.aclose()
    for r in replicas:
        r.close()

    ok = [o for o in outcomes if o.ok]
    prompt = sum(len(o.ids) for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    hit_rate = cached / max(prompt, 1)
    single = _single_hit_rate(sorted(ok, key=lambda o: o.sent), cfg.capacity_tokens * cfg.n_replicas)
    up = [r for r in replicas if r.up_s > 0]
    loads = [r.residence_s / r.up_s for r in up]
    served = [r.served / r.up_s for r in up]
    ttfts = [o.ttft_s for o in ok]
    return {
        "policy": cfg.policy,
        "gateways": cfg.n_gateways,
        "load": cfg.load,
        "requests": len(outcomes),
        "ok": len(ok),
        "errors": len(outcomes) - len(ok),
        "retries": sum(o.attempts - 1 for o in outcomes),
        "hit_rate": hit_rate,
        "single_hit_rate": single,
        "share_of_single": hit_rate / single if single > 0 else 0.0,
        "max_over_mean_load": max(loads) / statistics.mean(loads)
        if loads and statistics.mean(loads)
        else 0.0,
        "max_over_mean_served": max(served) / statistics.mean(served)
        if served and statistics.mean(served)
        else 0.0,
        "util": statistics.mean(r.busy_s / r.up_s for r in up) if up else 0.0,
        "load_by_replica": [round(v, 3) for v in loads],
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "sim_s": clock.now,
        "request_rate": request_rate,
    }


@lru_cache(maxsize=4096)
def hash_key(text: str) -> str:
    """The prefix key's stable part (the gateway hashes the stable segments; here the system prompt)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _subscribe(replica: SimReplica, policy: CacheAwarePolicy, clock: Clock, delay: float) -> None:
    def deliver(batch: dict) -> None:
        clock.after(delay, lambda: policy.apply_kv_events(replica.name, batch))

    def lost() -> None:
        clock.after(delay, lambda: policy.kv_stream_lost(replica.name))

    replica.subscribers.append(deliver)
    replica.on_lost.append(lost)


def _schedule_share(share: RoutingShare, clock: Clock, first: float, live: dict) -> None:
    async def tick() -> None:
        await share.exchange()
        if live["sessions"] > 0:
            clock.after(share.interval_s, tick)

    clock.at(first, tick)


def _single_hit_rate(ok: list[Outcome], capacity_tokens: int) -> float:
    cache = PrefixLRU(capacity_tokens)
    hit = total = 0
    for o in ok:
        hit += cache.lookup(o.ids, o.hashes)
        cache.insert(o.ids, o.hashes)
        total += len(o.ids)
    return hit / max(total, 1)


def index_blocks_for(capacity_tokens: int, workload: WorkloadConfig, sample: int = 200) -> int:
    """A replica's prefix cache in the approximate index's 64-character blocks for this workload's text.

    ``capacity_tokens / 16`` token blocks times the measured ratio of text blocks
    (``gateway.backends.upstream.routing_blocks``) to token blocks over the first ``sample`` sessions' first
    requests: the index then ages out about what the replica evicts (llm-d's ``LRUCapacityPerServer`` is sized
    the same way, from the pod's KV capacity).
    """
    text = tokens = 0
    for s in build_sessions(replace(workload, n_sessions=min(sample, workload.n_sessions)), 1.0):
        messages = [{"role": "system", "content": s.system}, {"role": "user", "content": s.user_messages[0]}]
        text += len(routing_blocks({"messages": messages}, "fleet"))
        tokens += len(chat_tokens(messages)) // 16
    return max(1, round(capacity_tokens / 16 * text / max(tokens, 1)))
