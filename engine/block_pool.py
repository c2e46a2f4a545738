"""The block pool: bookkeeping of the ``num_blocks`` physical KV blocks and the prefix-cache index over them.

Structure (after vLLM v1's ``block_pool.py`` and SGLang's ``radix_cache.py``; no tensors here, only ids):

- ``blocks[i]`` is the ``KVBlock`` describing physical block ``i`` of the preallocated KV tensor.
- ``_cached``: block hash -> the one block registered under it (the prefix-cache index).
- ``_free``: unreferenced blocks that hold no hash, FIFO.
- ``_evictable``: unreferenced *entries* (blocks that hold a hash, or a partial entry), in LRU order (oldest
  first); an ``OrderedDict`` keyed by block id, so taking a block out of the middle is O(1).
- ``_children``: (parent entry's ``cache_gen`` or None for a first block, the block's own encoded extra keys)
  -> the entries chained right after it, full or partial, in registration order: where a lookup that stops
  inside a block looks for a sibling sharing the longest token prefix (``children``).

A *partial entry* is a request's last, partly filled block kept when the request ends (``register_partial``):
its first ``len(token_ids) < block_size`` slots hold computed KV. It holds no block hash (so it is never a
parent, never written down to a KV tier, never listed), is found only through ``_children``, and is only ever
read: a request that hits it gets a fresh block with the shared slots copied in (copy-on-write).

Invariants (checked by ``check_invariants``; every operation keeps them and costs O(blocks touched)):

1. Every block is in exactly one state:
   *used*   ``ref_cnt > 0`` (in no queue; may or may not hold a hash),
   *cached* ``ref_cnt == 0`` and is an entry: holds a hash, or is a partial entry (in ``_evictable``),
   *free*   ``ref_cnt == 0`` and is no entry (in ``_free``).
   Hence ``blocks_used + blocks_cached + blocks_free == num_blocks`` always.
2. Who holds a reference: each request whose block table lists the block, and each pin that lists it,
   holds exactly one reference (``KVCacheManager`` takes and drops them); nothing else does. The pool never evicts, overwrites or
   re-hashes a block with ``ref_cnt > 0``.
3. A block with ``ref_cnt == 0`` and a hash stays cached and reusable (a prefix hit takes it back out of
   ``_evictable``) until it is evicted, dropped (``drop_unreferenced_cached``, which takes the unreferenced
   entries chained on what it drops with it) or, once stale (its parent entry gone), replaced by the same
   block registered on a live parent (``register``).
4. Fresh blocks come from ``_free`` first; only when it is empty is the least recently used block of
   ``_evictable`` evicted (its hash entry dropped, ``evictions`` incremented). ``on_evict``, when set, sees
   every evicted *full* block (hash, tokens, levels, id) right before it is cleared, while its KV is still
   intact: the tiers write it down from there. A partial entry is evicted like the others but never shown
   to ``on_evict``.
5. ``release`` queues blocks in the order given; ``KVCacheManager.free`` passes a block table tail first,
   so a chain's tail is less recently used than its parents and is evicted before them.
6. ``_cached[h].block_hash == h`` for every entry, and a block holds a hash iff it is an entry of
   ``_cached``. ``cache_gen`` is unique per registration, so a child can name the exact parent entry it
   was computed on (see ``kv_cache_manager``).
7. Every entry (full or partial) is in ``_children`` under its own (``parent_gen``, encoded extra keys), and
   nothing else is; a partial entry has ``0 < len(token_ids) < block_size`` (the pool does not know the block
   size: the manager checks it) and no hash.

Counters (kept by the structure, so they cannot drift): ``evictions`` (monotonic, partial entries included),
``blocks_used``, ``blocks_cached``, ``blocks_free``, ``num_blocks``, ``partial_entries``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from engine.block_hash import BlockHash, encode_extra_keys

ChildKey = tuple[int | None, bytes]
"""Key of ``BlockPool._children``: the parent entry's ``cache_gen`` (None for a first block) and the child's own
encoded extra keys (``engine.block_hash.encode_extra_keys``), so tenants never share a sibling list."""


@dataclass(slots=True, eq=False)
class KVBlock:
    """Metadata of one physical KV block (the KV values live in the model runner's tensor, by block_id).

    Attributes:
        block_id: index of the block in the KV tensor, ``0 <= block_id < num_blocks``.
        ref_cnt: number of live requests whose block table lists this block.
        block_hash: the prefix-cache key the block is registered under, or None (private, free, or a partial
            entry).
        token_ids: the block's ``block_size`` token ids, stored when registered (compared on every hit); for a
            partial entry its fewer computed tokens.
        parent_hash: hash of the previous block in its chain (None for a first block).
        extra_keys: extra keys it was hashed with (model id, cache salt, ...).
        cache_gen: unique number of this registration (None when not registered).
        parent_gen: ``cache_gen`` of the parent entry this block's KV was computed on (None for a first
            block).
        levels: prompt levels (``engine.kv_tiers.policy.LEVELS``) of the requests that used it; they choose
            its TTL and budget share in the tiers below the pool.
        partial: True for a partial entry (see the module docstring).
        released_at: the pool's ``release_seq`` when the block last became an unreferenced entry (its place in
            the LRU order; 0 before).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: BlockHash | None = None
    extra_keys: tuple = ()
    cache_gen: int | None = None
    parent_gen: int | None = None
    levels: frozenset[str] = frozenset()
    partial: bool = False
    released_at: int = 0

    @property
    def is_entry(self) -> bool:
        """True when the block is a prefix-cache entry: registered under a hash, or a partial entry."""
        return self.block_hash is not None or self.partial

    def clear_hash(self) -> None:
        """Forget the cache registration (the block becomes plain storage)."""
        self.partial = False
        self.block_hash = None
        self.token_ids = None
        self.parent_hash = None
        self.extra_keys = ()
        self.cache_gen = None
        self.parent_gen = None
        self.levels = frozenset()


