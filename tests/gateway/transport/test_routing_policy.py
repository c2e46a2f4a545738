"""Routing policies over an upstream's replicas (gateway.transport.routing_policy)."""

from __future__ import annotations

import math

import httpx
import pytest

from gateway.transport.affinity import AffinityRing
from gateway.transport.block_index import BlockIndex
from gateway.transport.retry import RetryPolicy
from gateway.transport.routing_policy import (
    CacheAwarePolicy,
    ConsistentHashPolicy,
    KVEventError,
    LeastLoadPolicy,
    NoReplicaAvailable,
    RoundRobinPolicy,
    RouteRequest,
    block_hashes,
    make_policy,
    text_block_hashes,
)
from gateway.transport.upstream_http import Upstream, open_response

REPLICAS = [f"http://replica-{i}:8000/v1" for i in range(4)]


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def ring(**kw) -> AffinityRing:
    return AffinityRing(REPLICAS, **kw)


def req(key: str, tokens: list[int] | None = None) -> RouteRequest:
    return RouteRequest(key=key, blocks=tuple(block_hashes(tokens or [])))


# ---- hashing and the index ---------------------------------------------------------------------------


def test_block_hashes_are_chained_and_skip_the_partial_block():
    a = block_hashes(list(range(40)))
    b = block_hashes(list(range(32)) + [999] * 8)
    assert len(a) == 2 and a == b  # 40 tokens: two full blocks; the partial third is not hashed
    c = block_hashes([1] + list(range(1, 32)))
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert block_hashes(list(range(32)), salt="tenant-b") != a
    assert block_hashes(list(range(15))) == []
    with pytest.raises(ValueError):
        block_hashes([1, 2], block_size=0)


def test_text_block_hashes_share_leading_blocks():
    base = "x" * 128
    assert text_block_hashes(base + "a" * 64)[:2] == text_block_hashes(base + "b" * 64)[:2]
    assert text_block_hashes(base + "a" * 64)[2] != text_block_hashes(base + "b" * 64)[2]
    assert text_block_hashes("short") == []


def test_block_index_is_bounded_and_ages_the_oldest_first():
    index = BlockIndex(capacity_blocks=4)
    index.add("r", [1, 2, 3])
    index.add("r", [7, 8])
    assert index.size("r") == 4
    # [1, 2, 3] were touched tail first, so 1 (the parent) is younger than 3; 3 went first.
    assert index.match("r", [1, 2, 3]) == 2
    assert index.match("r", [7, 8]) == 2
    index.remove("r", [1])
    assert index.match("r", [1, 2]) == 0  # a prefix match stops at the first missing block
    index.clear("r")
    assert index.size("r") == 0 and index.match("other", [1]) == 0


# ---- simple policies ---------------------------------------------------------------------------------


def test_round_robin_cycles_and_skips_a_down_replica():
    clock = Clock()
    policy = RoundRobinPolicy(ring(clock=clock))
    got = []
    for i in range(8):
        lease = policy.acquire(req(f"k{i}"))
        got.append(lease.replica)
        lease.release()
    assert got == REPLICAS * 2
    policy.report_failure(REPLICAS[1])
    got = []
    for i in range(6):
        lease = policy.acquire(req(f"k{i}"))
        got.append(lease.replica)
        lease.release()
    assert REPLICAS[1] not in got and set(got) == {REPLICAS[0], REPLICAS[2], REPLICAS[3]}


def test_least_load_takes_the_fewest_in_flight_and_rotates_ties():
    policy = LeastLoadPolicy(ring())
    leases = [policy.acquire(req("same")) for _ in range(8)]
    assert sorted(policy.ring.inflight.values()) == [2, 2, 2, 2]
    leases[0].release()
    assert policy.acquire(req("same")).replica == leases[0].replica
    idle = LeastLoadPolicy(ring())
    got = []
    for _ in range(8):  # one at a time: every replica is idle each time
        lease = idle.acquire(req("same"))
        got.append(lease.replica)
        lease.release()
    assert got == REPLICAS * 2


