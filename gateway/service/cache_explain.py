"""The live miss explanation of each request: the ``x-prefixgate-cache`` header and the counters by cause.

After the backend answers, ``CacheExplanations.explain`` renders the request's canonical prompt with the
model's tokenizer (the embedded engine's own template and tokenizer, so its token ids are the ones the engine
prefilled; ``cl100k_base`` over a plain layout for upstreams, whose own tokenizers we do not have), finds its
segments and stable prefix as token ranges, and asks ``gateway.service.miss_explain.MissExplainer`` where and
why the reported cached prefix stopped short of the stable prefix. The prompt is then recorded for the next
request of the same model and tenant, and its full blocks noted as cached. The render and tokenization need
no answer: ``prepare`` does them ahead (the pipeline runs it while the backend works) and ``explain`` takes
its result.

Invariants: never prompt text in what leaves this module (the header value and the counters hold counts,
cause names, segment names and token offsets); never an exception to the request: any failure (a template
that refuses the messages, a tokenizer missing) is counted in ``errors`` and the request goes on without a
header.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.core.request import ChatRequest
from gateway.service.canonicalize import Canonicalizer
from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer, PromptTokenizer
from gateway.service.canonicalize.rendered_prompt import RenderedPrompt
from gateway.service.canonicalize.token_memo import PieceTokenMemo
from gateway.service.miss_counters import MissCounters
from gateway.service.miss_explain import Epoch, MissExplainer
from gateway.service.miss_explanation import HEADER, MissExplanation, VolatileSpan

__all__ = ["HEADER", "CacheExplanations", "PreparedPrompt"]

logger = logging.getLogger("prefixgate.cache_explain")

_TOOLS_PREAMBLE = "<|tools|>\n"


@dataclass(frozen=True)
class PreparedPrompt:
    """A request's prompt as the explainer sees it (``CacheExplanations.prepare``): the rendered prompt (token
    ids, segments as token ranges, stable end), the learned slots' token spans, and ``shift``: tokens of a
    tools preamble the model's own template leaves out (added to the reported cached count)."""

    rendered: RenderedPrompt
    spans: list[VolatileSpan]
    shift: int


