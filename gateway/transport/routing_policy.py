"""Replica choice for one upstream: round robin, least load, consistent hashing with bounded load, cache-aware.

Protocol-blind: a request is a :class:`RouteRequest` (its prefix key and the chained hashes of its full
prompt blocks); nothing here knows HTTP, OpenAI or Anthropic. Every policy wraps today's replica ring
(``gateway.transport.affinity.AffinityRing``) through its public API only, so all four share one breaker (cool-down,
half-open probe), one in-flight count per replica and one :class:`~gateway.transport.affinity.Lease` type. A policy
that picks a replica itself pins the ring's walk to it with ``ring.acquire(key, exclude=<all others>)``.

Policies (``routing:`` per upstream; the reasoning and the anchors' parameters are in docs/routing.md):

- ``round_robin``: the next available replica in turn (the baseline the anchors report against).
- ``least_load``: the available replica with the fewest requests in flight (KubeAI "LeastLoad").
- ``consistent_hash``: the ring's bounded-load walk from the prefix key (Mirrokni et al. 2018; KubeAI's
  CHWBL "PrefixHash"): today's behaviour, unchanged.
- ``cache_aware``: among the replicas under the load bound ``ceil(c * (m + 1) / n)`` (the ring's
  ``capacity``) or within ``balance_abs_threshold`` requests of the least loaded one (SGLang router), if the
  best expected prefix match covers at least ``cache_threshold`` of the request (SGLang router, default 0.5),
  the one with the least ``overlap_weight * blocks to prefill + blocks pending + load_weight * in flight``
  there (Dynamo's KV router cost, temperature 0); otherwise the consistent-hash walk (to the first eligible
  replica within the real-valued bound ``c * (m + 1) / n`` when there is one), so gateways that share
  nothing but the load view still agree where a new prefix goes. The expected match comes from an approximate per-replica
  index of the block hashes routed there (LRU aged, bounded; llm-d's approximate prefix scorer), or, for a
  replica that publishes vLLM-style KV events, from the blocks it says it holds (llm-d's precise scorer,
  Dynamo's KV indexer).

Invariants:
- Whatever the index or the KV events say, a replica is only chosen while its in-flight count is under the
  ring's capacity or within ``balance_abs_threshold`` of the least loaded replica (or when it is the only
  candidate left), so a lying KV event stream cannot send one replica more than that bound allows.
- ``BlockIndex`` never holds more than ``capacity_blocks`` hashes per replica; the oldest go first.
- Block hashes are chained (each covers its parent), so "leading blocks present" is a prefix match.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.transport.affinity import AffinityRing, Lease, NoReplicaAvailable
from gateway.transport.block_index import BlockIndex

__all__ = [
    "POLICIES",
    "BlockIndex",
    "CacheAwarePolicy",
    "ConsistentHashPolicy",
    "KVEventError",
    "LeastLoadPolicy",
    "NoReplicaAvailable",
    "PendingLease",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingPolicy",
    "block_hashes",
    "make_policy",
    "text_block_hashes",
]

BLOCK_SIZE = 16
"""Tokens per block: vLLM's and this project's engine default (llm-d's ``DefaultBlockSizeTokens``)."""

CHARS_PER_BLOCK = 64
"""Characters per block when hashing text without a tokenizer: 16 tokens at llm-d's 4 characters per token."""


def _chain(parent: int, payload: bytes) -> int:
    digest = hashlib.blake2b(parent.to_bytes(8, "big") + payload, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def block_hashes(
    token_ids: Sequence[int], block_size: int = BLOCK_SIZE, salt: str = "", parent: int | None = None
) -> list[int]:
    """Chained 64-bit hashes of the full blocks of ``token_ids`` (a trailing partial block is not hashed).

    ``h[i] = blake2b(h[i-1] || token ids of block i as 4-byte big-endian)``, ``h[-1]`` = hash of ``salt`` (model
    id, tenant). Stable across processes (no seed), so every gateway and the fleet simulator's replicas compute
    the same chain for the same tokens. A real engine's KV events carry its own hashes (vLLM: sha256 over its
    own encoding); the ZeroMQ path maps them onto this chain through the token ids they carry.

    Args:
        token_ids: prompt token ids (ints >= 0).
        block_size: tokens per block (>= 1).
        salt: namespace of the chain.
        parent: continue the chain after this block hash (one this function returned) instead of starting at
            the salt's root; ``salt`` is then unused (the ZMQ KV event path maps an engine's stored blocks
            onto this chain: ``gateway.transport.kv_event_wire``).

    Returns:
        ``len(token_ids) // block_size`` ints in ``[0, 2**64)``.

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if parent is None:
        parent = _chain(0, salt.encode("utf-8"))
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        payload = b"".join(int(t).to_bytes(4, "big") for t in token_ids[start : start + block_size])
        parent = _chain(parent, payload)
        out.append(parent)
    return out


def text_block_hashes(text: str, chars_per_block: int = CHARS_PER_BLOCK, salt: str = "") -> list[int]:
    """Chained hashes of the full ``chars_per_block``-character blocks of ``text`` (no tokenizer needed).

    The approximate index's input where the gateway does not tokenize (llm-d's approximate prefix producer
    hashes characters the same way). Same chaining as :func:`block_hashes`.

    Raises:
        ValueError: ``chars_per_block < 1``.
    """
    if chars_per_block < 1:
        raise ValueError("chars_per_block must be >= 1")
    parent = _chain(0, salt.encode("utf-8"))
    out: list[int] = []
    for start in range(0, len(text) - chars_per_block + 1, chars_per_block):
        parent = _chain(parent, text[start : start + chars_per_block].encode("utf-8"))
        out.append(parent)
    return out


@dataclass(frozen=True)
class RouteRequest:
    """What routing needs of a request.

    Attributes:
        key: the prefix key (model id, tenant salt, hash of the stable segments); the ring hashes it.
        blocks: chained block hashes of the prompt (:func:`block_hashes` or :func:`text_block_hashes`), in order.
    """

    key: str
    blocks: tuple[int, ...] = ()


class KVEventError(ValueError):
    """A KV event batch that is not vLLM's shape (the stream is dropped, routing falls back to the index)."""


class RoutingPolicy:
    """Base: a ring (breaker, in-flight counts, bound) and the policy's ``choose``.

    Args:
        ring: the upstream's replica ring (names, load factor, cool-downs).
    """

    name = "base"
    wants_blocks = False
    """Whether ``acquire`` reads ``RouteRequest.blocks`` (callers skip hashing the prompt otherwise)."""
    has_homes = True
    """Whether a key goes to its home on the ring first, all else equal (``AffinityRing.keys_have_homes``)."""

    def __init__(self, ring: AffinityRing) -> None:
        self.ring = ring
        ring.keys_have_homes = self.has_homes

    @property
    def replicas(self) -> tuple[str, ...]:
        """Replica names in configuration order."""
        return self.ring.replicas

    def candidates(self, key: str, exclude: Iterable[str] = ()) -> list[str]:
        """Available replicas not in ``exclude``, in the key's ring order."""
        skip = set(exclude)
        return [r for r in self.ring.ring_order(key) if r not in skip and self.ring.is_available(r)]

    def pin(self, replica: str, key: str) -> Lease:
        """Count a request in flight on exactly ``replica`` (the ring's walk with every other one excluded)."""
        others = frozenset(r for r in self.ring.replicas if r != replica)
        return self.ring.acquire(key, exclude=others)

    def acquire(self, request: RouteRequest, exclude: Iterable[str] = ()) -> Lease:
        """Choose a replica for ``request`` and count it in flight; ``Lease.release`` when done.

        Raises:
            NoReplicaAvailable: every replica is in ``exclude``.
        """
        exclude = frozenset(exclude)
        if all(r in exclude for r in self.ring.replicas):
            raise NoReplicaAvailable(f"all {len(self.ring.replicas)} replica(s) failed for this request")
        available = self.candidates(request.key, exclude)
        if not available:
            # All down or probing: the ring probes the one whose cool-down ends first.
            return self.ring.acquire(request.key, exclude=exclude)
        return self.pin(self.choose(request, available), request.key)

    def choose(self, request: RouteRequest, available: list[str]) -> str:
        """The replica for ``request`` among ``available`` (non-empty, in the key's ring order)."""
        raise NotImplementedError

    def report_success(self, replica: str) -> None:
        """The replica answered: see ``AffinityRing.report_success``."""
        self.ring.report_success(replica)

    def report_failure(self, replica: str) -> None:
        """Connection error, timeout or 5xx: see ``AffinityRing.report_failure``."""
        self.ring.report_failure(replica)

    def replica_restarted(self, replica: str) -> None:
        """The replica lost its cache (restart); policies with an index forget it."""

    def replica_renewed(self, replica: str, keep: Sequence[int] = (), instance: str = "") -> None:
        """``replica`` answered as ``instance``, new to its URL (``gateway.transport.replica_instances``): its
        RAM cache started empty. Policies with an approximate index forget what they credited to it, bar
        ``keep`` (the block hashes of the request whose answer showed it: prefilled there now)."""


class RoundRobinPolicy(RoutingPolicy):
    """Each request to the next available replica in configuration order."""

    name = "round_robin"
    has_homes = False

    def __init__(self, ring: AffinityRing) -> None:
        super().__init__(ring)
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, available: list[str]) -> str:
        ordered = [r for r in self.ring.replicas if r in available]
        return ordered[next(self._counter) % len(ordered)]


