"""Prefix affinity over upstream replicas: consistent hashing with bounded loads, plus a per-replica breaker.

Source: V. Mirrokni, M. Thorup, M. Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018
(arXiv:1608.01350). Each replica owns ``vnodes`` points on a 64-bit hash ring. A prefix key hashes to a point;
its *home* is the first replica clockwise. With ``m`` requests in flight on the ``n`` available replicas, a
new request may only go to a replica whose in-flight count is below the capacity ``ceil(c * (m + 1) / n)``
(``c`` = ``load_factor`` > 1); otherwise it walks on clockwise to the next replica that is under capacity.
Because ``n * capacity >= c * (m + 1) > m``, some replica is always under capacity, and no replica ever holds
more than ``capacity`` requests at once.

Invariants:
- ``inflight[r]`` counts the leases of replica ``r`` that are not yet released; only ``acquire`` raises it and
  only ``Lease.release`` lowers it (once per lease), so it cannot drift.
- ``remote_load[r]`` is the in-flight count other gateways last reported for ``r`` (``routing_share``; empty
  when there is none or Redis is lost); the bound and every policy read ``load(r) = inflight[r] +
  remote_load[r]``, so several gateways sharing their counts bound a replica's total load, each within the
  staleness of the exchange.
- The ring depends only on the replica names (blake2b, no per-process seed): every gateway process routes the
  same prefix key to the same home replica.
- A replica is ``up``, ``down`` (until its cool-down ends; never chosen) or ``half_open`` (cool-down over: at
  most one probe request in flight; success -> ``up``, failure -> ``down`` with the cool-down doubled, up to
  ``max_cooldown_s``). Removing a replica from the candidates moves only the keys it was home to (and the
  spill of keys that overflowed onto it).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class NoReplicaAvailable(Exception):
    """Every replica of an upstream is excluded for this request. The gateway answers 503."""


def ring_hash(text: str) -> int:
    """64-bit position on the ring: the first 8 bytes of blake2b(text), big-endian (stable across
    processes)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


@dataclass
class ReplicaHealth:
    """Breaker state of one replica. Times are ``clock()`` seconds."""

    state: str = "up"  # "up" | "down" | "half_open"
    down_until: float = 0.0
    cooldown_s: float = 0.0
    probe_inflight: bool = False
    failures: int = 0


@dataclass
class Lease:
    """One request's claim on a replica. Release exactly once (``release`` is idempotent).

    Attributes:
        replica: the chosen replica (its name, e.g. a base URL).
        key: the prefix key it was chosen for.
        home: the key's home replica (first on the ring); ``replica != home`` means it spilled or failed over.
        load: in-flight requests on ``replica`` including this one, at acquire time.
        capacity: the bound ``ceil(c * (m + 1) / n)`` at acquire time (``load <= capacity`` always holds for a
            replica chosen under the bound).
        probe: this request is the half-open probe of a recovering replica.
    """

    replica: str
    key: str
    home: str
    load: int
    capacity: int
    probe: bool
    _ring: AffinityRing = field(repr=False)
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        if not self._released:
            self._released = True
            self._ring._release(self)


