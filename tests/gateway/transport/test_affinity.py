"""Consistent hashing with bounded loads and replica cool-downs (gateway.transport.affinity)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from gateway.transport.affinity import AffinityRing, NoReplicaAvailable, ring_hash

REPLICAS = [f"http://replica-{i}:8000/v1" for i in range(5)]
KEYS = [f"prefix-{i:04d}" for i in range(1000)]


class Clock:
    """A hand-driven monotonic clock (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ring_hash_is_stable_across_processes():
    # blake2b, not Python's seeded hash(): this exact value must never change
    assert ring_hash("prefix-0000") == int.from_bytes(
        __import__("hashlib").blake2b(b"prefix-0000", digest_size=8).digest(), "big"
    )


def test_same_key_same_replica_in_every_ring_instance():
    a, b = AffinityRing(REPLICAS), AffinityRing(list(REPLICAS))
    for key in KEYS[:200]:
        lease = a.acquire(key)
        assert lease.replica == lease.home == b.home(key)
        lease.release()
    assert sum(a.inflight.values()) == 0


def test_ring_spreads_keys_over_all_replicas():
    ring = AffinityRing(REPLICAS)
    counts = Counter(ring.home(key) for key in KEYS)
    assert set(counts) == set(REPLICAS)
    # 160 virtual nodes per replica: every share within 40 % of the mean (200)
    assert all(120 <= n <= 280 for n in counts.values()), counts


def test_loads_never_exceed_the_bound_under_concurrency():
    ring = AffinityRing(REPLICAS, load_factor=1.25)
    leases = []
    for key in ["one-hot-prefix"] * 40 + KEYS[:60]:  # a hot prefix plus background keys, all held at once
        lease = ring.acquire(key)
        assert lease.load <= lease.capacity
        leases.append(lease)
    m, n = len(leases), len(REPLICAS)
    assert max(ring.inflight.values()) <= math.ceil(1.25 * m / n)
    hot = [lease for lease in leases if lease.key == "one-hot-prefix"]
    # the hot prefix fills its home up to the bound, then spills clockwise
    assert Counter(lease.replica for lease in hot)[hot[0].home] >= 1
    assert any(lease.replica != lease.home for lease in hot)
    for lease in leases:
        lease.release()
    assert set(ring.inflight.values()) == {0}


def test_spill_goes_to_the_next_replica_on_the_ring():
    ring = AffinityRing(REPLICAS[:2], load_factor=1.25)
    key = "spilling-prefix"
    home, second = ring.ring_order(key)
    first = ring.acquire(key)  # m = 0: capacity ceil(1.25 * 1 / 2) = 1, home holds 0
    assert (first.replica, first.capacity) == (home, 1)
    again = ring.acquire(key)  # m = 1: capacity ceil(1.25 * 2 / 2) = 2, home holds 1 < 2
    assert (again.replica, again.capacity) == (home, 2)
    third = ring.acquire(key)  # m = 2: capacity ceil(1.25 * 3 / 2) = 2, home holds 2: next on the ring
    assert (third.replica, third.capacity) == (second, 2)
    for lease in (first, again, third):
        lease.release()


def test_a_failed_replica_moves_only_its_own_keys():
    clock = Clock()
    ring = AffinityRing(REPLICAS, clock=clock)
    before = {}
    for key in KEYS:
        lease = ring.acquire(key)
        before[key] = lease.replica
        lease.release()
    victim = REPLICAS[2]
    ring.report_failure(victim)
    moved = 0
    for key in KEYS:
        lease = ring.acquire(key)
        if before[key] == victim:
            assert lease.replica == ring.ring_order(key)[1]
            moved += 1
        else:
            assert lease.replica == before[key]
        lease.release()
    assert moved == sum(1 for r in before.values() if r == victim) > 0


def test_cooldown_half_open_probe_and_recovery():
    clock = Clock()
    ring = AffinityRing(REPLICAS[:2], cooldown_s=5.0, max_cooldown_s=12.0, clock=clock)
    key = next(k for k in KEYS if ring.home(k) == REPLICAS[0])
    ring.report_failure(REPLICAS[0])
    lease = ring.acquire(key)
    assert lease.replica == REPLICAS[1] and not lease.probe
    lease.release()

    clock.now += 5.0  # cool-down over: one probe may go
    probe = ring.acquire(key)
    assert probe.replica == REPLICAS[0] and probe.probe
    assert ring.snapshot()[REPLICAS[0]]["state"] == "half_open"
    other = ring.acquire(key)  # while the probe is in flight, others skip the replica
    assert other.replica == REPLICAS[1]
    other.release()

    ring.report_failure(REPLICAS[0])  # the probe failed: cool-down doubles to 10 s
    probe.release()
    clock.now += 9.9
    assert ring.acquire(key).replica == REPLICAS[1]
    clock.now += 0.1
    probe = ring.acquire(key)
    assert probe.probe
    ring.report_failure(REPLICAS[0])  # doubles again, capped at 12 s
    probe.release()
    assert ring.health[REPLICAS[0]].cooldown_s == 12.0

    clock.now += 12.0
    probe = ring.acquire(key)
    ring.report_success(REPLICAS[0])
    probe.release()
    assert {k: ring.snapshot()[REPLICAS[0]][k] for k in ("state", "inflight", "failures")} == {
        "state": "up",
        "inflight": 0,
        "failures": 0,
    }
    assert ring.acquire(key).replica == REPLICAS[0]


def test_a_probe_that_ends_without_verdict_frees_the_probe_slot():
    clock = Clock()
    ring = AffinityRing(REPLICAS[:2], cooldown_s=1.0, clock=clock)
    key = next(k for k in KEYS if ring.home(k) == REPLICAS[0])
    ring.report_failure(REPLICAS[0])
    clock.now += 1.0
    probe = ring.acquire(key)
    assert probe.probe
    probe.release()  # e.g. the client disconnected before the first byte
    assert ring.acquire(key).probe


def test_all_down_probes_the_one_that_recovers_first():
    clock = Clock()
    ring = AffinityRing(REPLICAS[:3], cooldown_s=5.0, clock=clock)
    for name in REPLICAS[:3]:
        ring.report_failure(name)
        clock.now += 1.0
    lease = ring.acquire("any-key")
    assert lease.replica == REPLICAS[0] and lease.probe


def test_excluding_every_replica_raises():
    ring = AffinityRing(REPLICAS[:2])
    with pytest.raises(NoReplicaAvailable):
        ring.acquire("k", exclude=set(REPLICAS[:2]))


def test_release_is_idempotent():
    ring = AffinityRing(REPLICAS[:2])
    lease = ring.acquire("k")
    lease.release()
    lease.release()
    assert sum(ring.inflight.values()) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"replicas": []},
        {"replicas": ["a", "a"]},
        {"replicas": ["a"], "vnodes": 0},
        {"replicas": ["a"], "load_factor": 1.0},
    ],
)
def test_bad_arguments(kwargs):
    replicas = kwargs.pop("replicas")
    with pytest.raises(ValueError):
        AffinityRing(replicas, **kwargs)


def test_snapshot_counts_requests_per_replica_and_those_sent_away_from_home():
    ring = AffinityRing(REPLICAS[:2], load_factor=1.25)
    key = "spilling-prefix"
    home, second = ring.ring_order(key)
    leases = [ring.acquire(key) for _ in range(3)]  # as above: the third spills to the next replica
    assert [lease.replica for lease in leases] == [home, home, second]
    snapshot = ring.snapshot()
    assert (snapshot[home]["requests"], snapshot[home]["away"]) == (2, 0)
    assert (snapshot[second]["requests"], snapshot[second]["away"]) == (1, 1)
