"""The KV cache manager: per-request block tables over one ``BlockPool``, and the prefix cache on top.

What the scheduler calls, per request (vLLM v1's ``kv_cache_manager.py`` has the same shape)::

    hashes = m.block_hashes(prompt_ids, extra_keys)                   # full blocks only
    hit = m.find_cached_prefix(prompt_ids, hashes[:(len(prompt_ids) - 1) // m.block_size], extra_keys,
                               partial=True)
    table = m.allocate(req_id, num_tokens, hit)                        # None: wait, nothing changed
    ... forward writes KV for tokens [hit.num_tokens, num_computed) ...
    m.cache_full_blocks(req_id, ids, num_computed, hashes, extra_keys) # right after that forward
    m.append_slots(req_id, num_total_tokens)                           # before each decode / chunk
    m.free(req_id, ids, num_computed, extra_keys)                      # finished, cancelled, preempted

Invariants (on top of ``block_pool``'s):

1. A request holds exactly one reference on every block of its block table and no other; ``free`` drops
   them tail first. So ``sum(ref_cnt) == sum(len(table))`` over live requests.
2. A block is registered in the prefix cache only when it is full *and* its KV has been computed
   (``cache_full_blocks`` after the forward that wrote it), and only if every block before it in the
   request's chain is itself provably equal to a live cache entry. Registration records the exact parent
   entry (``parent_gen``) the block's KV was computed on.
3. A hit is served only when, for every block from the start, the stored token ids, parent hash, extra
   keys (model id, cache salt; the block's own keys under ``LayeredKeys``) and parent entry all match. So a
   tenant only ever hits blocks whose every salt, from the first block on, is one its request carries for
   that block: the shared salt inside a declared public prefix, its own salt after it. A hash collision, a
   stale child whose parent was evicted and replaced, or another tenant's block therefore ends the hit; it
   can never serve another prompt's KV.
4. ``allocate`` / ``append_slots`` either do everything or change nothing (they check first).
5. Every operation costs O(blocks touched), never O(pool); only ``reset_prefix_cache`` walks the cache.
6. A *pin* holds one reference on each of its blocks, like a request (``pins.pin`` / ``pins.unpin``), so a
   pinned block is never evicted; pins hold at most ``pins.max_blocks`` blocks in all (``engine.prefix_pins``).
7. ``install_blocks`` (load-back from a tier) registers blocks exactly as ``cache_full_blocks`` would have,
   chained on the hit's entries, and leaves them unreferenced and cached (``engine.block_install``).

8. Token-granular hits (``enable_partial_hits``, needs a slot copier: ``set_slot_copier``): when the chain of
   whole blocks stops at block ``i``, the lookup takes the sibling entry sharing the longest token prefix
   ``j >= 1`` with the prompt's block ``i``, and ``allocate`` copies its first ``j`` slots into a fresh block
   while holding a reference on the source. The hit never serves the prompt's last token.
9. A partial entry (a finished request's last, partly computed block, kept by ``free``) holds no block hash:
   never a parent, never written to a tier, pinned or listed; evictable like any unreferenced cached block.

Invariants 2 and 3 are kept by ``engine.prefix_chain`` (the chain of cache entries: lookup, registration, a
hit's re-check), which this manager calls from ``find_cached_prefix``, ``cache_full_blocks`` and ``allocate``.
Invariants 8 and 9, and the costs of those steps, are kept by ``engine.partial_hits``, which this manager calls
from ``find_cached_prefix``, ``allocate`` and ``free``.

A prefix lookup's result is a ``PrefixHit`` (``engine.prefix_hit``), valid until the next call that can evict;
``allocate`` checks it and raises ``StaleCacheHitError`` rather than serve a block that was evicted in between.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from engine.block_hash import BlockHash, ExtraKeys, HashFn, LayeredKeys, hash_block, hash_request_blocks
from engine.block_install import install_blocks
from engine.block_pool import BlockPool, KVBlock
from engine.errors import PromptTooLongError
from engine.partial_hits import (
    PARTIAL_SCAN_LIMIT,
    SlotCopier,
    allocate_with_copy,
    check_partial_hit,
    find_partial_source,
    keep_partial,
)
from engine.prefix_chain import check_chain, count_cached_leading, find_chain, register_chain
from engine.prefix_hit import NO_HIT, BlockIdentity, PrefixHit
from engine.prefix_hit import StaleCacheHitError as StaleCacheHitError  # re-exported: this manager raises it
from engine.prefix_pins import PrefixPins


@dataclass(slots=True)
class _RequestBlocks:
    """One request's block table and how far its full blocks have been offered to the prefix cache.

    ``hashes[i]`` / ``chain_gens[i]`` exist for every processed full block ``i``; ``chain_gens[i]`` is the
    ``cache_gen`` of a live cache entry proven equal to this request's chain up to block ``i`` (its own
    block, or an equal entry that was cached first), or None when none could be proven.
    """

    blocks: list[KVBlock]
    hashes: list[BlockHash] = field(default_factory=list)
    chain_gens: list[int | None] = field(default_factory=list)


def _keys(extra_keys: ExtraKeys) -> ExtraKeys:
    """``LayeredKeys`` as they are; any other sequence as a tuple."""
    return extra_keys if isinstance(extra_keys, LayeredKeys) else tuple(extra_keys)


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for a >= 0, b > 0."""
    return -(-a // b)


class KVCacheManager:
    """Block tables of live requests and the prefix cache over one block pool.

    Args:
        num_blocks: physical KV blocks in the pool (>= 1).
        block_size: tokens per block (>= 1).
        enable_caching: share full blocks between requests by prefix; when False nothing is ever
            registered and ``find_cached_prefix`` returns ``NO_HIT``.
        hash_fn: block hash function ``(parent, token_ids, extra_keys) -> bytes`` (tests pass weak ones).
        enable_partial_hits: token-granular hits (invariant 8); they also need a slot copier
            (``set_slot_copier``) and caching on.
        partial_scan_limit: most siblings one token-granular lookup compares (>= 1).

    Raises:
        ValueError: ``num_blocks``, ``block_size`` or ``partial_scan_limit`` < 1.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: HashFn = hash_block,
        *,
        enable_partial_hits: bool = True,
        partial_scan_limit: int = PARTIAL_SCAN_LIMIT,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if partial_scan_limit < 1:
            raise ValueError(f"partial_scan_limit must be >= 1, got {partial_scan_limit}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.enable_partial_hits = enable_partial_hits
        self.partial_scan_limit = partial_scan_limit
        self._copy_slots: SlotCopier | None = None
        self._requests: dict[str, _RequestBlocks] = {}
        self.pins = PrefixPins(self.pool, num_blocks // 4)
        """The pin table (invariant 6): ``pins.pin`` / ``unpin`` / ``check_room``; ``pins.max_blocks`` (the engine
        sets it from ``max_pinned_fraction``) and ``pins.blocks_held``."""

    # ---- hashing and lookup ---------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int], extra_keys: ExtraKeys) -> list[BlockHash]:
        """Chained hashes of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` of them)."""
        return hash_request_blocks(token_ids, self.block_size, _keys(extra_keys), self.hash_fn)

    def set_slot_copier(self, copier: SlotCopier | None) -> None:
        """The KV copy of token-granular hits: ``copier(src, dst, n)`` copies the first ``n`` slots of block
        ``src``'s K and V, every layer, into block ``dst`` (``engine.model_runner.ModelRunner.copy_slots``)."""
        self._copy_slots = copier

    @property
    def partial_hits_active(self) -> bool:
        """True when lookups may serve part of a block: caching and partial hits on, a slot copier set."""
        return self.enable_caching and self.enable_partial_hits and self._copy_slots is not None

    def find_cached_prefix(
        self,
        token_ids: Sequence[int],
        block_hashes: list[BlockHash],
        extra_keys: ExtraKeys,
        *,
        partial: bool = False,
    ) -> PrefixHit:
        """Longest chain of cached blocks serving ``token_ids`` from its start, and with ``partial`` the
        longest cached token prefix of the next block (invariant 8).

        Every block's stored token ids, parent hash, parent entry and extra keys are compared, so a
        hash collision never serves another prompt's KV. Takes no reference and keeps the LRU order.

        Args:
            token_ids: the prompt's token ids.
            block_hashes: hashes of its full blocks (``block_hashes(...)``), possibly cut short to cap the
                hit (e.g. ``[:(len(token_ids) - 1) // block_size]`` so the last token is still computed).
            extra_keys: the extra keys the hashes were computed with.
            partial: also look for a partial part after the whole blocks (when ``partial_hits_active``); it
                never covers the last token of ``token_ids``.

        Returns:
            The hit (``num_blocks`` whole blocks in order, ``partial_tokens`` more, ``num_tokens`` tokens);
            ``NO_HIT`` when caching is off.
        """
        if not self.enable_caching:
            return NO_HIT
        bs = self.block_size
        extra_keys = _keys(extra_keys)
        hits, prev_hash, prev_gen = find_chain(self.pool, bs, token_ids, block_hashes, extra_keys)
        if partial and self.partial_hits_active:
            source, j = find_partial_source(
                self.pool, bs, self.partial_scan_limit, token_ids, len(hits), prev_hash, prev_gen, extra_keys
            )
            if source is not None:
                return PrefixHit(tuple(hits), len(hits) * bs + j, source, source.cache_gen, j)
        return PrefixHit(tuple(hits), len(hits) * bs)

    # ---- allocation -----------------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold: ``num_blocks * block_size``."""
        return self.pool.num_blocks * self.block_size

    def usable_tokens(
        self, token_ids: Sequence[int], block_hashes: list[BlockHash], extra_keys: ExtraKeys
    ) -> tuple[int, int]:
        """Tokens one request with this prompt could ever hold (every block no pin holds, plus the pinned blocks
        its cached prefix reuses), and the pinned blocks that keep it below ``capacity_tokens``; a request past it
        would wait for blocks no request frees (``InputProcessor.make_request`` refuses it).

        Returns:
            ``(tokens, pinned blocks not reused)``; ``(capacity_tokens, 0)`` when nothing is pinned.
        """
        pinned = self.pins.distinct_block_ids()
        if not pinned:
            return self.capacity_tokens, 0
        hit = self.find_cached_prefix(token_ids, block_hashes, extra_keys)
        reused = sum(1 for block in hit._blocks if block.block_id in pinned)
        blocked = len(pinned) - reused
        return (self.pool.num_blocks - blocked) * self.block_size, blocked

    def check_fits(self, num_tokens: int) -> None:
        """Raise unless ``num_tokens`` tokens could ever fit in the pool (call at submit, prompt + 1).

        Raises:
            PromptTooLongError: ``what="pool"``, when ``num_tokens > num_blocks * block_size``.
        """
        if num_tokens > self.capacity_tokens:
            raise PromptTooLongError(num_tokens, self.capacity_tokens, what="pool")

    def _check_hits(self, cached_blocks: tuple[KVBlock, ...]) -> None:
        """Raise ``StaleCacheHitError`` unless ``cached_blocks`` is still a valid chain of cache entries."""
        if cached_blocks and not self.enable_caching:
            raise ValueError("prefix caching is disabled; the prefix hit must be empty")
        check_chain(self.pool, cached_blocks)

    def _fresh_blocks_needed(self, num_tokens: int, hit: PrefixHit) -> int:
        """Blocks to allocate so hits + fresh cover ``num_tokens`` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.check_fits(num_tokens)
        self._check_hits(hit._blocks)
        check_partial_hit(hit, self.partial_hits_active)
        if hit._partial is not None and num_tokens <= hit.num_tokens:
            raise ValueError(
                f"a partial hit of {hit.num_tokens} tokens must leave a token of {num_tokens} to compute"
            )
        return max(0, cdiv(num_tokens, self.block_size) - len(hit._blocks))

    def _available_besides(self, hit: PrefixHit) -> int:
        """Blocks a fresh allocation may take when the hit's blocks and partial source are held too (they
        leave the LRU)."""
        held = hit._blocks + ((hit._partial,) if hit._partial is not None else ())
        return self.pool.num_available() - sum(1 for b in held if b.ref_cnt == 0)

    def can_allocate(self, num_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Whether ``allocate(_, num_tokens, hit)`` would succeed now. Changes nothing.

        Raises:
            PromptTooLongError: ``num_tokens`` exceeds the whole pool.
            StaleCacheHitError: a hit block was evicted since ``find_cached_prefix``.
            ValueError: ``num_tokens`` < 0, or hits given while caching is off.
        """
        need = self._fresh_blocks_needed(num_tokens, hit)
        return need <= self._available_besides(hit)

    def allocate(self, request_id: str, num_tokens: int, hit: PrefixHit = NO_HIT) -> list[int] | None:
        """Give a new request a block table: the hit blocks, then fresh blocks up to ``num_tokens`` tokens.

        Takes a reference on every hit block (an unreferenced one leaves the LRU queue), then fresh
        blocks from the free queue, evicting least recently used cached blocks when it is empty. With a
        partial hit, the first fresh block gets the source's first ``hit.partial_tokens`` slots copied in
        (the source held by a reference during the copy).

        Args:
            request_id: a request that holds no blocks yet.
            num_tokens: tokens the table must cover (prompt, or the first prefill chunk's end).
            hit: ``find_cached_prefix``'s result, unchanged, from this scheduling step (default: no hit).

        Returns:
            The block table (physical block ids), or None when there are not enough blocks now; then
            nothing has changed.

        Raises:
            PromptTooLongError: ``num_tokens`` exceeds the whole pool (before any change).
            StaleCacheHitError: a hit block was evicted since ``find_cached_prefix`` (before any change).
            ValueError: ``request_id`` already holds blocks, ``num_tokens`` < 0, or a partial hit that leaves
                nothing to compute.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks; use append_slots")
        cached_blocks = hit._blocks
        need = self._fresh_blocks_needed(num_tokens, hit)
        if need > self._available_besides(hit):
            return None
        self.pool.touch(cached_blocks)
        if hit._partial is None:
            fresh = self.pool.allocate(need)
        else:
            try:
                fresh = allocate_with_copy(self.pool, self._copy_slots, need, hit)
            except BaseException:
                self.pool.release(reversed(cached_blocks))
                raise
        blocks = list(cached_blocks) + fresh
        self._requests[request_id] = _RequestBlocks(
            blocks=blocks,
            hashes=[b.block_hash for b in cached_blocks],
            chain_gens=[b.cache_gen for b in cached_blocks],
        )
        return [b.block_id for b in blocks]

    def append_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's block table to cover ``num_total_tokens`` tokens.

        Returns:
            True when the table covers them (possibly already did); False, with no change, when there are
            not enough blocks now or ``num_total_tokens`` exceeds the whole pool (``capacity_tokens``).

        Raises:
            KeyError: unknown ``request_id``.
        """
        req = self._request(request_id)
        need = cdiv(num_total_tokens, self.block_size) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_available():
            return False
        req.blocks.extend(self.pool.allocate(need))
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> tuple[int, int] | bool:
        """Give ``child_id`` a block table that shares ``parent_id``'s first ``num_tokens`` tokens (``n > 1``).

        The full blocks are shared by reference (one more reference each, so each is freed only when its last
        holder frees it); a partial last block is copy-on-write: the child gets a fresh block, and the caller
        must copy the parent's block's KV into it before the next forward (both sequences are about to write
        their next token into that block). The child's chain of proven cache entries is the parent's.

        Args:
            parent_id: a live request whose KV for tokens ``[0, num_tokens)`` is computed.
            child_id: a request that holds no blocks yet.
            num_tokens: tokens to share (the prompt), ``<=`` what the parent's table covers.

        Returns:
            ``(src_block_id, dst_block_id)``, the KV copy to make, when the last block is partial; True when
            every shared block is full (nothing to copy); False, with no change, when no block is available for
            the copy now.

        Raises:
            KeyError: unknown ``parent_id``. ValueError: ``child_id`` already holds blocks, or ``num_tokens`` is
                beyond the parent's table.
        """
        parent = self._request(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already holds blocks")
        bs = self.block_size
        num_full, partial = divmod(num_tokens, bs)
        if num_tokens < 0 or cdiv(num_tokens, bs) > len(parent.blocks):
            raise ValueError(f"{num_tokens} tokens are beyond {parent_id!r}'s {len(parent.blocks)} blocks")
        if partial and self.pool.num_available() < 1:
            return False
        shared = parent.blocks[:num_full]
        self.pool.touch(shared)
        blocks = list(shared)
        copy: tuple[int, int] | bool = True
        if partial:
            fresh = self.pool.allocate(1)[0]
            blocks.append(fresh)
            copy = (parent.blocks[num_full].block_id, fresh.block_id)
        k = min(num_full, len(parent.hashes))
        self._requests[child_id] = _RequestBlocks(
            blocks=blocks, hashes=list(parent.hashes[:k]), chain_gens=list(parent.chain_gens[:k])
        )
        return copy

    # ---- caching --------------------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        block_hashes: list[BlockHash],
        extra_keys: ExtraKeys,
    ) -> None:
        """Register the request's blocks that are full and computed, so other requests hit them next step.

        Call right after the forward that wrote them. Idempotent: blocks already offered are skipped, so the
        cost is O(new full blocks). Hashes missing from ``block_hashes`` (generated tokens) are computed
        here. A block whose hash another block already holds stays private (``engine.prefix_chain``).

        Args:
            request_id: a live request.
            token_ids: all its tokens so far (prompt + generated).
            num_computed_tokens: tokens whose KV is written; blocks ``[0, num_computed_tokens // block_size)``
                are offered.
            block_hashes: its full-block hashes (from ``block_hashes``), possibly fewer than needed.
            extra_keys: the extra keys of those hashes.

        Raises:
            KeyError: unknown ``request_id``.
        """
        req = self._request(request_id)
        if not self.enable_caching:
            return
        register_chain(
            self.pool,
            self.block_size,
            self.hash_fn,
            req.blocks,
            req.hashes,
            req.chain_gens,
            token_ids,
            num_computed_tokens,
            block_hashes,
            _keys(extra_keys),
        )

    # ---- release --------------------------------------------------------------------------------------
    def free(
        self,
        request_id: str,
        token_ids: Sequence[int] | None = None,
        num_computed_tokens: int = 0,
        extra_keys: ExtraKeys = (),
    ) -> None:
        """Drop the request's references, tail block first (tails are evicted before parents). Unknown: no-op.

        With ``token_ids`` (and partial hits active) the request's last, partly computed block is first kept
        as a partial entry (invariant 9), so a later prompt sharing part of it copies its KV.

        Args:
            request_id: the request.
            token_ids: all its tokens (prompt + generated), or None to keep nothing.
            num_computed_tokens: tokens whose KV is written (the kept block holds the last
                ``num_computed_tokens % block_size`` of them).
            extra_keys: the extra keys of its block hashes.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if token_ids is not None and self.partial_hits_active:
            keep_partial(
                self.pool,
                self.block_size,
                self.partial_scan_limit,
                req.blocks,
                req.hashes,
                req.chain_gens,
                token_ids,
                num_computed_tokens,
                _keys(extra_keys),
            )
        self.pool.release(reversed(req.blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached entry (they become free blocks). O(cached); tests and admin.

        Returns:
            True when the prefix cache is now empty; False when entries held by live requests remain.
        """
        self.pool.drop_unreferenced_cached()
        return self.pool.num_cached_entries() == 0

    # ---- tiers: eviction listener, load-back, levels ---------------------------------------------------
    def set_evict_listener(self, listener: Callable[[KVBlock], None] | None) -> None:
        """Call ``listener(block)`` with every cached block right before eviction clears it (write-back)."""
        self.pool.on_evict = listener

    def registered_blocks(self) -> Iterator[KVBlock]:
        """Every block registered in the prefix cache, referenced or not (write everything down)."""
        return (b for b in self.pool.blocks if b.block_hash is not None and self.pool.is_registered(b))

    def install_blocks(
        self, hit: PrefixHit, loaded: Sequence[BlockIdentity], write_kv: Callable[[int, int], None]
    ) -> int:
        """Register blocks read back from a tier as cached entries chained right after ``hit``.

        Args:
            hit: the pool's current hit for the prompt (from ``find_cached_prefix``, this step).
            loaded: identities of the next blocks of the chain, in order (``loaded[0]``'s parent is the
                hit's last block).
            write_kv: ``write_kv(block_id, i)`` copies the KV of ``loaded[i]`` into physical block
                ``block_id``.

        Returns:
            Blocks installed: fewer than ``len(loaded)`` when the pool has no more room, or when a hash is
            already registered (then the chain stops there). The hit's blocks are held while fresh blocks
            are taken, so they are never evicted by this call; the installed blocks end unreferenced and
            cached (tail first in the LRU order).

        Raises:
            StaleCacheHitError: ``hit`` names a block evicted since it was found.
        """
        if not loaded or not self.enable_caching:
            return 0
        self._check_hits(hit._blocks)
        return install_blocks(self.pool, hit._blocks, loaded, write_kv)

    def count_cached_leading(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes of a chain are registered in the pool now (listing; no token check)."""
        return count_cached_leading(self.pool, block_hashes)

    def tag_levels(self, request_id: str, levels: Sequence[frozenset[str]]) -> None:
        """Add ``levels[i]`` to the levels of the request's block ``i`` (registered blocks only).

        Raises:
            KeyError: unknown ``request_id``.
        """
        for block, lv in zip(self._request(request_id).blocks, levels, strict=False):
            if lv and self.pool.is_registered(block) and not lv <= block.levels:
                block.levels = block.levels | lv

    def drop_unreferenced_where(self, match: Callable[[KVBlock], bool]) -> int:
        """Un-register every unreferenced cached block ``match`` accepts (admin: drop a tenant's or a model's
        prefixes). O(cached). Returns how many."""
        return self.pool.drop_unreferenced_cached(match)

    # ---- queries --------------------------------------------------------------------------------------
    def _request(self, request_id: str) -> _RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks") from None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids, in token order.

        Raises:
            KeyError: unknown ``request_id``.
        """
        return [b.block_id for b in self._request(request_id).blocks]

    def num_cached_blocks(self, request_id: str) -> int:
        """Full blocks of the request already offered to the prefix cache (hits included)."""
        return len(self._request(request_id).hashes)

    @property
    def partial_entries(self) -> int:
        """Partial entries kept in the pool (gauge)."""
        return self.pool.partial_entries

    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can get now: free + evictable cached."""
        return self.pool.num_available()

    @property
    def blocks_total(self) -> int:
        """Blocks in the pool."""
        return self.pool.num_blocks

    @property
    def blocks_used(self) -> int:
        """Blocks referenced by at least one live request."""
        return self.pool.blocks_used

    @property
    def blocks_cached(self) -> int:
        """Unreferenced cache entries, full or partial (evictable)."""
        return self.pool.blocks_cached

    @property
    def blocks_free(self) -> int:
        """Unreferenced blocks holding no hash."""
        return self.pool.blocks_free

    @property
    def evictions(self) -> int:
        """Cached blocks evicted to make room (monotonic)."""
        return self.pool.evictions

    def usage(self) -> dict[str, int]:
        """``blocks_total``, ``blocks_used``, ``blocks_cached``, ``blocks_free``, ``evictions``."""
        return {
            "blocks_total": self.blocks_total,
            "blocks_used": self.blocks_used,
            "blocks_cached": self.blocks_cached,
            "blocks_free": self.blocks_free,
            "evictions": self.evictions,
        }

    def check_invariants(self) -> None:
        """Assert the pool's invariants and that reference counts match the live block tables. O(pool).

        Raises:
            AssertionError: a bug.
        """
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        tables = [[b.block_id for b in req.blocks] for req in self._requests.values()]
        tables += [[b.block_id for b in blocks] for blocks in self.pins.tables()]
        for ids in tables:
            assert len(set(ids)) == len(ids), "a block is twice in one block table"
            for block_id in ids:
                refs[block_id] += 1
        assert self.pins.blocks_held <= self.pins.max_blocks
        for block in self.pool.blocks:
            assert block.ref_cnt == refs[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs[block.block_id]} live tables and pins"
            )
