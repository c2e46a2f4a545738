"""The tier stack: the tiers below the RAM pool, in lookup order (disk, then Redis), as one object.

What the engine calls:

- ``write_back(meta, levels, kv)`` when a cached block leaves the pool: ``kv`` is a copy of its KV
  (taken on the step thread, before the block is reused); encoding and tier writes happen on the write-back
  thread (``engine.kv_tiers.writeback``), never on the step thread;
- ``prefetch(metas)`` when a request's prefix lookup stops in the pool: the rest of its hash chain is read on
  the prefetch thread, tier by tier per block (disk first, then Redis), stopping at the first block no tier
  has; it returns a future of the blocks found, decoded and checked (``engine.kv_tiers.entry``);
- ``lookup(metas)``: the same, synchronously (tests, benchmarks, warming).

An entry that fails a check is counted by cause (``rejected.{cause}``), removed from that tier, and the next
tier is asked for the block; a block no tier serves ends the chain. Nothing a tier does raises into the
engine: failures are counted misses or skipped writes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from engine.block_hash import BlockHash
from engine.kv_tiers.catalog import (
    RECORD_KEY_PREFIX,
    PrefixRecord,
    decode_record,
    encode_record,
    is_record_key,
)
from engine.kv_tiers.counters import TIER_COUNTERS, TierCounters
from engine.kv_tiers.entry import (
    REJECT_CAUSES,
    BlockMeta,
    EntryRejected,
    KVLayout,
    decode_entry,
    encode_entry,
    entry_meta,
)
from engine.kv_tiers.policy import LEVELS
from engine.kv_tiers.writeback import WriteBackQueue
from engine.openmp_threads import serial_torch_thread

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class Tier(Protocol):
    """One tier: ``engine.kv_tiers.disk.DiskTier`` or ``engine.kv_tiers.redis_tier.RedisTier``."""

    name: str

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes, levels: frozenset[str]) -> bool: ...

    def delete(self, key: str) -> bool: ...

    def nbytes(self) -> int: ...

    def scan_heads(self) -> Iterator[tuple[str, bytes]]: ...

    def keys(self) -> Iterator[tuple[str, str]]: ...

    def peek(self, key: str) -> tuple[bool, float | None]: ...

    def peek_many(self, keys: Sequence[str]) -> list[tuple[bool, float | None]]: ...

    def close(self) -> None: ...


@dataclass
class LoadedBlock:
    """A block read back from a tier: its identity, its KV (``layout.block_shape``, CPU) and the tier."""

    meta: BlockMeta
    kv: torch.Tensor
    tier: str


@dataclass
class _Write:
    meta: BlockMeta
    levels: frozenset[str]
    kv: torch.Tensor


@dataclass
class _RecordWrite:
    key: str
    data: bytes | None  # None: forget the record
    levels: frozenset[str]


_FAILURE_COUNTERS = ("read_errors", "write_errors", "skipped_down")
"""A tier's counters that grow when one of its calls failed or was skipped (it catches its own failures)."""


