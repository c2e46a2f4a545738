"""Engine-internal state of one request, from submit to finish.

A request's tokens are ``prompt_token_ids + output_token_ids`` (``all_token_ids``). ``num_computed_tokens`` of
them have their K/V in the request's blocks; the scheduler advances it chunk by chunk (chunked prefill) and then
one token per decode step. After a preemption it is reset to 0 and the whole sequence, generated tokens
included, is recomputed (prefix-cache hits still apply, but they are not counted as hits again).

``block_hashes`` holds the chained hash of every full block of ``all_token_ids`` (extended as output grows),
so the blocks a request computes, prompt or output, become shareable prefix-cache entries.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.api import FinishReason, SamplingParams
from engine.block_hash import BlockHash
from engine.detokenizer import OutputText
from engine.errors import EngineError
from engine.sampling import SequenceSampler


class RequestStatus(enum.Enum):
    """Where a request is: waiting for admission, running (holds blocks), or finished (holds none)."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


BlockHasher = Callable[[list[int], BlockHash | None], list[BlockHash]]
"""``(token ids of whole blocks, parent hash or None) -> their chained hashes`` (extra keys bound)."""


@dataclass(eq=False)
class Request:
    """One request inside the engine.

    Attributes:
        request_id: unique id within the engine.
        prompt_token_ids: the rendered prompt (>= 1 token).
        params: sampling parameters as submitted.
        max_tokens: most tokens to generate, resolved against the context window (>= 1).
        stop_token_ids: token ids that end generation (EOS unless ``ignore_eos``, plus ``params.stop_token_ids``).
        extra_keys: prefix-cache extra keys ``(model_id, cache_salt)``.
        arrival_time: clock reading at submit, seconds.
        sampler: this sequence's sampling state (generator, penalty counts, constraint, pending forks).
        index: choice index within its request (0, or ``i`` for the ``i``-th fork of an ``n > 1`` request).
        parent_id: the request this one was forked from (None for a request as submitted).
        output: detokenizer + stop-string matcher (None when the engine does not detokenize).
        output_token_ids: generated tokens so far.
        num_computed_tokens: tokens of ``all_token_ids`` whose K/V is in the request's blocks.
        block_hashes: chained hashes of the full blocks of ``all_token_ids``.
        status: waiting / running / finished.
        num_cached_tokens: prompt tokens served by the prefix cache at first admission (None before it);
            counted once, never updated by a recompute.
        num_inflight_shared_tokens: of those, tokens that were being computed by another request when this one
            started waiting for them (in-flight sharing).
        inflight_wait_hashes: block hashes this request waited for while another request computed them.
        admit_seq: admission order number (larger = admitted later); the newest running request is preempted.
        prefill_end: ``num_tokens`` at the latest admission; tokens before it are computed as prefill (the
            prompt, or prompt + generated tokens when recomputing after a preemption), later ones as decode.
        num_preemptions: times this request was preempted.
        first_token_time / last_token_time: clock readings of the first and latest generated token.
        finish_reason: set when finished.
        level_ends: ``(end token, level)`` pairs of its prompt's levels (``engine.kv_tiers.policy``), or None.
        prefix_key: the gateway's prefix key of its stable head (``engine.kv_tiers.catalog``), or None.
        failure: why the scheduler ended it unserved (``PromptTooLongError``: pins made after it was queued left
            the pool too small for it), else None; its output carries it (finish reason ``"error"``).
        idle: an idle prefill (``AsyncEngine.prefill_next_turn``): it computes its prompt's KV for the prefix
            cache and samples nothing, runs only while no other request waits or runs, steps aside (back to
            waiting, its computed blocks left cached) as soon as one does, and is kept out of the request, TTFT
            and prefix-hit counters (``engine.scheduler``, "Idle prefills").
        idle_seq: for an idle prefill, the block pool's ``release_seq`` when it was queued: it may evict only
            cached blocks released before (``engine.scheduler``, "Idle prefills").
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    extra_keys: tuple
    arrival_time: float
    sampler: SequenceSampler
    output: OutputText | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_cached_tokens: int | None = None
    num_inflight_shared_tokens: int = 0
    inflight_wait_hashes: set[BlockHash] = field(default_factory=set)
    admit_seq: int = -1
    prefill_end: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_reason: FinishReason | None = None
    index: int = 0
    parent_id: str | None = None
    level_ends: tuple[tuple[int, str], ...] | None = None
    prefix_key: str | None = None
    failure: EngineError | None = None
    idle: bool = False
    idle_seq: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the request has finished (any reason)."""
        return self.status is RequestStatus.FINISHED

    @property
    def generator(self):
        """This sequence's ``torch.Generator`` (its sampler's)."""
        return self.sampler.generator

    def append_token(self, token_id: int) -> None:
        """Record one generated token (its K/V is computed by the next decode step); the sampler sees it too."""
        self.sampler.accept(token_id)
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int, hasher: BlockHasher) -> None:
        """Extend ``block_hashes`` to every full block of ``all_token_ids`` (chained on the last known hash)."""
        have = len(self.block_hashes)
        full = self.num_tokens // block_size
        if full <= have:
            return
        parent = self.block_hashes[-1] if have else None
        self.block_hashes.extend(hasher(self.all_token_ids[have * block_size : full * block_size], parent))
