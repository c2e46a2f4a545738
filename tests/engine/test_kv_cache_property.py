"""Property test: random submit / compute / decode / free / reset sequences on a tiny pool (8 blocks of 4).

A shadow "KV tensor" records what each physical block holds (the tenant and the token prefix its KV was
computed from). After every step we check that the manager never leaks or double-counts a block, that a
failed allocation changes nothing, that a block is written only while exclusively held, that no block
held by a live request is ever evicted or overwritten, and that every prefix hit serves exactly the KV of
the requested prefix, with a strong hash and with a weak one that collides all the time.

Tenants include layered ones (``LayeredKeys``: a public prefix of 1 or 2 blocks under a shared salt, then the
tenant's salt). The shadow records, per block, the salt of every block of the chain it was computed on, so
the hit check is the isolation invariant: a tenant only ever hits blocks whose every salt, from the first
block on, is the one its own request carries for that block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_hash import BlockHash, LayeredKeys, block_extra_keys, hash_block
from engine.errors import PromptTooLongError
from engine.kv_cache_manager import KVCacheManager

NUM_BLOCKS, BLOCK_SIZE = 8, 4
BASES = [[(b * 7 + i) % 5 for i in range(32)] for b in range(3)]  # 3 prompt families sharing prefixes
SHARED = ("m", ("shared", "public"))
TENANTS = [
    ("m", ""),
    ("m", "tenant-b"),
    LayeredKeys(SHARED, 1, ("m", "")),
    LayeredKeys(SHARED, 2, ("m", "")),
    LayeredKeys(SHARED, 1, ("m", "tenant-b")),
    LayeredKeys(SHARED, 2, ("m", "tenant-b")),
    LayeredKeys(SHARED, 2, ("m", "tenant-c")),
]


def salts(extra, j: int) -> tuple:
    """The extra keys of blocks 0..j of a request with extra keys ``extra``: what its block j depends on."""
    return tuple(block_extra_keys(extra, i) for i in range(j + 1))


def weak_hash(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple) -> BlockHash:
    """Collides constantly: only the token sum mod 3 and the parent count, extra keys are ignored."""
    return hashlib.sha256((parent or b"") + bytes([sum(token_ids) % 3])).digest()


@dataclass
class Req:
    tokens: list[int]
    prompt_hashes: list[BlockHash]
    computed: int
    extra: tuple


class KVCacheMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(hash_block)

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_fn=self.hash_fn)
        self.reqs: dict[str, Req] = {}
        self.kv: dict[int, tuple] = {}  # block id -> (extra keys, token prefix its KV was computed from)
        self.next_id = 0

    def snapshot(self) -> tuple:
        pool = self.m.pool
        return (
            [(b.ref_cnt, b.block_hash, b.cache_gen, b.token_ids) for b in pool.blocks],
            list(pool.free_ids()),
            list(pool.evictable_ids()),
            self.m.usage(),
            {rid: self.m.block_table(rid) for rid in self.reqs},
        )

    def expected_kv(self, req: Req, j: int, upto: int) -> tuple:
        return (salts(req.extra, j), tuple(req.tokens[: min(upto, (j + 1) * BLOCK_SIZE)]))

    @rule(
        base=st.integers(0, len(BASES) - 1),
        plen=st.one_of(st.sampled_from([5, 8, 9, 13]), st.integers(1, 34)),  # shared lengths + anything
        suffix=st.one_of(st.just([]), st.lists(st.integers(0, 4), max_size=4)),
        tenant=st.sampled_from(TENANTS),
        prefill_now=st.booleans(),
    )
    def submit(self, base: int, plen: int, suffix: list[int], tenant: tuple, prefill_now: bool) -> None:
        prompt = BASES[base][:plen] + suffix
        rid = f"r{self.next_id}"
        self.next_id += 1
        hashes = self.m.block_hashes(prompt, tenant)
        hits = self.m.find_cached_prefix(prompt, hashes[: (len(prompt) - 1) // BLOCK_SIZE], tenant)
        for j, block_id in enumerate(hits.block_ids):  # a hit serves exactly this tenant's KV of this prefix
            assert self.kv.get(block_id) == (salts(tenant, j), tuple(prompt[: (j + 1) * BLOCK_SIZE]))
        before = self.snapshot()
        if len(prompt) > NUM_BLOCKS * BLOCK_SIZE:
            for call in (
                lambda: self.m.can_allocate(len(prompt), hits),
                lambda: self.m.allocate(rid, len(prompt), hits),
            ):
                try:
                    call()
                except PromptTooLongError as err:
                    assert err.what == "pool"
                else:
                    raise AssertionError("a prompt longer than the pool was accepted")
            assert self.snapshot() == before
            return
        ok = self.m.can_allocate(len(prompt), hits)
        assert self.snapshot() == before
        table = self.m.allocate(rid, len(prompt), hits)
        if table is None:
            assert not ok
            assert self.snapshot() == before
            return
        assert ok
        assert table[: len(hits)] == hits.block_ids
        assert len(table) == -(-len(prompt) // BLOCK_SIZE)
        self.reqs[rid] = Req(list(prompt), hashes, hits.num_tokens, tenant)
        if prefill_now:
            self.write(rid, len(prompt))

    def write(self, rid: str, new: int) -> None:
        """A forward pass writes KV for tokens [computed, new), then full blocks are offered to the cache."""
        req = self.reqs[rid]
        table = self.m.block_table(rid)
        for j in range(req.computed // BLOCK_SIZE, -(-new // BLOCK_SIZE)):
            block = self.m.pool.blocks[table[j]]
            assert block.ref_cnt == 1, f"writing into block {block.block_id} shared by {block.ref_cnt}"
            assert block.block_hash is None, "writing into a registered block"
            self.kv[table[j]] = self.expected_kv(req, j, new)
        req.computed = new
        self.m.cache_full_blocks(rid, req.tokens, new, req.prompt_hashes, req.extra)

    @precondition(lambda self: any(r.computed < len(r.tokens) for r in self.reqs.values()))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """A (chunked) forward pass over the next k tokens of a request."""
        rid = data.draw(
            st.sampled_from(sorted(r for r, q in self.reqs.items() if q.computed < len(q.tokens)))
        )
        req = self.reqs[rid]
        self.write(rid, data.draw(st.integers(req.computed + 1, len(req.tokens))))

    @precondition(lambda self: any(r.computed == len(r.tokens) for r in self.reqs.values()))
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 4), min_size=1, max_size=5))
    def decode(self, data: st.DataObject, new_tokens: list[int]) -> None:
        """Sampled tokens extend a request; its table must grow to hold them (or nothing changes)."""
        rid = data.draw(
            st.sampled_from(sorted(r for r, q in self.reqs.items() if q.computed == len(q.tokens)))
        )
        req = self.reqs[rid]
        before = self.snapshot()
        if self.m.append_slots(rid, len(req.tokens) + len(new_tokens)):
            req.tokens.extend(new_tokens)
            assert len(self.m.block_table(rid)) == -(-len(req.tokens) // BLOCK_SIZE)
        else:
            assert self.snapshot() == before

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        del self.reqs[rid]
        self.m.free(rid)
        self.m.free(rid)  # a second free is a no-op

    @rule()
    def reset_prefix_cache(self) -> None:
        referenced_entries = sum(1 for b in self.m.pool.blocks if b.block_hash is not None and b.ref_cnt > 0)
        assert self.m.reset_prefix_cache() == (referenced_entries == 0)
        assert self.m.blocks_cached == 0

    @invariant()
    def accounting_is_exact(self) -> None:
        m = self.m
        assert set(m._requests) == set(self.reqs)
        m.check_invariants()  # used + cached + free == total; ref counts == live block tables
        assert m.blocks_used + m.blocks_cached + m.blocks_free == NUM_BLOCKS
        assert m.num_free_blocks() == m.blocks_cached + m.blocks_free

    @invariant()
    def live_blocks_keep_their_kv(self) -> None:
        """No block held by a live request was evicted and rewritten: its KV is still its own prefix."""
        for rid, req in self.reqs.items():
            for j, block_id in enumerate(self.m.block_table(rid)):
                if j * BLOCK_SIZE < req.computed:
                    assert self.kv[block_id] == self.expected_kv(req, j, req.computed)

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.m.free(rid)
        self.reqs.clear()
        assert self.m.blocks_used == 0
        assert self.m.blocks_free + self.m.blocks_cached == NUM_BLOCKS
        self.m.check_invariants()


class WeakHashMachine(KVCacheMachine):
    hash_fn = staticmethod(weak_hash)


_settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVCacheProperties = KVCacheMachine.TestCase
TestKVCacheProperties.settings = _settings
TestKVCacheWeakHashProperties = WeakHashMachine.TestCase
TestKVCacheWeakHashProperties.settings = _settings
