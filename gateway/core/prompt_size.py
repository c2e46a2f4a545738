"""How big a request's prompt is, and where work on it runs by that size: on the event loop for a short prompt (a
worker thread's hand-over and the GIL it holds while the loop waits cost more, docs/overhead.md), in a worker
thread for a long one, so one large prompt never stalls every other request and ``/healthz``.

Invariant: the thresholds only decide where work runs, never what it computes.
"""

from __future__ import annotations

from gateway.core.request import ChatRequest

INLINE_EXPLAIN_CHARS = 8_000
"""Prompts up to this many characters of text are explained on the event loop (tokenizing them takes well
under a millisecond); longer ones in a worker thread."""

INLINE_CANONICALIZE_CHARS = 100_000
"""Prompts up to this many characters of text are canonicalized on the event loop (the rules pass costs about a
microsecond a character where nothing is memoized); longer ones in a worker thread (a fresh-user trial: a 3.4 MB
one-line JSON system prompt held the loop for ~50 s before ``rules.actions.removal_range`` was made linear, and
still for ~3 s after)."""


INLINE_TOKENIZE_CHARS = 32_000
"""Prompts up to this many characters of text are tokenized for the embedded engine on the event loop (about
8,000 tokens: tens of milliseconds where nothing is memoized); longer ones in a worker thread, the encode itself
with the GIL released (``engine.backend_encode``): a 3 MB prompt held ``/healthz`` for ~4 s while the engine
tokenized it only to refuse it as longer than the context window (a fresh-user trial)."""


def prompt_chars(request: ChatRequest) -> int:
    """Characters of the request's prompt text (string contents, text parts' text, any other part as its ``str``),
    an upper bound's worth of an estimate for choosing where to work on it. Runs on every request: a text part
    is measured by its length, never turned into a string again."""
    total = 0
    for message in request.messages:
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                total += len(text) if isinstance(text, str) else len(str(part))
        elif content is not None:
            total += len(str(content))
    if request.tools:
        total += len(str(request.tools))
    return total
