"""The link between one engine's block pool (and its KV tensor) and the tier stack below it.

- **Write-back.** ``on_evict(block)`` is called by the block pool when it evicts a cached block, before the
  block is reused: the block's KV is copied out of the pool tensor (the only work on the step thread) and
  offered to the write-back queue with the block's levels. A full queue drops it (counted) without copying.
- **Prefetch and load-back.** ``start_prefetch(req)`` (at submit) looks the request's prompt up in the pool;
  when the lookup stops before the usable end (``(num_tokens - 1) // block_size`` blocks), the rest of the
  hash chain is read from the tiers on the prefetch thread. ``ready(req)`` (at admission) is False while
  that read runs, so the request keeps waiting and other requests keep stepping; once it is done the blocks
  found are *installed*: copied into fresh pool blocks and registered as ordinary cached entries, chained on
  the pool's own entries (``parent_gen``), so the scheduler's prefix lookup hits them like any other block.
  If the pool lost part of the prefix meanwhile (the lookup now stops earlier than where the read began),
  the read is done again from there once.

Invariants: installing never evicts the request's own pool hits (they are referenced while it runs), never
takes a block a request holds, and leaves every installed block unreferenced and cached (evictable), so
the pool's accounting is unchanged; an installed block is registered under the same chain hash, tokens,
parent and extra keys the request computed, so a hit on it is exactly as safe as a hit on a computed block.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.block_hash import BlockHash, ExtraKeys, block_extra_keys
from engine.block_pool import KVBlock
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers.entry import BlockMeta
from engine.kv_tiers.stack import LoadedBlock, TierStack
from engine.prefix_hit import PrefixHit

log = logging.getLogger(__name__)


@dataclass
class _Prefetch:
    """One request's tier read: the first block index it covers and its future."""

    start: int
    future: Future[list[LoadedBlock]]
    retried: bool = False


def chain_order(blocks: list[KVBlock]) -> list[KVBlock]:
    """``blocks`` deepest first: by their depth in the chains among ``blocks`` (a block whose parent is not
    among them is a head), the deepest first, the heads last.

    A full level drops its least recently written entries first (disk: least recently used; a write counts
    as a use), and a lookup stops at a chain's first missing block: written head first (the pool's block
    order), a chain longer than its level's budget kept its tail and lost its head, so a restart served none
    of it. Written deepest first, the heads are the newest and a too-small level keeps the chain's head (what
    a lookup can serve). The pool evicts a chain's tail before its head, so write-back while serving keeps
    the same order.
    """
    by_hash = {b.block_hash: b for b in blocks}
    depth: dict[int, int] = {}

    def depth_of(block: KVBlock) -> int:
        path: list[KVBlock] = []
        cur: KVBlock | None = block
        while cur is not None and cur.block_id not in depth and len(path) <= len(blocks):
            path.append(cur)
            cur = by_hash.get(cur.parent_hash) if cur.parent_hash is not None else None
        d = depth[cur.block_id] if cur is not None and cur.block_id in depth else -1
        for b in reversed(path):
            d += 1
            depth[b.block_id] = d
        return depth[block.block_id]

    return sorted(blocks, key=depth_of, reverse=True)


