"""Output processing of the engine: each sampled token of a request becomes a ``RequestOutput``.

Owns what happens to a sampled token after the forward pass: TTFT and TPOT observations, appending it to the
request (and hashing a block it fills, so generated blocks become prefix-cache entries too), detokenization,
the stop checks, and the final output of a finished request (usage, TTFT, stop-trimmed full text).

Invariants:

- Stop checks run in this order: a stop token (EOS unless ``ignore_eos``, or ``stop_token_ids``; its text is
  never emitted) or a constraint whose grammar is complete and can take no more tokens, a stop string or a
  repeated tool call (the text is cut before it: ``engine.detokenizer``), then ``max_tokens`` (``"length"``,
  or ``"stop"`` when it cuts what is so far a repeated tool call, dropped).
- A request's last output is the only one with ``finished=True``; it alone carries ``finish_reason`` and
  ``usage``, and its ``text`` ends with whatever the detokenizer still held back.
- This module frees nothing and owns no queue: the engine removes a finished request from the scheduler
  (freeing its blocks at once) right after its final output is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.api import FinishReason, TokenLogprob, Usage
from engine.block_hash import HashFn, block_extra_keys, block_hasher
from engine.errors import EngineError
from engine.request import Request
from engine.stats import EngineCounters


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated this step (0 or 1).
        text: new text to emit (may be "" while a character or a stop string is pending).
        finished: True on the request's last output.
        finish_reason: set when finished.
        usage: set when finished.
        ttft_s: seconds from submit to the first token (None if none was generated).
        cached_tokens: prompt tokens the prefix cache served at first admission (None before it).
        full_text: all text generated (stop-string trimmed), set when finished.
        index: the choice (``Request.index``).
        parent_id: the request it was forked from (None for a submitted request).
        logprobs: one entry per token of ``new_token_ids`` when the request asked for logprobs, but none for
            a stop token (not part of the text).
        unforked: choice indexes of forks that were never created because this request ended before its
            prompt was computed (aborted); they end with it, with no output tokens.
        stop_string: the stop string that ended the request (finish reason ``stop``), else None.
        prompt_tokens: the request's prompt length in tokens.
        error: why the request failed (finish reason ``"error"``), else None.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    full_text: str = ""
    cached_tokens: int | None = None
    index: int = 0
    parent_id: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    unforked: tuple[int, ...] = ()
    stop_string: str | None = None
    prompt_tokens: int | None = None
    error: EngineError | None = None


class OutputProcessor:
    """Turns sampled tokens into outputs for one engine.

    Args:
        counters: the engine's counters (TTFT, TPOT, decode tokens, finished requests).
        block_size: tokens per KV block (a request's ``block_hashes`` grow by whole blocks).
        hash_fn: the engine's block hash function.
    """

    def __init__(self, counters: EngineCounters, block_size: int, hash_fn: HashFn) -> None:
        self.counters = counters
        self.block_size = block_size
        self.hash_fn = hash_fn

    def process_token(
        self, req: Request, token: int, now: float, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Record a sampled token; detokenize; finish on a stop token, a stop string or ``max_tokens``.

        Args:
            req: a running request.
            token: the token sampled for it this step.
            now: clock reading of the step's end, seconds.
            logprob: the token's logprobs when the request asked for them.

        Returns:
            The step's output; ``finished`` (built by ``finish``) when the token ended the request.
        """
        if req.first_token_time is None:
            req.first_token_time = now
            self.counters.ttft.observe(now - req.arrival_time)
        elif req.last_token_time is not None:
            self.counters.tpot.observe(now - req.last_token_time)
        req.last_token_time = now
        req.append_token(token)
        bs = self.block_size
        if req.num_tokens // bs > len(req.block_hashes):  # a block just filled up
            # generated blocks lie past any public prefix: the keys of the next block (the tenant's own)
            keys = block_extra_keys(req.extra_keys, len(req.block_hashes))
            req.update_block_hashes(bs, block_hasher(bs, keys, self.hash_fn))
        self.counters.decode_tokens += 1
        text = ""
        reason: FinishReason | None = None
        constraint = req.sampler.constraint
        if token in req.stop_token_ids:
            reason = "stop"
        else:
            if req.output is not None:
                text = req.output.add(token)
                if req.output.stopped:
                    reason = "stop"
            if constraint is not None and constraint.is_stopped:
                reason = "stop"
        if reason is None and req.num_output_tokens >= req.max_tokens:
            # cut inside a repeat of an earlier tool call past its arguments: the answer ends, complete, at the
            # call before it
            reason = "stop" if req.output is not None and req.output.end_at_repeat() else "length"
        # a stop token ends the answer without being part of its text: its logprob is left out, so the logprobs'
        # tokens spell the text returned (found by a trial: '<|im_end|>' came back after 'Yes.')
        lps = [logprob] if logprob is not None and token not in req.stop_token_ids else []
        if reason is None:
            return RequestOutput(
                req.request_id,
                [token],
                text,
                cached_tokens=req.num_cached_tokens,
                index=req.index,
                parent_id=req.parent_id,
                logprobs=lps,
                prompt_tokens=req.num_prompt_tokens,
            )
        out = self.finish(req, reason)
        out.new_token_ids = [token]
        out.text = text + out.text
        out.logprobs = lps
        return out

    def finish(self, req: Request, reason: FinishReason) -> RequestOutput:
        """Set the request's finish reason and build its final output (held-back text, usage, TTFT).

        Counts the request as finished (not an idle prefill); frees nothing (the engine does, see the module
        docstring).
        """
        req.finish_reason = reason
        if not req.idle:  # an idle prefill is no client's request (``EngineStats.idle_prefills``)
            self.counters.requests += 1
        tail = req.output.finish() if req.output is not None else ""
        return RequestOutput(
            request_id=req.request_id,
            text=tail,
            finished=True,
            finish_reason=reason,
            usage=Usage(
                prompt_tokens=req.num_prompt_tokens,
                cached_tokens=req.num_cached_tokens or 0,
                completion_tokens=req.num_output_tokens,
            ),
            ttft_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            full_text=req.output.text if req.output is not None else "",
            cached_tokens=req.num_cached_tokens,
            index=req.index,
            parent_id=req.parent_id,
            unforked=tuple(f.index for f in req.sampler.pending_forks),
            stop_string=req.output.stop_string if req.output is not None and reason == "stop" else None,
            prompt_tokens=req.num_prompt_tokens,
        )

    def fail(self, req: Request, error: EngineError) -> RequestOutput:
        """Build the final output of a request that failed (finish reason ``"error"``, ``error`` set, no text:
        the detokenizer is not asked for what it held back, it may be what failed). Counts the request as
        finished (not an idle prefill); frees nothing."""
        req.finish_reason = "error"
        if not req.idle:
            self.counters.requests += 1
        return RequestOutput(
            request_id=req.request_id,
            finished=True,
            finish_reason="error",
            usage=Usage(
                prompt_tokens=req.num_prompt_tokens,
                cached_tokens=req.num_cached_tokens or 0,
                completion_tokens=req.num_output_tokens,
            ),
            ttft_s=None if req.first_token_time is None else req.first_token_time - req.arrival_time,
            cached_tokens=req.num_cached_tokens,
            index=req.index,
            parent_id=req.parent_id,
            unforked=tuple(f.index for f in req.sampler.pending_forks),
            prompt_tokens=req.num_prompt_tokens,
            error=error,
        )
