"""Every miss explained: where a request's cached prefix stopped short of its stable prefix, and why.

``MissExplainer`` keeps, per model+tenant, a bounded index of recent prompts (token ids with their
block-hash chains at ``block_size`` 16 for the cached-chain set; least recently used dropped first, bounded in entries and bytes) and
the set of block chains known to have been cached (with when). For one request it is given the prompt's
token ids, its segments as token ranges (``tools``, ``system``, ``documents``, ``history``, ``tail``), where
its stable prefix ends and how many tokens the engine or upstream reported cached, and answers with a
``MissExplanation``: a miss or not, the cause, the segment and token offset where the prompt diverged from
the nearest earlier prompt of the same model+tenant, the learned-slot candidate, and for ``evicted`` how
long ago the prefix was known cached.

Causes (``MISS_CAUSES``), decided in this order:

- ``below_minimum``: the stable prefix is shorter than the upstream's minimum cacheable length.
- ``evicted``: the first uncached block's chain was known cached before (it was cached, and is not now).
- ``cold``: nothing earlier shares a token with the prompt, the shared part was never known cached, or the
  prompt only extends an earlier one (new content: nothing to hit).
- at the divergence from the nearest earlier prompt, by segment: ``tools_changed`` (tools),
  ``volatile`` (a known volatile span covers it, or in system/documents text the prompts re-converge after a
  short span), ``system_changed`` (system), ``history_rewritten`` (history: client compaction, an edited or
  retried turn, a template that rewrites earlier turns), ``cold`` (a new document).

A provider's own diagnostic, when an upstream returns one, is mapped to the same causes
(``gateway.service.miss_explanation.map_provider_cause``) and takes precedence over the local cause; the local segment and offset are kept.

The vocabulary (causes, segments, ``MissExplanation``, the header) lives in ``miss_explanation``; the
counters in ``miss_counters``; the chain hashes in ``token_chains``.

Invariants: a miss starts where the reported cached prefix ends or after it (``offset >= cached``: the
explanation never places a miss inside the span the engine or upstream served; a divergence from a recorded
prompt that lies inside it, which happens when the cache holds what the index never saw, is ``cold`` at
``cached``); nothing here holds or returns prompt text (token ids stay inside the index and never leave it);
memory is bounded by ``max_keys``, ``max_prompts_per_key``, ``max_bytes`` and ``max_cached_chains``
(``footprint``); chain hashes are BLAKE2b-128 rooted in model and tenant; divergence offsets are found on
the stored token ids (binary search over array slice compares). Pure Python, no HTTP.
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.service.miss_explanation import (
    SEGMENT_NAMES,
    MissExplainError,
    MissExplanation,
    PromptSegment,
    VolatileSpan,
    map_provider_cause,
)
from gateway.service.token_chains import chain_hashes, common_tokens

DEFAULT_BLOCK_SIZE = 16

_MAX_TOKEN = (1 << 32) - 1
_ENTRY_OVERHEAD = 256
_REJOIN_WINDOW = 8


@dataclass
class _Entry:
    tokens: array
    segments: tuple[PromptSegment, ...]
    seen_at: float
    digest: bytes = b""  # BLAKE2b-128 of ``tokens``: the key of ``MissExplainer._seqs``

    @property
    def nbytes(self) -> int:
        return _ENTRY_OVERHEAD + 4 * len(self.tokens)


class MissExplainer:
    """The per-model+tenant index of recent prompts and known cached chains, and the explanation of a miss.

    Args:
        block_size: tokens per block of the chain hashes (the engine's block size, 16).
        max_keys: model+tenant keys kept.
        max_prompts_per_key: prompts kept per key.
        max_bytes: bytes of prompts kept in all (4 per token + 256 per prompt, estimated).
        max_cached_chains: known cached block chains kept (LRU).
        max_volatile_tokens: longest span after which two prompts must re-converge for a divergence in
            system or document text to count as ``volatile``.
        clock: seconds since the epoch (``time.time``; tests pass their own).

    Per request the gateway calls ``explain`` (with the reported cached count), then ``record`` (the prompt is
    now known), then ``mark_cached`` with how far the prompt is now cached. Thread-safe (one lock).
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_keys: int = 1024,
        max_prompts_per_key: int = 64,
        max_bytes: int = 64 << 20,
        max_cached_chains: int = 200_000,
        max_volatile_tokens: int = 32,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_keys", max_keys),
            ("max_prompts_per_key", max_prompts_per_key),
            ("max_bytes", max_bytes),
            ("max_cached_chains", max_cached_chains),
            ("max_volatile_tokens", max_volatile_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MissExplainError(f"{name} must be a positive integer, not {value!r}")
        self.block_size = block_size
        self.max_keys = max_keys
        self.max_prompts_per_key = max_prompts_per_key
        self.max_bytes = max_bytes
        self.max_cached_chains = max_cached_chains
        self.max_volatile_tokens = max_volatile_tokens
        self._clock = clock
        self._keys: OrderedDict[tuple[str, str], OrderedDict[int, _Entry]] = OrderedDict()
        self._lru: OrderedDict[tuple[tuple[str, str], int], None] = OrderedDict()
        # (key, digest of the tokens) -> seq of the stored prompt: ``record`` finds an identical prompt without
        # comparing it with every prompt of the key (docs/overhead.md, session 7)
        self._seqs: dict[tuple[tuple[str, str], bytes], int] = {}
        self._bytes = 0
        self._seq = 0
        self._cached: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    # ----- inputs -----------------------------------------------------------------------------------------
    @staticmethod
    def _root(model: str, tenant: str) -> bytes:
        if not isinstance(model, str) or not isinstance(tenant, str):
            raise MissExplainError("model and tenant must be strings")
        return hashlib.blake2b(f"{len(model)}:{model}\x00{tenant}".encode(), digest_size=16).digest()

    @staticmethod
    def _tokens(tokens: Iterable[int]) -> array:
        try:
            data = array("I", tokens)
        except (TypeError, OverflowError, ValueError):
            raise MissExplainError(f"tokens must be integers in [0, {_MAX_TOKEN}]") from None
        return data

    @staticmethod
    def _segments(segments: Iterable[PromptSegment], n: int) -> tuple[PromptSegment, ...]:
        out = tuple(segments)
        pos = 0
        for i, s in enumerate(out):
            if not isinstance(s, PromptSegment) or s.name not in SEGMENT_NAMES:
                raise MissExplainError(f"segments[{i}] must be a PromptSegment named one of {SEGMENT_NAMES}")
            if s.start != pos or s.end < s.start:
                raise MissExplainError(f"segments[{i}] must start where the previous one ended ({pos})")
            pos = s.end
        if out and pos != n:
            raise MissExplainError(f"segments must cover the prompt's {n} tokens (they end at {pos})")
        return out

    @staticmethod
    def _count(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MissExplainError(f"{name} must be a non-negative integer, not {value!r}")
        return value

    # ----- explaining -------------------------------------------------------------------------------------
    def explain(
        self,
        model: str,
        tenant: str,
        tokens: Sequence[int],
        segments: Iterable[PromptSegment],
        stable_end: int,
        cached_tokens: int,
        *,
        min_cacheable: int | None = None,
        granularity: int | None = None,
        volatile_spans: Iterable[VolatileSpan] = (),
        provider_cause: str | None = None,
    ) -> MissExplanation:
        """Explain one request's cache result (read-only: call ``record`` and ``mark_cached`` after).

        Args:
            model, tenant: the key (the prefix key's model id and cache salt).
            tokens: the prompt's token ids (ints in [0, 2**32)), as the engine or a tokenizer of the model
                saw them.
            segments: contiguous ``PromptSegment`` token ranges covering the prompt, in order.
            stable_end: token offset where the stable prefix ends (the start of the volatile tail).
            cached_tokens: tokens the engine or upstream reported cached (clamped to the prompt length).
            min_cacheable: the upstream's minimum cacheable prompt length in tokens (e.g. 1024), or None.
            granularity: the cache's unit in tokens (the engine's block size, an upstream's 128-token steps);
                ``block_size`` when None.
            volatile_spans: token ranges of known volatile values (learned-slot matches).
            provider_cause: the upstream's own diagnostic, if it gave one (see ``map_provider_cause``).

        Raises:
            MissExplainError: bad tokens, segments or counts.
        """
        root = self._root(model, tenant)
        data = self._tokens(tokens)
        n = len(data)
        segs = self._segments(segments, n)
        stable_end = min(self._count(stable_end, "stable_end"), n)
        cached = min(self._count(cached_tokens, "cached_tokens"), n)
        unit = self.block_size if granularity is None else self._count(granularity, "granularity") or 1
        reach = min(stable_end, max(n - 1, 0))
        reach -= reach % unit
        if cached >= reach:
            return MissExplanation(cached, reach, False)
        provider = map_provider_cause(provider_cause)
        chains = chain_hashes(data, self.block_size, root)
        local = self._local_cause(
            model,
            tenant,
            data,
            chains,
            segs,
            stable_end,
            cached,
            reach,
            unit,
            min_cacheable,
            tuple(volatile_spans),
        )
        cause, at, slot, ago = local
        where = _segment_at(segs, at - 1 if cause == "below_minimum" and at > 0 else at)
        if provider is not None and provider != cause:
            return MissExplanation(
                cached,
                reach,
                True,
                provider,
                where,
                at,
                slot if provider == "volatile" else None,
                None,
                "provider",
            )
        return MissExplanation(cached, reach, True, cause, where, at, slot, ago, "local")

    def _local_cause(
        self,
        model: str,
        tenant: str,
        data: array,
        chains: list[bytes],
        segs: tuple[PromptSegment, ...],
        stable_end: int,
        cached: int,
        reach: int,
        unit: int,
        min_cacheable: int | None,
        spans: tuple[VolatileSpan, ...],
    ) -> tuple[str, int, str | None, float | None]:
        """(cause, offset, slot, cached_ago) of a miss."""
        if min_cacheable is not None and reach < self._count(min_cacheable, "min_cacheable"):
            return "below_minimum", stable_end, None, None
        bs = self.block_size
        with self._lock:
            first = cached // bs
            if first < len(chains) and first * bs < reach and chains[first] in self._cached:
                return "evicted", cached, None, max(0.0, self._clock() - self._cached[chains[first]])
            nearest = self._nearest(model, tenant, data)
        if nearest is None:
            return "cold", cached, None, None
        entry, d = nearest
        if d == 0 or cached < d - d % unit or d < cached:
            # d < cached: the cache served past where this prompt leaves every prompt the index knows (a
            # warmed prefix, generated tokens, a prompt dropped from the index, another gateway's): that
            # divergence is not why the hit stopped, and lies inside what was served
            return "cold", cached, None, None
        old_len = len(entry.tokens)
        if d >= old_len - old_len % bs:
            # the earlier prompt is all shared: what follows it is new (past what the cache served: with
            # token-granular hits it may also have served the earlier request's own generated tokens)
            return "cold", max(d, cached), None, None
        slot_span = next((s for s in spans if s.start - 1 <= d < s.end), None)
        names = {_segment_at(segs, d), _segment_at(entry.segments, d)}
        if "tools" in names:
            return "tools_changed", d, None, None
        if slot_span is not None:
            return "volatile", d, slot_span.slot, None
        if "system" in names:
            if self._rejoins(data, entry.tokens, d):
                return "volatile", d, None, None
            return "system_changed", d, None, None
        if "history" in names:
            return "history_rewritten", d, None, None
        if "documents" in names and self._rejoins(data, entry.tokens, d):
            return "volatile", d, None, None
        return "cold", d, None, None

    def _nearest(self, model: str, tenant: str, data: array) -> tuple[_Entry, int] | None:
        """The recorded prompt of the key sharing the longest token prefix with ``data``, and that length
        (ties: the most recent)."""
        entries = self._keys.get((model, tenant))
        if not entries:
            return None
        best: tuple[_Entry, int] | None = None
        for entry in reversed(entries.values()):
            d = common_tokens(data, entry.tokens, 0)
            if best is None or d > best[1]:
                best = (entry, d)
        return best

    def _rejoins(self, new: array, old: array, d: int) -> bool:
        """True when, within ``max_volatile_tokens`` after ``d``, both prompts continue with the same
        ``_REJOIN_WINDOW`` tokens (the divergence is a short span with identical text after it)."""
        limit = self.max_volatile_tokens
        windows = {
            tuple(old[d + j : d + j + _REJOIN_WINDOW]): j
            for j in range(limit + 1)
            if d + j + _REJOIN_WINDOW <= len(old)
        }
        for i in range(limit + 1):
            if d + i + _REJOIN_WINDOW > len(new):
                break
            j = windows.get(tuple(new[d + i : d + i + _REJOIN_WINDOW]))
            if j is not None and (i, j) != (0, 0):
                return True
        return False

    # ----- recording --------------------------------------------------------------------------------------
    def record(
        self, model: str, tenant: str, tokens: Sequence[int], segments: Iterable[PromptSegment]
    ) -> None:
        """Add a prompt to the key's index (an identical prompt is only refreshed).

        Raises:
            MissExplainError: bad tokens or segments.
        """
        self._root(model, tenant)
        data = self._tokens(tokens)
        segs = self._segments(segments, len(data))
        key = (model, tenant)
        digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
        with self._lock:
            entries = self._keys.get(key)
            if entries is None:
                entries = self._keys[key] = OrderedDict()
                while len(self._keys) > self.max_keys:
                    self._drop_key(next(iter(self._keys)))
            else:
                self._keys.move_to_end(key)
            seq = self._seqs.get((key, digest))
            same = entries.get(seq) if seq is not None else None
            if same is not None and same.tokens == data:
                same.seen_at = self._clock()
                entries.move_to_end(seq)
                self._lru.move_to_end((key, seq))
                return
            entry = _Entry(data, segs, self._clock(), digest)
            if entry.nbytes > self.max_bytes:
                return
            self._seq += 1
            entries[self._seq] = entry
            self._lru[(key, self._seq)] = None
            self._seqs[(key, digest)] = self._seq
            self._bytes += entry.nbytes
            while len(entries) > self.max_prompts_per_key:
                self._drop_entry(key, next(iter(entries)))
            while self._bytes > self.max_bytes:
                self._drop_entry(*next(iter(self._lru)))

    def mark_cached(self, model: str, tenant: str, tokens: Sequence[int], upto: int | None = None) -> int:
        """Note that the prompt's full blocks within its first ``upto`` tokens (all when None) are now cached.

        Returns:
            the number of block chains noted.

        Raises:
            MissExplainError: bad tokens or ``upto``.
        """
        root = self._root(model, tenant)
        data = self._tokens(tokens)
        limit = len(data) if upto is None else min(self._count(upto, "upto"), len(data))
        chains = chain_hashes(data[:limit], self.block_size, root)
        now = self._clock()
        with self._lock:
            for h in chains:
                self._cached[h] = now
                self._cached.move_to_end(h)
            while len(self._cached) > self.max_cached_chains:
                self._cached.popitem(last=False)
        return len(chains)

    def _drop_key(self, key: tuple[str, str]) -> None:
        for seq in list(self._keys[key]):
            self._drop_entry(key, seq)
        self._keys.pop(key, None)

    def _drop_entry(self, key: tuple[str, str], seq: int) -> None:
        entries = self._keys.get(key)
        entry = entries.pop(seq) if entries is not None else None
        self._lru.pop((key, seq), None)
        if entry is not None:
            self._bytes -= entry.nbytes
            if self._seqs.get((key, entry.digest)) == seq:
                del self._seqs[(key, entry.digest)]
        if entries is not None and not entries:
            self._keys.pop(key, None)

    def footprint(self) -> dict[str, int]:
        """``keys``, ``prompts``, ``bytes`` (estimated, as bounded by ``max_bytes``), ``cached_chains``."""
        with self._lock:
            return {
                "keys": len(self._keys),
                "prompts": len(self._lru),
                "bytes": self._bytes,
                "cached_chains": len(self._cached),
            }


def _segment_at(segments: Sequence[PromptSegment], offset: int) -> str:
    """The name of the segment holding token ``offset`` (``tail`` past the end or with no segments); an
    empty segment never holds a token."""
    for s in segments:
        if s.start <= offset < s.end:
            return s.name
    return "tail"