class LeastLoadPolicy(RoutingPolicy):
    """The available replica with the fewest requests in flight; ties taken in turn (an idle fleet is not
    all sent to the first replica)."""

    name = "least_load"
    has_homes = False

    def __init__(self, ring: AffinityRing) -> None:
        super().__init__(ring)
        self._counter = itertools.count()

    def choose(self, request: RouteRequest, available: list[str]) -> str:
        least = min(self.ring.load(r) for r in available)
        tied = [r for r in self.ring.replicas if r in available and self.ring.load(r) == least]
        return tied[next(self._counter) % len(tied)]


class ConsistentHashPolicy(RoutingPolicy):
    """Consistent hashing with bounded loads on the prefix key: the ring's own walk, unchanged."""

    name = "consistent_hash"

    def acquire(self, request: RouteRequest, exclude: Iterable[str] = ()) -> Lease:
        return self.ring.acquire(request.key, exclude=frozenset(exclude))

    def choose(self, request: RouteRequest, available: list[str]) -> str:
        cap = self.ring.capacity(len(available))
        return next((r for r in available if self.ring.load(r) < cap), available[0])


@dataclass
class CacheAwareStats:
    """Counters of the cache-aware choice (for /admin/stats and the bench)."""

    by_match: int = 0
    by_ring: int = 0
    over_bound_skips: int = 0
    kv_batches: int = 0
    kv_errors: int = 0