class TierStack:
    """The tiers below the RAM pool, their write-back queue, prefetch thread and counters.

    Args:
        layout: the engine's KV layout (keys and entry format).
        tiers: tiers in lookup order (disk first, then Redis).
        counters: shared with the tiers.
        writeback_capacity: blocks the write-back queue holds before it drops.
    """

    def __init__(
        self, layout: KVLayout, tiers: list[Tier], counters: TierCounters, writeback_capacity: int = 256
    ) -> None:
        self.layout = layout
        self.tiers = list(tiers)
        self.counters = counters
        self._bytes: dict[str, int] = {t.name: 0 for t in self.tiers}
        self._bytes_at = 0.0
        self.bytes_refresh_s = 1.0
        """Tier sizes are measured on the writer thread: at most this often during a burst of writes, at its end,
        and every ``queue.idle_s`` seconds without writes (``stats`` does no I/O)."""
        self.queue: WriteBackQueue[_Write] = WriteBackQueue(
            writeback_capacity, self._write, counters, idle=self._housekeep
        )
        self._prefetcher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-prefetch", initializer=serial_torch_thread
        )
        self._measure_bytes()

    @property
    def tier_names(self) -> list[str]:
        """Names of the tiers, in lookup order."""
        return [t.name for t in self.tiers]

    def key(self, meta: BlockMeta) -> str:
        """The block's key in every tier."""
        return self.layout.tier_key(meta.block_hash)

    # ---- writes ---------------------------------------------------------------------------------------
    def write_back(self, meta: BlockMeta, levels: frozenset[str], kv: torch.Tensor) -> bool:
        """Queue one block for every tier without waiting. ``kv`` must be the caller's own copy.

        Returns:
            False when the queue was full (the block is dropped and counted).
        """
        return self.queue.offer(_Write(meta, levels, kv))

    def write_now(self, meta: BlockMeta, levels: frozenset[str], kv: torch.Tensor) -> None:
        """Encode and write one block to every tier on the calling thread (tests, warming at start)."""
        self._write(_Write(meta, levels, kv))

    def _write(self, item: _Write | _RecordWrite) -> None:
        if isinstance(item, _RecordWrite):
            for tier in self.tiers:
                if item.data is None:
                    tier.delete(item.key)
                else:
                    tier.put(item.key, item.data, item.levels)
            return
        data = encode_entry(self.layout, item.meta, item.kv)
        key = self.key(item.meta)
        for tier in self.tiers:
            tier.put(key, data, item.levels)
        if time.monotonic() - self._bytes_at >= self.bytes_refresh_s:
            self._measure_bytes()

    def _housekeep(self) -> None:
        """The writer thread's work between bursts: expired entries swept (and counted) where a tier sweeps,
        then the tiers' sizes measured (a burst's last writes, and expiry, change them)."""
        for tier in self.tiers:
            sweep = getattr(tier, "sweep_expired", None)
            if sweep is not None:
                sweep()
        self._measure_bytes()

    def _measure_bytes(self) -> None:
        self._bytes = self.nbytes()
        self._bytes_at = time.monotonic()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is done (then measure the tiers' sizes). Returns False on timeout."""
        done = self.queue.flush(timeout_s)
        self._measure_bytes()
        return done

    # ---- reads ----------------------------------------------------------------------------------------
    def lookup(self, metas: list[BlockMeta]) -> list[LoadedBlock]:
        """Read the longest run of ``metas`` (a hash chain, in order) the tiers hold, checked.

        Counts per tier ``{t}.hit_tokens`` (blocks it served) and ``{t}.miss_tokens`` (blocks it was asked
        for and did not serve), ``rejected.{cause}``, and the load-back latency.

        Returns:
            The blocks found, in chain order (a prefix of ``metas``).
        """
        t0 = time.perf_counter()
        bs = self.layout.block_size
        out: list[LoadedBlock] = []
        for meta in metas:
            found = self._read_one(meta, bs)
            if found is None:
                break
            out.append(found)
        if out:
            self.counters.observe_load(time.perf_counter() - t0)
        return out

    def _read_one(self, meta: BlockMeta, block_size: int) -> LoadedBlock | None:
        key = self.key(meta)
        for tier in self.tiers:
            data = tier.get(key)
            if data is not None:
                try:
                    kv = decode_entry(self.layout, meta, data)
                except EntryRejected as e:
                    self.counters.add(f"rejected.{e.cause}")
                    log.info("tier %s entry %s rejected: %s", tier.name, key[:16], e)
                    tier.delete(key)
                else:
                    self.counters.add(f"{tier.name}.hit_tokens", block_size)
                    return LoadedBlock(meta, kv, tier.name)
            self.counters.add(f"{tier.name}.miss_tokens", block_size)
        return None

    def prefetch(self, metas: list[BlockMeta]) -> Future[list[LoadedBlock]]:
        """``lookup(metas)`` on the prefetch thread."""
        return self._prefetcher.submit(self.lookup, metas)

    # ---- admin ----------------------------------------------------------------------------------------
    def _admin_call(
        self, tier: Tier, call: Callable[[], _T], fallback: _T, skipped: dict[str, str] | None
    ) -> _T:
        """``call()`` (one admin operation on ``tier``), failing soft as the request path does: a tier that
        raises, or that counted a failure or a skip while it ran (it catches its own: a delete that failed
        reads as "nothing deleted"), is counted (``{tier}.admin_errors``) and named in ``skipped`` (tier ->
        reason); a raised call returns ``fallback``. Never raises: an admin answer never fails on a tier."""
        before = [self.counters.get(f"{tier.name}.{c}") for c in _FAILURE_COUNTERS]
        reason = None
        try:
            result = call()
        except Exception as e:  # noqa: BLE001 - any tier failure is a skipped tier, never an admin 500
            result, reason = fallback, f"{type(e).__name__}: {e}"
            log.warning("tier %s skipped by an admin operation: %s", tier.name, reason)
        else:
            after = [self.counters.get(f"{tier.name}.{c}") for c in _FAILURE_COUNTERS]
            failed = [c for c, b, a in zip(_FAILURE_COUNTERS, before, after, strict=True) if a > b]
            if failed:
                reason = f"some operations failed ({', '.join(failed)})"
        if reason is not None:
            self.counters.add(f"{tier.name}.admin_errors")
            if skipped is not None:
                skipped.setdefault(tier.name, reason)
        return result

    def delete(self, meta: BlockMeta) -> int:
        """Remove the block from every tier. Returns how many tiers held it."""
        key = self.key(meta)
        return sum(1 for t in self.tiers if t.delete(key))

    def presence(
        self, hashes: list[BlockHash], skipped: dict[str, str] | None = None, ram_blocks: int = 0
    ) -> dict[str, tuple[int, float | None]]:
        """Per tier: how many blocks of a chain's servable head it holds, and the soonest any of those expires
        (None: none of them does, or it holds none).

        The servable head is what a request for the chain gets now: the ``ram_blocks`` leading blocks the RAM
        pool holds, then the run a lookup reads on from the tiers (each block from a tier holding it, up to
        the first block none holds). A tier counts its copies of the pool's blocks (a run from the first, as a
        restarted engine would read them) and the blocks of the run below them it holds. Before, a tier
        counted only a run from the chain's first block, so a tier holding the tail the pool had evicted below
        a head still in RAM, and serving it, was listed with 0 (a trial). A chain's blocks can be kept under
        different levels (a system prompt's for a day, a conversation's history for minutes): from the
        soonest expiry on the tier serves less of it. A tier that fails holds nothing here and is named in
        ``skipped`` (``_admin_call``; counted once per call). Blocks are peeked in chunks of 1, 4, 16, ...
        (``peek_many``), so a tier holding nothing of the chain costs one peek."""
        keys = [self.layout.tier_key(h) for h in hashes]
        ram = min(ram_blocks, len(keys))
        kept: dict[str, list[float | None]] = {t.name: [] for t in self.tiers}

        failed: dict[str, str] = {}  # a tier that failed once is not asked again in this call

        def peek(tier: Tier, part: list[str]) -> list[tuple[bool, float | None]]:
            if tier.name not in failed:
                found = self._admin_call(tier, lambda: tier.peek_many(part), [], failed)
                if tier.name not in failed and len(found) == len(part):
                    return found
            return [(False, None)] * len(part)

        for tier in self.tiers:  # the pool's blocks: this tier's copies, a run from the first
            at, step = 0, 1
            while at < ram:
                part = keys[at : min(ram, at + step)]
                found = peek(tier, part)
                run = next((j for j, (present, _) in enumerate(found) if not present), len(found))
                kept[tier.name] += [expires_at for _, expires_at in found[:run]]
                if run < len(part):
                    break
                at, step = at + len(part), step * 4
        at, step = ram, 1
        while at < len(keys):  # the run below them, each block from any tier holding it
            part = keys[at : at + step]
            found = {t.name: peek(t, part) for t in self.tiers}
            for j in range(len(part)):
                holders = [name for name, f in found.items() if f[j][0]]
                if not holders:
                    at = len(keys)
                    break
                for name in holders:
                    kept[name].append(found[name][j][1])
            else:
                at, step = at + len(part), step * 4
        if skipped is not None:
            for name, reason in failed.items():
                skipped.setdefault(name, reason)
        return {
            name: (len(exp), min((e for e in exp if e is not None), default=None))
            for name, exp in kept.items()
        }

    def delete_chain(self, hashes: list[BlockHash], skipped: dict[str, str] | None = None) -> dict[str, int]:
        """Remove the blocks of a chain from every tier. Returns entries removed per tier; a tier that fails
        is named in ``skipped`` (``_admin_call``) with what it removed before."""

        def delete(tier: Tier) -> int:
            return sum(1 for h in hashes if tier.delete(self.layout.tier_key(h)))

        return {t.name: self._admin_call(t, lambda t=t: delete(t), 0, skipped) for t in self.tiers}

    def drop_where(
        self, match: Callable[[BlockMeta], bool], skipped: dict[str, str] | None = None
    ) -> dict[str, int]:
        """Remove every entry (of any tier) whose claimed identity ``match``es, e.g. a tenant's or a model's.

        O(entries): reads the head of every entry. A tier whose scan or deletes fail (Redis down) is left as
        it is, counted and named in ``skipped`` (``_admin_call``); the other tiers are dropped all the same.

        Returns:
            Entries removed per tier (0 for a tier whose scan failed).
        """

        def drop(tier: Tier) -> int:
            doomed = []
            for key, head in tier.scan_heads():
                meta = entry_meta(head)
                if meta is not None and match(meta):
                    doomed.append(key)
            return sum(1 for key in doomed if tier.delete(key))

        return {t.name: self._admin_call(t, lambda t=t: drop(t), 0, skipped) for t in self.tiers}

    # ---- prefix records (engine.kv_tiers.catalog) ------------------------------------------------------
    def record_key(self, prefix_key: str) -> str:
        """The tier key of a prefix record: ``catalog-`` + hex sha256(model digest, layout digest, prefix key),
        so another model's or layout's records never share it."""
        digest = self.layout.model_digest() + self.layout.layout_digest() + prefix_key.encode()
        return RECORD_KEY_PREFIX + hashlib.sha256(digest).hexdigest()

    def save_record(self, rec: PrefixRecord) -> bool:
        """Queue ``rec`` for every tier, kept under its level, without waiting (as ``write_back``).

        Returns:
            False when the queue was full (the record is not kept down; counted as a dropped write).
        """
        item = _RecordWrite(self.record_key(rec.prefix_key), encode_record(rec), frozenset({rec.level}))
        return self.queue.offer(item)

    def forget_record(self, prefix_key: str) -> bool:
        """Queue the removal of a prefix record from every tier without waiting (a record the catalog's bound
        pushed out). Returns False when the queue was full (it stays down until a start reads it back)."""
        return self.queue.offer(_RecordWrite(self.record_key(prefix_key), None, frozenset()))

    def delete_record(self, prefix_key: str, skipped: dict[str, str] | None = None) -> int:
        """Remove a prefix record from every tier (on the calling thread). Returns how many tiers held it; a
        tier that fails is named in ``skipped`` (``_admin_call``)."""
        key = self.record_key(prefix_key)
        return sum(1 for t in self.tiers if self._admin_call(t, lambda t=t: t.delete(key), False, skipped))

    def load_records(self, model_id: str) -> list[PrefixRecord]:
        """The prefix records of ``model_id`` the tiers keep, oldest use first (one per prefix key: the latest
        use among tiers). O(entries): at start only. A malformed record, or one kept under a key that is not its
        own, is skipped; a tier that is down (Redis unreachable at start) or fails to list is skipped (counted
        ``{tier}.read_errors`` when it fails): its records are not listed until a request names them again."""
        found: dict[str, PrefixRecord] = {}
        for tier in self.tiers:
            if getattr(tier, "is_down", False):
                continue
            try:
                keys = [key for _, key in tier.keys() if is_record_key(key)]
            except Exception as e:  # noqa: BLE001 - a tier down at start (Redis) costs its records, not the start
                self.counters.add(f"{tier.name}.read_errors")
                log.warning("prefix records in tier %s not read: %s", tier.name, e)
                continue
            for key in keys:
                data = tier.get(key)
                rec = None if data is None else decode_record(data)
                if rec is None or rec.model_id != model_id or self.record_key(rec.prefix_key) != key:
                    continue
                known = found.get(rec.prefix_key)
                if known is None or rec.last_use > known.last_use:
                    found[rec.prefix_key] = rec
        return sorted(found.values(), key=lambda r: r.last_use)

    def nbytes(self) -> dict[str, int]:
        """Bytes per tier."""
        return {t.name: t.nbytes() for t in self.tiers}

    def stats(self) -> dict[str, int]:
        """Every counter (each tier's ``TIER_COUNTERS`` and ``{t}.expired.{level}``, every
        ``rejected.{cause}``, the write-back queue's and ``loaded_blocks`` from 0 on, so a rate is defined
        before the first event), ``{t}.bytes`` per tier (as last measured by the writer thread: no I/O here, so the engine lock
        is never held for a tier call), ``{t}.up`` (0 while the tier waits to retry an unreachable backend,
        else 1) and ``writeback.depth``."""
        out = self.counters.snapshot()
        for tier in self.tiers:
            for counter in TIER_COUNTERS:
                out.setdefault(f"{tier.name}.{counter}", 0)
            for level in LEVELS:
                out.setdefault(f"{tier.name}.expired.{level}", 0)
        for cause in REJECT_CAUSES:
            out.setdefault(f"rejected.{cause}", 0)
        for name in ("writeback.queued", "writeback.dropped", "writeback.errors", "loaded_blocks"):
            out.setdefault(name, 0)
            out[f"{tier.name}.up"] = 0 if getattr(tier, "is_down", False) else 1
        for name, n in self._bytes.items():
            out[f"{name}.bytes"] = n
        out["writeback.depth"] = self.queue.depth()
        return out

    def close(self) -> None:
        """Write what is queued, stop the threads, close the tiers."""
        self.queue.close()
        self._prefetcher.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
