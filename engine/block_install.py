"""Load-back from a KV tier into the RAM pool: blocks read from disk or Redis registered as cache entries chained
right after a prefix hit (``engine.kv_cache_manager``, invariant 7).

Owns ``install_blocks``. Invariants: the installed blocks are registered exactly as ``cache_full_blocks`` would
have registered them (hash, token ids, parent hash and entry, extra keys), chained on the hit's entries; the
hit's blocks are held while fresh blocks are taken, so this call never evicts them; every block taken and not
installed is released; the installed blocks end unreferenced and cached, tail first in the LRU order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.block_pool import BlockPool, KVBlock
from engine.prefix_hit import BlockIdentity


def install_blocks(
    pool: BlockPool,
    prefix: Sequence[KVBlock],
    loaded: Sequence[BlockIdentity],
    write_kv: Callable[[int, int], None],
) -> int:
    """Register ``loaded`` (block identities read back from a tier) after ``prefix`` (a live chain of cache
    entries: the prompt's hit, checked by the caller).

    Args:
        pool: the RAM pool.
        prefix: the hit's blocks, in order (may be empty: ``loaded`` starts the chain).
        loaded: the next blocks of the chain, in order (``loaded[0]``'s parent is ``prefix``'s last block).
        write_kv: ``write_kv(block_id, i)`` copies the KV of ``loaded[i]`` into physical block ``block_id``.

    Returns:
        Blocks installed: 0 when ``loaded[0]`` does not chain on ``prefix``; fewer than ``len(loaded)`` when the
        pool has no more room or a hash is already registered (the chain stops there).
    """
    if not loaded or loaded[0].parent_hash != (prefix[-1].block_hash if prefix else None):
        return 0
    prefix = list(prefix)
    pool.touch(prefix)
    fresh = pool.allocate(min(len(loaded), pool.num_available()))
    installed: list[KVBlock] = []
    parent_gen = prefix[-1].cache_gen if prefix else None
    for i, (block, item) in enumerate(zip(fresh, loaded, strict=False)):
        if pool.get_cached(item.block_hash) is not None:
            break
        write_kv(block.block_id, i)
        pool.register(
            block,
            item.block_hash,
            tuple(item.token_ids),
            item.parent_hash,
            parent_gen,
            tuple(item.extra_keys),
        )
        parent_gen = block.cache_gen
        installed.append(block)
    pool.release(fresh[len(installed) :])
    pool.release(reversed(installed))
    pool.release(reversed(prefix))
    return len(installed)
