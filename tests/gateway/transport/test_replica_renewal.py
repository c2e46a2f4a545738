"""A replica that restarted between requests (no request of this gateway failed on it) is seen by the instance
name in its answers (``x-prefixgate-instance``), and the cache-aware index, here and in the gateways sharing it
through Redis, stops crediting it with what its old instance held (``gateway.transport.replica_instances``)."""

from __future__ import annotations

import uuid

import httpx
import redis

from gateway.backends.upstream import routing_blocks
from gateway.config.schema import RoutingShareConfig
from gateway.core.headers import INSTANCE_HEADER
from gateway.transport.affinity import AffinityRing
from gateway.transport.replica_instances import KNOWN_PER_REPLICA, ReplicaInstances
from gateway.transport.routing_policy import CacheAwarePolicy
from gateway.transport.routing_share import RoutingShare
from tests.gateway.transport.fleet_helpers import SYSTEM, forget_routing_keys, gateway, key_with_home, send

OTHER = "A different assistant for the billing desk. " * 30


def test_a_new_instance_name_at_a_url_is_a_restart():
    seen = ReplicaInstances()
    assert not seen.observe("u", {INSTANCE_HEADER: "aaaa"})  # the first answer: nothing to compare with
    assert not seen.observe("u", {INSTANCE_HEADER: "aaaa"})
    assert not seen.observe("u", {})  # vLLM, a provider: no header, no verdict
    assert seen.observe("u", {INSTANCE_HEADER: "bbbb"})
    assert seen.restarts == {"u": 1}
    assert not seen.observe("v", {INSTANCE_HEADER: "bbbb"})  # each URL on its own
    for bad in ("", "x" * 65, "a b", "a,b", "é"):
        assert not seen.observe("u", {INSTANCE_HEADER: bad})
    assert seen.restarts == {"u": 1}


def test_a_url_balancing_over_live_instances_is_no_restart_once_each_is_known():
    seen = ReplicaInstances()
    assert not seen.observe("svc", {INSTANCE_HEADER: "pod-a"})
    assert seen.observe("svc", {INSTANCE_HEADER: "pod-b"})  # new to the URL: counted once
    for _ in range(5):
        assert not seen.observe("svc", {INSTANCE_HEADER: "pod-a"})
        assert not seen.observe("svc", {INSTANCE_HEADER: "pod-b"})
    assert seen.restarts == {"svc": 1}
    for i in range(KNOWN_PER_REPLICA):  # the oldest names are forgotten past the bound
        seen.observe("svc", {INSTANCE_HEADER: f"n{i}"})
    assert seen.observe("svc", {INSTANCE_HEADER: "pod-a"})


def test_renewal_forgets_the_approximate_blocks_but_the_kept_ones_and_the_exact_view():
    policy = CacheAwarePolicy(AffinityRing(["r0", "r1"]))
    told: list[tuple[str, tuple[int, ...]]] = []
    policy.on_renew.append(lambda replica, kept, instance: told.append((replica, kept, instance)))
    policy.approx.add("r0", [1, 2, 3])
    policy.approx.add("r1", [1, 2])
    policy.exact.add("r0", [7, 8])
    policy.replica_renewed("r0", [9, 10], "beef")
    assert policy.approx.match("r0", [1, 2, 3]) == 0
    assert policy.approx.match("r0", [9, 10]) == 2
    assert policy.approx.match("r1", [1, 2]) == 2
    assert policy.exact.match("r0", [7, 8]) == 2  # the KV event stream's own business (kv_stream_lost)
    assert told == [("r0", (9, 10), "beef")]


A1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "conversation A"}]
C1 = [{"role": "system", "content": OTHER}, {"role": "user", "content": "conversation C"}]


async def place_a_and_b(g, replicas) -> str:
    """Conversation A served by r0 (its home), then B, sharing A's system prompt, by r1 (r0 held busy); returns
    A's prefix key."""
    r0, r1 = replicas[0].base_url, replicas[1].base_url
    ka = key_with_home(g, r0, "a")
    assert await send(g, replicas, A1, ka) == "r0"
    held = [g.upstream.routing.pin(r0, "busy") for _ in range(3)]
    b1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "conversation B"}]
    assert await send(g, replicas, b1, key_with_home(g, r1, "b")) == "r1"
    for lease in held:
        lease.release()
    return ka


