"""The ZeroMQ KV event feed against real PUB/ROUTER sockets on loopback (``bench.fleet.kv_zmq``, vLLM's wire
format): in-order batches reach the policy in the gateway's hashes, a gap is replayed (or, without a replay
socket, the view is dropped until an ``AllBlocksCleared``), malformed messages are counted and skipped, a lost
publisher drops the replica's exact view, and a late subscriber syncs only from a complete history. Then a
loopback gateway routes on a stub replica's ZeroMQ events."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import zmq
import zmq.asyncio

from bench.fleet.kv_zmq import ZmqKVPublisher
from bench.fleet.replica import EngineTiming, StubReplica
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.config.schema import KVEventsConfig
from gateway.transport.affinity import AffinityRing
from gateway.transport.kv_events_zmq import ZmqKVEventFeed
from gateway.transport.routing_policy import CacheAwarePolicy, block_hashes
from tests.gateway.transport.fleet_helpers import SYSTEM, key_with_home, send
from tests.gateway.upstream_helpers import Sleeps

FAST = EngineTiming(time_scale=0.001)
A, B = "http://a", "http://b"
TOKENS = list(range(1000, 1000 + 16 * 6))
MINE = block_hashes(TOKENS)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def stored(first: int, last: int) -> dict:
    """vLLM's BlockStored of blocks ``first..last`` of TOKENS (engine hashes 100 + i, chained by parent)."""
    return {
        "type": "BlockStored",
        "block_hashes": [100 + i for i in range(first, last + 1)],
        "parent_block_hash": 100 + first - 1 if first > 0 else None,
        "token_ids": TOKENS[first * 16 : (last + 1) * 16],
        "block_size": 16,
    }


def drop(publisher: ZmqKVPublisher, events: list[dict]) -> None:
    """A batch the PUB socket dropped (as at its high-water mark): buffered for replay, never sent live."""
    publisher.buffer.append((publisher.published, publisher.batch(events)))
    publisher.published += 1


async def setup(
    replay: bool = True, idle_replay_s: float = 0.2, **kwargs
) -> tuple[ZmqKVPublisher, ZmqKVEventFeed, CacheAwarePolicy]:
    publisher = ZmqKVPublisher(replay_port=0 if replay else None, **kwargs)
    await publisher.start()
    other = ZmqKVPublisher(replay_port=None)
    await other.start()
    policy = CacheAwarePolicy(AffinityRing([A, B]), use_kv_events=True)
    feed = ZmqKVEventFeed(
        policy,
        {A: publisher.endpoint, B: other.endpoint},
        replay_endpoints={A: publisher.replay_endpoint} if replay else None,
        replay_timeout_s=5.0,
        idle_replay_s=idle_replay_s,
    )
    feed._other = other  # closed by teardown
    return publisher, feed, policy


async def teardown(publisher: ZmqKVPublisher, feed: ZmqKVEventFeed) -> None:
    await feed.close()
    await publisher.close()
    await feed._other.close()


async def test_in_order_batches_reach_the_policy_in_the_gateways_hashes():
    publisher, feed, policy = await setup(layout="array")
    try:
        feed.start()
        await _until(lambda: feed.followers[A].synced)
        publisher.publish([stored(0, 2)])
        publisher.publish([stored(3, 4), {"type": "BlockRemoved", "block_hashes": [104]}])
        await _until(lambda: feed.stats.batches == 2)
        assert policy.expected_match(A, MINE) == 4 and policy.expected_match(B, MINE) == 0
        assert (feed.stats.refused, feed.stats.gaps, feed.stats.lost) == (0, 0, 0)
    finally:
        await teardown(publisher, feed)


async def test_a_gap_is_filled_from_the_replay_socket():
    publisher, feed, policy = await setup(idle_replay_s=60)  # no idle catch-up racing the gap
    try:
        feed.start()
        await _until(lambda: feed.followers[A].synced)
        publisher.publish([stored(0, 1)])
        drop(publisher, [stored(2, 3)])
        publisher.publish([stored(4, 5)])
        await _until(lambda: feed.stats.batches == 3)
        assert policy.expected_match(A, MINE) == 6
        assert (feed.stats.gaps, feed.stats.lost, feed.stats.replayed >= 1) == (1, 0, True)
        assert feed.followers[A].expected == 3
        snap = feed.snapshot()  # what /admin/stats shows
        assert (snap["gaps"], snap["batches"], snap["events"], snap["mapped_blocks"]) == (1, 3, 3, 6)
        assert snap["replays"] == feed.stats.replays >= 2 and snap["replicas"][A]["synced"]
    finally:
        await teardown(publisher, feed)


