"""Shared by the routing tests over stub replicas on loopback (tests/gateway/transport/test_routing_*.py,
test_kv_event_feed.py; the replicas fixture ``fleet`` is in conftest.py): a gateway's upstream backend, exact-placement helpers, and Redis
cleanup of a test model's routing keys."""

from __future__ import annotations

import httpx
import redis

from bench.fleet.replica import EngineTiming, StubReplica
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.config.schema import RoutingShareConfig
from tests.gateway.upstream_helpers import Sleeps, chat_request, drain

FAST = EngineTiming(time_scale=0.001)
SYSTEM = "You answer questions about the fleet. " + "Replicas keep their prefixes warm. " * 40


def key_with_home(backend: OpenAIUpstreamBackend, home: str, tag: str) -> str:
    """The first key ``{tag}-{i}`` whose home on the ring is ``home`` (placements below are then exact)."""
    return next(f"{tag}-{i}" for i in range(10_000) if backend.upstream.ring.home(f"{tag}-{i}") == home)


async def send(
    backend: OpenAIUpstreamBackend, replicas: list[StubReplica], messages: list[dict], key: str
) -> str:
    """Send one request; returns the name of the replica that served it (by its own served count)."""
    before = [r.engine.served for r in replicas]
    events = await drain(backend.stream(chat_request(messages, prefix_key=key)))
    assert events, "no events"
    served = [r.name for r, b in zip(replicas, before, strict=True) if r.engine.served == b + 1]
    assert len(served) == 1, served
    return served[0]


def gateway(
    replicas: list[StubReplica],
    http: httpx.AsyncClient,
    model: str,
    share: RoutingShareConfig | None,
    routing: str = "cache_aware",
) -> OpenAIUpstreamBackend:
    """One gateway's upstream backend over ``replicas`` (one retry, no real sleeps)."""
    return OpenAIUpstreamBackend(
        model,
        [r.base_url for r in replicas],
        client=http,
        retries=1,
        sleep=Sleeps(),
        routing=routing,
        routing_share=share,
    )


def forget_routing_keys(model: str) -> None:
    """Delete ``model``'s routing keys from the local Redis (what the shared index and load wrote)."""
    client = redis.Redis()
    for key in client.scan_iter(f"prefixgate:route:{model}:*"):
        client.delete(key)
