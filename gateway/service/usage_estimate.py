"""Token counts for the two charges made without a backend's final usage: the cost estimate a request
reserves against its key's budget when it is admitted (``reservation_usd``), and the usage a request is
charged when it ends before its ``Finish`` (``unfinished_usage``: the client left, or the backend failed
mid-stream).

- The prompt: what the backend said before the end (the embedded engine's first delta carries the prompt's
  exact ``prompt_tokens`` and ``cached_tokens``), else a local estimate (``estimate_prompt_tokens``:
  ``gateway.core.tokens.default_counter`` over the messages' and tools' JSON, or a completion's prompt), with
  nothing known cached (an upstream reports its cache only in its final usage: the prompt is charged as
  uncached input, an upper bound).
- The completion: the tokens of the text and tool-call fragments generated so far, per choice, counted by
  the model's own tokenizer when the backend has one (``Backend.prompt_tokenizer``), else by the default
  counter (as an upstream answer without ``usage`` is counted).
- The reservation: prompt tokens at the input price, plus the output cap (``max_tokens``, else
  ``DEFAULT_OUTPUT_TOKENS``) times ``n`` at the output price.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gateway.config.price_table import ModelPrices
from gateway.core.events import BackendEvent, BackendUsage, Delta, Finish
from gateway.core.request import ChatRequest
from gateway.core.tokens import default_counter

DEFAULT_OUTPUT_TOKENS = 4096
"""Output tokens reserved for a request that sets no ``max_tokens`` (the cap prefixgate sends an Anthropic
upstream for such a request, ``gateway.backends.anthropic_upstream.DEFAULT_MAX_TOKENS``)."""


def estimate_prompt_tokens(request: ChatRequest) -> int:
    """A local count of the request's prompt tokens: ``default_counter`` (cl100k_base) over a completion's
    prompt, or over the JSON of the messages (and of the tools, when there are some)."""
    count = default_counter().count
    if request.kind == "completion":
        return count(request.prompt or "")
    text = json.dumps(request.messages, ensure_ascii=False, default=str)
    if request.tools:
        text += "\n" + json.dumps(request.tools, ensure_ascii=False, default=str)
    return count(text)


def output_cap(request: ChatRequest) -> int:
    """The most tokens the request may generate: ``max_tokens`` (else ``DEFAULT_OUTPUT_TOKENS``) per choice,
    times its ``n`` choices."""
    params = request.params
    per_choice = params.max_tokens if params.max_tokens is not None else DEFAULT_OUTPUT_TOKENS
    return per_choice * max(params.n, 1)


def reservation_usd(prices: ModelPrices, prompt_tokens: int, output_tokens: int) -> float:
    """The cost estimate a request reserves: ``prompt_tokens`` at the input price plus ``output_tokens`` at
    the output price (0 for a model whose output is not priced), USD."""
    return prices.dollars(prompt_tokens, prices.input) + prices.dollars(output_tokens, prices.output or 0.0)


class GeneratedText:
    """What a request generated so far, kept for the charge of a request that ends before its ``Finish``: each
    choice's text and tool-call fragments (function names and arguments), joined into one string every
    ``COMPACT_PIECES`` pieces so a long answer holds about a byte per character, and the prompt's counts when a
    delta carried them (the embedded engine's first delta)."""

    COMPACT_PIECES = 256

    def __init__(self) -> None:
        self._pieces: dict[int, list[str]] = {}
        self.prompt_tokens: int | None = None
        self.cached_tokens = 0

    def add(self, delta: Delta) -> None:
        """Keep ``delta``'s text and tool-call fragments (and its prompt counts, the first ones given)."""
        if delta.prompt_tokens is not None and self.prompt_tokens is None:
            self.prompt_tokens, self.cached_tokens = delta.prompt_tokens, delta.cached_tokens or 0
        if not delta.text and not delta.tool_calls:
            return
        pieces = self._pieces.get(delta.index)
        if pieces is None:
            pieces = self._pieces[delta.index] = []
        if delta.text:
            pieces.append(delta.text)
        for call in delta.tool_calls or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                if function.get("name"):  # a call's start: not glued to the text or call before it
                    pieces.append("\n" + str(function["name"]))
                if function.get("arguments"):
                    pieces.append(str(function["arguments"]))
        if len(pieces) >= self.COMPACT_PIECES:
            pieces[:] = ["".join(pieces)]

    def tokens(self, count: Callable[[str], int]) -> int:
        """The generated tokens: ``count`` of each choice's text, summed over the choices."""
        return sum(count("".join(pieces)) for pieces in self._pieces.values() if pieces)


def unfinished_usage(
    request: ChatRequest,
    generated: GeneratedText,
    held: BackendEvent | None = None,
    tokenizer: Any = None,
    prompt_estimate: int | None = None,
) -> BackendUsage:
    """The usage to charge a request that ended before its ``Finish`` reached the client: its prompt and what
    it ``generated``.

    Args:
        held: the event that opened the stream when it was never handed out: a ``Finish`` there is the
            backend's own count of the whole request, and wins; a ``Delta`` counts as generated.
        tokenizer: the model's ``PromptTokenizer`` (``encode(text) -> (ids, offsets)``), or None (upstreams:
            the default counter).
        prompt_estimate: ``estimate_prompt_tokens(request)`` when already computed (the budget reservation).
    """
    if isinstance(held, Finish):
        return held.usage
    if isinstance(held, Delta):
        generated.add(held)
    counter = default_counter()
    count: Callable[[str], int] = counter.count
    counted_by = counter.counted_by
    if tokenizer is not None:
        encode = tokenizer.encode

        def count(text: str) -> int:
            return len(encode(text)[0])

        counted_by = getattr(tokenizer, "name", "tokenizer")
    if generated.prompt_tokens is not None:
        prompt_tokens, cached = generated.prompt_tokens, generated.cached_tokens
    else:
        prompt_tokens = prompt_estimate if prompt_estimate is not None else estimate_prompt_tokens(request)
        cached = 0
    return BackendUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=generated.tokens(count),
        cached_tokens=min(cached, prompt_tokens),
        counted_by=counted_by,
    )
