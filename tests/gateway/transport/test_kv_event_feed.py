"""The gateway's exact path: an upstream with ``kv_events`` follows its replicas' KV event streams (the fleet
stubs publish vLLM-style batches) into the cache-aware index, hashes requests as the engine does, routes on
what a replica says it holds, falls back to the approximate view when a stream is lost, and refuses garbage."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.fleet.replica import EngineTiming, StubReplica
from bench.fleet.tokens import encode_chat
from gateway.backends.kv_blocks import KVBlockHasher
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.config.schema import KVEventsConfig
from gateway.transport.affinity import AffinityRing
from gateway.transport.kv_events import KVEventFeed
from gateway.transport.routing_policy import CacheAwarePolicy, block_hashes
from tests.gateway.transport.fleet_helpers import SYSTEM, key_with_home, send
from tests.gateway.upstream_helpers import Sleeps

FAST = EngineTiming(time_scale=0.001)


def test_the_hasher_computes_the_stub_engines_hashes():
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    hasher = KVBlockHasher(KVEventsConfig())
    assert hasher({"model": "m", "messages": messages}) == tuple(block_hashes(encode_chat(messages)))
    assert hasher("not a body") == () and hasher({"messages": "x"}) == ()
    # An Anthropic body's top-level system is the first message.
    anthropic = {"system": SYSTEM, "messages": messages[1:]}
    assert hasher(anthropic) == hasher({"messages": messages})


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_prefix_computed_behind_the_gateways_back_is_found_through_kv_events():
    replicas = [StubReplica(f"r{i}", 50_000, FAST) for i in range(3)]
    for r in replicas:
        await r.start()
    async with httpx.AsyncClient(timeout=10) as http:
        backend = OpenAIUpstreamBackend(
            "m",
            [r.base_url for r in replicas],
            client=http,
            retries=1,
            sleep=Sleeps(),
            routing="cache_aware",
            kv_events=KVEventsConfig(),
        )
        approx_only = OpenAIUpstreamBackend(
            "m", [r.base_url for r in replicas], client=http, retries=1, sleep=Sleeps(), routing="cache_aware"
        )
        policy = backend.upstream.routing
        assert isinstance(policy, CacheAwarePolicy) and backend.kv_feed is not None
        try:
            await backend.start()
            await _until(lambda: backend.kv_feed.stats.connects == 3)
            key = key_with_home(backend, replicas[0].base_url, "kv")
            x1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
            # r1 computes X without the gateway (another client, a warm-up): only its events say so.
            r = await http.post(
                f"{replicas[1].base_url}/chat/completions", json={"messages": x1, "max_tokens": 2}
            )
            assert r.status_code == 200
            blocks = backend.kv_hasher({"messages": x1})
            await _until(lambda: policy.expected_match(replicas[1].base_url, blocks) == len(blocks))
            assert policy.expected_match(replicas[0].base_url, blocks) == 0
            # The next turn goes where the events say X is, not to its home (the approximate view's choice).
            x2 = x1 + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "second"}]
            cached = replicas[1].engine.cached_tokens
            assert await send(backend, replicas, x2, key) == "r1"
            assert replicas[1].engine.cached_tokens - cached >= len(blocks) * 16 - 16
            assert await send(approx_only, replicas, x2, key) == "r0"
            # r1 dies: its stream ends, its exact view is dropped (the approximate index routes it meanwhile).
            await replicas[1].kill()
            await _until(lambda: backend.kv_feed.stats.lost >= 1)
            assert policy.exact.size(replicas[1].base_url) == 0
            # Back empty: it reconnects and says AllBlocksCleared; X is no longer expected there.
            await replicas[1].start()
            await _until(lambda: backend.kv_feed.stats.connects >= 4, timeout_s=15)
            assert policy.expected_match(replicas[1].base_url, blocks) == 0
            assert backend.kv_feed.stats.refused == 0
        finally:
            await backend.close()
            for r in replicas:
                await r.kill()


def test_the_feed_refuses_garbage_lines_whole():
    ring = AffinityRing(["http://a", "http://b"])
    policy = CacheAwarePolicy(ring, use_kv_events=True)
    feed = KVEventFeed(policy, lambda: httpx.AsyncClient(), max_line_bytes=200)
    good = '{"ts": 1, "events": [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": null}]}'
    assert feed.apply_line("http://a", good)
    for bad in (
        "not json",
        "[1, 2]",
        '{"events": [{"type": "BlockStored", "block_hashes": ["x"]}]}',
        '{"events": [{"type": "BlockStored", "block_hashes": [' + ",".join(["1"] * 100) + "]}]}",
    ):
        assert not feed.apply_line("http://a", bad)
    assert not feed.apply_line("http://z", good)  # unknown replica
    assert (feed.stats.batches, feed.stats.refused) == (1, 5)
    assert policy.exact.size("http://a") == 2
    assert feed.snapshot() == {  # what /admin/stats shows under models[name]["kv_events"]
        "transport": "http",
        "connects": 0,
        "batches": 1,
        "events": 1,
        "refused": 5,
        "lost": 0,
    }
    with pytest.raises(ValueError, match="use_kv_events"):
        KVEventFeed(CacheAwarePolicy(ring), lambda: httpx.AsyncClient())