def test_consistent_hash_is_todays_ring_walk():
    a, b = ConsistentHashPolicy(ring()), ring()
    for i in range(50):
        lease = a.acquire(req(f"prefix-{i}"))
        assert lease.replica == b.home(f"prefix-{i}")
        lease.release()


def test_every_replica_excluded_raises():
    for name in ("round_robin", "least_load", "consistent_hash", "cache_aware"):
        policy = make_policy(name, ring())
        with pytest.raises(NoReplicaAvailable):
            policy.acquire(req("k"), exclude=set(REPLICAS))


def test_make_policy_rejects_unknown_names_and_stray_options():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", ring())
    with pytest.raises(ValueError, match="takes no options"):
        make_policy("round_robin", ring(), cache_threshold=0.3)
    with pytest.raises(ValueError):
        make_policy("cache_aware", ring(), cache_threshold=1.5)


# ---- cache-aware -------------------------------------------------------------------------------------

SYSTEM = list(range(1000, 1000 + 64))  # four blocks shared by a conversation


def test_cache_aware_sends_a_new_prefix_home_and_a_continuation_to_where_its_history_went():
    policy = CacheAwarePolicy(ring())
    home = policy.ring.home("sys")
    first = policy.acquire(req("sys", SYSTEM + list(range(16))))
    assert first.replica == home and policy.stats.by_ring == 1
    first.release()
    # Same key, but the history was placed elsewhere (e.g. by spill): the match wins over the home.
    other = next(r for r in REPLICAS if r != home)
    policy.approx.add(other, block_hashes(SYSTEM + list(range(48))))
    second = policy.acquire(req("sys", SYSTEM + list(range(48)) + list(range(16))))
    assert second.replica == other and policy.stats.by_match == 1
    second.release()
    assert policy.pending_blocks[other] == 0 and sum(policy.ring.inflight.values()) == 0


def test_cache_aware_below_threshold_follows_the_ring():
    policy = CacheAwarePolicy(ring(), cache_threshold=0.9)
    other = next(r for r in REPLICAS if r != policy.ring.home("k"))
    tokens = SYSTEM + list(range(64))
    policy.approx.add(other, block_hashes(tokens)[:4])  # half of the 8 blocks
    lease = policy.acquire(req("k", tokens))
    assert lease.replica == policy.ring.home("k")


def test_cache_aware_pending_blocks_spread_equal_matches():
    policy = CacheAwarePolicy(ring(load_factor=8.0))
    tokens = SYSTEM + list(range(64))
    hashes = block_hashes(tokens)
    a, b = REPLICAS[0], REPLICAS[2]
    policy.approx.add(a, hashes[:6])
    policy.approx.add(b, hashes[:6])
    first = policy.acquire(req("k", tokens))
    second = policy.acquire(req("k2", tokens[:96] + list(range(500, 532))))
    # Both share 6 blocks with either replica: 2 to prefill on each; the first request's 2 pending blocks
    # make the second one's cost 4 where the first went and 2 on the other.
    assert {first.replica, second.replica} == {a, b}
    first.prefill_done()  # the replica's first byte: its prefill is no longer pending
    assert policy.pending_blocks[first.replica] == 0
    third = policy.acquire(req("k3", tokens[:96] + list(range(600, 632))))
    assert third.replica == first.replica  # cost 2 there (its prefill is done), 4 where the second is pending
    first.release()
    first.release()  # idempotent, and the pending blocks are not given back twice
    assert policy.pending_blocks[first.replica] == third.weight
    second.release()
    third.release()
    assert set(policy.pending_blocks.values()) == {0}


