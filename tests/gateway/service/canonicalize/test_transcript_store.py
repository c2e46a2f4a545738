"""The Redis transcript store: shared between gateways through the real Redis on 127.0.0.1:6379 (a key
prefix unique to each test), and never an error to the caller when Redis is unreachable or slow."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest
import redis

from gateway.service.canonicalize.transcript_store import RedisTranscriptStore
from rules import load_ruleset
from rules.transcript import InProcessTranscriptStore, TranscriptMemory

DEFAULT = load_ruleset(["default"])


def turn(minute: int, n: int) -> list[dict]:
    messages = [
        {"role": "system", "content": f"Agent.\nCurrent time: 2026-12-01 10:{minute:02d}:00"},
        {"role": "user", "content": "task"},
    ]
    for i in range(n):
        messages += [
            {"role": "assistant", "content": f"step {i}"},
            {"role": "user", "content": f"result {i}"},
        ]
    return messages


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"prefixgate-test:{uuid.uuid4().hex}:"
    yield name
    client = redis.Redis(host="127.0.0.1", port=6379)
    keys = list(client.scan_iter(match=name + "*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_two_gateways_share_the_transcript_through_redis(prefix: str) -> None:
    one = RedisTranscriptStore(prefix=prefix)
    two = RedisTranscriptStore(prefix=prefix)
    first = DEFAULT.apply(turn(0, 0), memory=TranscriptMemory(one), scope="m\0t")
    second = DEFAULT.apply(turn(5, 1), memory=TranscriptMemory(two), scope="m\0t")  # another gateway
    assert second.messages[:2] == first.messages
    assert second.history.reused_turns == 1
    assert two.stats.redis_hits == 1 and one.stats.writes == 1 and two.stats.writes == 1
    assert len(two.local) == 2  # the entry from Redis is kept locally too
    ttl = redis.Redis(host="127.0.0.1", port=6379).pttl(
        next(iter(redis.Redis().scan_iter(match=prefix + "*")))
    )
    assert 0 < ttl <= one.local.ttl_s * 1000
    assert one.stats.errors == two.stats.errors == 0


def test_unreachable_redis_costs_no_request_and_is_counted() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    clock = [0.0]
    store = RedisTranscriptStore(url=f"redis://127.0.0.1:{port}/0", retry_after_s=30, clock=lambda: clock[0])
    memory = TranscriptMemory(store)
    first = DEFAULT.apply(turn(0, 0), memory=memory, scope="s")
    second = DEFAULT.apply(turn(1, 1), memory=memory, scope="s")
    assert second.messages[:2] == first.messages  # the in-process store still works
    assert store.stats.errors == 1 and store.stats.skipped >= 1  # one try, then Redis is left alone
    clock[0] = 31.0
    DEFAULT.apply(turn(2, 2), memory=memory, scope="s")
    assert store.stats.errors == 2


def test_slow_redis_times_out_and_is_counted() -> None:
    with socket.socket() as server:  # accepts connections, never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        store = RedisTranscriptStore(
            url=f"redis://127.0.0.1:{port}/0",
            socket_timeout_s=0.05,
            local=InProcessTranscriptStore(max_entries=10),
        )
        assert store.get_many([b"k" * 32]) == [None]
        store.put(b"k" * 32, b"value")
        assert store.stats.errors == 1 and store.stats.skipped == 1
        assert store.get_many([b"k" * 32]) == [b"value"]  # from the local store
        store.close()


def test_garbage_in_redis_is_a_miss(prefix: str) -> None:
    store = RedisTranscriptStore(prefix=prefix)
    memory = TranscriptMemory(store)
    first = DEFAULT.apply(turn(0, 0), memory=memory, scope="s")
    client = redis.Redis(host="127.0.0.1", port=6379)
    for key in client.scan_iter(match=prefix + "*"):
        client.set(key, b"garbage")
    fresh = RedisTranscriptStore(prefix=prefix)
    fresh_memory = TranscriptMemory(fresh)
    second = DEFAULT.apply(turn(0, 1), memory=fresh_memory, scope="s")
    assert second.history.reused_turns == 0 and fresh_memory.stats.rejected == 1
    assert second.messages[:2] == first.messages  # the stateless form: same values, same first turn
