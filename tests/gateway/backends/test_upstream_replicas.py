"""Prefix affinity over two real stub replicas (uvicorn on free ports): 100 requests over 10 prefixes, then
one replica is killed."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections import defaultdict

import httpx

from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.transport.affinity import AffinityRing
from tests.gateway.stub_upstreams import StubServer, StubState, openai_stub
from tests.gateway.upstream_helpers import Sleeps, chat_request, drain


def prefix_keys(ring: AffinityRing, per_replica: int = 5) -> list[str]:
    """``per_replica`` prefix keys homed on each replica of ``ring``, in draw order. The replicas' names hold
    their free ports, so the first ten keys of a fixed list are all homed on one replica about once in 1,100
    draws: that replica would then never be tried, and the failover checks below would test nothing."""
    keys: list[str] = []
    homed = dict.fromkeys(ring.replicas, 0)
    i = 0
    while len(keys) < per_replica * len(ring.replicas):
        key = hashlib.blake2b(f"system prompt {i}".encode(), digest_size=16).hexdigest()
        i += 1
        if homed[ring.home(key)] < per_replica:
            homed[ring.home(key)] += 1
            keys.append(key)
    return keys


IN_FLIGHT = (
    2  # with 2 replicas and c = 1.25, the bound ceil(1.25 * 2 / 2) = 2 admits 2 requests on one replica
)


class RecordingRing(AffinityRing):
    """An AffinityRing that keeps every lease it hands out."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leases = []

    def acquire(self, key, exclude=frozenset()):
        lease = super().acquire(key, exclude)
        self.leases.append(lease)
        return lease


async def send_all(backend: OpenAIUpstreamBackend, keys: list[str]) -> dict[str, set[str]]:
    """Send one request per key, ``IN_FLIGHT`` at a time; returns prefix key -> replicas that answered (by the
    name in the answer text, i.e. what the stub server itself says)."""
    gate = asyncio.Semaphore(IN_FLIGHT)
    placement: dict[str, set[str]] = defaultdict(set)

    async def one(key: str) -> None:
        async with gate:
            events = await drain(
                backend.stream(chat_request([{"role": "user", "content": "hi"}], prefix_key=key))
            )
            placement[key].add("".join(e.text for e in events[:-1]).split()[-1])

    await asyncio.gather(*(one(key) for key in keys))
    return placement


async def test_prefix_affinity_bounded_load_and_failover_on_real_sockets():
    states = [StubState("A", delay_s=0.02), StubState("B", delay_s=0.02)]
    servers = [StubServer(openai_stub(state)).start() for state in states]
    urls = [f"{server.base_url}/v1" for server in servers]
    name_of = dict(zip(urls, ["A", "B"], strict=True))
    try:
        async with httpx.AsyncClient() as http:
            ring = RecordingRing(urls, load_factor=1.25, cooldown_s=60.0)
            prefixes = prefix_keys(ring)
            backend = OpenAIUpstreamBackend("m", urls, ring=ring, client=http, retries=2, sleep=Sleeps())
            keys = [key for _ in range(10) for key in prefixes]
            random.Random(0).shuffle(keys)

            placement = await send_all(backend, keys)
            assert sum(len(s.requests) for s in states) == 100
            assert all(len(replicas) == 1 for replicas in placement.values()), (
                placement
            )  # one replica per prefix
            for key, replicas in placement.items():
                assert replicas == {name_of[ring.home(key)]}  # ... its home on the ring
            assert len(ring.leases) == 100 and all(lease.load <= lease.capacity for lease in ring.leases)
            assert max(s.max_inflight for s in states) <= IN_FLIGHT
            assert sum(ring.inflight.values()) == 0
            before = {key: next(iter(replicas)) for key, replicas in placement.items()}

            servers[1].stop()  # kill replica B: connections are refused from now on
            served_by_a = len(states[0].requests)
            after = await send_all(backend, [key for _ in range(3) for key in prefixes])
            for key, replicas in after.items():
                assert replicas == {"A"}
                if before[key] == "A":
                    assert ring.home(key) == urls[0]  # A's prefixes never moved
            moved = {key for key in prefixes if before[key] != "A"}
            assert moved == {key for key in prefixes if ring.home(key) == urls[1]}  # only B's prefixes moved
            assert len(moved) == 5  # B was home to some prefixes, so it was tried and failed
            assert len(states[0].requests) - served_by_a == 30  # every request answered, by A
            assert ring.snapshot()[urls[1]]["state"] == "down"
    finally:
        servers[0].stop()
        if servers[1]._thread.is_alive():
            servers[1].stop()