def test_cache_aware_prefers_matching_replicas_within_the_real_valued_bound():
    policy = CacheAwarePolicy(ring())
    tokens = SYSTEM + list(range(64))
    hashes = block_hashes(tokens)
    a, b, c, d = REPLICAS
    policy.approx.add(a, hashes)  # all of it
    policy.approx.add(b, hashes[: len(hashes) * 3 // 4])  # three quarters
    held = [policy.pin(r, "busy") for r, n in ((a, 2), (b, 1), (c, 3), (d, 2)) for _ in range(n)]
    # m = 8 over 4: the ring's bound ceil(1.25 * 9 / 4) = 3 admits a (2 in flight, cost 0), but a third
    # request there is over 1.25 x 9 / 4 = 2.81; b (1 in flight, 2 after) holds three quarters and is within.
    lease = policy.acquire(req("k", tokens))
    assert lease.replica == b
    lease.release()
    assert policy.approx.match(b, hashes) == len(hashes)  # b holds all of it now
    for h in held:
        h.release()
    # With nothing in flight no replica is within the real-valued bound (1 > 1.25 / 4): the ring's bound
    # alone decides, and a and b tie at cost 0 (ring order).
    first = next(r for r in policy.ring.ring_order("k") if r in (a, b))
    assert policy.acquire(req("k", tokens)).replica == first


def test_cache_aware_new_prefix_walks_the_ring_past_replicas_over_the_real_valued_bound():
    policy = CacheAwarePolicy(ring())
    order = policy.ring.ring_order("new")
    held = [policy.pin(r, "busy") for r, n in zip(order, (2, 2, 0, 0), strict=True) for _ in range(n)]
    # m = 4 over 4: every replica is eligible (within 3 of the least loaded), but the real-valued bound is
    # 1.25 x 5 / 4 = 1.56: the key's home and the next one (2 in flight, 3 after) are past it, so the new
    # prefix (nothing matches) goes to the third replica of its ring walk, not home.
    assert policy.eligible(list(REPLICAS)) == list(REPLICAS)
    assert policy.mean_bound(order) == pytest.approx(1.5625)
    lease = policy.acquire(req("new", SYSTEM + list(range(16))))
    assert lease.replica == order[2] and policy.stats.by_ring == 1
    lease.release()
    for h in held:
        h.release()
    # Nothing in flight: no replica is within 1.25 / 4, and the walk falls back to the first eligible (home).
    assert policy.acquire(req("new", list(range(500, 532)))).replica == order[0]
    assert policy.stats.by_ring == 2


@pytest.mark.parametrize("threshold", [0, 3])
def test_lying_kv_events_cannot_exceed_the_load_bound(threshold):
    policy = CacheAwarePolicy(ring(), use_kv_events=True, balance_abs_threshold=threshold)
    liar = REPLICAS[2]
    tokens = SYSTEM + list(range(32))
    # The liar claims every block of every request, none of which was ever sent there.
    policy.apply_kv_events(
        liar, {"ts": 0.0, "events": [{"type": "BlockStored", "block_hashes": block_hashes(tokens)}]}
    )
    leases = []
    for i in range(40):
        total = sum(policy.ring.inflight.values())
        cap = math.ceil(policy.ring.load_factor * (total + 1) / len(REPLICAS))
        floor = min(policy.ring.inflight.values())
        before = policy.ring.inflight[liar]
        lease = policy.acquire(req(f"key-{i}", tokens))
        # Admitted only under the ring's bound or within the threshold of the least loaded replica.
        if lease.replica == liar:
            assert before < cap or before + 1 - floor <= threshold
        assert policy.ring.inflight[liar] <= max(cap, floor + threshold)
        leases.append(lease)
    # 40 in flight over 4: the liar holds exactly the most the bound admits, no more.
    assert policy.ring.inflight[liar] == max(policy.ring.inflight.values())
    assert policy.ring.inflight[liar] <= max(
        math.ceil(1.25 * 40 / 4), min(policy.ring.inflight.values()) + threshold
    )
    # With the ring's bound alone the liar fills up and the walk passes it; with the threshold the cost's
    # per-request term spreads the load before the liar reaches the bound.
    assert (policy.stats.over_bound_skips > 0) == (threshold == 0)
    for lease in leases:
        lease.release()
    assert sum(policy.ring.inflight.values()) == 0


def test_balance_threshold_keeps_a_cached_prefix_on_a_busy_replica_until_the_gap_passes_it():
    policy = CacheAwarePolicy(ring(), balance_abs_threshold=2, load_weight=0.0)
    tokens = SYSTEM + list(range(64))
    holder = REPLICAS[1]
    policy.approx.add(holder, block_hashes(tokens))
    # Nothing elsewhere: the ring's bound is ceil(1.25 * 1 / 4) = 1, yet the holder takes a second request
    # (gap 2 <= 2) and refuses a third (gap 3 > 2): that one follows the key's ring walk.
    first = policy.acquire(req("k", tokens))
    second = policy.acquire(req("k", tokens))
    assert first.replica == second.replica == holder
    third = policy.acquire(req("k", tokens))
    assert third.replica != holder
    assert third.replica == next(r for r in policy.ring.ring_order("k") if r != holder)
    for lease in (first, second, third):
        lease.release()
    # Without the threshold (0) the ring's bound alone decides: the second request already spills.
    strict = CacheAwarePolicy(ring(), balance_abs_threshold=0)
    strict.approx.add(holder, block_hashes(tokens))
    assert strict.acquire(req("k", tokens)).replica == holder
    assert strict.acquire(req("k", tokens)).replica != holder


def test_load_weight_breaks_an_equal_match_towards_fewer_requests_in_flight():
    policy = CacheAwarePolicy(ring(load_factor=8.0), load_weight=4.0)
    tokens = SYSTEM + list(range(64))
    a, b = REPLICAS[0], REPLICAS[3]
    policy.approx.add(a, block_hashes(tokens))
    policy.approx.add(b, block_hashes(tokens))
    busy = policy.pin(a, "busy")  # one request decoding on a (no pending prefill there)
    # Both hold every block: cost 0 + 0 + 4 x 1 on a, 0 on b.
    assert policy.acquire(req("k", tokens)).replica == b
    busy.release()


def test_cache_aware_rejects_negative_weights_and_thresholds():
    with pytest.raises(ValueError, match="load_weight"):
        CacheAwarePolicy(ring(), load_weight=-1.0)
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        CacheAwarePolicy(ring(), balance_abs_threshold=-1)


def test_kv_events_are_the_exact_view_and_removals_count():
    policy = CacheAwarePolicy(ring(), use_kv_events=True)
    hashes = block_hashes(SYSTEM)
    r = REPLICAS[1]
    assert (
        policy.apply_kv_events(r, {"ts": 1.0, "events": [{"type": "BlockStored", "block_hashes": hashes}]})
        == 1
    )
    assert policy.expected_match(r, hashes) == 4
    policy.apply_kv_events(r, {"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": hashes[2:3]}]})
    assert policy.expected_match(r, hashes) == 2
    policy.apply_kv_events(r, {"ts": 3.0, "events": [{"type": "AllBlocksCleared"}]})
    assert policy.expected_match(r, hashes) == 0
    # A replica that reports events is judged by them, not by what was routed there.
    policy.approx.add(r, hashes)
    assert policy.expected_match(r, hashes) == 0
    assert policy.expected_match(REPLICAS[0], hashes) == 0


