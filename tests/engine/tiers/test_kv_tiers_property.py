"""Property test: the KV manager's state machine (``tests/engine/test_kv_cache_property.py``) with a disk tier
under its 8-block pool. Evicted blocks are written down (the pool's eviction hook), a new rule loads a prompt's
missing prefix back from the tier before admission, and after every step:

- no referenced block was evicted or overwritten, no block leaked (the base machine's invariants);
- every hit, including blocks just loaded back, serves exactly the KV of its tenant and prefix;
- every tier entry is stored under the key of the block it claims, decodes, and holds exactly the KV of
  that block's tenant and prefix (tier contents consistent with their keys).

The shadow KV is the pool tensor itself: each block's 16 values encode (tenant, token prefix) its KV was
"computed" from, so a block copied in from a tier is checked like a computed one.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, precondition, rule

from engine.block_hash import block_extra_keys
from engine.kv_tiers.config import build_tier_stack
from engine.kv_tiers.entry import KVLayout, decode_entry, entry_meta
from engine.kv_tiers.keys import keyed_block_hash
from engine.kv_tiers.policy import TierPolicies
from engine.kv_tiers.pool_link import PoolTiers
from engine.kv_tiers.settings import DiskTierConfig, RedisTierConfig
from tests.engine.test_kv_cache_property import (
    BASES,
    BLOCK_SIZE,
    NUM_BLOCKS,
    TENANTS,
    KVCacheMachine,
    salts,
)

LAYOUT = KVLayout("m", "test", "float32", BLOCK_SIZE, 1, 1, 2)


def code(shadow: tuple) -> torch.Tensor:
    """16 float32 values that identify ``shadow`` (tenant, token prefix)."""
    digest = hashlib.sha256(repr(shadow).encode()).digest()[:16]
    return torch.tensor(list(digest), dtype=torch.float32).view(1, 2, BLOCK_SIZE, 1, 2)


class TensorShadow:
    """The base machine's ``kv`` dict (block id -> shadow), stored in and read from the pool tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.ident: dict[bytes, tuple] = {}

    def __setitem__(self, block_id: int, shadow: tuple) -> None:
        value = code(shadow)
        self.tensor[:, :, block_id] = value
        self.ident[value.numpy().tobytes()] = shadow

    def get(self, block_id: int, default=None):
        return self.ident.get(self.tensor[:, :, block_id].contiguous().numpy().tobytes(), default)

    def __getitem__(self, block_id: int) -> tuple | None:
        return self.get(block_id)


class TieredKVMachine(KVCacheMachine):
    hash_fn = staticmethod(keyed_block_hash(b"property-test-secret"))

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="pg-tier-prop-")
        self.stack = build_tier_stack(
            ("disk",),
            LAYOUT,
            disk=DiskTierConfig(self.dir, 1 << 24),
            redis=RedisTierConfig(),
            policies=TierPolicies(),
            writeback_capacity=1024,
        )
        tensor = torch.zeros(1, 2, NUM_BLOCKS, BLOCK_SIZE, 1, 2)
        self.kv = TensorShadow(tensor)
        self.link = PoolTiers(self.m, tensor, self.stack)
        self.m.pool.on_evict = self.link.on_evict
        # block hash -> (the block's own extra keys, its shadow: salts of its chain and token prefix)
        self.prefix_of: dict[bytes, tuple] = {}
        self.loads = 0

    def remember(self, prompt: list[int], tenant: tuple) -> list[bytes]:
        hashes = self.m.block_hashes(prompt, tenant)
        for j, h in enumerate(hashes):
            shadow = (salts(tenant, j), tuple(prompt[: (j + 1) * BLOCK_SIZE]))
            self.prefix_of[h] = (block_extra_keys(tenant, j), shadow)
        return hashes

    @rule(
        base=st.integers(0, len(BASES) - 1),
        plen=st.one_of(st.sampled_from([5, 8, 9, 13]), st.integers(1, 34)),
        suffix=st.one_of(st.just([]), st.lists(st.integers(0, 4), max_size=4)),
        tenant=st.sampled_from(TENANTS),
        prefill_now=st.booleans(),
    )
    def submit(self, base, plen, suffix, tenant, prefill_now) -> None:
        self.remember(BASES[base][:plen] + suffix, tenant)
        super().submit(base, plen, suffix, tenant, prefill_now)

    @rule(
        base=st.integers(0, len(BASES) - 1),
        plen=st.integers(5, 34),
        tenant=st.sampled_from(TENANTS),
        prefill_now=st.booleans(),
    )
    def load_back_then_submit(self, base, plen, tenant, prefill_now) -> None:
        """Read the prompt's missing prefix from the tier, install it, then submit (checks every hit's KV)."""
        prompt = BASES[base][:plen]
        hashes = self.remember(prompt, tenant)
        rid = f"load{self.next_id}"
        self.stack.flush()
        if self.link.start_prefetch(rid, prompt, hashes, tenant):
            self.link._prefetches[rid].future.result(10)
            before = self.m.blocks_used
            assert self.link.ready(rid, prompt, hashes, tenant)
            assert self.m.blocks_used == before  # installed blocks are cached, not held
        self.loads += 1
        super().submit(base, plen, [], tenant, prefill_now)

    @rule()
    def memory_pressure(self) -> None:
        """A request takes every available block and leaves: every cached unreferenced block is evicted
        (written down through the pool's eviction hook)."""
        n = self.m.num_free_blocks()
        if n and self.m.allocate("pressure", n * BLOCK_SIZE) is not None:
            self.m.free("pressure")
        assert self.m.blocks_cached == 0

    @precondition(lambda self: any(r.computed == len(r.tokens) for r in self.reqs.values()))
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 4), min_size=1, max_size=5))
    def decode(self, data, new_tokens) -> None:
        super().decode(data, new_tokens)
        for req in self.reqs.values():  # generated tokens fill blocks that are cached (and written down) too
            self.remember(req.tokens, req.extra)

    @invariant()
    def tier_entries_match_their_keys(self) -> None:
        self.stack.flush()
        (disk,) = self.stack.tiers
        for _, key in list(disk.keys()):
            data = disk.get(key)
            if data is None:
                continue
            meta = entry_meta(data)
            assert meta is not None and LAYOUT.tier_key(meta.block_hash) == key
            kv = decode_entry(LAYOUT, meta, data)
            keys, shadow = self.prefix_of[meta.block_hash]
            assert meta.extra_keys == keys and meta.token_ids == shadow[1][-BLOCK_SIZE:]
            assert torch.equal(kv, code(shadow))

    def teardown(self) -> None:
        super().teardown()
        self.stack.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestTieredKVProperties = TieredKVMachine.TestCase
TestTieredKVProperties.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
