"""The chain of cache entries behind a prompt: looking it up, proving a request's blocks equal to it, and
checking a hit is still that chain (``engine.kv_cache_manager``, invariants 2 and 3).

A full block's cache entry holds its hash, its token ids, its parent's hash, the exact parent entry its KV was
computed on (``parent_gen``: the parent's ``cache_gen``) and its extra keys (model id, cache salt; the block's
own under ``LayeredKeys``). The prefix cache is only as correct as the chain of those entries from a prompt's
first block, so this module owns the three places that walk it:

- ``find_chain``: the longest chain of cached entries serving a prompt from its start (invariant 3: every
  block's token ids, parent hash, parent entry and extra keys compared, so a hash collision, a stale child whose
  parent was evicted and replaced, or another tenant's block ends the chain);
- ``register_chain``: offering a request's full, computed blocks to the cache (invariant 2: a block is
  registered only when every block before it is proven equal to a live entry, chained on that entry;
  ``chain_gens[i]`` is that entry's ``cache_gen``, or None when none could be proven);
- ``check_chain``: a hit found earlier is still a chain of live entries (``StaleCacheHitError`` otherwise).

Invariants: nothing here takes or drops a reference or reorders the LRU; each call costs O(blocks walked).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_hash import BlockHash, ExtraKeys, HashFn, block_extra_keys, encode_extra_keys
from engine.block_pool import BlockPool, KVBlock
from engine.prefix_hit import StaleCacheHitError


def find_chain(
    pool: BlockPool,
    block_size: int,
    token_ids: Sequence[int],
    block_hashes: Sequence[BlockHash],
    extra_keys: ExtraKeys,
) -> tuple[list[KVBlock], BlockHash | None, int | None]:
    """The longest chain of cached entries equal to the prompt's first full blocks (invariant 3).

    Args:
        pool: the RAM pool.
        block_size: tokens per block.
        token_ids: the prompt's token ids.
        block_hashes: its full blocks' chained hashes, possibly cut short to cap the chain.
        extra_keys: the extra keys the hashes were computed with (a tuple or ``LayeredKeys``).

    Returns:
        ``(blocks, last_hash, last_gen)``: the chain's blocks in order, and the hash and ``cache_gen`` of its
        last block (None, None for an empty chain), the parent a next block would chain on.
    """
    bs = block_size
    hits: list[KVBlock] = []
    prev_hash: BlockHash | None = None
    prev_gen: int | None = None
    for i in range(min(len(block_hashes), len(token_ids) // bs)):
        block = pool.get_cached(block_hashes[i])
        if (
            block is None
            or block.parent_hash != prev_hash
            or block.parent_gen != prev_gen
            or encode_extra_keys(block.extra_keys) != encode_extra_keys(block_extra_keys(extra_keys, i))
            or block.token_ids != tuple(token_ids[i * bs : (i + 1) * bs])
        ):
            break
        hits.append(block)
        prev_hash, prev_gen = block_hashes[i], block.cache_gen
    return hits, prev_hash, prev_gen


def check_chain(pool: BlockPool, blocks: Sequence[KVBlock]) -> None:
    """Raise unless ``blocks`` (a hit's, from ``find_chain``) is still a chain of live cache entries.

    Raises:
        StaleCacheHitError: a block was evicted (and possibly re-registered as another entry) since it was found.
    """
    prev_gen: int | None = None
    for i, block in enumerate(blocks):
        if not pool.is_registered(block) or block.parent_gen != prev_gen:
            raise StaleCacheHitError(
                f"cached block {i} (block {block.block_id}) is no longer that cache entry; "
                "call find_cached_prefix again right before allocate"
            )
        prev_gen = block.cache_gen


def register_chain(
    pool: BlockPool,
    block_size: int,
    hash_fn: HashFn,
    blocks: Sequence[KVBlock],
    hashes: list[BlockHash],
    chain_gens: list[int | None],
    token_ids: Sequence[int],
    num_computed_tokens: int,
    block_hashes: Sequence[BlockHash],
    extra_keys: ExtraKeys,
) -> None:
    """Offer a request's full, computed blocks not offered yet to the cache, in order (invariant 2).

    A block whose hash another block already holds stays private (the existing entry is kept); when that entry
    has the same content and chain, later blocks still chain onto it, otherwise (a collision) nothing after it
    is registered for this request.

    Args:
        pool: the RAM pool.
        block_size: tokens per block.
        hash_fn: the block hash function (for hashes missing from ``block_hashes``: generated tokens).
        blocks: the request's block table.
        hashes, chain_gens: the request's hashes and proven entries so far; one entry is appended to each per
            block offered (``kv_cache_manager._RequestBlocks``).
        token_ids: all its tokens so far (prompt + generated).
        num_computed_tokens: tokens whose KV is written; blocks ``[0, num_computed_tokens // block_size)`` are
            offered.
        block_hashes: its full-block hashes, possibly fewer than needed.
        extra_keys: the extra keys of those hashes (a tuple or ``LayeredKeys``).
    """
    bs = block_size
    num_full = min(num_computed_tokens // bs, len(blocks), len(token_ids) // bs)
    for i in range(len(hashes), num_full):
        tokens = tuple(token_ids[i * bs : (i + 1) * bs])
        parent_hash = hashes[i - 1] if i else None
        keys = block_extra_keys(extra_keys, i)
        block_hash = block_hashes[i] if i < len(block_hashes) else hash_fn(parent_hash, tokens, keys)
        hashes.append(block_hash)
        chain_gens.append(_register(pool, blocks[i], i, chain_gens, block_hash, tokens, parent_hash, keys))


def _register(
    pool: BlockPool,
    block: KVBlock,
    i: int,
    chain_gens: Sequence[int | None],
    block_hash: BlockHash,
    tokens: tuple[int, ...],
    parent_hash: BlockHash | None,
    extra_keys: tuple,
) -> int | None:
    """Register block ``i`` if its chain is proven; return the proven entry's gen or None."""
    if i and chain_gens[i - 1] is None:
        return None
    parent_gen = chain_gens[i - 1] if i else None
    if block.block_hash is not None:
        return block.cache_gen if pool.is_registered(block) else None
    if pool.register(block, block_hash, tokens, parent_hash, parent_gen, extra_keys):
        return block.cache_gen
    existing = pool.get_cached(block_hash)
    if (
        existing is not None
        and existing.token_ids == tokens
        and existing.parent_gen == parent_gen
        and encode_extra_keys(existing.extra_keys) == encode_extra_keys(extra_keys)
    ):
        return existing.cache_gen
    return None


def count_cached_leading(pool: BlockPool, block_hashes: Sequence[BlockHash]) -> int:
    """How many leading hashes of a chain are registered in the pool now (listing; no token check)."""
    n = 0
    for h in block_hashes:
        if pool.get_cached(h) is None:
            break
        n += 1
    return n
