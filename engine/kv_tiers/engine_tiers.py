"""What one ``LLMEngine`` does with its tiers, request by request.

- at construction: check the settings, build the tier stack (``engine.kv_tiers.config``), link it to the pool
  (``engine.kv_tiers.pool_link``: evicted blocks are written down);
- at submit (``on_submit``): start reading the part of the prompt's chain the pool lacks (prefetch thread);
- at admission (``ready``, the scheduler's gate): False while that read runs (the request waits, the others
  step); then the blocks found are installed in the pool and the scheduler's lookup hits them;
- at finish (``on_finish``): the request's levels are merged into its blocks (they decide each block's TTL
  and budget share when it is written down); a warming request with ``pin`` pins its prompt blocks;
- ``flush(write_cached)``: wait for queued writes (and first write every cached block down); ``close``.

The engine stays correct with every tier down: a tier failure is a counted miss or a skipped write.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

import torch

from engine.api import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_tiers.config import build_tier_stack
from engine.kv_tiers.disk import TierConfigError
from engine.kv_tiers.entry import KVLayout
from engine.kv_tiers.policy import level_of_blocks
from engine.kv_tiers.pool_link import PoolTiers
from engine.request import Request


class EngineTiers:
    """The tiers of one engine (see the module docstring).

    Args:
        config: the engine's settings (``tiers`` non-empty).
        kv: its KV cache manager (hashing with the deployment's keyed hash).
        kv_cache: its pool tensor.
        layout: its KV layout (model id, weight format, KV dtype, shape).
        clock: wall-clock seconds for TTLs (tests pass a fake one).

    Raises:
        TierConfigError: a tier cannot start (key and reason), or tiers without prefix caching (they keep the
            prefix cache's blocks: with ``enable_prefix_caching`` false there are none, and they did nothing).
    """

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        kv_cache: torch.Tensor,
        layout: KVLayout,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not config.enable_prefix_caching:
            raise TierConfigError(
                "engine.tiers",
                "need enable_prefix_caching: the tiers keep the prefix cache's blocks, and with "
                "enable_prefix_caching false there are none (remove tiers or turn prefix caching on)",
            )
        self.config = config
        self.kv = kv
        self.stack = build_tier_stack(
            tuple(config.tiers),
            layout,
            disk=config.tier_disk,
            redis=config.tier_redis,
            policies=config.tier_policies,
            writeback_capacity=config.tier_writeback_capacity,
            clock=clock,
        )
        self.link = PoolTiers(kv, kv_cache, self.stack)
        kv.set_evict_listener(self.link.on_evict)
        self.counters = self.stack.counters

    # ---- the request path -----------------------------------------------------------------------------
    def on_submit(self, req: Request) -> None:
        """Start the tier read of the part of ``req``'s prompt chain the pool lacks (if any)."""
        if self.kv.enable_caching:
            self.link.start_prefetch(req.request_id, req.all_token_ids, req.block_hashes, req.extra_keys)

    def ready(self, req: Request) -> bool:
        """The scheduler's admission gate: False while ``req``'s tier read runs; installs its result once."""
        return self.link.ready(req.request_id, req.all_token_ids, req.block_hashes, req.extra_keys)

    def has_pending(self) -> bool:
        """True while a tier read runs."""
        return bool(self.link.pending())

    def wait_pending(self, timeout_s: float) -> None:
        """Block until one tier read finishes or ``timeout_s`` passes (only when nothing else can run)."""
        pending = self.link.pending()
        if pending:
            wait_futures(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def on_finish(self, req: Request) -> None:
        """Merge the request's levels into its blocks (before they are freed); forget its read."""
        self.link.forget(req.request_id)
        if req.request_id not in self.kv:
            return
        num = len(req.prompt_token_ids) // self.kv.block_size
        levels = level_of_blocks(
            num, self.kv.block_size, req.level_ends, self.config.tier_policies.default_level
        )
        self.kv.tag_levels(req.request_id, levels)

    # ---- shutdown and stats ---------------------------------------------------------------------------
    def flush(self, write_cached: bool = True, timeout_s: float = 60.0) -> bool:
        """Write every cached block down (when ``write_cached``) and wait for the queue to drain."""
        if write_cached:
            self.link.write_all_cached()
        return self.stack.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        """Tier counters, bytes per tier, write-back queue depth (``engine.kv_tiers.counters``)."""
        return self.stack.stats()

    def close(self) -> None:
        """Flush (writing cached blocks down when ``tier_flush_on_close``), stop the threads, close the tiers."""
        self.flush(write_cached=self.config.tier_flush_on_close)
        self.kv.set_evict_listener(None)
        self.stack.close()
