"""Token-granular prefix hits: the part of a block a prompt shares with a cached sibling, copied on write.

Owns the three steps ``KVCacheManager`` takes for them (its invariants 8 and 9; ``docs/prefix-cache.md``):

- lookup (``find_partial_source``): when the chain of whole blocks stops at block ``i``, the entry chained
  right after the same parent entry, under the same extra keys, that shares the longest token prefix ``j >= 1``
  with the prompt's block ``i`` (never its last token); at most ``scan_limit`` siblings, the newest first;
- copy (``allocate_with_copy``): a fresh block ``i`` gets the source's first ``j`` slots (every layer, K and V)
  while the source holds a reference, so it is neither evicted during the copy nor ever written;
- partial entries (``keep_partial``): a finished request's last, partly computed block, kept when the chain
  before it is a live cache entry and no sibling already serves all its tokens.

Invariants: a partial entry holds no block hash (never a parent, never written to a tier, pinned or listed)
and is evictable like any unreferenced cached block; a partial hit never covers a prompt's last token; every
function here costs O(block_size * scan_limit) at most, never O(pool).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.block_hash import BlockHash, ExtraKeys, block_extra_keys
from engine.block_pool import BlockPool, KVBlock
from engine.prefix_hit import PrefixHit, StaleCacheHitError

SlotCopier = Callable[[int, int, int], None]
"""``copy(src_block_id, dst_block_id, n)``: copy the first ``n`` slots of a block's K and V, every layer."""

PARTIAL_SCAN_LIMIT = 64
"""Most sibling entries one token-granular lookup compares (the newest first)."""


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    j = 0
    while j < n and a[j] == b[j]:
        j += 1
    return j


def find_partial_source(
    pool: BlockPool,
    block_size: int,
    scan_limit: int,
    token_ids: Sequence[int],
    i: int,
    parent_hash: BlockHash | None,
    parent_gen: int | None,
    extra_keys: ExtraKeys,
) -> tuple[KVBlock | None, int]:
    """The sibling entry sharing the longest token prefix with block ``i`` of ``token_ids`` (never its last
    token), and that length; ``(None, 0)`` when none shares a token.

    Args:
        pool: the block pool whose sibling index is read (``BlockPool.children``).
        block_size: tokens per block.
        scan_limit: most siblings compared (the newest first).
        token_ids: the prompt's token ids.
        i: the block the chain of whole blocks stopped at.
        parent_hash, parent_gen: hash and ``cache_gen`` of the entry before block ``i`` (None for block 0).
        extra_keys: the request's extra keys (normalised: ``LayeredKeys`` or a tuple).
    """
    bs = block_size
    start = i * bs
    want = tuple(token_ids[start : min(start + bs, len(token_ids) - 1)])
    if not want:
        return None, 0
    best, best_j = None, 0
    for cand in pool.children(parent_gen, block_extra_keys(extra_keys, i), scan_limit):
        tokens = cand.token_ids
        if tokens[0] != want[0] or cand.parent_hash != parent_hash:
            continue
        j = common_prefix_len(tokens, want)
        if j > best_j:
            best, best_j = cand, j
            if j == len(want):
                break
    return best, best_j


def check_partial_hit(hit: PrefixHit, active: bool) -> None:
    """Raise unless ``hit``'s partial source (if any) is still the entry it was found as.

    Args:
        hit: a ``find_cached_prefix`` result. active: whether partial hits are on now (``partial_hits_active``).

    Raises:
        ValueError: the hit has a partial part while partial hits are off.
        StaleCacheHitError: the source was evicted or re-registered since the lookup.
    """
    src = hit._partial
    if src is None:
        return
    if not active:
        raise ValueError("partial prefix hits are off; the prefix hit must have no partial part")
    if not src.is_entry or src.cache_gen != hit._partial_gen:
        raise StaleCacheHitError(
            f"the partial hit's source (block {src.block_id}) is no longer that cache entry; "
            "call find_cached_prefix again right before allocate"
        )


def allocate_with_copy(
    pool: BlockPool, copy_slots: SlotCopier | None, need: int, hit: PrefixHit
) -> list[KVBlock]:
    """``need`` (>= 1) fresh blocks, the first holding a copy of the first ``hit.partial_tokens`` slots of
    the hit's partial source. The source is referenced from before the allocation (so it cannot be
    evicted to make room) until the copy is made. On a copy error every block taken here is released and
    the error raised (the caller has taken the hit's references: it releases them)."""
    src = hit._partial
    assert src is not None and copy_slots is not None and need >= 1
    pool.touch((src,))
    try:
        fresh = pool.allocate(need)
        try:
            copy_slots(src.block_id, fresh[0].block_id, hit.partial_tokens)
        except BaseException:
            pool.release(reversed(fresh))
            raise
    finally:
        pool.release((src,))
    return fresh


def keep_partial(
    pool: BlockPool,
    block_size: int,
    scan_limit: int,
    blocks: Sequence[KVBlock],
    hashes: Sequence[BlockHash],
    chain_gens: Sequence[int | None],
    token_ids: Sequence[int],
    num_computed_tokens: int,
    extra_keys: ExtraKeys,
) -> bool:
    """Register a finishing request's last partly computed block as a partial entry when it is worth keeping
    (``KVCacheManager`` invariant 9). Returns True when kept.

    Args:
        pool: the block pool. block_size: tokens per block. scan_limit: most siblings compared.
        blocks, hashes, chain_gens: the request's block table, its full blocks' hashes and proven chain entries
            (``kv_cache_manager._RequestBlocks``), before its references are dropped.
        token_ids: all its tokens. num_computed_tokens: tokens whose KV is written.
        extra_keys: the extra keys of its block hashes (normalised: ``LayeredKeys`` or a tuple).
    """
    bs = block_size
    num_full, k = divmod(min(num_computed_tokens, len(token_ids)), bs)
    if not k or num_full >= len(blocks) or len(hashes) < num_full:
        return False
    parent_gen = chain_gens[num_full - 1] if num_full else None
    parent_hash = hashes[num_full - 1] if num_full else None
    if num_full and (parent_gen is None or not is_live_entry(pool, parent_hash, parent_gen)):
        return False
    block = blocks[num_full]
    if block.ref_cnt != 1 or block.is_entry:
        return False
    tokens = tuple(token_ids[num_full * bs : num_full * bs + k])
    keys = block_extra_keys(extra_keys, num_full)
    for sib in pool.children(parent_gen, keys, scan_limit):
        have = sib.token_ids
        if sib.parent_hash != parent_hash:
            continue
        if len(have) >= k and have[:k] == tokens:
            return False  # an entry already serves every token of this block
        if sib.partial and sib.ref_cnt == 0 and tokens[: len(have)] == have:
            pool.drop_partial(sib)  # this block serves all of it and more
    pool.register_partial(block, tokens, parent_hash, parent_gen, keys)
    return True


def is_live_entry(pool: BlockPool, block_hash: BlockHash | None, gen: int) -> bool:
    """True when the entry registered under ``block_hash`` now is the registration ``gen``."""
    entry = pool.get_cached(block_hash) if block_hash is not None else None
    return entry is not None and entry.cache_gen == gen
