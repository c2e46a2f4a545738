"""The ``Backend`` base every backend (embedded engine, OpenAI-compatible upstream, Anthropic upstream)
derives from: the stream of events it yields, and the capabilities the service and HTTP layers may ask of it.

A backend turns a ``ChatRequest`` (already canonicalized by the rules, with its prefix key) into an async
stream of ``Delta`` events and exactly one final ``Finish``; the protocol renderers format these as OpenAI or
Anthropic JSON/SSE. Closing the stream early (client disconnect) must cancel the work behind it.

Capabilities are methods with a default here (``count_tokens``: a local estimate; ``engine_stats``,
``replicas``, ``system_fingerprint``, ``prompt_tokenizer``: none; ``warm``, ``cached_prefixes``,
``drop_cached``: the prefix cache's admin, None where the backend keeps no cache of its own), so the layers above call them on any backend and never test a
backend's class or look up its attributes: a new backend overrides what it can do better and touches no HTTP
code.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.api import EngineStats, WarmResult
from engine.kv_tiers.catalog import CachedPrefix
from gateway.core.errors import InvalidRequestError
from gateway.core.events import BackendEvent
from gateway.core.request import ChatRequest
from gateway.core.tokens import default_counter
from gateway.protocols.anthropic.strip import plain_messages, plain_tools


@dataclass(frozen=True)
class TokenCount:
    """The input tokens of a request, counted without running it.

    Attributes:
        input_tokens: tokens of the prompt.
        counted_by: how they were counted (``chat-template:<model id>``, ``upstream``, or a counter's name
            such as ``tiktoken:cl100k_base``).
        estimate: True when the count is a local estimate rather than the model's own tokenizer's.
    """

    input_tokens: int
    counted_by: str
    estimate: bool = False


ReplicaStates = dict[str, dict[str, object]]
"""Replica base URL (without credentials or query string) -> ``{"state", "inflight", "failures"}``."""


class Backend(ABC):
    """A model backend. ``name`` is the client-facing model name it serves.

    ``estimate_target`` names the backend in the errors of the local token estimate ("... cannot be sent to
    <target> model").
    """

    name: str
    estimate_target: str = "this"

    async def start(self) -> None:  # noqa: B027 - a backend with nothing to acquire keeps this
        """Acquire resources (load weights, open HTTP clients)."""

    async def close(self) -> None:  # noqa: B027 - a backend with nothing to release keeps this
        """Release resources; cancel work in flight."""

    @abstractmethod
    def stream(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """Yield ``Delta`` events then one ``Finish``. Raises ``gateway.core.errors`` API errors on bad
        input."""

    async def count_tokens(self, request: ChatRequest) -> TokenCount:
        """The input tokens of a canonical request, without running it. Default: ``estimate_tokens``.

        Raises:
            InvalidRequestError / UnsupportedContentError: content the backend cannot take (the same 400 a
                completion of the request gets).
        """
        return estimate_tokens(request, self.estimate_target)

    def engine_stats(self) -> EngineStats | None:
        """The counters of the engine behind this backend; None when there is none (or it is not started)."""
        return None

    def replicas(self) -> ReplicaStates | None:
        """Replica health and load for ``/admin/stats``; None for a backend without replicas."""
        return None

    def routing_share_stats(self) -> dict[str, Any] | None:
        """The counters of the backend's Redis routing share for ``/admin/stats``
        (``models[name]["routing_share"]``, docs/routing.md); None without one."""
        return None

    def kv_events(self) -> dict[str, Any] | None:
        """The counters of the backend's KV event feed for ``/admin/stats`` (``models[name]["kv_events"]``,
        docs/routing.md); None without a feed."""
        return None

    def system_fingerprint(self) -> str | None:
        """OpenAI's ``system_fingerprint`` for this backend's answers (changes with its weights or config)."""
        return None

    async def warm(
        self, request: ChatRequest, level_ends: list[tuple[int, str]] | None, pin: bool
    ) -> WarmResult | None:
        """Prefill a canonical request's prompt into the backend's prefix cache (no output), its blocks
        tagged with ``level_ends`` (``(end token, level)``), pinned in RAM with ``pin``. None: the backend
        keeps no cache of its own (upstreams).

        Raises:
            InvalidRequestError / ContextLengthExceededError: the prompt cannot be served.
        """
        return None

    def wants_level_ends(self) -> bool:
        """Whether ``stream`` uses ``ChatRequest.level_ends`` (computing them renders the prompt again, so the
        pipeline does it only for a backend that asks)."""
        return False

    def cached_prefixes(self, *, prefix_key: str | None, tenant: str | None) -> list[CachedPrefix] | None:
        """The prefixes cached now (``engine.kv_tiers.catalog.CachedPrefix`` rows, never text), narrowed by
        prefix key and tenant; None without a cache of its own."""
        return None

    def drop_cached(self, *, prefix_key: str | None, tenant: str | None) -> dict[str, Any] | None:
        """Drop cached prefixes in every tier (all of this backend's with neither filter): counts
        ``{"prefixes", "ram", "disk", "redis"}`` and ``"skipped_tiers": {tier: reason}`` when a tier could not
        be dropped (Redis down); None without a cache of its own."""
        return None

    def prompt_tokenizer(self) -> Any:
        """The model's own chat template and tokenizer as a
        ``gateway.service.canonicalize.prompt_tokenizers.PromptTokenizer`` (``render(messages, tools,
        add_generation_prompt) -> str``, ``encode(text) -> (ids, start offsets)``), for the miss explanation;
        None when the backend has none (upstreams: the explanation falls back to ``cl100k_base``)."""
        return None


def estimate_text(request: ChatRequest, target: str = "an OpenAI-compatible") -> str:
    """The text a local estimate counts: the JSON (``json.dumps``, ``ensure_ascii=False``, default separators)
    of the messages, then, when there are tools, a newline and the JSON of the tools, both as an
    OpenAI-compatible upstream would receive them (``plain_messages`` / ``plain_tools``).

    Raises:
        UnsupportedContentError: Anthropic-only content such a backend cannot take; ``target`` names it.
    """
    text = json.dumps(plain_messages(request.messages, target), ensure_ascii=False)
    tools = plain_tools(request.tools, target)
    if tools:
        text += "\n" + json.dumps(tools, ensure_ascii=False)
    return text


def estimate_tokens(request: ChatRequest, target: str = "an OpenAI-compatible") -> TokenCount:
    """``gateway.core.tokens.default_counter()`` over ``estimate_text``: JSON punctuation is counted (an
    overcount of a few tokens per message against a chat template), so is an image part's URL, and the
    model's own tokenizer may differ from cl100k.

    Raises:
        UnsupportedContentError: see ``estimate_text``.
    """
    counter = default_counter()
    return TokenCount(counter.count(estimate_text(request, target)), counter.counted_by, estimate=True)


def refuse_choices_and_logprobs(request: ChatRequest, target: str) -> None:
    """Refuse ``n`` > 1 and logprobs for a backend that relays one choice of text only (the upstream backends:
    their events carry neither a choice index nor logprobs), so no choice is merged into another and no
    requested field is silently dropped.

    Raises:
        InvalidRequestError: ``n`` > 1 (param ``n``) or logprobs asked for (param ``logprobs``).
    """
    if request.params.n != 1:
        raise InvalidRequestError(
            f"Invalid 'n': {target} model answers one choice per request through prefixgate (n=1), got "
            f"{request.params.n}.",
            param="n",
            code="unsupported_value",
        )
    if request.params.logprobs is not None:
        raise InvalidRequestError(
            f"'logprobs' is not relayed from {target} model by prefixgate.",
            param="logprobs",
            code="unsupported_value",
        )