async def test_without_replay_a_gap_drops_the_view_until_the_cache_is_cleared():
    publisher, feed, policy = await setup(replay=False)
    try:
        feed.start()
        await _until(lambda: feed.stats.connects == 2)
        # No replay socket: the feed syncs on the first message of the publisher's life (seq 0).
        publisher.publish([stored(0, 1)])
        await _until(lambda: feed.stats.batches == 1)
        assert policy.expected_match(A, MINE) == 2
        drop(publisher, [stored(2, 3)])
        publisher.publish([stored(4, 5)])
        await _until(lambda: feed.stats.lost == 1)
        assert policy.exact.size(A) == 0 and feed.stats.unsynced == 1
        assert policy.expected_match(A, MINE) == 0  # the approximate index routes it now
        publisher.publish([{"type": "AllBlocksCleared"}, stored(0, 0)])
        await _until(lambda: feed.stats.batches == 2)
        assert policy.expected_match(A, MINE) == 1 and feed.followers[A].synced
    finally:
        await teardown(publisher, feed)


async def test_a_replay_socket_that_does_not_answer_makes_a_gap_a_lost_stream():
    publisher = ZmqKVPublisher(replay_port=None)
    await publisher.start()
    ctx = zmq.asyncio.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes replay requests, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    policy = CacheAwarePolicy(AffinityRing([A]), use_kv_events=True)
    feed = ZmqKVEventFeed(
        policy,
        {A: publisher.endpoint},
        replay_endpoints={A: f"tcp://127.0.0.1:{port}"},
        replay_timeout_s=0.2,
        idle_replay_s=60,
    )
    try:
        feed.start()
        await _until(lambda: feed.stats.replay_failures == 1)  # the catch-up on connecting
        publisher.publish([stored(0, 1)])  # seq 0: in sync without a replay
        await _until(lambda: feed.stats.batches == 1)
        drop(publisher, [stored(2, 3)])
        publisher.publish([stored(4, 5)])
        await _until(lambda: feed.stats.lost == 1)
        assert (feed.stats.gaps, feed.stats.replay_failures, feed.stats.unsynced) == (1, 2, 1)
        assert policy.exact.size(A) == 0 and not feed.followers[A].synced
    finally:
        await feed.close()
        await publisher.close()
        ctx.destroy(linger=0)


async def test_malformed_messages_are_counted_and_skipped():
    publisher, feed, policy = await setup(idle_replay_s=60)
    try:
        feed.start()
        await _until(lambda: feed.followers[A].synced)
        pub = publisher._pub
        assert pub is not None
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])  # seq 0, garbage
        await pub.send_multipart([b"other", (1).to_bytes(8, "big"), publisher.batch([stored(0, 0)])])
        await pub.send_multipart([b"", b"\x01"])
        await pub.send_multipart([b"", b"\x00\x01", b"x"])
        publisher.published = 1
        publisher.publish([stored(0, 2)])  # seq 1
        await _until(lambda: feed.stats.batches == 1)
        # Garbage at seq 0, another topic (the "" subscription lets it through), 2 frames, a 2-byte seq.
        assert feed.stats.refused == 4
        assert policy.expected_match(A, MINE) == 3 and feed.stats.lost == 0
    finally:
        await teardown(publisher, feed)


async def test_a_lost_publisher_drops_the_exact_view_and_a_restart_resyncs():
    publisher, feed, policy = await setup()
    try:
        feed.start()
        await _until(lambda: feed.followers[A].synced)
        publisher.publish([stored(0, 3)])
        await _until(lambda: policy.expected_match(A, MINE) == 4)
        await publisher.close()
        await _until(lambda: feed.stats.lost == 1)
        assert policy.exact.size(A) == 0 and not feed.followers[A].synced
        await publisher.start()  # a new life on the same ports: seq from 0, an empty cache
        await _until(lambda: feed.followers[A].synced)
        assert feed.stats.connects >= 3 and policy.expected_match(A, MINE) == 0
        publisher.publish([stored(0, 0)])
        await _until(lambda: policy.expected_match(A, MINE) == 1)
    finally:
        await teardown(publisher, feed)


async def test_a_late_subscriber_replays_the_whole_history():
    publisher, feed, policy = await setup()
    try:
        publisher.publish([stored(0, 1)])
        publisher.publish([stored(2, 4)])
        feed.start()
        await _until(lambda: feed.stats.batches == 2)
        assert policy.expected_match(A, MINE) == 5 and feed.followers[A].synced
    finally:
        await teardown(publisher, feed)


