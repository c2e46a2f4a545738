"""Every miss explained: where a request's cached prefix stopped short of its stable prefix, and why.

``MissExplainer`` keeps, per model+tenant, a bounded index of recent prompts (token ids with their
block-hash chains at ``block_size`` 16 for the cached-chain set; least recently used dropped first, bounded in entries and bytes;
a prompt followed by the answer served to it, ``record_answer``, replaces that prompt's entry, its last segment, ``history``, the answer) and
the set of block chains known to have been cached (with when). For one request it is given the prompt's
token ids, its segments as token ranges (``tools``, ``system``, ``documents``, ``history``, ``tail``), where
its stable prefix ends and how many tokens the engine or upstream reported cached, and answers with a
``MissExplanation``: a miss or not, the cause, the segment and token offset where the prompt diverged from
the nearest earlier prompt of the same model+tenant, the learned-slot candidate, and for ``evicted`` how
long ago the prefix was known cached.

Terms: ``unit`` is the cache's granularity (the engine's block size; an upstream's step); the *target* is
what the cache could have served: the stable prefix rounded down to ``unit`` and short of the last prompt
token (always computed), or, when that is empty, the whole prompt so rounded (the engine caches every full
block of a prompt, so a short system prompt with a long question is still cacheable); and, when the nearest
earlier prompt is a prompt followed by its served answer that this prompt shares all the engine computed of,
no more than that computed part so rounded (the answer's last sampled token when it is part of the answer, the
end of its turn and the new turn were never computed: ``record_answer``). A request is a miss
when fewer tokens were reported cached than the target, and whenever nothing was cached of a non-empty
prompt (``cached=0`` is never ``miss=none``). *Evidence* is what the explainer knew when the request began
(``epoch``): prompts recorded and blocks marked cached by requests that finished while this one was in
flight are not evidence, since the cache lookup of this request could not have found them.

Causes (``MISS_CAUSES``), decided in this order (docs/cache-explanations.md):

- ``below_minimum``: the target is shorter than the upstream's minimum cacheable length, or empty (the whole
  prompt is shorter than one ``unit`` plus its last token): nothing of it could be cached.
- ``evicted``: the first uncached block's chain was marked cached before the request began (it was cached,
  and the cache served less), on the replica that served the request or with no replica known.
- ``other_replica``: that chain was marked cached before the request began only on other replicas of the
  model than the one that served it (the router sent the turn elsewhere: load, a failover, a policy without
  affinity); its cache never held it.
- ``cold``: no earlier prompt shares a token with this one; or the shared part was never known cached; or the
  cache served past where the nearest earlier prompt diverges; or this prompt only extends an earlier one
  (new content); or the nearest earlier prompt shares less than one ``unit`` and the two do not re-converge
  after the divergence (a new prompt, not an edit of an earlier one); or the divergence lies in a document or
  in the volatile tail (new content).
- ``reply_cut``: the nearest earlier prompt is followed by a reply cut by ``max_tokens`` inside a character (its
  text ended in U+FFFD: the caller's ``record_answer(cut=True)``) and the divergence lies in that reply's last
  ``CUT_TAIL`` tokens, before the last token the engine computed (the resent text spells the cut end
  otherwise). A reply cut between characters comes back as served; a divergence in it is an edit.
- otherwise, at the divergence ``d`` from the nearest earlier prompt (either prompt's segment at ``d``):
  ``tools_changed`` (tools, unless both prompts carry a tools digest and the digests are equal: the tools are
  the same and only where the template cut them moved, e.g. a system text added after a tools-only system
  message, so the other prompt's segment there, or the segment the tools lead into, names the cause),
  ``volatile`` (a known volatile span covers ``d``: a learned slot's match, a rule's value in a
  rules-off system prompt, a value in a hoisted-value block; its slot id is reported), ``system_changed`` (system), ``history_rewritten`` (history: client compaction, an
  edited or retried turn, a template that rewrites earlier turns). ``volatile`` is never guessed from the
  shape of the edit: an ordinary edit of a system prompt is ``system_changed``.

A provider's own diagnostic, when an upstream returns one, is mapped to the same causes
(``gateway.service.miss_explanation.map_provider_cause``) and takes precedence over the local cause; the local segment and offset are kept.

The vocabulary (causes, segments, ``MissExplanation``, the header) lives in ``miss_explanation``; the
counters in ``miss_counters``; the chain hashes in ``token_chains``; the segment geometry (which segment holds an
offset, whether two prompts re-converge after a divergence) in ``miss_segments``; a recorded prompt and the choice
of the one that explains a divergence in ``miss_entries``.

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
from typing import Any, NamedTuple

from gateway.service.miss_entries import CUT_TAIL, Entry, Reply, nearest_entry
from gateway.service.miss_explanation import (
    MissExplainError,
    MissExplanation,
    PromptSegment,
    VolatileSpan,
    map_provider_cause,
)
from gateway.service.miss_segments import divergence_segments, rejoins, segment_at, validated_segments
from gateway.service.token_chains import chain_hashes

DEFAULT_BLOCK_SIZE = 16

MAX_PLACES = 8
"""Replicas a cached chain is remembered on (the newest kept): past it a chain cached on more replicas may
read ``other_replica`` on one whose mark was forgotten."""

_MAX_TOKEN = (1 << 32) - 1


class Epoch(NamedTuple):
    """What the explainer knew at one moment (``MissExplainer.epoch``): the last prompt recorded and the last
    ``mark_cached`` call then. A request's explanation takes as evidence only what was known when it began."""

    prompts: int
    marks: int