async def restart_r0_and_serve_c(g, replicas) -> None:
    """r0 restarts empty; conversation C (another system prompt, home r0) is its new instance's first answer."""
    await replicas[0].kill()
    await replicas[0].start()
    assert await send(g, replicas, C1, key_with_home(g, replicas[0].base_url, "c")) == "r0"


async def test_a_restarted_replica_loses_its_credit_at_its_first_answer(fleet):
    """Conversation A on r0 and B on r1 share the system prompt. r0 restarts empty between requests. Before,
    A's next turn still went to r0 (credited with A's whole history) and found nothing cached; now the first
    answer of r0's new instance (to another conversation) clears its credit, and A's turn follows the shared
    system prompt to r1."""
    replicas = fleet
    async with httpx.AsyncClient(timeout=10) as http:
        g = gateway(replicas, http, f"renew-{uuid.uuid4().hex[:8]}", None)
        r0, r1 = replicas[0].base_url, replicas[1].base_url
        ka = await place_a_and_b(g, replicas)
        await restart_r0_and_serve_c(g, replicas)
        assert g.replicas()[r0]["restarts"] == 1 and g.replicas()[r1]["restarts"] == 0
        cached_before = replicas[1].engine.cached_tokens
        a2 = A1 + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "A again"}]
        assert await send(g, replicas, a2, ka) == "r1"
        assert replicas[1].engine.cached_tokens - cached_before > len(SYSTEM) // 8
        # What r0's new instance did serve stays credited to it.
        c2 = C1 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "C again"}]
        assert await send(g, replicas, c2, key_with_home(g, r1, "c2")) == "r0"
        await g.close()


async def test_a_renewal_reaches_the_gateways_sharing_the_index(fleet):
    """Gateway A sees r0's new instance; gateway B, which learned A's placements through Redis, forgets r0's
    credit at its next exchange, and r0's shared set keeps only what its new instance served."""
    replicas = fleet
    model = f"renew-share-{uuid.uuid4().hex[:8]}"
    share = RoutingShareConfig(redis_url="redis://127.0.0.1:6379/0", interval_s=0.05, timeout_s=0.5)
    async with httpx.AsyncClient(timeout=10) as http:
        ga, gb = gateway(replicas, http, model, share), gateway(replicas, http, model, share)
        r0 = replicas[0].base_url
        try:
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            ka = await place_a_and_b(ga, replicas)
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            a_blocks = routing_blocks({"messages": A1}, model)
            assert gb.upstream.routing.approx.match(r0, a_blocks) == len(a_blocks)

            await restart_r0_and_serve_c(ga, replicas)
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            c_blocks = routing_blocks({"messages": C1}, model)
            shared = redis.Redis()
            members = {int(m) for m in shared.zrange(f"prefixgate:route:{model}:{r0}", 0, -1)}
            assert members == set(c_blocks)
            assert gb.routing_share.stats.renewals_read == 1 and ga.routing_share.stats.renewals_read == 0
            assert gb.upstream.routing.approx.match(r0, a_blocks) == 0
            assert gb.upstream.routing.approx.match(r0, c_blocks) == len(c_blocks)
            a2 = A1 + [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "A again"}]
            assert await send(gb, replicas, a2, ka) == "r1"
            # A gateway that starts now reads the trimmed sets and takes the moment as known.
            gc = gateway(replicas, http, model, share)
            assert await gc.routing_share.exchange()
            assert gc.routing_share.stats.renewals_read == 0
            assert gc.upstream.routing.approx.match(r0, a_blocks) == 0
            assert gc.upstream.routing.approx.match(r0, c_blocks) == len(c_blocks)
            await gc.close()
        finally:
            forget_routing_keys(model)
            await ga.close()
            await gb.close()