class BlockPool:
    """Reference counts, the free queue, the LRU queue of evictable cached blocks and the hash index.

    Args:
        num_blocks: physical blocks in the pool (>= 1).

    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[KVBlock] = deque(self.blocks)
        self._evictable: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        self._children: dict[ChildKey, dict[int, KVBlock]] = {}
        self.partial_entries = 0
        """Partial entries now in the pool (referenced or not)."""
        self._next_gen = 0
        self.blocks_used = 0
        self.evictions = 0
        self.allocations = 0
        """Blocks handed out by ``allocate`` so far (monotonic): the pool's turnover (``engine.pool_turnover``)."""
        self.release_seq = 0
        """Entries that became unreferenced so far (monotonic): each one's ``KVBlock.released_at``."""
        self.on_evict: Callable[[KVBlock], None] | None = None
        """Called with each cached block right before eviction clears it (the tiers' write-back)."""

    # ---- gauges -------------------------------------------------------------------------------------
    @property
    def blocks_cached(self) -> int:
        """Unreferenced entries, full or partial (evictable)."""
        return len(self._evictable)

    @property
    def blocks_free(self) -> int:
        """Unreferenced blocks holding no hash."""
        return len(self._free)

    def num_available(self) -> int:
        """Blocks a fresh allocation can get now: free + evictable."""
        return len(self._free) + len(self._evictable)

    # ---- prefix-cache index ---------------------------------------------------------------------------
    def get_cached(self, block_hash: BlockHash) -> KVBlock | None:
        """The block registered under ``block_hash``, or None. Takes no reference, keeps LRU order."""
        return self._cached.get(block_hash)

    def is_registered(self, block: KVBlock) -> bool:
        """True when ``block`` is the index entry for its own hash."""
        return block.block_hash is not None and self._cached.get(block.block_hash) is block

    def register(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: tuple[int, ...],
        parent_hash: BlockHash | None,
        parent_gen: int | None,
        extra_keys: tuple,
    ) -> bool:
        """Register a referenced, full, computed block under ``block_hash``.

        An unreferenced entry holding ``block_hash`` whose parent entry is gone (stale: no lookup reaches it, see
        ``engine.prefix_chain``) gives way when this block's own parent entry is live: it becomes free, and this
        block takes the hash. Otherwise such a stale entry would keep the hash until evicted, and the same
        block computed again on the live parent could never be cached.

        Returns:
            True when registered; False (and no change) when another block already holds ``block_hash``.

        Raises:
            ValueError: the block is unreferenced or already registered.
        """
        if block.ref_cnt < 1:
            raise ValueError(f"block {block.block_id} is not referenced; only a request's block is cached")
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already registered")
        existing = self._cached.get(block_hash)
        if existing is not None:
            if existing.ref_cnt > 0 or self.chain_is_live(existing.parent_hash, existing.parent_gen):
                return False
            if not self.chain_is_live(parent_hash, parent_gen):
                return False
            self._drop_entry(existing)
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_hash = parent_hash
        block.parent_gen = parent_gen
        block.extra_keys = extra_keys
        block.cache_gen = self._next_gen
        self._next_gen += 1
        self._cached[block_hash] = block
        self._add_child(block)
        return True

    def register_partial(
        self,
        block: KVBlock,
        token_ids: tuple[int, ...],
        parent_hash: BlockHash | None,
        parent_gen: int | None,
        extra_keys: tuple,
    ) -> None:
        """Make a referenced block whose first ``len(token_ids)`` slots are computed a partial entry under its
        parent entry (``parent_gen``); it stays referenced until its holder releases it.

        Raises:
            ValueError: the block is unreferenced or already an entry, or ``token_ids`` is empty.
        """
        if block.ref_cnt < 1:
            raise ValueError(f"block {block.block_id} is not referenced; only a request's block is kept")
        if block.is_entry:
            raise ValueError(f"block {block.block_id} is already a cache entry")
        if not token_ids:
            raise ValueError("a partial entry holds at least one token")
        block.partial = True
        block.token_ids = tuple(token_ids)
        block.parent_hash = parent_hash
        block.parent_gen = parent_gen
        block.extra_keys = tuple(extra_keys)
        block.cache_gen = self._next_gen
        self._next_gen += 1
        self.partial_entries += 1
        self._add_child(block)

    def children(self, parent_gen: int | None, extra_keys: tuple, limit: int) -> list[KVBlock]:
        """At most ``limit`` entries (full or partial) chained right after the parent entry ``parent_gen`` (None:
        first blocks) with these extra keys, newest first. Takes no reference. O(limit)."""
        kids = self._children.get((parent_gen, encode_extra_keys(extra_keys)))
        if not kids:
            return []
        return list(itertools.islice(reversed(kids.values()), limit))

    def drop_partial(self, block: KVBlock) -> None:
        """Un-register an unreferenced partial entry now (a longer one replaces it); it becomes free.

        Raises:
            ValueError: not an unreferenced partial entry.
        """
        if not block.partial or block.ref_cnt != 0:
            raise ValueError(f"block {block.block_id} is not an unreferenced partial entry")
        self._drop_entry(block)

    def _child_key(self, block: KVBlock) -> ChildKey:
        return (block.parent_gen, encode_extra_keys(block.extra_keys))

    def _add_child(self, block: KVBlock) -> None:
        self._children.setdefault(self._child_key(block), {})[block.block_id] = block

    def _unregister(self, block: KVBlock) -> None:
        """Drop an entry from the indexes and clear it (no queue changes)."""
        key = self._child_key(block)
        kids = self._children[key]
        del kids[block.block_id]
        if not kids:
            del self._children[key]
        if block.partial:
            self.partial_entries -= 1
        else:
            del self._cached[block.block_hash]
        block.clear_hash()

    # ---- references -----------------------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one reference on each block; an unreferenced cached block leaves the LRU queue (a hit).

        Raises:
            ValueError: a block is unreferenced and not cached (a free block cannot be shared).
        """
        for block in blocks:
            if block.ref_cnt == 0:
                if not block.is_entry:
                    raise ValueError(f"block {block.block_id} is free, not cached; it cannot be shared")
                del self._evictable[block.block_id]
                self.blocks_used += 1
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` fresh blocks (ref_cnt 1, no hash): free blocks first, then evict LRU cached blocks.

        Raises:
            ValueError: fewer than ``n`` blocks are available (nothing changes).
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_available():
            raise ValueError(f"need {n} blocks, only {self.num_available()} available")
        out: list[KVBlock] = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                _, block = self._evictable.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        self.blocks_used += n
        self.allocations += n
        return out

    def _evict(self, block: KVBlock) -> None:
        """Drop an unreferenced block's entry (it is about to be reused); only a full one is shown to
        ``on_evict``."""
        assert block.ref_cnt == 0 and block.is_entry
        if self.on_evict is not None and not block.partial:
            self.on_evict(block)
        self._unregister(block)
        self.evictions += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in order; a block reaching 0 goes to the tail of its queue.

        Pass a block table reversed (tail first) so chain tails are evicted before their parents.

        Raises:
            ValueError: a block is already unreferenced.
        """
        for block in blocks:
            if block.ref_cnt < 1:
                raise ValueError(f"block {block.block_id} released more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.blocks_used -= 1
                if not block.is_entry:
                    self._free.append(block)
                else:
                    self.release_seq += 1
                    block.released_at = self.release_seq
                    self._evictable[block.block_id] = block

    def evicts_released_after(self, n: int, seq: int, keep: set[int]) -> bool:
        """Whether taking ``n`` fresh blocks now would evict an entry that became unreferenced after release
        number ``seq`` (``release_seq``): free blocks go first, then entries least recently used first, those in
        ``keep`` (blocks the allocation takes a reference on) excepted. O(entries it would evict)."""
        short = n - len(self._free)
        for block_id, block in self._evictable.items():
            if short <= 0:
                return False
            if block_id in keep:
                continue
            if block.released_at > seq:
                return True
            short -= 1
        return False

    def drop_unreferenced_cached(self, match: Callable[[KVBlock], bool] | None = None) -> int:
        """Un-register every unreferenced cached block (that ``match`` accepts, when given), and every
        unreferenced entry chained on a dropped one, at any depth (no lookup can reach those once their parent
        entry is gone: ``engine.prefix_chain``); they become free. O(cached). Returns how many."""
        doomed = [b for b in self._evictable.values() if match is None or match(b)]
        dead: set[int] = set()
        for block in doomed:
            dead.add(block.cache_gen)
            self._drop_entry(block)
        by_parent: dict[int | None, list[ChildKey]] = {}
        for key in self._children:
            by_parent.setdefault(key[0], []).append(key)
        n = len(doomed)
        while dead:
            children = [
                b
                for gen in dead
                for key in by_parent.get(gen, ())
                for b in list(self._children.get(key, {}).values())
                if b.ref_cnt == 0
            ]
            dead = set()
            for block in children:
                dead.add(block.cache_gen)
                self._drop_entry(block)
            n += len(children)
        return n

    def chain_is_live(self, parent_hash: BlockHash | None, parent_gen: int | None) -> bool:
        """Whether an entry chained on (``parent_hash``, ``parent_gen``) still has that parent: a first block
        (no parent) always does; otherwise the entry registered under ``parent_hash`` must be that
        registration (``cache_gen == parent_gen``)."""
        if parent_gen is None:
            return parent_hash is None
        parent = self._cached.get(parent_hash) if parent_hash is not None else None
        return parent is not None and parent.cache_gen == parent_gen

    def _drop_entry(self, block: KVBlock) -> None:
        """Un-register an unreferenced entry now; it becomes free (not an eviction: no ``on_evict``)."""
        del self._evictable[block.block_id]
        self._unregister(block)
        self._free.append(block)

    # ---- introspection (tests, admin) -----------------------------------------------------------------
    def free_ids(self) -> Iterator[int]:
        """Ids of free (hash-less) blocks in the order they will be handed out."""
        return (b.block_id for b in self._free)

    def evictable_ids(self) -> Iterator[int]:
        """Ids of unreferenced cached blocks, least recently used (next evicted) first."""
        return iter(self._evictable.keys())

    def num_cached_entries(self) -> int:
        """Entries in the hash index (referenced or not)."""
        return len(self._cached)

    def check_invariants(self) -> None:
        """Assert the module invariants. O(num_blocks): for tests and debugging only.

        Raises:
            AssertionError: an invariant is broken (a bug).
        """
        free_ids = [b.block_id for b in self._free]
        free_set = set(free_ids)
        assert len(free_set) == len(free_ids), "a block is twice in the free queue"
        assert not free_set & set(self._evictable.keys()), "a block is both free and cached"
        used = 0
        partial = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0
            if block.ref_cnt > 0:
                used += 1
                assert block.block_id not in self._evictable and block.block_id not in free_set
            elif not block.is_entry:
                assert block.block_id in free_set, f"free block {block.block_id} not in the free queue"
            else:
                assert self._evictable.get(block.block_id) is block, f"cached block {block.block_id} lost"
            if block.block_hash is not None:
                assert not block.partial, f"partial block {block.block_id} holds a hash"
                assert self._cached.get(block.block_hash) is block, f"block {block.block_id} not indexed"
            if block.is_entry:
                assert block.token_ids is not None and block.cache_gen is not None
                assert self._children[self._child_key(block)].get(block.block_id) is block, "child index"
            if block.partial:
                partial += 1
                assert block.token_ids, f"partial block {block.block_id} holds no token"
        for h, block in self._cached.items():
            assert block.block_hash == h
        kids = sum(len(v) for v in self._children.values())
        assert all(self._children.values()), "an empty sibling list is kept"
        assert kids == len(self._cached) + partial, (
            f"{kids} children != {len(self._cached)} + {partial} entries"
        )
        assert partial == self.partial_entries, f"partial_entries {self.partial_entries} != {partial}"
        assert used == self.blocks_used, f"blocks_used counter {self.blocks_used} != {used}"
        assert self.blocks_used + self.blocks_cached + self.blocks_free == self.num_blocks
