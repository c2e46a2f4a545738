"""Cache-aware routing through the real upstream backend: 3 stub replicas on loopback, 2 gateways sharing the
index through Redis (127.0.0.1:6379), a scripted sequence with exact placements, and Redis loss."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import httpx
import pytest
import redis

from bench.fleet.netfault import TcpProxy
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.backends.upstream import routing_blocks
from gateway.config.schema import (
    ROUTING_POLICIES,
    CacheAwareConfig,
    KVEventsConfig,
    RoutingShareConfig,
)
from gateway.transport.routing_policy import POLICIES, CacheAwarePolicy, RouteRequest
from tests.gateway.transport.fleet_helpers import (
    SYSTEM,
    forget_routing_keys,
    gateway,
    key_with_home,
    send,
)
from tests.gateway.upstream_helpers import Sleeps, chat_request, drain


def test_config_names_every_policy():
    assert set(ROUTING_POLICIES) == set(POLICIES)


def test_routing_blocks_share_the_leading_blocks_of_a_growing_conversation():
    turn1 = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q1"}]}
    turn2 = {
        "messages": turn1["messages"]
        + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    }
    a, b = routing_blocks(turn1, "m"), routing_blocks(turn2, "m")
    assert len(a) > 10 and b[: len(a)] == a
    assert routing_blocks(turn1, "other-model")[0] != a[0]
    assert routing_blocks("not a body", "m") == ()


@pytest.mark.parametrize("isolated", [True, False])
async def test_a_tenant_follows_another_tenants_blocks_only_where_the_upstream_shares_them(
    fleet, monkeypatch, isolated
):
    """Before: the index's blocks were salted with the upstream model alone, so with ``cache_salt: true`` (the
    replicas keep tenants apart) tenant B followed tenant A's placement to a replica that held nothing B could
    use. Now the tenant salts them where the upstream isolates tenants; without it, tenants share the
    upstream's cache, and its placement with it."""
    salts: list[str] = []
    real = routing_blocks
    monkeypatch.setattr(
        "gateway.backends.upstream.routing_blocks", lambda body, salt: salts.append(salt) or real(body, salt)
    )
    async with httpx.AsyncClient(timeout=10) as http:
        backend = OpenAIUpstreamBackend(
            "m", [r.base_url for r in fleet], client=http, retries=0, sleep=Sleeps(), routing="cache_aware",
            cache_salt=isolated,
        )  # fmt: skip
        try:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
            for tenant in ("alice", "bob"):
                await drain(backend.stream(chat_request(messages, prefix_key=f"k-{tenant}", tenant=tenant)))
        finally:
            await backend.close()
    assert salts == (["m\x00alice", "m\x00bob"] if isolated else ["m", "m"])