class MissExplainer:
    """The per-model+tenant index of recent prompts and known cached chains, and the explanation of a miss.

    Args:
        block_size: tokens per block of the chain hashes (the engine's block size, 16).
        max_keys: model+tenant keys kept.
        max_prompts_per_key: prompts kept per key.
        max_bytes: bytes of prompts kept in all (4 per token + 256 per prompt, estimated).
        max_cached_chains: known cached block chains kept (LRU).
        max_edit_tokens: longest changed span after which two prompts must re-converge (continue with the same
            tokens) for a divergence within the first cache unit to count as an edit of the earlier prompt
            (its segment's cause) rather than a new prompt (``cold``).
        clock: seconds since the epoch (``time.time``; tests pass their own).

    Per request the gateway takes an ``epoch`` when the request begins, calls ``explain`` (with the reported
    cached count and that epoch), then ``record`` (the prompt is now known), then ``mark_cached`` with how far
    the prompt is now cached, and once answered ``record_answer`` when the answer's tokens are known (the
    embedded engine). Thread-safe (one lock).
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_keys: int = 1024,
        max_prompts_per_key: int = 64,
        max_bytes: int = 64 << 20,
        max_cached_chains: int = 200_000,
        max_edit_tokens: int = 64,
        clock: Callable[[], float] = time.time,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_keys", max_keys),
            ("max_prompts_per_key", max_prompts_per_key),
            ("max_bytes", max_bytes),
            ("max_cached_chains", max_cached_chains),
            ("max_edit_tokens", max_edit_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MissExplainError(f"{name} must be a positive integer, not {value!r}")
        self.block_size = block_size
        self.max_keys = max_keys
        self.max_prompts_per_key = max_prompts_per_key
        self.max_bytes = max_bytes
        self.max_cached_chains = max_cached_chains
        self.max_edit_tokens = max_edit_tokens
        self._clock = clock
        self._keys: OrderedDict[tuple[str, str], OrderedDict[int, Entry]] = OrderedDict()
        self._lru: OrderedDict[tuple[tuple[str, str], int], None] = OrderedDict()
        # (key, digest of the tokens) -> seq of the stored prompt: ``record`` finds an identical prompt without
        # comparing it with every prompt of the key (docs/overhead.md, session 7)
        self._seqs: dict[tuple[tuple[str, str], bytes], int] = {}
        self._bytes = 0
        self._seq = 0
        # chain -> (when last marked cached, the ``mark_cached`` call that first marked it, the replicas it was
        # marked cached on with the call that first marked it there: at most MAX_PLACES, the newest last)
        self._cached: OrderedDict[bytes, tuple[float, int, tuple[tuple[str, int], ...]]] = OrderedDict()
        self._marks = 0
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
    def _digest(value: Any) -> bytes | None:
        if value is not None and not isinstance(value, bytes):
            raise MissExplainError(f"tools_digest must be bytes or None, not {type(value).__name__}")
        return value

    @staticmethod
    def _count(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise MissExplainError(f"{name} must be a non-negative integer, not {value!r}")
        return value

    def epoch(self) -> Epoch:
        """What is known now: pass it to ``explain`` for a request that begins now, so prompts and blocks that
        requests finishing meanwhile record are not taken as evidence about this one."""
        with self._lock:
            return Epoch(self._seq, self._marks)

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
        epoch: Epoch | None = None,
        tools_digest: bytes | None = None,
        replica: str | None = None,
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
            volatile_spans: token ranges of known volatile values (learned-slot matches, a rules-off system
                prompt's rule values, the values in hoisted-value blocks).
            provider_cause: the upstream's own diagnostic, if it gave one (see ``map_provider_cause``).
            epoch: ``epoch()`` when the request began; None takes everything recorded so far as evidence.
            tools_digest: a digest of the request's tools as sent (``b""`` for none; ``RenderedPrompt``'s), or
                None (unknown): with the nearest earlier prompt's, it tells whether the tools changed where
                the two prompts' tools segments disagree at the divergence.
            replica: the upstream replica that served the request (its base URL), or None (an embedded
                engine; unknown): a prefix known cached only on other replicas is ``other_replica``.

        Raises:
            MissExplainError: bad tokens, segments or counts.
        """
        root = self._root(model, tenant)
        data = self._tokens(tokens)
        n = len(data)
        segs = validated_segments(segments, n)
        stable_end = min(self._count(stable_end, "stable_end"), n)
        cached = min(self._count(cached_tokens, "cached_tokens"), n)
        unit = self.block_size if granularity is None else self._count(granularity, "granularity") or 1
        end = stable_end
        reach = min(stable_end, max(n - 1, 0))
        reach -= reach % unit
        if reach == 0:  # a stable prefix shorter than a unit: the target is the whole prompt's full units
            end = n
            reach = max(n - 1, 0) - max(n - 1, 0) % unit
        if cached >= reach and (cached > 0 or n == 0):
            return MissExplanation(cached, reach, False)
        with self._lock:
            nearest = self._nearest(model, tenant, data, None if epoch is None else epoch.prompts)
        held = self._held(nearest, unit)
        if held is not None and held < reach:
            # this prompt continues all the engine computed of an answered prompt: the cache cannot hold more
            reach = held
            if cached >= reach and cached > 0:
                return MissExplanation(cached, reach, False)
        provider = map_provider_cause(provider_cause)
        chains = chain_hashes(data, self.block_size, root)
        local = self._local_cause(
            data,
            chains,
            segs,
            end,
            cached,
            reach,
            unit,
            min_cacheable,
            tuple(volatile_spans),
            epoch,
            self._digest(tools_digest),
            nearest,
            replica,
        )
        cause, at, slot, ago = local
        where = segment_at(segs, at - 1 if cause == "below_minimum" and at > 0 else at)
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

    @staticmethod
    def _held(nearest: tuple[Entry, int] | None, unit: int) -> int | None:
        """What the cache can hold of a prompt whose nearest earlier prompt is ``nearest`` (entry, shared
        tokens), rounded down to ``unit``, when that entry is a prompt followed by its served answer and the
        prompt shares all the engine computed of it: the tokens after it (the answer's last sampled token, which
        is never fed to the model, the end of its turn, the new turn) were never computed. None otherwise."""
        if nearest is None or nearest[0].reply is None:
            return None
        computed = nearest[0].reply.computed
        if nearest[1] < computed:
            return None
        return computed - computed % unit

    def _local_cause(
        self,
        data: array,
        chains: list[bytes],
        segs: tuple[PromptSegment, ...],
        end: int,
        cached: int,
        reach: int,
        unit: int,
        min_cacheable: int | None,
        spans: tuple[VolatileSpan, ...],
        epoch: Epoch | None,
        tools: bytes | None,
        nearest: tuple[Entry, int] | None,
        replica: str | None = None,
    ) -> tuple[str, int, str | None, float | None]:
        """(cause, offset, slot, cached_ago) of a miss (``end``: where the target ends, unrounded; ``nearest``:
        the nearest earlier prompt of the evidence and the tokens it shares, ``_nearest``)."""
        if reach == 0 or (min_cacheable is not None and reach < self._count(min_cacheable, "min_cacheable")):
            return "below_minimum", max(end, cached), None, None
        bs = self.block_size
        with self._lock:
            first = cached // bs
            known = self._cached.get(chains[first]) if first < len(chains) and first * bs < reach else None
            if known is not None and (epoch is None or known[1] <= epoch.marks):
                ago = max(0.0, self._clock() - known[0])
                places = [r for r, mark in known[2] if epoch is None or mark <= epoch.marks]
                if replica is not None and places and replica not in places:
                    return "other_replica", cached, None, ago
                return "evicted", cached, None, ago
        if nearest is None:
            return "cold", cached, None, None
        entry, d = nearest
        if d == 0 or cached < d - d % unit or d < cached:
            # d < cached: the cache served past where this prompt leaves every prompt the index knows (a
            # warmed prefix, generated tokens, a prompt dropped from the index, another gateway's): that
            # divergence is not why the hit stopped, and lies inside what was served
            return "cold", cached, None, None
        reply = entry.reply
        if reply is not None and reply.cut_from is not None and reply.cut_from <= d < reply.computed:
            # the resent text of a reply cut by max_tokens spells its cut end otherwise (a character cut in
            # two comes back as U+FFFD): the KV the engine computed for the reply from ``d`` is lost
            return "reply_cut", d, None, None
        old_len = len(entry.tokens)
        if d >= old_len - old_len % bs and not (reply is not None and d < old_len):
            # the earlier prompt is all shared: what follows it is new (past what the cache served: with
            # token-granular hits it may also have served the earlier request's own generated tokens). Not
            # when it ends with an answer this prompt leaves before its end: the client edited that reply
            # (a short answer can end in the block the edit is in)
            return "cold", max(d, cached), None, None
        if d < unit and not rejoins(data, entry.tokens, d, segs, entry.segments, self.max_edit_tokens):
            # less than a unit in common (a template's header) and nothing in common after it: a new prompt
            return "cold", cached, None, None
        slot_span = next((s for s in spans if s.start - 1 <= d < s.end), None)
        names = divergence_segments(segs, entry.segments, d, tools is not None and tools == entry.tools)
        if "tools" in names:
            return "tools_changed", d, None, None
        if slot_span is not None:
            return "volatile", d, slot_span.slot, None
        if "system" in names:
            return "system_changed", d, None, None
        if "history" in names:
            return "history_rewritten", d, None, None
        return "cold", d, None, None  # a new or edited document, or the new question: content never cached

    def _nearest(self, model: str, tenant: str, data: array, upto: int | None) -> tuple[Entry, int] | None:
        """The key's recorded prompt that explains where ``data`` leaves them (``nearest_entry``)."""
        entries = self._keys.get((model, tenant))
        return nearest_entry(entries, data, upto) if entries else None

    # ----- recording --------------------------------------------------------------------------------------
    def record(
        self,
        model: str,
        tenant: str,
        tokens: Sequence[int],
        segments: Iterable[PromptSegment],
        extends: array | None = None,
        tools_digest: bytes | None = None,
    ) -> None:
        """Add a prompt to the key's index (an identical prompt is only refreshed: its time and tools digest; the
        served answer an identical entry carries, from ``record_answer``, is kept).

        ``extends``, a recorded prompt that ``tokens`` continues (``record_answer``: the prompt before its
        answer), is replaced in place by this one, keeping its place in the index (its sequence number, so a
        request whose epoch saw that prompt sees its continuation): one entry per answered request, not two.
        ``tools_digest``: the prompt's tools digest (``explain``), None when unknown.

        Raises:
            MissExplainError: bad tokens, segments or digest.
        """
        self._record(model, tenant, tokens, segments, extends, tools_digest, None)

    def _record(
        self,
        model: str,
        tenant: str,
        tokens: Sequence[int],
        segments: Iterable[PromptSegment],
        extends: array | None,
        tools_digest: bytes | None,
        reply: Reply | None,
    ) -> None:
        """``record``, the entry carrying ``reply`` (``record_answer``; None for a prompt)."""
        self._root(model, tenant)
        data = self._tokens(tokens)
        segs = validated_segments(segments, len(data))
        tools = self._digest(tools_digest)
        key = (model, tenant)
        digest = hashlib.blake2b(data.tobytes(), digest_size=16).digest()
        with self._lock:
            if extends is not None and self._extend(key, extends, data, segs, digest, tools, reply):
                return
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
                same.tools = tools
                if reply is not None:  # a prompt recorded again says nothing of the answer an entry carries:
                    same.reply = reply  # keep it, or a request whose epoch saw the entry would read another
                entries.move_to_end(seq)
                self._lru.move_to_end((key, seq))
                return
            entry = Entry(data, segs, self._clock(), digest, tools, reply)
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

    def record_answer(
        self,
        model: str,
        tenant: str,
        tokens: Sequence[int],
        segments: Iterable[PromptSegment],
        answer: Sequence[int],
        tools_digest: bytes | None = None,
        uncomputed: int = 0,
        cut: bool = False,
    ) -> None:
        """Record a prompt followed by the answer served to it (the model's token ids as its engine cached
        them): one prompt of the key whose last segment, ``history``, is the answer, as it is in the client's
        next request. A later prompt that resends the answer edited diverges from it inside that history
        (``history_rewritten``); one that resends it unedited shares all of it, and the cache can hold no more
        of it than the engine computed: the prompt and the answer less its ``uncomputed`` last ids (the last
        sampled token is never fed to the model). Such a prompt is a hit once that much is cached; past it a
        new turn starts. ``cut``: the reply was cut by ``max_tokens`` inside a character, so its resent text may spell its last
        ``CUT_TAIL`` tokens otherwise (``reply_cut`` where it does, before what the engine computed ends).

        Raises:
            MissExplainError: bad tokens, segments, answer tokens or ``uncomputed`` (not in [0, answer length]).
        """
        prompt = self._tokens(tokens)
        segs = validated_segments(segments, len(prompt)) or (PromptSegment("tail", 0, len(prompt)),)
        ids = self._tokens(answer)
        missing = self._count(uncomputed, "uncomputed")
        if missing > len(ids):
            raise MissExplainError(
                f"uncomputed must be at most the answer's {len(ids)} tokens, not {missing}"
            )
        end = len(prompt) + len(ids)
        history = PromptSegment("history", len(prompt), end)
        cut_from = max(len(prompt), end - CUT_TAIL) if cut else None
        reply = Reply(end - missing, cut_from)
        self._record(model, tenant, prompt + ids, (*segs, history), prompt, tools_digest, reply)

    def _extend(
        self,
        key: tuple[str, str],
        prompt: array,
        data: array,
        segs: tuple[PromptSegment, ...],
        digest: bytes,
        tools: bytes | None,
        reply: Reply | None,
    ) -> bool:
        """Replace the recorded ``prompt`` of ``key`` by its continuation ``data`` in place (caller holds the
        lock). False when the prompt is not recorded (dropped, or never recorded), the continuation is
        already recorded (the prompt's entry is then dropped: the continuation holds it) or is over the byte
        bound: the caller then records ``data`` as usual."""
        entries = self._keys.get(key)
        old_digest = hashlib.blake2b(prompt.tobytes(), digest_size=16).digest()
        seq = self._seqs.get((key, old_digest))
        entry = entries.get(seq) if entries is not None and seq is not None else None
        if entry is None or entry.tokens != prompt:
            return False
        if (key, digest) in self._seqs:
            self._drop_entry(key, seq)
            return False
        new = Entry(data, segs, self._clock(), digest, tools, reply)
        if new.nbytes > self.max_bytes:
            return False
        entries[seq] = new
        entries.move_to_end(seq)
        self._keys.move_to_end(key)
        self._lru.move_to_end((key, seq))
        del self._seqs[(key, old_digest)]
        self._seqs[(key, digest)] = seq
        self._bytes += new.nbytes - entry.nbytes
        while self._bytes > self.max_bytes:
            self._drop_entry(*next(iter(self._lru)))
        return True

    def mark_cached(
        self,
        model: str,
        tenant: str,
        tokens: Sequence[int],
        upto: int | None = None,
        replica: str | None = None,
    ) -> int:
        """Note that the prompt's full blocks within its first ``upto`` tokens (all when None) are now cached,
        on ``replica`` (the upstream replica that served the prompt; None: an embedded engine, or unknown).

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
            self._marks += 1
            for h in chains:
                known = self._cached.get(h)
                places = () if known is None else known[2]
                if replica is not None and all(r != replica for r, _ in places):
                    places = (*places, (replica, self._marks))[-MAX_PLACES:]
                self._cached[h] = (now, self._marks if known is None else known[1], places)
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
