"""What a backend yields for one request: ``Delta`` events, then exactly one ``Finish`` with ``BackendUsage``.
The protocol renderers turn these into OpenAI or Anthropic JSON/SSE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TopLogprob:
    """One candidate token: its text, UTF-8 bytes (a token may hold part of a character) and logprob."""

    token: str
    token_bytes: tuple[int, ...]
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's text, bytes and natural-log probability, with its most likely alternatives
    (OpenAI ``logprobs``; ``top`` is empty unless the client asked for ``top_logprobs``)."""

    token: str
    token_bytes: tuple[int, ...]
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    """Generated text, and/or tool-call fragments in OpenAI's streaming shape
    (``choices[].delta.tool_calls``).

    ``cached_tokens``: prompt tokens served from a prefix cache, when the backend knows it before ``Finish``
    (the embedded engine sets it on its first delta), so a streamed answer's headers can report it; None
    otherwise. ``prompt_tokens``: all input tokens, when the backend knows them before ``Finish`` (the embedded
    engine, on the same first delta), so a streamed Anthropic ``message_start`` can report real input counts.
    Renderers ignore it. ``index``: the choice (0 .. n-1, OpenAI ``n``). ``logprobs``: one entry per token this
    delta's text came from, when the client asked for logprobs.
    """

    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class BackendUsage:
    """Token counts as the backend reports them.

    Attributes:
        prompt_tokens: all input tokens (cached ones included).
        completion_tokens: generated tokens.
        cached_tokens: input tokens served from a prefix cache (ours or the provider's).
        cache_creation_tokens: input tokens written to a provider cache (Anthropic, OpenAI from GPT-5.6), else 0.
        counted_by: how the counts were made (``"engine"``, ``"upstream"``, ``"tiktoken:cl100k_base"``, ...).
        cache_writes: ``(retention, tokens)`` pairs splitting ``cache_creation_tokens`` by retention when the
            provider says (Anthropic ``5m`` / ``1h``); empty = all at the request's retention.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cache_creation_tokens: int = 0
    counted_by: str = "engine"
    cache_writes: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class Finish:
    """The last event: OpenAI-style finish reason (stop, length, tool_calls, content_filter) and usage.

    Attributes:
        finish_reason: ``stop``, ``length``, ``tool_calls`` or ``content_filter``.
        usage: the request's token counts.
        ttft_s: seconds to the first token as the backend measured it, if it did.
        stop_sequence: the stop string that ended the answer, when the backend knows it.
        anthropic_stop_reason: an Anthropic upstream's own ``stop_reason`` (wins over the mapped reason on the
            Anthropic face).
        native: the upstream's own Anthropic events were relayed (``NativeDelta``): the Anthropic face adds
            no closing events of its own.
        replica: the upstream replica that answered (base URL, credentials and query removed).
        cache_miss_reason: the provider's own word on why the prompt cache missed (Anthropic
            ``diagnostics.cache_miss_reason.type``), when it gave one.
        cache_retention: the cache retention the request asked for (``5m``, ``1h``, ``24h``, ...), if any.
        finish_reasons: each choice's finish reason when the request asked for ``n`` > 1 choices (index =
            choice; ``finish_reason`` is choice 0's); empty for one choice. ``usage`` covers all choices (the
            prompt once, the completion tokens of every choice).
        answer_token_ids: choice 0's answer as token ids of the model, as its engine cached them behind the
            prompt and as a client resending the answer unedited renders it (the embedded engine: its
            generated ids, less the stop token that ended them); empty when unknown (upstreams, whose caches
            hold prompts only; an answer a stop string cut, whose ids hold text the client never got). The
            cache explanation of a later request compares its history with it (an edited newest reply).
        answer_uncomputed: how many of ``answer_token_ids``' last ids the engine never computed KV for, so its
            cache cannot hold them: 1 when the answer ends with the last token the model sampled (a reply cut
            by ``max_tokens``; a stop token that has text), 0 when the stop token that ended it was left out
            (the answer's last id was fed to the model to sample it) or the answer is empty.
    """

    finish_reason: str
    usage: BackendUsage
    ttft_s: float | None = None
    stop_sequence: str | None = None
    anthropic_stop_reason: str | None = None
    native: bool = False
    replica: str | None = None
    cache_miss_reason: str | None = None
    cache_retention: str | None = None
    finish_reasons: tuple[str, ...] = ()
    answer_token_ids: tuple[int, ...] = ()
    answer_uncomputed: int = 0


BackendEvent = Delta | Finish