def test_a_first_exchange_only_learns_the_renewal_moments():
    policy = CacheAwarePolicy(AffinityRing(["r0", "r1"]))
    share = RoutingShare(policy, "m", client=None)  # no exchange is made: the parser alone
    assert share._read_renewals({b"r0": b"5", b"gone": b"9", b"r1": b"junk"}) == {}
    assert share._read_renewals({b"r0": b"5"}) == {}
    assert share._read_renewals({b"r0": b"6", b"r1": b"3"}) == {"r0": 6, "r1": 3}
    assert share._read_renewals("not a mapping") == {}


async def test_one_restart_is_one_renewal_across_the_gateways(fleet):
    """A trial: each gateway that had known the old instance renewed the replica at its own first answer from
    the new one, and the later renewal erased what the first gateway had placed on the new instance since.
    Now a renewal names the instance: a gateway that read it knows the instance, and one that saw it before
    reading it renews without erasing anything (the shared hash already names that instance)."""
    replicas = fleet
    model = f"renew-once-{uuid.uuid4().hex[:8]}"
    share = RoutingShareConfig(redis_url="redis://127.0.0.1:6379/0", interval_s=0.05, timeout_s=0.5)
    async with httpx.AsyncClient(timeout=10) as http:
        ga, gb, gc = (gateway(replicas, http, model, share) for _ in range(3))
        r0 = replicas[0].base_url
        shared = redis.Redis()
        members = f"prefixgate:route:{model}:{r0}"
        try:
            for g in (ga, gb, gc):  # every gateway has had an answer from r0's first instance
                assert await send(g, replicas, A1, key_with_home(g, r0, "a")) == "r0"
                assert await g.routing_share.exchange()
            await restart_r0_and_serve_c(ga, replicas)  # gateway A renews r0
            d1 = [{"role": "system", "content": "Dispatch desk. " * 60}, {"role": "user", "content": "D"}]
            assert await send(ga, replicas, d1, key_with_home(ga, r0, "d")) == "r0"
            assert await ga.routing_share.exchange()
            placed = {int(m) for m in shared.zrange(members, 0, -1)}
            d_blocks = set(routing_blocks({"messages": d1}, model))
            assert d_blocks <= placed
            # B reads A's renewal first: it knows the new instance, so its first answer from it is no restart
            assert await gb.routing_share.exchange()
            e1 = [{"role": "system", "content": OTHER}, {"role": "user", "content": "conversation E"}]
            assert await send(gb, replicas, e1, key_with_home(gb, r0, "c")) == "r0"
            assert gb.replicas()[r0]["restarts"] == 0
            d_chain = tuple(routing_blocks({"messages": d1}, model))
            assert gb.upstream.routing.approx.match(r0, d_chain) == len(d_chain)  # no renewal cleared it
            # C sees the new instance before reading the renewal: it renews its own index, erases nothing shared
            assert await send(gc, replicas, e1, key_with_home(gc, r0, "c")) == "r0"
            assert gc.replicas()[r0]["restarts"] == 1
            assert await gc.routing_share.exchange()
            assert d_blocks <= {int(m) for m in shared.zrange(members, 0, -1)}
            assert await ga.routing_share.exchange()
            assert ga.upstream.routing.approx.match(r0, d_chain) > 0
        finally:
            forget_routing_keys(model)
            for g in (ga, gb, gc):
                await g.close()


def test_malformed_shared_members_are_ignored():
    """What another process wrote under the routing keys is never trusted to be well formed."""
    policy = CacheAwarePolicy(AffinityRing(["r0"]))
    share = RoutingShare(policy, "m", client=None)
    policy.approx.add("r0", [1, 2])
    placed = [(b"3", 10.0), (b"not-a-hash", 11.0), (b"4",), "junk"]
    retracted = [(b"1:other-gateway", 12.0), (b"x:other", 12.0), (b"2", "late"), (b"3:other", 9.0), None]
    share._read_back("r0", placed, retracted, None)
    assert policy.approx.match("r0", [2]) == 1 and policy.approx.match("r0", [1]) == 0
    assert policy.approx.match("r0", [3]) == 1  # its placement (10) is later than the retraction (9)
    assert share.stats.read == 1 and share.stats.retractions_read == 1
    share._read_back("r0", "not a list", {"nor": "this"}, None)
    assert policy.approx.size("r0") == 2
