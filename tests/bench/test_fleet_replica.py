"""The fleet simulator's stub replica and bench router over loopback (bench.fleet)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
import zmq
import zmq.asyncio

from bench.fleet.replica import EngineTiming, PrefixLRU, StubReplica
from bench.fleet.router import BenchRouter
from bench.fleet.run import percentile, single_cache_hit_rate
from bench.fleet.tokens import encode_chat
from gateway.transport.kv_event_wire import BlockRemoved, BlockStored, decode_batch, decode_seq
from gateway.transport.routing_policy import block_hashes

FAST = EngineTiming(time_scale=0.001)
SYSTEM = {"role": "system", "content": "You are a careful assistant. " + "alpha beta gamma delta " * 60}


def test_prefix_lru_counts_whole_blocks_and_keeps_one_token_to_compute():
    cache = PrefixLRU(capacity_tokens=64)
    ids = list(range(40))
    hashes = block_hashes(ids)
    assert cache.lookup(ids, hashes) == 0
    assert cache.insert(ids, hashes) == (hashes, [])
    assert cache.lookup(ids, hashes) == 32
    exact = list(range(32))
    assert (
        cache.lookup(exact, block_hashes(exact)) == 16
    )  # a fully cached prompt still computes its last block
    other = list(range(100, 164))
    stored, removed = cache.insert(other, block_hashes(other))
    assert (
        len(cache) == 4 and len(stored) == 4 and removed == hashes[::-1]
    )  # 4 blocks fit: a went, tail first


def test_prefix_lru_evicts_a_chain_tail_before_its_parent():
    cache = PrefixLRU(capacity_tokens=32)
    a = list(range(32))
    cache.insert(a, block_hashes(a))
    b = list(range(200, 216))
    _, removed = cache.insert(b, block_hashes(b))
    assert removed == [block_hashes(a)[1]]  # the tail of a, not its first block
    assert cache.lookup(a + [0], block_hashes(a + [0])) == 16


def test_single_cache_hit_rate_and_percentile():
    ids = list(range(64))
    assert single_cache_hit_rate([ids, ids], 1000) == pytest.approx(48 / 128)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([], 99) == 0.0


async def _chat(client: httpx.AsyncClient, url: str, messages: list[dict]) -> dict:
    r = await client.post(
        f"{url}/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    return r.json()


async def test_replica_reports_cached_tokens_and_publishes_kv_events():
    replica = StubReplica("r0", 4096, FAST)
    await replica.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            events: list[dict] = []

            async def follow() -> None:
                with contextlib.suppress(httpx.HTTPError):
                    async with client.stream("GET", f"{replica.base_url}/kv_events") as r:
                        async for line in r.aiter_lines():
                            if line:
                                events.append(json.loads(line))

            task = asyncio.create_task(follow())
            await asyncio.sleep(0.05)
            first = await _chat(client, replica.base_url, [SYSTEM, {"role": "user", "content": "one"}])
            n = first["usage"]["prompt_tokens"]
            assert n == len(encode_chat([SYSTEM, {"role": "user", "content": "one"}]))
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            second = await _chat(client, replica.base_url, [SYSTEM, {"role": "user", "content": "two"}])
            a = encode_chat([SYSTEM, {"role": "user", "content": "one"}])
            b = encode_chat([SYSTEM, {"role": "user", "content": "two"}])
            common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == common // 16 * 16 > 0
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            kinds = [e["type"] for batch in events for e in batch["events"]]
            assert kinds[0] == "AllBlocksCleared" and "BlockStored" in kinds
            stored = [
                h
                for b in events
                for e in b["events"]
                if e["type"] == "BlockStored"
                for h in e["block_hashes"]
            ]
            assert stored[: n // 16] == block_hashes(
                encode_chat([SYSTEM, {"role": "user", "content": "one"}])
            )
            bad = await client.post(f"{replica.base_url}/chat/completions", json={"messages": "x"})
            assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
            bad = await client.post(f"{replica.base_url}/chat/completions", content=b"{")
            assert bad.status_code == 400
    finally:
        await replica.kill()


def system_homed_on(router: BenchRouter, replica: str) -> dict:
    """A variant of SYSTEM whose prefix key (the system message: ``BenchRouter.route_request``) is homed on
    ``replica``. The replicas' names hold their free ports, so SYSTEM itself is homed on a given replica in
    only about a third of the runs."""
    for i in range(10_000):
        system = {"role": "system", "content": f"{SYSTEM['content']} v{i}"}
        if router.policy.ring.home(router.route_request([system]).key) == replica:
            return system
    raise AssertionError(f"no key homed on {replica}")


async def test_router_fails_over_before_the_first_byte_and_placements_follow_the_prefix():
    replicas = [StubReplica(f"r{i}", 4096, FAST) for i in range(3)]
    for r in replicas[:2]:
        await r.start()  # r2 is down: connections are refused
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            router = BenchRouter([r.base_url for r in replicas], "cache_aware", client)
            down = replicas[2].base_url
            # A prefix homed on the dead replica: refused there, answered by the next one. (With SYSTEM as is,
            # 45 % of the runs never tried the dead replica at all, and the failover went untested.)
            system = system_homed_on(router, down)
            first = await router.complete([system, {"role": "user", "content": "hi"}], 4)
            assert first.ok and first.cached_tokens == 0 and first.replica != down
            assert first.attempts == 2 and router.failovers == 1
            again = await router.complete([system, {"role": "user", "content": "hi again"}], 4)
            assert again.ok and again.replica == first.replica and again.cached_tokens > 0
            # Force the walk onto the dead replica: it is marked down and the request goes elsewhere.
            lease = router.policy.pin(down, "x")
            lease.release()
            outcomes = [await router.complete([{"role": "user", "content": f"q{i}"}], 2) for i in range(6)]
            assert all(o.ok for o in outcomes)
            assert all(o.replica != down for o in outcomes)
            assert router.policy.ring.health[down].state in ("down", "half_open", "up")
            await router.close()
    finally:
        for r in replicas:
            await r.kill()


async def test_replica_publishes_vllms_zmq_wire_format_with_token_ids():
    replica = StubReplica("z", 64, FAST, kv_zmq=True)  # 4 blocks of 16 tokens
    await replica.start()
    ctx = zmq.asyncio.Context()
    try:
        publisher = replica.kv_publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        ids = list(range(40))  # 2 full blocks
        engine = replica.engine
        assert engine is not None
        seq = engine.submit(ids, 1)
        while (await seq.out.get())[0] != "done":
            pass
        longer = list(range(56))  # the same 2 blocks, then one more
        seq = engine.submit(longer, 1)
        while (await seq.out.get())[0] != "done":
            pass
        other = list(range(500, 548))  # 3 new blocks: 2 of the 6 held are evicted
        seq = engine.submit(other, 1)
        while (await seq.out.get())[0] != "done":
            pass
        # Every batch of this life is in the replay buffer (the live PUB stream is tested in
        # tests/gateway/transport/test_kv_events_zmq.py).
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        frames = []
        while True:
            _, seq_frame, payload = await dealer.recv_multipart()
            if decode_seq(seq_frame) == -1:
                break
            frames.append((decode_seq(seq_frame), decode_batch(payload)))
        dealer.close(linger=0)
        assert [s for s, _ in frames] == [0, 1, 2]
        h_ids, h_longer, h_other = block_hashes(ids), block_hashes(longer), block_hashes(other)
        assert frames[0][1].events == (BlockStored(tuple(h_ids), None, tuple(ids[:32]), 16, medium="GPU"),)
        assert frames[1][1].events == (
            BlockStored((h_longer[2],), h_longer[1], tuple(longer[32:48]), 16, medium="GPU"),
        )
        stored, removed = frames[2][1].events
        assert stored == BlockStored(tuple(h_other), None, tuple(other), 16, medium="GPU")
        assert isinstance(removed, BlockRemoved) and len(removed.block_hashes) == 2
        assert set(removed.block_hashes) <= set(h_longer)
    finally:
        ctx.destroy(linger=0)
        await replica.kill()