class AffinityRing:
    """Consistent hashing with bounded loads over named replicas, with failure cool-downs.

    Args:
        replicas: distinct replica names (base URLs); at least one.
        vnodes: ring points per replica.
        load_factor: ``c`` of the paper, > 1 (1.25 keeps every replica within 25 % of the average load).
        cooldown_s: seconds a failed replica is skipped before its half-open probe.
        max_cooldown_s: cap of the doubling cool-down after repeated failures.
        clock: monotonic seconds (injectable for tests).

    Raises:
        ValueError: no replicas, duplicates, ``vnodes < 1`` or ``load_factor <= 1``.
    """

    def __init__(
        self,
        replicas: Sequence[str],
        *,
        vnodes: int = 160,
        load_factor: float = 1.25,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not replicas:
            raise ValueError("at least one replica is required")
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"duplicate replicas in {list(replicas)}")
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        if not load_factor > 1.0:
            raise ValueError("load_factor must be > 1 (the paper's c)")
        self.replicas: tuple[str, ...] = tuple(replicas)
        self.vnodes = vnodes
        self.load_factor = float(load_factor)
        self.cooldown_s = float(cooldown_s)
        self.max_cooldown_s = float(max_cooldown_s)
        self._clock = clock
        points = sorted(
            (ring_hash(f"{name}#{i}"), idx) for idx, name in enumerate(self.replicas) for i in range(vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [idx for _, idx in points]
        self.inflight: dict[str, int] = dict.fromkeys(self.replicas, 0)
        self.served: dict[str, int] = dict.fromkeys(self.replicas, 0)
        self.spilled: dict[str, int] = dict.fromkeys(self.replicas, 0)
        self.keys_have_homes = True
        """Whether the routing over this ring sends a key to its home first (False under ``round_robin`` and
        ``least_load``, which have no home): ``snapshot``'s ``away`` is None then."""
        self.remote_load: dict[str, int] = {}
        self.health: dict[str, ReplicaHealth] = {name: ReplicaHealth() for name in self.replicas}

    # ---- ring walk -------------------------------------------------------------------------------------
    def ring_order(self, key: str) -> list[str]:
        """All replicas in clockwise order from the key's point: ``[home, next, ...]``."""
        start = bisect.bisect_left(self._points, ring_hash(key))
        seen: list[str] = []
        n_points = len(self._points)
        for step in range(n_points):
            name = self.replicas[self._owners[(start + step) % n_points]]
            if name not in seen:
                seen.append(name)
                if len(seen) == len(self.replicas):
                    break
        return seen

    def home(self, key: str) -> str:
        """The key's home replica (ignoring load and health)."""
        return self.ring_order(key)[0]

    # ---- health ----------------------------------------------------------------------------------------
    def _refresh(self, name: str) -> ReplicaHealth:
        health = self.health[name]
        if health.state == "down" and self._clock() >= health.down_until:
            health.state = "half_open"
            health.probe_inflight = False
        return health

    def is_available(self, name: str) -> bool:
        """Up, or half-open with no probe in flight."""
        health = self._refresh(name)
        return health.state == "up" or (health.state == "half_open" and not health.probe_inflight)

    def report_success(self, name: str) -> None:
        """The replica answered (any status that is not its own fault): it is up again, cool-down reset."""
        health = self.health[name]
        health.state = "up"
        health.cooldown_s = 0.0
        health.failures = 0
        health.probe_inflight = False

    def report_failure(self, name: str) -> None:
        """Connection error, timeout or 5xx: skip the replica for a cool-down (doubled on each failure in a
        row)."""
        health = self.health[name]
        health.failures += 1
        health.cooldown_s = (
            self.cooldown_s if health.cooldown_s == 0.0 else min(health.cooldown_s * 2, self.max_cooldown_s)
        )
        health.state = "down"
        health.down_until = self._clock() + health.cooldown_s
        health.probe_inflight = False

    # ---- bounded-load choice -----------------------------------------------------------------------------
    def load(self, name: str) -> int:
        """Requests in flight on replica ``name``: this gateway's plus what other gateways last reported."""
        return self.inflight[name] + self.remote_load.get(name, 0)

    def capacity(self, n_available: int | None = None) -> int:
        """``ceil(c * (m + 1) / n)``: the most requests one replica may hold once a new one is admitted
        (``m``: requests in flight on every replica, other gateways' included, see ``load``)."""
        n = n_available if n_available is not None else sum(self.is_available(r) for r in self.replicas)
        n = max(n, 1)
        total = sum(self.inflight.values()) + sum(self.remote_load.values())
        return math.ceil(self.load_factor * (total + 1) / n)

    def acquire(self, key: str, exclude: frozenset[str] | set[str] = frozenset()) -> Lease:
        """Choose a replica for ``key`` and count the request in flight on it.

        Walks clockwise from the key's point over the available replicas not in ``exclude`` and takes the
        first one under capacity. When none is available (all down or probing), the non-excluded replica
        whose cool-down ends first is probed anyway, so a recovered upstream is never locked out.

        Raises:
            NoReplicaAvailable: every replica is in ``exclude``.
        """
        walk = self.ring_order(key)
        home = walk[0]
        order = [name for name in walk if name not in exclude]
        if not order:
            raise NoReplicaAvailable(f"all {len(self.replicas)} replica(s) failed for this request")
        available = [name for name in order if self.is_available(name)]
        if available:
            cap = self.capacity(len(available))
            chosen = next((name for name in available if self.load(name) < cap), available[0])
        else:
            chosen = min(order, key=lambda name: self.health[name].down_until)
            cap = self.capacity(1)
        health = self._refresh(chosen)
        probe = health.state != "up"
        if probe:
            health.state = "half_open"
            health.probe_inflight = True
        self.inflight[chosen] += 1
        self.served[chosen] += 1
        if chosen != home:
            self.spilled[chosen] += 1
        return Lease(
            replica=chosen,
            key=key,
            home=home,
            load=self.load(chosen),
            capacity=cap,
            probe=probe,
            _ring=self,
        )

    def _release(self, lease: Lease) -> None:
        self.inflight[lease.replica] -= 1
        health = self.health[lease.replica]
        if lease.probe and health.state == "half_open":
            # The probe ended without a verdict (e.g. the client went away): let another request probe.
            health.probe_inflight = False

    def snapshot(self) -> dict[str, dict[str, object]]:
        """Per replica: state, in-flight count, failures in a row, requests sent there (``requests``) and how
        many of them had another home replica (``away``: spilled by load or health; None where the routing has
        no homes, ``keys_have_homes``) (for /admin/stats; names only, no keys)."""
        return {
            name: {
                "state": self._refresh(name).state,
                "inflight": self.inflight[name],
                "failures": self.health[name].failures,
                "requests": self.served[name],
                "away": self.spilled[name] if self.keys_have_homes else None,
            }
            for name in self.replicas
        }