class PendingLease:
    """A ring :class:`~gateway.transport.affinity.Lease` that also counts its prefill blocks as pending on the
    replica until the replica's first byte (its prefill is done then) or the release, whichever comes first.

    Reads like the ``Lease`` it wraps (``replica``, ``key``, ``home``, ``load``, ``capacity``, ``probe``);
    ``prefill_done`` and ``release`` are idempotent.
    """

    def __init__(
        self, lease: Lease, weight: int, policy: CacheAwarePolicy, added: tuple[int, ...] = ()
    ) -> None:
        self.lease = lease
        self.weight = weight
        self.added = added
        """The block hashes this lease's route added to the replica's approximate index (those past what it
        held before): ``not_served`` takes them back."""
        self._policy = policy
        self._pending = True
        self._released = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.lease, name)

    def prefill_done(self) -> None:
        """The replica sent its first byte: its prefill blocks are no longer pending (idempotent)."""
        if self._pending:
            self._pending = False
            pending = self._policy.pending_blocks
            pending[self.lease.replica] = pending.get(self.lease.replica, 0) - self.weight

    def not_served(self) -> None:
        """The replica failed this request (a connection error, a timeout, a 5xx, or an answer broken off: a
        replica killed mid-answer keeps nothing), so the blocks this route added to its approximate index are
        taken back (and, through ``on_unroute``, from the index other gateways share). Else the replica would
        seem to hold the retried request's whole prompt as well as the replica that served it, and, ahead in
        ring order, win the conversation's next turn back once it is up (found by a trial: a replica killed and
        restarted empty got the next turn with 0 of 184 tokens cached)."""
        self._policy.approx.remove(self.lease.replica, self.added)
        if self.added:
            for callback in self._policy.on_unroute:
                callback(self.lease.replica, self.added)
        self.added = ()

    def release(self) -> None:
        """Give the slot (and the pending blocks, if still counted) back (idempotent)."""
        if not self._released:
            self._released = True
            self.prefill_done()
            self.lease.release()