async def test_two_gateways_follow_a_spilled_conversation_through_redis(fleet):
    replicas = fleet
    by_url = {r.base_url: r.name for r in replicas}
    model = f"fleet-test-{uuid.uuid4().hex[:8]}"
    share = RoutingShareConfig(redis_url="redis://127.0.0.1:6379/0", interval_s=0.05, timeout_s=0.5)
    async with httpx.AsyncClient(timeout=10) as http:
        ga, gb = gateway(replicas, http, model, share), gateway(replicas, http, model, share)
        lone = gateway(replicas, http, model, None)  # a third gateway that shares nothing
        r0 = replicas[0].base_url
        kx = key_with_home(ga, r0, "x")
        walk = [by_url[u] for u in ga.upstream.ring.ring_order(kx)]
        assert walk[0] == "r0"
        try:
            x1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
            # 1. r0 is busy on gateway A (3 requests in flight: over the ring's bound ceil(1.25 * 4 / 3) = 2,
            # and 3 + 1 over the idle replicas passes the balance threshold 3): X spills.
            held = [ga.upstream.routing.pin(r0, "busy") for _ in range(3)]
            assert await send(ga, replicas, x1, kx) == walk[1]
            for lease in held:
                lease.release()
            # 2. Gateway A writes its placement, gateway B reads it (one exchange each: the staleness bound).
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            # 3. The next turn goes to gateway B: it follows the history to the spill replica, not home.
            x2 = x1 + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second"}]
            cached_before = sum(r.engine.cached_tokens for r in replicas)
            assert await send(gb, replicas, x2, kx) == walk[1]
            assert sum(r.engine.cached_tokens for r in replicas) - cached_before > len(SYSTEM) // 8
            # 4. A gateway without the shared index sends it home (where nothing of X is cached).
            assert await send(lone, replicas, x2, kx) == "r0"
            # 5. A new conversation goes home on both gateways (they agree without sharing anything).
            ky = key_with_home(ga, replicas[2].base_url, "y")
            y1 = [
                {"role": "system", "content": "Another system prompt. " * 30},
                {"role": "user", "content": "hi"},
            ]
            assert await send(gb, replicas, y1, ky) == "r2"
            assert await send(ga, replicas, y1 + [{"role": "user", "content": "more"}], ky) == "r2"
            policy = gb.upstream.routing
            assert isinstance(policy, CacheAwarePolicy) and policy.stats.by_match >= 1
            assert sum(ga.upstream.ring.inflight.values()) == sum(gb.upstream.ring.inflight.values()) == 0
            assert ga.routing_share.stats.errors == gb.routing_share.stats.errors == 0
        finally:
            forget_routing_keys(model)
            await ga.close()
            await gb.close()


async def test_redis_loss_degrades_to_the_local_view(fleet):
    replicas = fleet
    dead = RoutingShareConfig(
        redis_url="redis://127.0.0.1:1/0", interval_s=0.05, timeout_s=0.05, retry_after_s=60
    )
    async with httpx.AsyncClient(timeout=10) as http:
        g = gateway(replicas, http, "lost-redis", dead)
        key = key_with_home(g, replicas[1].base_url, "z")
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
        assert await send(g, replicas, msgs, key) == "r1"
        assert await g.routing_share.exchange() is False  # refused: counted, paused, nothing raised
        assert await g.routing_share.exchange() is False
        assert (g.routing_share.stats.errors, g.routing_share.stats.skipped) == (1, 1)
        # Routing goes on with the local index: the conversation stays where its history is.
        more = msgs + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
        assert await send(g, replicas, more, key) == "r1"
        await g.routing_share.close()


def test_kv_events_need_cache_aware():
    with pytest.raises(ValueError, match="cache_aware"):
        OpenAIUpstreamBackend(
            "m", ["http://127.0.0.1:9/v1"], routing="round_robin", kv_events=KVEventsConfig()
        )
    with pytest.raises(ValueError, match="unknown routing policy"):
        OpenAIUpstreamBackend("m", ["http://127.0.0.1:9/v1"], routing="random")
    with pytest.raises(ValueError, match="cache_aware settings"):
        OpenAIUpstreamBackend("m", ["http://127.0.0.1:9/v1"], cache_aware=CacheAwareConfig())


def test_cache_aware_settings_reach_the_policy():
    settings = CacheAwareConfig(
        index_blocks=670, cache_threshold=0.25, overlap_weight=2.0, balance_abs_threshold=1, load_weight=0.5
    )
    backend = OpenAIUpstreamBackend(
        "m", ["http://127.0.0.1:9/v1"], routing="cache_aware", cache_aware=settings
    )
    policy = backend.upstream.routing
    assert isinstance(policy, CacheAwarePolicy)
    assert (policy.approx.capacity_blocks, policy.cache_threshold, policy.overlap_weight) == (670, 0.25, 2.0)
    assert (policy.balance_abs_threshold, policy.load_weight) == (1, 0.5)


