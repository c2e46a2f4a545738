"""The scheduler: which requests run in the next step, and how many tokens each computes.

Continuous batching with chunked prefill, after vLLM v1's unified scheduler (every request has
``num_computed_tokens`` and a step gives each scheduled request some new tokens) and nano-vllm's
``schedule``/``preempt``. One step, under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_batch``):

1. **decodes** of running requests, oldest first, one token each. A decode that needs a new block and cannot
   get one preempts the *newest* running request (its blocks are freed; it goes back to the front of the
   waiting queue and is recomputed later, generated tokens included). A request that cannot grow even when it
   runs alone has filled the whole pool: it finishes with ``"length"``.
2. **prefill chunks** of running requests whose prompt is not computed yet (chunked prefill), oldest first.
3. **admissions** from the waiting queue, ordered by the policy. Admission looks up the longest cached prefix
   (a ``PrefixHit``: the scheduler sees block ids, hashes and counts, never the pool's blocks, and asks the pool
   only whether an idle prefill would evict recent entries; the last prompt
   token is always computed: hits cover at most ``(num_tokens - 1) // block_size`` whole blocks and, with
   token-granular hits, part of the next block up to the last token), allocates the
   request's whole block table at once (``KVCacheManager.allocate``: all or nothing; a request that cannot get
   blocks keeps waiting and blocks the queue behind it, so it is never starved by smaller ones), and schedules
   a first chunk.

**Long and short prefills** (``long_prefill_token_threshold``, T; default half the budget). A prefill with more
than T tokens left to compute (uncached tokens, for a waiting request) is *long*; the others are *short*. After
the decodes, short prefill chunks (2, then 3) are sized first and the long prefill's chunk last, from what they
leave; while a long prefill is in the step, the short chunks together take at most T tokens (and leave it at
least one). So a short prompt that arrives behind a long prefill is prefilled in the next step, between two of
the long prefill's chunks, instead of after its last one (head-of-line blocking: a 3,500-token prompt delayed a
51-token one's first token by 13 s), and the long prefill still gets at least ``max_num_batched_tokens - T -
decodes`` tokens every step however many short prompts arrive; with no short prefill it takes the whole budget.
Long prefills go oldest first: a younger one gets only what the older ones leave, and a long waiting request is
admitted only in a step where the long prefills already in it leave room, in practice the step of the last chunk
of the one before it (short ones behind it in the queue pass it; it takes no blocks while skipped). Several long
prompts are thus prefilled one after the other, not side by side: the first finishes as early as it can and the
last no later than side by side (one budget either way), the lowest mean time to first token for prompts of
similar length; side by side, all would get their first token near the end. With no short prompt about, the
plans are exactly those of T = 0, which turns all this off: running prefills take the budget first, oldest first,
and admissions get what is left.

**In-flight sharing** (grouping by prefix). The *pending* blocks are the full blocks that running requests
(and requests admitted earlier in this step) have not computed yet, keyed by block hash. A waiting request
whose next uncached block is pending in another request does not compute it: it stays waiting, right behind
that leader, and is admitted once the leader's blocks are written (the engine registers computed blocks in the
prefix cache after every step, so they are ordinary hits by then). It then prefills only its own suffix. The
hit tokens it waited for are counted as ``inflight_shared_tokens``. A follower takes no tokens of the step while
it waits, so it never delays its leader; it only skips work.

**Policies** (``EngineConfig.scheduling``):

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first (SGLang's "longest prefix match"); requests whose cached prefix ends in
  the same block are kept together so a shared prefix goes into one step.

Both put preempted requests first, then requests older than ``max_wait_s`` (the starvation bound: a request
waiting longer goes first regardless of its cached prefix), oldest first.

**Idle prefills** (``Request.idle``: a conversation's next-turn prefix, ``AsyncEngine.prefill_next_turn``). They
are admitted only in a step where no other request waits or runs, and such a step computes at most
``idle_prefill_chunk_tokens`` tokens, so a request arriving meanwhile waits at most one small step. When any other
request waits or runs, every running idle prefill steps aside at the start of the next plan: its blocks are freed
(the full blocks it computed are already cached, its partly computed last block is kept as a partial entry) and
it goes to the back of the waiting queue, to resume from its cached prefix at the next idle step. It never
evicts a cached block that became unreferenced after it was queued (``Request.idle_seq``,
``BlockPool.evicts_released_after``): those belong to conversations active since its reply, and a pool that
turns over that fast would evict its blocks before its own next turn came; nor does it run where the pool would
keep its blocks less than ``idle_prefill_min_residency_s``, at the rate the pool hands blocks out
(``engine.pool_turnover``), for the same reason. It is dropped instead
(finish reason ``"abort"``, ``idle_prefills_dropped``). An idle
prefill samples no token (``ScheduledRequest.needs_token``) and never decodes; it is not counted as an
admission (``record_admission``), and ends once its whole prompt is computed (``LLMEngine.finish_step``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.api import EngineConfig
from engine.block_hash import BlockHash
from engine.errors import PromptTooLongError
from engine.kv_cache_manager import KVCacheManager
from engine.pool_turnover import PoolTurnover
from engine.prefix_hit import PrefixHit
from engine.request import Request, RequestStatus
from engine.stats import EngineCounters

POLICIES = ("fcfs", "lpm")


def long_threshold_of(config: EngineConfig) -> int:
    """``config.long_prefill_token_threshold`` resolved: None = half of ``max_num_batched_tokens`` (rounded down).

    Raises:
        ValueError: neither 0 (off) nor in [1, ``max_num_batched_tokens`` - 1] (a long prefill must keep at
            least one token of every step).
    """
    budget = config.max_num_batched_tokens
    threshold = config.long_prefill_token_threshold
    if threshold is None:
        return budget // 2
    if not 0 <= threshold < budget:
        raise ValueError(
            f"long_prefill_token_threshold must be 0 (off) or in [1, {budget - 1}] (below "
            f"max_num_batched_tokens {budget}), got {threshold}"
        )
    return threshold


@dataclass
class ScheduledRequest:
    """A request's share of one step: tokens ``[start, start + num_new_tokens)`` of ``all_token_ids``."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def end(self) -> int:
        """Tokens computed after this step."""
        return self.start + self.num_new_tokens

    @property
    def needs_token(self) -> bool:
        """True when the step reaches the end of the request's known tokens, so a token is sampled (never for
        an idle prefill: it computes KV only)."""
        return self.end == self.request.num_tokens and not self.request.idle

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of this chunk that are prefill (prompt, or recompute after preemption), not decode."""
        return max(0, min(self.end, self.request.prefill_end) - self.start)


@dataclass
class SchedulerOutput:
    """One step's plan.

    Attributes:
        scheduled: the requests to run and their tokens, decodes first.
        preempted: requests preempted while planning (already back in the waiting queue).
        finished: requests the scheduler ended itself (pool exhausted by a lone request: ``"length"``; a
            waiting request no free block could ever serve: ``"error"``, ``Request.failure`` set).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed by the step."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Prefill tokens computed by the step (recomputation included)."""
        return sum(s.num_prefill_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs."""
        return not self.scheduled


@dataclass
class PrefillBudget:
    """One step's prefill tokens (what the decodes left), split between short and long prefill chunks.

    Attributes:
        tokens: prefill tokens the step may compute.
        threshold: a prefill with more tokens left than this is long; 0 = none is (no split).
        short_used: tokens given to short chunks so far.
        long_chunks: the step's long prefill chunks (also in the step's plan), sized last by ``fill_long``.
    """

    tokens: int
    threshold: int
    short_used: int = 0
    long_chunks: list[ScheduledRequest] = field(default_factory=list)

    def is_long(self, num_tokens: int) -> bool:
        """True when a prefill with ``num_tokens`` tokens left to compute is long."""
        return 0 < self.threshold < num_tokens

    @property
    def short_room(self) -> int:
        """Tokens short chunks may still take: all that is left, or with a long chunk in the step at most
        ``threshold`` in all, leaving the long chunk at least one."""
        cap = min(self.threshold, self.tokens - 1) if self.long_chunks else self.tokens
        return max(0, cap - self.short_used)

    @property
    def long_room(self) -> int:
        """Tokens left after the short chunks so far and the whole rest of every long prefill in the step: a long
        waiting request is admitted only when this is positive (it gets what the older long prefills leave)."""
        return self.tokens - self.short_used - sum(s.request.prefill_end - s.start for s in self.long_chunks)

    def take_short(self, num_tokens: int) -> int:
        """Give a short chunk up to ``num_tokens`` tokens of ``short_room``; return how many it got."""
        n = min(num_tokens, self.short_room)
        self.short_used += n
        return n

    def fill_long(self) -> None:
        """Size the long chunks, oldest first, from what the short chunks left (a chunk may get 0)."""
        left = self.tokens - self.short_used
        for s in self.long_chunks:
            s.num_new_tokens = min(s.request.prefill_end - s.start, left)
            left -= s.num_new_tokens


class Scheduler:
    """Waiting queue, running set and block allocation of one engine.

    Args:
        kv: the KV cache manager (block tables, prefix cache).
        config: ``block_size``, ``max_batch``, ``max_num_batched_tokens``, ``long_prefill_token_threshold``
            (None = half the budget), ``scheduling``, ``max_wait_s``, ``enable_inflight_sharing`` (wait for blocks
            another request is computing instead of computing them again; ignored when prefix caching is off).
        counters: the engine's counters (admissions, preemptions).
        clock: monotonic clock in seconds (tests pass a fake one to count steps instead of seconds).
        admission_gate: ``gate(request) -> bool``; a waiting request it refuses is skipped this step (the
            ones behind it may go): the tiers refuse a request while its prefix is being read back.

    Raises:
        ValueError: an unknown policy, a non-positive budget or ``idle_prefill_chunk_tokens``, or a
            ``long_prefill_token_threshold`` that is neither 0 nor in [1, ``max_num_batched_tokens`` - 1].
    """

    def __init__(
        self,
        kv: KVCacheManager,
        config: EngineConfig,
        counters: EngineCounters,
        *,
        clock: Callable[[], float] = time.monotonic,
        admission_gate: Callable[[Request], bool] | None = None,
    ) -> None:
        if config.scheduling not in POLICIES:
            raise ValueError(f"scheduling must be one of {POLICIES}, got {config.scheduling!r}")
        if config.max_batch < 1 or config.max_num_batched_tokens < 1 or config.idle_prefill_chunk_tokens < 1:
            raise ValueError("max_batch, max_num_batched_tokens and idle_prefill_chunk_tokens must be >= 1")
        if not 0 <= config.idle_prefill_min_residency_s < math.inf:
            raise ValueError("idle_prefill_min_residency_s must be a finite number >= 0")
        self.kv = kv
        self.block_size = kv.block_size
        self.max_batch = config.max_batch
        self.cache_generated_kv = config.cache_generated_kv
        self.token_budget = config.max_num_batched_tokens
        self.idle_chunk_tokens = config.idle_prefill_chunk_tokens
        self.idle_min_residency_s = config.idle_prefill_min_residency_s
        self.turnover = PoolTurnover(kv.pool, clock)
        """The pool's allocation rate, sampled at each plan (the idle prefills' residency rule)."""
        self.long_threshold = long_threshold_of(config)
        self.policy = config.scheduling
        self.max_wait_s = config.max_wait_s
        self.counters = counters
        self.inflight_sharing = config.enable_inflight_sharing and kv.enable_caching
        self.clock = clock
        self.admission_gate = admission_gate
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Admitted requests in admission order (``admit_seq`` ascending): ``_admit`` appends, removals keep
        the order, so the oldest is first and the newest (the preemption victim) last."""
        self._admit_seq = itertools.count()

    # ---- queue management -------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a new request (it takes no block until admitted)."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def add_forked(self, req: Request) -> None:
        """Add a fork that already holds blocks with its prompt computed (``n > 1``) to the running set; it
        decodes from the next step on, and is the newest running request (the first preemption victim)."""
        req.status = RequestStatus.RUNNING
        req.admit_seq = next(self._admit_seq)
        req.prefill_end = req.num_computed_tokens
        self.running.append(req)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def finish_request(self, req: Request) -> None:
        """Remove a waiting or running request and free its blocks at once (finished, cancelled)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._free_blocks(req)
        req.status = RequestStatus.FINISHED

    def cacheable_tokens(self, req: Request) -> int:
        """Leading tokens of ``req`` whose KV may enter the prefix cache: every computed one with
        ``cache_generated_kv``, else the computed prompt tokens only (a generated token's KV comes from the decode
        path, not the prompt path a later request's prompt computes it with; ``EngineConfig.cache_generated_kv``)."""
        if self.cache_generated_kv:
            return req.num_computed_tokens
        return min(req.num_computed_tokens, req.num_prompt_tokens)

    def _free_blocks(self, req: Request) -> None:
        """Free ``req``'s blocks, keeping its last partly computed block as a partial cache entry (of its
        cacheable tokens, ``cacheable_tokens``)."""
        self.kv.free(req.request_id, req.all_token_ids, self.cacheable_tokens(req), req.extra_keys)

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and put it at the front of the waiting queue (to recompute)."""
        self.running.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(req)

    # ---- the step -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring). Mutates queues and block tables; runs nothing."""
        out = SchedulerOutput()
        self.turnover.sample()
        only_idle = self._only_idle()
        if not only_idle:
            self._yield_idle()
        tokens = self._schedule_decodes(out, self.token_budget)
        if only_idle:
            tokens = min(tokens, self.idle_chunk_tokens)
        budget = PrefillBudget(tokens, self.long_threshold)
        self._schedule_running_prefills(out, budget)
        self._schedule_waiting(out, budget, only_idle)
        budget.fill_long()
        out.scheduled = [s for s in out.scheduled if s.num_new_tokens > 0]
        return out

    def _only_idle(self) -> bool:
        """True when every waiting and running request is an idle prefill (or there is none)."""
        return all(r.idle for r in self.running) and all(r.idle for r in self.waiting)

    def _yield_idle(self) -> None:
        """Send every running idle prefill back to the end of the waiting queue, its blocks freed (the ones it
        computed stay cached: ``_free_blocks``), to resume from its cached prefix at the next idle step."""
        for req in [r for r in self.running if r.idle]:
            self.running.remove(req)
            self._free_blocks(req)
            req.status = RequestStatus.WAITING
            req.num_computed_tokens = 0
            self.counters.idle_prefills_yielded += 1
            self.waiting.append(req)

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        for req in list(self.running):  # a copy: preemption removes from ``running`` while we iterate
            if req.status is not RequestStatus.RUNNING or req.num_computed_tokens < req.prefill_end:
                continue
            if len(out.scheduled) >= self.max_batch or budget < 1:
                break
            if not self._reserve_decode_slot(req, out):
                if req.status is not RequestStatus.RUNNING:
                    continue
                break  # pragma: no cover - _reserve_decode_slot preempts or finishes req before failing
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, 1))
            budget -= 1
        return budget

    def _reserve_decode_slot(self, req: Request, out: SchedulerOutput) -> bool:
        """Grow ``req``'s block table to hold its next token, preempting the newest running requests if needed.

        Returns:
            True when the slot is there; False when ``req`` itself was preempted or finished.
        """
        while not self.kv.append_slots(req.request_id, req.num_tokens):
            if len(self.running) == 1:
                # Alone and still out of blocks: the sequence has filled the whole pool.
                req.finish_reason = "length"
                self.finish_request(req)
                out.finished.append(req)
                return False
            victim = self.running[-1]  # the newest: ``running`` is in admission order
            for i, s in enumerate(out.scheduled):
                if s.request is victim:
                    del out.scheduled[i]
                    break
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _schedule_running_prefills(self, out: SchedulerOutput, budget: PrefillBudget) -> None:
        """Chunks of running prefills, in admission order: the long ones' chunks are sized last (``fill_long``),
        so they are known before any short chunk is sized."""
        prefilling = [r for r in self.running if r.num_computed_tokens < r.prefill_end]
        for req in prefilling:
            if budget.is_long(req.prefill_end - req.num_computed_tokens):
                budget.long_chunks.append(ScheduledRequest(req, req.num_computed_tokens, 0))
        longs = {id(s.request): s for s in budget.long_chunks}
        for req in prefilling:
            if len(out.scheduled) >= self.max_batch:
                break
            if id(req) in longs:
                out.scheduled.append(longs[id(req)])
                continue
            n = budget.take_short(req.prefill_end - req.num_computed_tokens)
            if n > 0:
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))

    # ---- admission ----------------------------------------------------------------------------------------
    def cached_prefix(self, req: Request, partial: bool = True) -> PrefixHit:
        """The request's usable prefix-cache hit now: at most ``(num_tokens - 1) // block_size`` whole blocks
        and, with ``partial`` (token-granular hits, when the KV cache manager has them on), part of the next
        block; never the last token."""
        cap = (req.num_tokens - 1) // self.block_size
        return self.kv.find_cached_prefix(
            req.all_token_ids, req.block_hashes[:cap], req.extra_keys, partial=partial
        )

    def _ordered_waiting(self, preempted_now: list[Request], only_idle: bool = False) -> list[Request]:
        """Waiting requests in admission order: preempted, then starved (older than max_wait_s), then policy;
        idle prefills only when ``only_idle`` (nothing else waits or runs)."""
        now = self.clock()
        skip = {id(r) for r in preempted_now}
        first: list[Request] = []
        starved: list[Request] = []
        rest: list[Request] = []
        for req in self.waiting:
            if id(req) in skip or (req.idle and not only_idle):
                continue
            if req.num_preemptions > 0:
                first.append(req)
            elif now - req.arrival_time > self.max_wait_s:
                starved.append(req)
            else:
                rest.append(req)
        starved.sort(key=lambda r: r.arrival_time)
        if self.policy == "lpm" and rest:
            rest = self._longest_prefix_first(rest)
        return first + starved + rest

    def _longest_prefix_first(self, reqs: list[Request]) -> list[Request]:
        """Sort by cached prefix length, longest first; requests whose hits end in the same block form a group,
        groups ordered by their first member's place in the queue, members by their own place (arrival)."""
        keyed = []
        group_rank: dict[tuple[int, int | None], int] = {}
        for pos, req in enumerate(reqs):
            hit = self.cached_prefix(req, partial=False)
            group = (hit.num_blocks, hit.last_block_id)
            rank = group_rank.setdefault(group, len(group_rank))
            keyed.append((-hit.num_blocks, rank, pos, req))
        keyed.sort(key=lambda k: k[:3])
        return [k[3] for k in keyed]

    def _pending_blocks(self) -> dict[BlockHash, tuple[Request, int]]:
        """Full blocks that running requests have not computed yet: hash -> (request, block index)."""
        pending: dict[BlockHash, tuple[Request, int]] = {}
        for req in self.running:
            self._add_pending(pending, req)
        return pending

    def _add_pending(self, pending: dict[BlockHash, tuple[Request, int]], req: Request) -> None:
        bs = self.block_size
        end = req.prefill_end if self.cache_generated_kv else min(req.prefill_end, req.num_prompt_tokens)
        for j in range(
            req.num_computed_tokens // bs, min(len(req.block_hashes), end // bs)
        ):  # cached ones only
            pending.setdefault(req.block_hashes[j], (req, j))

    def _waits_for_inflight(
        self, req: Request, num_hit_blocks: int, pending: dict[BlockHash, tuple[Request, int]]
    ) -> bool:
        """True when ``req``'s next uncached block is being computed by another request (it should wait).

        Records the run of pending blocks it waits for in ``req.inflight_wait_hashes``.
        """
        bs = self.block_size
        cap = (req.num_tokens - 1) // bs
        i = num_hit_blocks
        if i >= cap:
            return False
        entry = pending.get(req.block_hashes[i])
        if entry is None or entry[0] is req:
            return False
        leader, j = entry
        if j != i or leader.all_token_ids[: (i + 1) * bs] != req.all_token_ids[: (i + 1) * bs]:
            return False  # a hash collision: not the same prefix
        while i < cap:
            entry = pending.get(req.block_hashes[i])
            if entry is None or entry[0] is not leader:
                break
            req.inflight_wait_hashes.add(req.block_hashes[i])
            i += 1
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: PrefillBudget, only_idle: bool) -> None:
        """Admit waiting requests in policy order while the step has room (idle prefills only when
        ``only_idle``: nothing else waits or runs)."""
        if not self.waiting:
            return
        pending = self._pending_blocks() if self.inflight_sharing else {}
        for req in self._ordered_waiting(out.preempted, only_idle):
            if (
                budget.short_room < 1
                or len(out.scheduled) >= self.max_batch
                or len(self.running) >= self.max_batch
            ):
                break
            if self.admission_gate is not None and not self.admission_gate(req):
                continue  # its prefix is still being read back from a tier
            hit = self.cached_prefix(req)
            if self.inflight_sharing and self._waits_for_inflight(req, hit.num_blocks, pending):
                continue
            if req.idle and self._idle_work_lost(req, hit):
                req.finish_reason = "abort"
                self.finish_request(req)
                out.finished.append(req)
                self.counters.idle_prefills_dropped += 1
                continue
            long = budget.is_long(req.num_tokens - hit.num_tokens)
            if long and budget.long_room < 1:
                continue  # the older long prefills take the rest of the step; short ones behind it may pass
            table = self.kv.allocate(req.request_id, req.num_tokens, hit)
            if table is None and hit.partial_tokens:
                # The copy's source is held while the blocks are taken: when it is in the way, go without it.
                hit = hit.whole_blocks()
                table = self.kv.allocate(req.request_id, req.num_tokens, hit)
            if table is None:
                if self.running or out.scheduled:
                    break  # not enough blocks now: wait (and keep the queue behind it waiting too)
                # Nothing runs, so every block a request could free is free: pins made after it was queued
                # (``InputProcessor.make_request`` checks them at submit) leave too few, and it would wait, with
                # every request behind it, for good. It ends with the 400 it would have got at submit.
                usable, pinned = self.kv.usable_tokens(req.all_token_ids, req.block_hashes, req.extra_keys)
                req.failure = PromptTooLongError(req.num_tokens, usable, what="pool", pinned_blocks=pinned)
                req.finish_reason = "error"
                self.finish_request(req)
                out.finished.append(req)
                continue
            n = self._admit(req, hit)
            chunk = ScheduledRequest(req, req.num_computed_tokens, 0)
            if long:
                budget.long_chunks.append(chunk)  # sized by ``fill_long``: what the older long chunks leave
            else:
                chunk.num_new_tokens = budget.take_short(n)
            out.scheduled.append(chunk)
            if self.inflight_sharing:
                self._add_pending(pending, req)
        if pending:
            for req in self.waiting:
                self._note_inflight(req, pending)

    def _idle_work_lost(self, req: Request, hit: PrefixHit) -> bool:
        """Whether admitting idle prefill ``req`` with ``hit`` would evict a cached block released after it was
        queued (``Request.idle_seq``), or where the pool would keep its blocks less than
        ``idle_prefill_min_residency_s`` (``engine.pool_turnover``)."""
        need = -(-req.num_tokens // self.block_size) - hit.num_blocks
        keep = set(hit.block_ids)
        if hit.partial_block_id is not None:
            keep.add(hit.partial_block_id)
        if self.kv.pool.evicts_released_after(need, req.idle_seq, keep):
            return True
        return self.turnover.residency_s(need) < self.idle_min_residency_s

    def _note_inflight(self, req: Request, pending: dict[BlockHash, tuple[Request, int]]) -> None:
        """Remember which of a waiting request's prompt blocks another request is computing right now."""
        cap = (req.num_tokens - 1) // self.block_size
        for h in req.block_hashes[:cap]:
            entry = pending.get(h)
            if entry is not None and entry[0] is not req:
                req.inflight_wait_hashes.add(h)

    def _admit(self, req: Request, hit: PrefixHit) -> int:
        """Move ``req`` to running with ``hit``'s tokens served by the cache; return tokens left to compute."""
        num_cached = hit.num_tokens
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.admit_seq = next(self._admit_seq)
        req.num_computed_tokens = num_cached
        req.prefill_end = req.num_tokens
        if req.num_cached_tokens is None:
            shared = sum(1 for h in hit.block_hashes if h in req.inflight_wait_hashes) * self.block_size
            req.num_cached_tokens = num_cached
            req.num_inflight_shared_tokens = shared
            if not req.idle:  # an idle prefill is no client's lookup: kept out of the hit counters
                self.counters.record_admission(req.num_prompt_tokens, num_cached, shared)
        return req.num_tokens - num_cached