async def test_a_late_subscriber_without_the_whole_history_stays_approximate():
    publisher, feed, policy = await setup(buffer_steps=1)
    try:
        publisher.publish([stored(0, 1)])
        publisher.publish([stored(2, 4)])  # the buffer now starts at seq 1
        feed.start()
        await _until(lambda: feed.stats.unsynced == 1)
        assert not feed.followers[A].synced and policy.exact.size(A) == 0 and feed.stats.batches == 0
        publisher.publish([stored(5, 5)])  # still unsynced: its parent chain is unknown anyway
        await _until(lambda: feed.stats.unsynced == 2)
        assert policy.expected_match(A, MINE) == 0
    finally:
        await teardown(publisher, feed)


async def test_a_replayed_duplicate_is_skipped_and_an_unseen_restart_is_caught_by_its_message_0():
    policy = CacheAwarePolicy(AffinityRing([A, B]), use_kv_events=True)
    feed = ZmqKVEventFeed(policy, {A: "tcp://127.0.0.1:1", B: "tcp://127.0.0.1:2"})  # never started
    encoder = ZmqKVPublisher()
    follower = feed.followers[A]
    try:
        life1 = [encoder.batch([stored(0, 1)]), encoder.batch([stored(2, 3)])]
        follower.sequence(0, life1[0])
        follower.sequence(1, life1[1])
        follower.sequence(0, life1[0])  # the same message 0 again (a replay overlapping the live stream)
        assert (feed.stats.batches, feed.stats.duplicates, feed.stats.lost) == (2, 1, 0)
        assert policy.expected_match(A, MINE) == 4
        # A different message 0: the publisher restarted (its cache is empty) without a disconnect seen.
        follower.sequence(0, encoder.batch([stored(0, 0)]))
        assert (feed.stats.batches, feed.stats.lost) == (3, 1)
        assert policy.expected_match(A, MINE) == 1 and follower.expected == 1 and follower.synced
    finally:
        await feed.close()