class CacheAwarePolicy(RoutingPolicy):
    """Longest expected prefix match under the load bound; the bounded-load ring walk otherwise.

    *Eligible* replicas: those under the ring's bound ``ceil(c * (m + 1) / n)``, and those within
    ``balance_abs_threshold`` requests of the least loaded available replica (SGLang's router: the cache
    decides unless the load gap passes an absolute threshold; at a handful of requests in flight the ring's
    bound alone is 1 or 2 per replica, and a spill costs a whole prefill, far more than queueing behind one
    cached request). Among the eligible, when the best expected match covers at least ``cache_threshold`` of
    the request's blocks, the replica with the least cost ``overlap_weight * (blocks to prefill there) +
    (blocks this gateway has pending there) + load_weight * (requests in flight there)`` (Dynamo's KV router
    cost with temperature 0, plus a per-request term for the decode slots; ties in ring order), taken among
    the replicas holding some of the prefix whose load stays within the real-valued ``c * (m + 1) / n`` when
    there are any (the ring's bound rounds up, which at small ``m`` lets one replica reach 1.5 times the
    mean); otherwise the first eligible one in the key's ring order that stays within that real-valued
    bound, or the first eligible one when none does (consistent hashing with bounded load, the bound taken
    before its ceil), so gateways that share the load view agree on a new prefix, and new prefixes go to
    replicas with room (one that joined or restarted empty fills up) rather than to the busiest eligible. Pending blocks are the blocks each in-flight request
    has to prefill, counted until the replica's first byte (``PendingLease.prefill_done``) or the lease's
    release.

    No replica ever takes a request while it holds ``max(ceil(c * (m + 1) / n), least load +
    balance_abs_threshold)`` or more (unless it is the only candidate left), whatever the index or the KV
    events say.

    Args:
        ring: the replica ring; its ``load_factor`` is the load bound ``c``.
        cache_threshold: least matched fraction of the request's blocks to follow the match (SGLang: 0.5).
        overlap_weight: weight of the prefill blocks against pending blocks (Dynamo: 1.0).
        index_capacity_blocks: hashes kept per replica by the approximate index (llm-d: 31,250); about the
            replica's prefix cache in blocks is best (the index then ages out what the replica evicts).
        use_kv_events: take the blocks a replica reports in KV events as its cache, once it has reported any.
        balance_abs_threshold: requests over the least loaded replica a replica may hold and still be
            eligible past the ring's bound (SGLang's ``balance_abs_threshold``, default 32 for its large
            batches; 3 here, measured in ``bench.fleet``: docs/routing.md).
        load_weight: blocks charged per request in flight on a replica (0: Dynamo's cost alone; 12 measured
            in ``bench.fleet`` over 16 workload seeds: docs/routing.md).

    Raises:
        ValueError: ``cache_threshold`` outside ``[0, 1]``, or ``overlap_weight``, ``load_weight`` or
            ``balance_abs_threshold`` below 0.
    """

    name = "cache_aware"
    wants_blocks = True

    def __init__(
        self,
        ring: AffinityRing,
        *,
        cache_threshold: float = 0.5,
        overlap_weight: float = 1.0,
        index_capacity_blocks: int = 31_250,
        use_kv_events: bool = False,
        balance_abs_threshold: int = 3,
        load_weight: float = 12.0,
    ) -> None:
        super().__init__(ring)
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if not overlap_weight >= 0.0:
            raise ValueError("overlap_weight must be >= 0")
        if not load_weight >= 0.0:
            raise ValueError("load_weight must be >= 0")
        if balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        self.cache_threshold = float(cache_threshold)
        self.overlap_weight = float(overlap_weight)
        self.balance_abs_threshold = int(balance_abs_threshold)
        self.load_weight = float(load_weight)
        self.pending_blocks: dict[str, int] = {}
        self.on_route: list[Callable[[str, tuple[int, ...]], None]] = []  # e.g. RoutingShare.record
        self.on_unroute: list[Callable[[str, tuple[int, ...]], None]] = []  # e.g. RoutingShare.retract
        self.on_renew: list[Callable[[str, tuple[int, ...], str], None]] = []  # e.g. RoutingShare.renewed
        self.use_kv_events = use_kv_events
        self.approx = BlockIndex(index_capacity_blocks)
        # Exact view from KV events: bounded like the approximate one (a lying stream cannot grow memory).
        self.exact = BlockIndex(index_capacity_blocks)
        self._reporting: set[str] = set()
        self.stats = CacheAwareStats()

    def expected_match(self, replica: str, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` expected cached on ``replica`` (exact view when it reports events)."""
        if self.use_kv_events and replica in self._reporting:
            return self.exact.match(replica, blocks)
        return self.approx.match(replica, blocks)

    def eligible(self, available: list[str]) -> list[str]:
        """The replicas of ``available`` that may take one more request (see the class docstring)."""
        loads = {r: self.ring.load(r) for r in available}
        cap = self.ring.capacity(len(available))
        floor = min(loads.values())
        return [r for r in available if loads[r] < cap or loads[r] + 1 - floor <= self.balance_abs_threshold]

    def mean_bound(self, available: list[str]) -> float:
        """The real-valued load bound ``c * (m + 1) / n`` (``m`` requests in flight on every replica, ``n``
        available replicas): the ring's ``capacity`` before its ceil, which at a few requests per replica
        lets one replica reach 1.5 to 2 times the mean."""
        total = sum(self.ring.load(r) for r in self.ring.replicas)
        return self.ring.load_factor * (total + 1) / len(available)

    def choose(self, request: RouteRequest, available: list[str]) -> str:
        under = self.eligible(available)
        limit = self.mean_bound(available)
        blocks = request.blocks
        if blocks:
            matches = {r: self.expected_match(r, blocks) for r in available}
            best = max(matches[r] for r in under)
            if max(matches.values()) > best:
                self.stats.over_bound_skips += 1
            if best > 0 and best >= self.cache_threshold * len(blocks):
                # Dynamo's cost: overlap weight x blocks to prefill there + blocks already pending there.
                rank = {r: i for i, r in enumerate(available)}
                self.stats.by_match += 1
                # Among the replicas that hold some of the prefix, prefer those within the real-valued bound.
                strict = [r for r in under if matches[r] > 0 and self.ring.load(r) + 1 <= limit]
                return min(
                    strict or under,
                    key=lambda r: (
                        self.overlap_weight * (len(blocks) - matches[r])
                        + self.pending_blocks.get(r, 0)
                        + self.load_weight * self.ring.load(r),
                        rank[r],
                    ),
                )
        # No replica holds enough of it: a new prefix (a miss wherever it goes). The ring walk from its key,
        # skipping the replicas past the real-valued bound: gateways that share the load view still agree,
        # and new prefixes (and later their turns) land on the replicas that have room, such as one that
        # just joined or restarted empty, instead of piling onto the holders of hot prefixes.
        self.stats.by_ring += 1
        return next((r for r in under if self.ring.load(r) + 1 <= limit), under[0])

    def acquire(self, request: RouteRequest, exclude: Iterable[str] = ()) -> PendingLease:  # type: ignore[override]
        lease = super().acquire(request, exclude)
        weight = len(request.blocks) - self.expected_match(lease.replica, request.blocks)
        added: tuple[int, ...] = ()
        if request.blocks:
            added = tuple(request.blocks[self.approx.match(lease.replica, request.blocks) :])
            self.approx.add(lease.replica, request.blocks)
            for callback in self.on_route:
                callback(lease.replica, request.blocks)
        self.pending_blocks[lease.replica] = self.pending_blocks.get(lease.replica, 0) + weight
        return PendingLease(lease, weight, self, added)

    def replica_restarted(self, replica: str) -> None:
        self.approx.clear(replica)
        self.exact.clear(replica)

    def replica_renewed(self, replica: str, keep: Sequence[int] = (), instance: str = "") -> None:
        """Forget the approximate index's blocks on ``replica`` but ``keep`` (see ``RoutingPolicy``), and tell
        ``on_renew`` (other gateways, through ``routing_share``). The exact view stays: a restart ends the
        replica's KV event stream (``kv_stream_lost`` clears it then), and what the new stream reported since
        is the new instance's."""
        self.approx.clear(replica)
        kept = tuple(keep)
        if kept:
            self.approx.add(replica, kept)
        for callback in self.on_renew:
            callback(replica, kept, instance)

    def kv_stream_lost(self, replica: str) -> None:
        """``replica``'s KV event stream ended: forget its exact view; the approximate index routes it until
        the stream is back (``gateway.transport.kv_events``)."""
        self._reporting.discard(replica)
        self.exact.clear(replica)

    def apply_kv_events(self, replica: str, batch: Mapping[str, object]) -> int:
        """Apply one vLLM-style ``KVEventBatch`` from ``replica`` to the exact view.

        Shape (vLLM ``vllm/distributed/kv_events.py``, as JSON): ``{"ts": float, "events": [event, ...]}`` with
        ``{"type": "BlockStored", "block_hashes": [int], "parent_block_hash": int | None, ...}``,
        ``{"type": "BlockRemoved", "block_hashes": [int]}`` or ``{"type": "AllBlocksCleared"}``.

        Returns:
            Number of events applied.

        Raises:
            KVEventError: ``replica`` is unknown or the batch is not that shape (nothing of it is applied).
        """
        if replica not in self.ring.replicas:
            self.stats.kv_errors += 1
            raise KVEventError(f"KV events from unknown replica {replica!r}")
        events = batch.get("events") if isinstance(batch, Mapping) else None
        if not isinstance(events, list):
            self.stats.kv_errors += 1
            raise KVEventError("KV event batch without an 'events' list")
        parsed: list[tuple[str, list[int]]] = []
        for event in events:
            kind = event.get("type") if isinstance(event, Mapping) else None
            if kind == "AllBlocksCleared":
                parsed.append((kind, []))
                continue
            hashes = event.get("block_hashes") if kind in ("BlockStored", "BlockRemoved") else None
            if not isinstance(hashes, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in hashes
            ):
                self.stats.kv_errors += 1
                raise KVEventError(f"bad KV event: {str(event)[:120]}")
            parsed.append((kind, hashes))
        for kind, hashes in parsed:
            if kind == "BlockStored":
                self.exact.add(replica, hashes)
            elif kind == "BlockRemoved":
                self.exact.remove(replica, hashes)
            else:
                self.exact.clear(replica)
        self._reporting.add(replica)
        self.stats.kv_batches += 1
        return len(parsed)


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobinPolicy, LeastLoadPolicy, ConsistentHashPolicy, CacheAwarePolicy)
}


def make_policy(name: str, ring: AffinityRing, **options: object) -> RoutingPolicy:
    """The policy called ``name`` over ``ring``; ``options`` go to ``CacheAwarePolicy`` only.

    Raises:
        ValueError: unknown ``name``, or options given to a policy that takes none.
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {sorted(POLICIES)}")
    if cls is CacheAwarePolicy:
        return CacheAwarePolicy(ring, **options)  # type: ignore[arg-type]
    if options:
        raise ValueError(f"routing policy {name!r} takes no options, got {sorted(options)}")
    return cls(ring)