async def test_redis_cut_and_back_placements_are_kept_and_shared_later(fleet):
    replicas = fleet
    proxy = TcpProxy()
    await proxy.start()
    model = f"fleet-cut-{uuid.uuid4().hex[:8]}"
    share = RoutingShareConfig(
        redis_url=f"redis://127.0.0.1:{proxy.port}/0", interval_s=0.05, timeout_s=0.5, retry_after_s=0.05
    )
    async with httpx.AsyncClient(timeout=10) as http:
        ga, gb = gateway(replicas, http, model, share), gateway(replicas, http, model, share)
        try:
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            await proxy.cut()  # Redis is gone (every connection reset, the port refuses)
            kx = key_with_home(ga, replicas[0].base_url, "cut")
            held = [ga.upstream.routing.pin(replicas[0].base_url, "busy") for _ in range(3)]
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "while redis is down"}]
            placed = await send(ga, replicas, msgs, kx)  # routing works without Redis
            for lease in held:
                lease.release()
            assert placed != "r0"
            assert await ga.routing_share.exchange() is False  # failed: counted, placement kept
            assert ga.routing_share.stats.errors >= 1 and len(ga.routing_share._outbox) == 1
            await proxy.start()  # back on the same port
            await asyncio.sleep(0.06)  # past retry_after_s
            assert await ga.routing_share.exchange()  # the kept placement is written now
            # Gateway B's pooled connection was reset by the cut: its first exchange fails on it (counted),
            # the next one reconnects.
            for _ in range(3):
                if await gb.routing_share.exchange():
                    break
                await asyncio.sleep(0.06)
            assert gb.routing_share.stats.exchanges == 2
            more = msgs + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "and now?"}]
            assert await send(gb, replicas, more, kx) == placed  # gateway B learned it after the outage
        finally:
            forget_routing_keys(model)
            await ga.close()
            await gb.close()
            with contextlib.suppress(Exception):
                await proxy.cut()


async def test_a_failed_attempts_placement_is_retracted_from_the_shared_index(fleet):
    """A trial: a placement shared through Redis stayed there when its attempt failed, so other gateways
    credited the replica that had failed it with the prompt. Its blocks are now removed from the replica's
    shared set, after every placement queued before the retraction and before any queued after it."""
    replicas = fleet
    model = f"fleet-retract-{uuid.uuid4().hex[:8]}"
    share = RoutingShareConfig(redis_url="redis://127.0.0.1:6379/0", interval_s=0.05, timeout_s=0.5)
    async with httpx.AsyncClient(timeout=10) as http:
        ga, gb = gateway(replicas, http, model, share), gateway(replicas, http, model, share)
        policy = ga.upstream.routing
        assert isinstance(policy, CacheAwarePolicy)
        r0 = replicas[0].base_url
        others = [r.base_url for r in replicas if r.base_url != r0]
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a question"}]
        blocks = tuple(routing_blocks({"messages": msgs}, model))
        shared = redis.Redis()
        key = f"prefixgate:route:{model}:{r0}"
        try:
            # 1. Placed and written before its attempt failed (a read timeout): the set holds it, then not.
            lease = policy.acquire(RouteRequest(key="k", blocks=blocks), exclude=others)
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            assert shared.zcard(key) == len(blocks)
            assert gb.upstream.routing.approx.match(r0, blocks) == len(blocks)  # B read the placement
            lease.not_served()
            lease.release()
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            assert shared.zcard(key) == 0 and ga.routing_share.stats.retracted == 1
            # ... and forgets it once it reads the retraction (before: kept until its LRU dropped it)
            assert gb.upstream.routing.approx.match(r0, blocks) == 0
            assert gb.routing_share.stats.retractions_read == len(blocks)
            assert ga.routing_share.stats.retractions_read == 0  # its own: taken back at not_served

            # 2. Failed before any exchange (connection refused), then served there on a retry: the
            # retraction is written between the two placements, so the second stands.
            failed = policy.acquire(RouteRequest(key="k", blocks=blocks), exclude=others)
            failed.not_served()
            failed.release()
            policy.acquire(RouteRequest(key="k", blocks=blocks), exclude=others).release()
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            assert shared.zcard(key) == len(blocks) and ga.routing_share.stats.retracted == 2
            assert gb.upstream.routing.approx.match(r0, blocks) == len(blocks)  # the retry's placement stands
            assert policy.approx.match(r0, blocks) == len(blocks)
        finally:
            forget_routing_keys(model)
            await ga.close()
            await gb.close()