@pytest.mark.parametrize(
    "batch",
    [
        {"events": "nope"},
        {"ts": 1.0},
        {"events": [{"type": "BlockStored", "block_hashes": ["a"]}]},
        {"events": [{"type": "BlockStored", "block_hashes": [True]}]},
        {"events": [{"type": "Unknown"}]},
        {"events": [{"type": "BlockStored", "block_hashes": [1]}, 5]},
    ],
)
def test_bad_kv_event_batches_are_refused_whole(batch):
    policy = CacheAwarePolicy(ring(), use_kv_events=True)
    with pytest.raises(KVEventError):
        policy.apply_kv_events(REPLICAS[0], batch)
    assert policy.exact.size(REPLICAS[0]) == 0 and policy.stats.kv_errors == 1
    with pytest.raises(KVEventError, match="unknown replica"):
        policy.apply_kv_events("http://nowhere/v1", {"events": []})


def test_replica_restart_forgets_its_index():
    policy = CacheAwarePolicy(ring())
    policy.approx.add(REPLICAS[0], [1, 2])
    policy.replica_restarted(REPLICAS[0])
    assert policy.approx.size(REPLICAS[0]) == 0


async def test_a_replica_that_failed_a_request_is_not_credited_with_its_prompt():
    """A trial: a conversation's home replica was killed, its next turn failed over to another replica, and once
    the home was back (restarted empty) the turn after went home again with nothing cached. The failed attempt
    had recorded the whole retried prompt on the home's index, a tie that ring order broke its way. Now the
    failed route's blocks are taken back: the home keeps what it held before, the replica that served the turn
    holds more, and the next turn goes there."""
    policy = CacheAwarePolicy(AffinityRing(REPLICAS[:2]))
    home = policy.ring.home("sys")
    other = next(r for r in REPLICAS[:2] if r != home)
    turn1 = SYSTEM + list(range(32))
    turn2 = turn1 + list(range(100, 132))
    turn3 = turn2 + list(range(200, 232))
    down = {home}

    def answer(request: httpx.Request) -> httpx.Response:
        if any(str(request.url).startswith(r) for r in down):
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, content=b"{}")

    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    upstream = Upstream(
        ring=policy.ring, timeout=httpx.Timeout(5.0), policy=RetryPolicy(retries=2), routing=policy
    )

    async def no_sleep(seconds: float) -> None:
        return None

    async def send(tokens: list[int]) -> str:
        def build(base_url: str) -> httpx.Request:
            return client.build_request("POST", f"{base_url}/chat/completions", content=b"{}")

        opened = await open_response(
            client, upstream, "sys", build, sleep=no_sleep, blocks=tuple(block_hashes(tokens))
        )
        replica = opened.lease.replica
        await opened.aclose()
        return replica

    down.clear()
    assert await send(turn1) == home
    down.add(home)
    assert await send(turn2) == other  # failed over
    assert policy.approx.match(home, block_hashes(turn2)) == len(block_hashes(turn1))  # what it held before
    assert policy.approx.match(other, block_hashes(turn2)) == len(block_hashes(turn2))
    down.clear()
    policy.ring.report_success(home)  # back up
    assert await send(turn3) == other  # the longer match, not the ring's home
    await client.aclose()


@pytest.mark.parametrize(
    "name, homes",
    [("round_robin", False), ("least_load", False), ("consistent_hash", True), ("cache_aware", True)],
)
def test_away_is_counted_only_where_keys_have_a_home_replica(name, homes):
    """A trial: ``away`` counted requests sent away from the key's ring home under ``round_robin`` and
    ``least_load`` too, which send nothing home: three of every four requests looked spilled on an idle fleet.
    It is None there now, and left out of ``/metrics``."""
    from gateway.service.metrics import _replica_metrics

    policy = make_policy(name, ring())
    for i in range(8):
        policy.acquire(RouteRequest(key=f"k{i}", blocks=())).release()
    snapshot = policy.ring.snapshot()
    assert sum(row["requests"] for row in snapshot.values()) == 8
    aways = [row["away"] for row in snapshot.values()]
    # an idle fleet: every key goes home where there is one
    assert aways == ([0] * len(REPLICAS) if homes else [None] * len(REPLICAS))
    families = {f.name: f for f in _replica_metrics({"m": {"replicas": snapshot}})}
    assert len(families["prefixgate_upstream_replica_away"].samples) == (len(REPLICAS) if homes else 0)
