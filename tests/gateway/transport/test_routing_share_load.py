"""Load shared by several gateways through Redis (127.0.0.1:6379): each gateway's bounded-load check sees the
others' requests in flight, within the staleness bound; losing Redis (or a stale peer) falls back to the
local view. Three stub replicas on loopback, the real upstream backend."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
import redis

from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.config.schema import RoutingShareConfig
from gateway.transport.routing_share import RoutingShare
from tests.gateway.transport.fleet_helpers import (
    SYSTEM,
    forget_routing_keys,
    gateway,
    key_with_home,
    send,
)


@pytest.mark.parametrize("routing", ["consistent_hash", "cache_aware"])
async def test_a_replica_busy_on_another_gateway_is_over_the_bound_here(fleet, routing):
    replicas = fleet
    by_url = {r.base_url: r.name for r in replicas}
    model = f"load-{uuid.uuid4().hex[:8]}"
    share = RoutingShareConfig(redis_url="redis://127.0.0.1:6379/0", interval_s=0.05, timeout_s=0.5)
    async with httpx.AsyncClient(timeout=10) as http:
        ga = gateway(replicas, http, model, share, routing)
        gb = gateway(replicas, http, model, share, routing)
        r0 = replicas[0].base_url
        key = key_with_home(gb, r0, "load")
        walk = [by_url[u] for u in gb.upstream.ring.ring_order(key)]
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
        try:
            # Gateway A holds 4 requests on r0; B alone would send the key home (0 in flight here).
            held = [ga.upstream.routing.pin(r0, "busy") for _ in range(4)]
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            assert gb.upstream.ring.remote_load == {r0: 4} and gb.routing_share.stats.gateways == 1
            # B's bound: ceil(1.25 * (4 + 1) / 3) = 3 and r0 holds 4 (A's), 5 over the idle replicas after
            # this one (past cache_aware's balance threshold 3): the request spills.
            assert await send(gb, replicas, msgs, key) == walk[1]
            # A releases; after one exchange each, B sees r0 free again and sends the key home.
            for lease in held:
                lease.release()
            assert await ga.routing_share.exchange() and await gb.routing_share.exchange()
            assert gb.upstream.ring.remote_load == {}
            other = [
                {"role": "system", "content": "A new conversation. " * 40},
                {"role": "user", "content": "q"},
            ]
            assert await send(gb, replicas, other, key) == "r0"
            assert ga.routing_share.stats.errors == gb.routing_share.stats.errors == 0
        finally:
            forget_routing_keys(model)
            await ga.close()
            await gb.close()


async def test_stale_or_lost_peers_fall_back_to_the_local_view(fleet):
    replicas = fleet
    model = f"stale-{uuid.uuid4().hex[:8]}"
    url = "redis://127.0.0.1:6379/0"
    async with httpx.AsyncClient(timeout=10) as http:
        ga = gateway(replicas, http, model, RoutingShareConfig(redis_url=url, interval_s=0.05), "least_load")
        gb = gateway(replicas, http, model, RoutingShareConfig(redis_url=url, interval_s=0.05), "least_load")
        r1 = replicas[1].base_url
        try:
            held = [ga.upstream.routing.pin(r1, "busy") for _ in range(3)]
            assert await ga.routing_share.exchange()
            # A peer whose last report is older than load_stale_s is not counted.
            late = RoutingShare(
                gb.upstream.routing,
                model,
                url=url,
                interval_s=0.05,
                load_stale_s=1.0,
                clock=lambda: time.time() + 5,
            )
            assert await late.exchange()
            assert gb.upstream.ring.remote_load == {} and late.stats.gateways == 0
            await late.close()
            assert await gb.routing_share.exchange()
            assert gb.upstream.ring.remote_load == {r1: 3}
            # least_load on B avoids r1 (3 in flight on A) ...
            assert gb.upstream.routing.acquire(_route("k")).replica != r1
            # ... until Redis is lost: B forgets the peers' load (local view) and never raises.
            gb.routing_share._client = redis.asyncio.Redis.from_url(
                "redis://127.0.0.1:1/0", socket_connect_timeout=0.05
            )
            assert await gb.routing_share.exchange() is False
            assert gb.upstream.ring.remote_load == {} and gb.routing_share.stats.errors == 1
            assert gb.upstream.ring.load(r1) == 0
            for lease in held:
                lease.release()
            # Closing A withdraws its field: nothing of it is left for the others to read.
            await ga.close()
            assert redis.Redis().hget(ga.routing_share.load_key(), ga.routing_share.gateway_id) is None
        finally:
            forget_routing_keys(model)
            await ga.close()
            await gb.close()


def _route(key: str):
    from gateway.transport.routing_policy import RouteRequest

    return RouteRequest(key=key, blocks=())


def test_malformed_peer_fields_are_ignored():
    ring_backend = OpenAIUpstreamBackend(
        "m", ["http://a/v1", "http://b/v1"], routing="round_robin", routing_share=RoutingShareConfig()
    )
    share = ring_backend.routing_share
    assert share is not None
    now = int(time.time() * 1000)
    fields = {
        b"bad-json": b"{",
        b"no-t": b'{"inflight": {"http://a/v1": 1}}',
        b"unknown-replica": f'{{"t": {now}, "inflight": {{"http://z/v1": 7}}}}'.encode(),
        b"negative": f'{{"t": {now}, "inflight": {{"http://a/v1": -4}}}}'.encode(),
        b"good": f'{{"t": {now}, "inflight": {{"http://b/v1": 2}}}}'.encode(),
        share.gateway_id.encode(): f'{{"t": {now}, "inflight": {{"http://a/v1": 9}}}}'.encode(),
    }
    assert share._remote_load(fields, now) == {"http://b/v1": 2}
    assert share._remote_load(None, now) == {}


class _Pipe:
    """A Redis pipeline whose ``execute`` fails while ``down`` (any command is queued and ignored)."""

    def __init__(self, owner: _Redis) -> None:
        self.owner = owner

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None

    async def execute(self):
        if self.owner.down:
            raise redis.ConnectionError("connection refused")
        return [1, True, {}]


class _Redis:
    def __init__(self) -> None:
        self.down = False

    def pipeline(self, transaction: bool = False) -> _Pipe:
        return _Pipe(self)


async def test_the_share_is_counted_logged_once_per_outage_and_exported(caplog):
    """A trial found a routing share that could not be observed: with Redis down, nothing in the log, the stats
    or the metrics. The counters are now in ``/admin/stats`` (``models[name]["routing_share"]``) and
    ``/metrics``, and an outage is logged once when it starts and once when Redis is back."""
    from gateway.service.metrics import _routing_share_metrics

    backend = OpenAIUpstreamBackend("shared", ["http://127.0.0.1:9/v1"], routing="least_load")
    fake = _Redis()
    backend.routing_share = RoutingShare(backend.upstream.routing, "shared", client=fake, retry_after_s=0.0)
    share = backend.routing_share
    assert await share.exchange() is True
    fake.down = True
    with caplog.at_level("INFO", logger="gateway.transport.routing_share"):
        assert await share.exchange() is False
        assert await share.exchange() is False
        fake.down = False
        assert await share.exchange() is True
    lines = [r.getMessage() for r in caplog.records]
    assert sum("Redis failed (ConnectionError)" in line for line in lines) == 1, lines
    assert sum("Redis reached again" in line for line in lines) == 1, lines
    stats = backend.routing_share_stats()
    assert (stats["exchanges"], stats["errors"], stats["up"]) == (2, 2, True)
    fake.down = True
    await share.exchange()
    metrics = {
        m.name: m
        for m in _routing_share_metrics({"shared": {"routing_share": backend.routing_share_stats()}})
    }
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for m in metrics.values() for s in m.samples
    }
    assert samples[("prefixgate_routing_share_total", (("counter", "errors"), ("model", "shared")))] == 3
    assert samples[("prefixgate_routing_share_up", (("model", "shared"),))] == 0
    # every counter of /admin/stats is in /metrics too (a trial: renewals_read was in the stats only)
    exported = {
        dict(labels)["counter"] for name, labels in samples if name == "prefixgate_routing_share_total"
    }
    assert exported == set(stats) - {"gateways", "up"}
    assert OpenAIUpstreamBackend("alone", ["http://127.0.0.1:9/v1"]).routing_share_stats() is None