def test_the_feeds_counters_are_on_admin_stats_and_metrics():
    from prometheus_client.parser import text_string_to_metric_families
    from starlette.testclient import TestClient

    from gateway.config.loader import parse_config
    from gateway.http.app import create_app

    urls = ["http://10.0.0.1/v1?k=1", "http://10.0.0.2/v1"]
    kv = {"transport": "zmq", "endpoints": ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"]}
    data = {
        "rules": [],
        "models": [
            {"name": "m", "backend": "openai", "base_url": urls, "routing": "cache_aware", "kv_events": kv},
            {"name": "plain", "backend": "openai", "base_url": "http://10.0.0.3/v1"},
        ],
    }
    app = create_app(parse_config(data))  # no lifespan: the feed never connects, the test drives it
    feed = app.state.gateway.registry.get("m").kv_feed
    assert isinstance(feed, ZmqKVEventFeed)
    client = TestClient(app)
    before = client.get("/admin/stats").json()["models"]
    assert "kv_events" not in before["plain"]
    assert before["m"]["kv_events"]["batches"] == 0 and before["m"]["kv_events"]["transport"] == "zmq"

    encoder = ZmqKVPublisher()
    follower = feed.followers[urls[0]]
    orphan = stored(4, 4)  # its parent (engine block 103) was never stored
    first = encoder.batch([stored(0, 1), orphan])
    follower.sequence(0, first)
    follower.sequence(0, first)  # a duplicate
    follower.sequence(1, b"\xc1 not msgpack")  # refused
    follower.sequence(3, encoder.batch([{"type": "BlockRemoved", "block_hashes": [100]}]))  # a gap: lost
    follower.sequence(4, encoder.batch([{"type": "AllBlocksCleared"}]))  # in sync again
    feed.followers[urls[1]].sequence(5, encoder.batch([stored(0, 0)]))  # joined late: unsynced too

    doc = client.get("/admin/stats").json()["models"]["m"]["kv_events"]
    counters = {k: doc[k] for k in ("batches", "events", "refused", "duplicates", "lost", "unsynced")}
    assert counters == {"batches": 2, "events": 2, "refused": 1, "duplicates": 1, "lost": 1, "unsynced": 2}
    assert (doc["gaps"], doc["replays"], doc["replay_failures"], doc["connects"]) == (0, 0, 0, 0)
    assert doc["mapped_blocks"] == 2 + 1 and doc["skipped_blocks"]["orphan"] == 1
    assert set(doc["skipped_blocks"]) == {
        "orphan",
        "block_size",
        "lora",
        "extra_keys",
        "other_medium",
        "other_group",
        "bad_length",
    }
    assert doc["replicas"] == {
        "http://10.0.0.1/v1": {"up": False, "synced": True, "next_seq": 5, "engine_blocks": 0},
        "http://10.0.0.2/v1": {"up": False, "synced": False, "next_seq": 6, "engine_blocks": 1},
    }
    assert "secret" not in json.dumps(doc)

    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    samples = {
        s.labels["counter"]: s.value
        for s in families["prefixgate_kv_events"].samples
        if s.labels["model"] == "m"
    }
    assert {k: samples[k] for k in counters} == counters
    skipped = {s.labels["reason"]: s.value for s in families["prefixgate_kv_event_blocks_skipped"].samples}
    assert skipped["orphan"] == 1
    synced = [
        s.value for s in families["prefixgate_kv_event_replicas"].samples if s.labels["state"] == "synced"
    ]
    assert synced == [1]


def test_an_upstream_with_zmq_kv_events_needs_one_endpoint_per_replica():
    urls = ["http://10.0.0.1/v1", "http://10.0.0.2/v1"]
    for endpoints, replay in ((("tcp://h:1",), ()), (("tcp://h:1", "tcp://h:2"), ("tcp://h:3",))):
        config = KVEventsConfig(transport="zmq", endpoints=endpoints, replay_endpoints=replay)
        with pytest.raises(ValueError, match="one endpoint"):
            OpenAIUpstreamBackend("m", urls, routing="cache_aware", kv_events=config)


def test_the_feed_needs_an_event_policy_and_every_endpoint():
    ring = AffinityRing([A, B])
    with pytest.raises(ValueError, match="use_kv_events"):
        ZmqKVEventFeed(CacheAwarePolicy(ring), {A: "tcp://127.0.0.1:1", B: "tcp://127.0.0.1:2"})
    with pytest.raises(ValueError, match="no KV event endpoint"):
        ZmqKVEventFeed(CacheAwarePolicy(ring, use_kv_events=True), {A: "tcp://127.0.0.1:1"})


async def test_a_gateway_routes_on_a_stub_replicas_zmq_events():
    replicas = [StubReplica(f"r{i}", 50_000, FAST, kv_zmq=True) for i in range(3)]
    for r in replicas:
        await r.start()
    config = KVEventsConfig(
        transport="zmq",
        endpoints=tuple(r.kv_publisher.endpoint for r in replicas),
        replay_endpoints=tuple(r.kv_publisher.replay_endpoint for r in replicas),
    )
    async with httpx.AsyncClient(timeout=10) as http:
        backend = OpenAIUpstreamBackend(
            "m",
            [r.base_url for r in replicas],
            client=http,
            retries=1,
            sleep=Sleeps(),
            routing="cache_aware",
            kv_events=config,
        )
        approx_only = OpenAIUpstreamBackend(
            "m", [r.base_url for r in replicas], client=http, retries=1, sleep=Sleeps(), routing="cache_aware"
        )
        policy = backend.upstream.routing
        feed = backend.kv_feed
        assert isinstance(policy, CacheAwarePolicy) and isinstance(feed, ZmqKVEventFeed)
        try:
            await backend.start()
            await _until(lambda: all(f.synced for f in feed.followers.values()))
            key = key_with_home(backend, replicas[0].base_url, "kvz")
            x1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
            # r1 computes X behind the gateway's back: only its ZeroMQ events say so.
            r = await http.post(
                f"{replicas[1].base_url}/chat/completions", json={"messages": x1, "max_tokens": 2}
            )
            assert r.status_code == 200
            blocks = backend.kv_hasher({"messages": x1})
            await _until(lambda: policy.expected_match(replicas[1].base_url, blocks) == len(blocks))
            assert policy.expected_match(replicas[0].base_url, blocks) == 0
            x2 = x1 + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "second"}]
            assert await send(backend, replicas, x2, key) == "r1"
            assert await send(approx_only, replicas, x2, key) == "r0"
            # r1 dies: its publisher's connection drops, its exact view is forgotten; back empty, it resyncs.
            await replicas[1].kill()
            await _until(lambda: feed.stats.lost >= 1)
            assert policy.exact.size(replicas[1].base_url) == 0
            await replicas[1].start()
            await _until(lambda: feed.followers[replicas[1].base_url].synced, timeout_s=15)
            assert policy.expected_match(replicas[1].base_url, blocks) == 0
            assert feed.stats.refused == 0
        finally:
            await backend.close()
            for r in replicas:
                await r.kill()


def test_zmq_sockets_are_the_real_library():
    # The wire helpers above run over libzmq itself (not a fake): the version the feed was built against.
    assert zmq.zmq_version_info() >= (4, 2) and zmq.asyncio.Context is not None
