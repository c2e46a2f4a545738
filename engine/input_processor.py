"""Input processing of the engine: a submitted prompt and its sampling parameters become a queued ``Request``.

Owns every check a request passes before it takes anything (``InvalidRequestError`` for bad parameters or
token ids, ``PromptTooLongError`` for the context window or the block pool), and the construction of the
engine-side ``Request``: ``max_tokens`` resolved against the context window, stop token ids (EOS unless
``ignore_eos``), the stop strings' reach (the answer's text, not its tool calls), prefix-cache extra keys ``(model_id, cache_salt)``, its sequence sampler and detokenizer,
and the block hashes of its full prompt blocks.

Invariants: the checks depend only on the engine's configuration, never on its state, so a prompt checked
before the engine lock is taken is still valid under it; a request built here holds no block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.api import MAX_N, SamplingParams
from engine.block_hash import ExtraKeys, LayeredKeys, block_hasher
from engine.constrained import ConstraintCompiler
from engine.detokenizer import Decoder, OutputText
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling import MAX_TOP_LOGPROBS, SequenceSampler
from engine.tool_calls import CALL_MARKERS


def validate_params(params: SamplingParams) -> None:
    """Check sampling parameters.

    Raises:
        InvalidRequestError: ``max_tokens`` < 1, ``temperature`` < 0, ``top_p`` not in (0, 1], ``top_k`` < 0,
            an empty stop string, a negative stop token id, a seed outside ``[-2**63, 2**64)``, ``n`` not in
            ``[1, MAX_N]``, ``logprobs`` not in ``[0, 20]``, a presence / frequency penalty outside [-2, 2], a
            repetition penalty <= 0, or a malformed ``logit_bias`` pair (``param`` names the field).
    """
    if params.max_tokens is not None and (not isinstance(params.max_tokens, int) or params.max_tokens < 1):
        raise InvalidRequestError(
            f"max_tokens must be an integer >= 1, got {params.max_tokens!r}", "max_tokens"
        )
    if not params.temperature >= 0.0:
        raise InvalidRequestError(f"temperature must be >= 0, got {params.temperature!r}", "temperature")
    if not 0.0 < params.top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in (0, 1], got {params.top_p!r}", "top_p")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0, got {params.top_k!r}", "top_k")
    if any(not isinstance(s, str) or not s for s in params.stop):
        raise InvalidRequestError("stop strings must be non-empty strings", "stop")
    if any(not isinstance(t, int) or t < 0 for t in params.stop_token_ids):
        raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")
    if params.seed is not None and (not _is_int(params.seed) or not -(1 << 63) <= params.seed < (1 << 64)):
        raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64), got {params.seed!r}", "seed")
    if not _is_int(params.n) or not 1 <= params.n <= MAX_N:
        raise InvalidRequestError(f"n must be an integer in [1, {MAX_N}], got {params.n!r}", "n")
    if params.logprobs is not None and (
        not _is_int(params.logprobs) or not 0 <= params.logprobs <= MAX_TOP_LOGPROBS
    ):
        raise InvalidRequestError(
            f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {params.logprobs!r}", "logprobs"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
            raise InvalidRequestError(f"{name} must be a number in [-2, 2], got {value!r}", name)
    rp = params.repetition_penalty
    if not isinstance(rp, int | float) or not 0.0 < rp < float("inf"):
        raise InvalidRequestError(
            f"repetition_penalty must be a number > 0, got {rp!r}", "repetition_penalty"
        )
    for pair in params.logit_bias:
        if (
            not isinstance(pair, tuple)
            or len(pair) != 2
            or not _is_int(pair[0])
            or pair[0] < 0
            or not isinstance(pair[1], int | float)
            or pair[1] != pair[1]
        ):
            raise InvalidRequestError(
                f"logit_bias entries must be (token id >= 0, number) pairs, got {pair!r}", "logit_bias"
            )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_prompt(prompt_token_ids: Sequence[int], vocab_size: int) -> None:
    """Check a prompt's token ids.

    Raises:
        InvalidRequestError: an empty prompt, or a token id that is not an int in ``[0, vocab_size)``.
    """
    if len(prompt_token_ids) == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    for t in prompt_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError(f"token id {t!r} is not in the vocabulary [0, {vocab_size})", "prompt")


class InputProcessor:
    """Checks prompts and builds engine requests for one engine.

    Args:
        kv: the engine's KV cache manager (pool capacity, block size, hash function).
        vocab_size: the model's vocabulary size (token ids must be in ``[0, vocab_size)``).
        max_model_len: the context window in tokens (prompt + generated).
        model_id: stable id of the weights (first prefix-cache extra key).
        tokenizer: detokenizer for output text and stop strings; None = token ids only.
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        clock: monotonic clock in seconds (a request's ``arrival_time``).
        constraints: the engine's grammar compiler (``engine.constrained``), or None when the engine has no
            tokenizer (constrained requests are then refused).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        *,
        vocab_size: int,
        max_model_len: int,
        model_id: str,
        tokenizer: Decoder | None,
        eos_token_ids: Sequence[int],
        clock: Callable[[], float],
        constraints: ConstraintCompiler | None = None,
    ) -> None:
        self.kv = kv
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.clock = clock
        self.constraints = constraints

    def check_prompt(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Validate a prompt and its parameters before anything is queued or allocated.

        Raises:
            InvalidRequestError: bad parameters or token ids; stop strings without a tokenizer; a constraint that
                does not compile (or no tokenizer to compile it for).
            PromptTooLongError: ``what="context"`` when ``prompt + 1 > max_model_len``, or when an explicit
                ``max_tokens`` does not fit beside the prompt (``prompt + max_tokens > max_model_len``, as OpenAI
                and vLLM refuse it); ``what="pool"`` when ``prompt + 1`` tokens, or the prompt and an explicit
                ``max_tokens``, exceed the whole block pool (a pool configured smaller than the context window).
        """
        validate_params(params)
        validate_prompt(prompt_token_ids, self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", "stop")
        if params.constraint is not None:
            if self.constraints is None:
                raise InvalidRequestError(
                    "constrained decoding needs the checkpoint's tokenizer", "response_format"
                )
            self.constraints.check(params.constraint)
        for token_id, _ in params.logit_bias:
            if token_id >= self.vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {token_id} is not in the vocabulary [0, {self.vocab_size})",
                    "logit_bias",
                )
        n = len(prompt_token_ids)
        if n + 1 > self.max_model_len:
            raise PromptTooLongError(n + 1, self.max_model_len, what="context")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                n, self.max_model_len, what="context", completion_tokens=params.max_tokens
            )
        self.kv.check_fits(n + 1)
        if params.max_tokens is not None and n + params.max_tokens > self.kv.capacity_tokens:
            raise PromptTooLongError(
                n, self.kv.capacity_tokens, what="pool", completion_tokens=params.max_tokens
            )

    def extra_keys(
        self, prompt_len: int, cache_salt: str, shared_prefix_tokens: int = 0, shared_salt: str = ""
    ) -> ExtraKeys:
        """The extra keys of a ``prompt_len``-token prompt's blocks (``make_request``'s): ``(model_id,
        cache_salt)``, or, when ``shared_prefix_tokens`` covers at least one full block, ``LayeredKeys`` whose
        first blocks are keyed ``(model_id, ("shared", shared_salt))``."""
        own = (self.model_id, cache_salt)
        shared_blocks = min(shared_prefix_tokens, prompt_len) // self.kv.block_size
        if shared_blocks <= 0:
            return own
        shared = (self.model_id, ("shared", shared_salt))
        return LayeredKeys(shared=shared, shared_blocks=shared_blocks, private=own)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str,
        shared_prefix_tokens: int = 0,
        shared_salt: str = "",
    ) -> Request:
        """The engine request for a prompt that passed ``check_prompt`` (not queued, holding no block).

        ``max_tokens`` is the room left in the context window (or in the whole block pool, when that is
        smaller), or the explicit value when smaller; the block hashes of the prompt's full blocks are computed
        here, once. For ``n > 1`` the request's sampler gets the
        ``n - 1`` pending fork samplers (choices 1 .. n-1), forked when its prompt is computed. When
        ``shared_prefix_tokens`` covers at least one full block, those blocks are keyed ``(model_id, ("shared", shared_salt))`` and the rest
        ``(model_id, cache_salt)`` (``block_hash.LayeredKeys``).
        """
        room = min(self.max_model_len, self.kv.capacity_tokens) - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        extra_keys = self.extra_keys(len(prompt_token_ids), cache_salt, shared_prefix_tokens, shared_salt)
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            max_tokens=max_tokens,
            stop_token_ids=frozenset(stop_ids),
            extra_keys=extra_keys,
            arrival_time=self.clock(),
            sampler=SequenceSampler(
                params,
                prompt_token_ids,
                constraint=None if params.constraint is None else self.constraints.start(params.constraint),
            ),
            output=self._output_text(params),
        )
        req.sampler.pending_forks = [req.sampler.fork(i) for i in range(1, params.n)]
        bs = self.kv.block_size
        req.update_block_hashes(bs, block_hasher(bs, extra_keys, self.kv.hash_fn))
        self._fit_beside_pins(req, params)
        return req

    def _fit_beside_pins(self, req: Request, params: SamplingParams) -> None:
        """Bound ``req`` by what the pins leave of the pool (``KVCacheManager.usable_tokens``): its default
        ``max_tokens`` stops there, and a prompt (or explicit ``max_tokens``) past it is refused. Before (a burst
        trial), such a request passed ``check_prompt`` (which measures the whole pool), then waited for blocks
        no request would free, and every request behind it waited too; one that fitted was cut short with a
        ``length`` finish.

        Raises:
            PromptTooLongError: ``what="pool"`` with ``pinned_blocks``, before the request is queued.
        """
        n = len(req.prompt_token_ids)
        usable, pinned = self.kv.usable_tokens(req.prompt_token_ids, req.block_hashes, req.extra_keys)
        if not pinned:
            return
        if n + 1 > usable:
            raise PromptTooLongError(n + 1, usable, what="pool", pinned_blocks=pinned)
        if params.max_tokens is not None and n + params.max_tokens > usable:
            raise PromptTooLongError(
                n, usable, what="pool", completion_tokens=params.max_tokens, pinned_blocks=pinned
            )
        req.max_tokens = min(req.max_tokens, usable - n)

    def _output_text(self, params: SamplingParams) -> OutputText | None:
        """The request's detokenizer and stop matcher; with a tool-call constraint, stop strings apply to the
        answer's text before its first call only (``engine.tool_calls.CALL_MARKERS``), never to the calls, and a
        call repeating an earlier one ends the output (``engine.detokenizer.RepeatedCallGuard``)."""
        if self.tokenizer is None:
            return None
        tool_calls = params.constraint is not None and params.constraint.kind == "tool_calls"
        return OutputText(self.tokenizer, params.stop, CALL_MARKERS if tool_calls else (), tool_calls)

    def make_fork(self, parent: Request, sampler: SequenceSampler) -> Request:
        """Choice ``sampler.index`` of ``parent``'s prompt: a request with the parent's prompt, limits, keys and
        prompt block hashes, holding no block, its prompt counted as computed and cached as the parent's."""
        req = Request(
            request_id=f"{parent.request_id}/{sampler.index}",
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params,
            max_tokens=parent.max_tokens,
            stop_token_ids=parent.stop_token_ids,
            extra_keys=parent.extra_keys,
            arrival_time=parent.arrival_time,
            sampler=sampler,
            output=self._output_text(parent.params),
            num_cached_tokens=parent.num_cached_tokens,
            index=sampler.index,
            parent_id=parent.request_id,
        )
        req.block_hashes = list(parent.block_hashes[: parent.num_prompt_tokens // self.kv.block_size])
        req.num_computed_tokens = parent.num_prompt_tokens
        return req