class PoolTiers:
    """Write-back and load-back between a ``KVCacheManager`` and a ``TierStack``.

    Args:
        kv: the engine's KV cache manager (its pool calls ``on_evict``).
        kv_cache: the pool's KV tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.
        stack: the tiers.
    """

    def __init__(self, kv: KVCacheManager, kv_cache: torch.Tensor, stack: TierStack) -> None:
        self.kv = kv
        self.kv_cache = kv_cache
        self.stack = stack
        self.counters = stack.counters
        self._prefetches: dict[str, _Prefetch] = {}

    # ---- write-back -----------------------------------------------------------------------------------
    def on_evict(self, block: KVBlock) -> None:
        """Offer an evicted cached block to the write-back queue (copying its KV out of the pool)."""
        if block.block_hash is None or block.token_ids is None:
            return
        if self.stack.queue.full():
            self.counters.add("writeback.dropped")
            return
        meta = BlockMeta(block.block_hash, block.parent_hash, tuple(block.token_ids), tuple(block.extra_keys))
        kv = self.kv_cache[:, :, block.block_id].clone()
        self.stack.write_back(meta, frozenset(block.levels), kv)

    def write_all_cached(self) -> int:
        """Write every cached block of the pool (referenced or not) down now, on this thread (shutdown, so a
        restart finds them), deepest first (``chain_order``). Returns how many were written."""
        n = 0
        for block in chain_order(list(self.kv.registered_blocks())):
            meta = BlockMeta(block.block_hash, block.parent_hash, tuple(block.token_ids), block.extra_keys)
            self.stack.write_now(meta, frozenset(block.levels), self.kv_cache[:, :, block.block_id].clone())
            n += 1
        return n

    # ---- prefetch -------------------------------------------------------------------------------------
    def usable_blocks(self, token_ids: list[int]) -> int:
        """Blocks of a prompt a hit may cover: the last token is always computed."""
        return (len(token_ids) - 1) // self.kv.block_size

    def metas(
        self, token_ids: list[int], hashes: list[BlockHash], extra_keys: ExtraKeys, start: int, end: int
    ) -> list[BlockMeta]:
        """Identities of blocks ``[start, end)`` of a prompt (each block with its own extra keys: a layered
        request's public blocks carry the shared salt, ``engine.block_hash.LayeredKeys``)."""
        bs = self.kv.block_size
        return [
            BlockMeta(
                hashes[i],
                hashes[i - 1] if i else None,
                tuple(token_ids[i * bs : (i + 1) * bs]),
                block_extra_keys(extra_keys, i),
            )
            for i in range(start, end)
        ]

    def start_prefetch(
        self, request_id: str, token_ids: list[int], hashes: list[BlockHash], extra_keys: ExtraKeys
    ) -> bool:
        """Start reading the part of the prompt's chain the pool lacks. Returns True when a read started."""
        cap = min(self.usable_blocks(token_ids), len(hashes))
        ram = len(self.kv.find_cached_prefix(token_ids, hashes[:cap], extra_keys))
        if ram >= cap:
            return False
        metas = self.metas(token_ids, hashes, extra_keys, ram, cap)
        self._prefetches[request_id] = _Prefetch(ram, self.stack.prefetch(metas))
        return True

    def pending(self) -> list[Future]:
        """Futures of the reads still running."""
        return [p.future for p in self._prefetches.values() if not p.future.done()]

    def ready(
        self, request_id: str, token_ids: list[int], hashes: list[BlockHash], extra_keys: ExtraKeys
    ) -> bool:
        """False while the request's tier read runs; when it is done, install what it found and return True."""
        p = self._prefetches.get(request_id)
        if p is None:
            return True
        if not p.future.done():
            return False
        del self._prefetches[request_id]
        try:
            loaded = p.future.result()
        except Exception:  # a tier bug must cost a miss, not the request
            log.exception("tier read failed")
            self.counters.add("prefetch.errors")
            return True
        cap = min(self.usable_blocks(token_ids), len(hashes))
        hit = self.kv.find_cached_prefix(token_ids, hashes[:cap], extra_keys)
        if len(hit) < p.start and not p.retried:
            # The pool lost part of the prefix while the read ran: read again from where it now stops.
            metas = self.metas(token_ids, hashes, extra_keys, len(hit), cap)
            self._prefetches[request_id] = _Prefetch(len(hit), self.stack.prefetch(metas), retried=True)
            self.counters.add("prefetch.retried")
            return False
        if len(hit) >= p.start:
            self.install(hit, loaded[len(hit) - p.start :])
        return True

    def forget(self, request_id: str) -> None:
        """Drop a finished or aborted request's read (its result is not installed)."""
        self._prefetches.pop(request_id, None)

    # ---- load-back ------------------------------------------------------------------------------------
    def install(self, hit: PrefixHit, loaded: list[LoadedBlock]) -> int:
        """Copy ``loaded`` (the chain right after ``hit``) into fresh pool blocks and register them
        (``KVCacheManager.install_blocks``). Returns blocks installed."""
        device = self.kv_cache.device

        def write_kv(block_id: int, i: int) -> None:
            self.kv_cache[:, :, block_id].copy_(loaded[i].kv.to(device))

        n = self.kv.install_blocks(hit, [b.meta for b in loaded], write_kv)
        if n:
            self.counters.add("loaded_blocks", n)
        return n