class CacheExplanations:
    """One per app: the explainer's index of recent prompts, the counters by cause, and the fallback
    tokenizer.

    Args:
        canonicalizer: renders canonical requests and knows the learned slots.
        block_size: tokens per block of the chain hashes (the engines' block size).
    """

    def __init__(self, canonicalizer: Canonicalizer, block_size: int = 16) -> None:
        self.canonicalizer = canonicalizer
        self.explainer = MissExplainer(block_size=block_size)
        self.counters: dict[str, MissCounters] = {}
        self.errors = 0
        self._fallback: PromptTokenizer | None = None
        self.token_memo = PieceTokenMemo()
        self._lock = threading.Lock()

    def _tokenizer(self, own: PromptTokenizer | None) -> PromptTokenizer:
        if own is not None:
            return own
        if self._fallback is None:
            self._fallback = Cl100kTokenizer()
        return self._fallback

    def epoch(self) -> Epoch:
        """What the explainer knows now; take it when a request begins and pass it to ``explain``, so what
        requests finishing while it is in flight record is not taken as evidence about it (a concurrent first
        request is ``cold``, not ``evicted``)."""
        return self.explainer.epoch()

    def prepare(self, request: ChatRequest, tokenizer: PromptTokenizer | None = None) -> PreparedPrompt:
        """The part of ``explain`` that needs no answer: the canonical request rendered and tokenized with
        ``tokenizer`` (``cl100k_base`` when None; its pieces memoized per model and tenant), the learned
        slots' spans, and the tools-preamble shift. Reads the learned slots as they are now.

        Raises:
            ValueError: a request that cannot be rendered (completion; messages the template refuses), or
                whatever the tokenizer raises (``explain`` counts it).
        """
        own = self._tokenizer(tokenizer)
        encode = None
        if isinstance(own, Cl100kTokenizer):  # per message, memoized within the model and tenant
            scope = Canonicalizer.tenant_scope(request)
            encode = lambda text: self.token_memo.encode(own, text, scope)  # noqa: E731
        elif callable(getattr(own, "encode_in_scope", None)):  # an engine's memo, shared with its renders
            encode = lambda text: own.encode_in_scope(text, request.tenant)  # noqa: E731
        rendered, spans = self.canonicalizer.render(request, own, encode)
        shift = 0
        if (
            tokenizer is not None
            and rendered.text.startswith(_TOOLS_PREAMBLE)
            and rendered.segments
            and rendered.segments[0].name == "tools"
        ):
            # the engine's template ignores tools: the preamble the explainer sees is not in its prompt
            shift = rendered.segments[0].end
        return PreparedPrompt(rendered, spans, shift)

    def explain(
        self,
        request: ChatRequest,
        cached_tokens: int,
        tokenizer: PromptTokenizer | None = None,
        provider_cause: str | None = None,
        min_cacheable: int | None = None,
        granularity: int | None = None,
        prepared: PreparedPrompt | None = None,
        later: list[Callable[[], None]] | None = None,
        epoch: Epoch | None = None,
    ) -> MissExplanation | None:
        """Explain one finished chat request's cache result, count it, and record its prompt.

        Args:
            request: the canonicalized request (completion requests get no explanation: None).
            cached_tokens: prompt tokens the engine or upstream reported cached.
            tokenizer: the model's own (``Backend.prompt_tokenizer``); ``cl100k_base`` when None.
            provider_cause: an upstream's own cache diagnostic, when it gave one.
            min_cacheable: the upstream's minimum cacheable prompt length, when it has one.
            granularity: the cache's unit in tokens (an engine's block size); the explainer's block size
                when None.
            prepared: ``prepare(request, tokenizer)``'s result when it was computed ahead (while the backend
                worked); computed here when None.
            later: when given, the recording of the prompt (for the explanations of later requests) is
                appended to it, for the caller to run once the answer is sent (``record_prompt``), instead
                of being done here.
            epoch: ``epoch()`` when the request began (None: everything recorded so far is evidence).

        Returns:
            the explanation, or None (completion request, or a failure, counted in ``errors``). Never raises.
            Its counts and offsets are in the backend's prompt: ``cached`` is ``cached_tokens`` as reported
            (never clamped to the explainer's own count of the prompt, which for an upstream is in
            ``cl100k_base`` tokens, not the upstream's), so the header never contradicts the backend's usage,
            and a miss's
            ``offset`` is never inside the cached span.
        """
        if request.kind != "chat" or request.canonical is None:
            return None
        try:
            if prepared is None:
                prepared = self.prepare(request, tokenizer)
            rendered, spans, shift = prepared.rendered, prepared.spans, prepared.shift
            model, tenant = request.model, request.tenant
            explanation = self.explainer.explain(
                model,
                tenant,
                rendered.tokens,
                rendered.segments,
                rendered.stable_tokens,
                max(0, cached_tokens) + shift,
                min_cacheable=min_cacheable,
                granularity=granularity,
                volatile_spans=spans,
                provider_cause=provider_cause,
                epoch=epoch,
                tools_digest=rendered.tools_digest,
                replica=request.replica,
            )
            if shift:
                explanation = _without_preamble(explanation, shift)
            if explanation.cached != max(0, cached_tokens):
                # the explainer clamped the count to its own prompt; an upstream counts in its own tokens
                # (cl100k_base here): the header keeps the backend's figure, which the answer's usage reports
                explanation = dataclasses.replace(explanation, cached=max(0, cached_tokens))
            if later is None:
                self._record(model, tenant, rendered, request.replica)
            else:
                later.append(lambda: self.record_prompt(request, rendered))
        except Exception as exc:  # noqa: BLE001 - an explanation must never fail a request
            with self._lock:
                self.errors += 1
            logger.warning("no cache explanation for a request of %s (%s)", request.model, type(exc).__name__)
            return None
        with self._lock:
            self.counters.setdefault(request.model, MissCounters()).add(explanation)
        return explanation

    def _record(self, model: str, tenant: str, rendered: RenderedPrompt, replica: str | None) -> None:
        self.explainer.record(
            model, tenant, rendered.tokens, rendered.segments, tools_digest=rendered.tools_digest
        )
        self.explainer.mark_cached(model, tenant, rendered.tokens, replica=replica)

    def record_answer(
        self,
        request: ChatRequest,
        prepared: PreparedPrompt,
        answer: tuple[int, ...],
        uncomputed: int = 0,
        cut: bool = False,
    ) -> None:
        """Record an explained request's prompt followed by its answer as the engine cached it (token ids of
        the model, ``Finish.answer_token_ids``), so the explanation of the client's next request knows the
        newest reply: an edit of it is ``history_rewritten`` where it differs, not ``cold``. ``uncomputed``:
        the answer's last ids the engine has no KV for (``Finish.answer_uncomputed``); ``cut``: the reply was
        cut by ``max_tokens`` (``MissExplainer.record_answer``). Its blocks are not marked cached (what of the
        answer the engine kept is not known here). Never raises: a failure is counted in ``errors``."""
        rendered = prepared.rendered
        try:
            self.explainer.record_answer(
                request.model,
                request.tenant,
                rendered.tokens,
                rendered.segments,
                answer,
                tools_digest=rendered.tools_digest,
                uncomputed=uncomputed,
                cut=cut,
            )
        except Exception as exc:  # noqa: BLE001 - never fails a request
            with self._lock:
                self.errors += 1
            logger.warning("answer of a request of %s not recorded (%s)", request.model, type(exc).__name__)

    def record_prompt(self, request: ChatRequest, rendered: RenderedPrompt) -> None:
        """Record an explained request's prompt for the explanations of later requests, and its full blocks as
        cached (what ``explain`` does unless given ``later``). Never raises: a failure is counted in
        ``errors``."""
        try:
            self._record(request.model, request.tenant, rendered, request.replica)
        except Exception as exc:  # noqa: BLE001 - never fails a request
            with self._lock:
                self.errors += 1
            logger.warning("prompt of a request of %s not recorded (%s)", request.model, type(exc).__name__)

    def snapshot(self) -> dict[str, Any]:
        """``/admin/stats``'s ``cache_misses``: per model the counters by cause and segment, the explainer's
        footprint, and ``errors`` (requests left unexplained)."""
        with self._lock:
            models = {name: c.snapshot() for name, c in self.counters.items()}
            errors = self.errors
        return {"models": models, "errors": errors, "index": self.explainer.footprint()}


def _without_preamble(explanation: MissExplanation, shift: int) -> MissExplanation:
    """``explanation`` (made on a prompt that starts with a ``shift``-token tools preamble the engine's template
    leaves out) in the engine's prompt: counts and the offset less the preamble, so ``cached`` is the count the
    engine reported and the offset stays at or after it."""
    cached = max(0, explanation.cached - shift)
    offset = None if explanation.offset is None else max(cached, explanation.offset - shift)
    return dataclasses.replace(
        explanation, cached=cached, stable=max(0, explanation.stable - shift), offset=offset
    )
