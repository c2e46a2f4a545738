"""The gateway's provider-cache retention choices, attached to the upstream backends at start-up.

``RetentionPolicy`` owns one ``cache_ttl.ReuseTracker`` and answers, per request:

- Anthropic upstreams (``anthropic_ttls``): ``{"stable": ttl, "history": ttl}`` for
  ``protocols.anthropic.cache_control.plan_cache_control``: the stable breakpoints by the prefix key's reuse
  (scope: model + tenant + ``stable``), the history breakpoints and the automatic marker by the conversation's
  (its key: the prefix key and the first message, which never changes within a conversation; scope: model +
  tenant + ``history``); "none" allowed (a prefix that never comes back is cheaper without a marker).
- OpenAI-compatible upstreams (``openai_retention``): the ``prompt_cache_retention`` for the prefix key, where
  the model's price entry offers more than one retention (``24h`` dominates ``in_memory`` at equal prices).

Prefix tokens are estimated as JSON characters / 4 (only ratios of them matter to the rule). Nothing here holds
prompt text: keys are hashes. ``attach_retention_policy`` gives each upstream backend its chooser.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from gateway.backends.anthropic_upstream import AnthropicUpstreamBackend
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.config.price_table import ModelPrices
from gateway.core.request import ChatRequest
from gateway.service.cache_ttl import ReuseTracker, options_for


def _tokens(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":"))) // 4 if value else 0


def conversation_key(prefix_key: str, body: Mapping[str, Any]) -> str:
    """A conversation's key: BLAKE2b-128 of the prefix key and the first message (stable across turns)."""
    messages = body.get("messages") or []
    first = json.dumps(messages[0] if messages else None, ensure_ascii=False, sort_keys=True)
    return hashlib.blake2b(f"{prefix_key}\0{first}".encode(), digest_size=16).hexdigest()


class RetentionPolicy:
    """Retention choices from observed reuse (see the module docstring).

    Args:
        tracker: the reuse tracker (default: a new one on the monotonic clock).
    """

    def __init__(self, tracker: ReuseTracker | None = None) -> None:
        self.tracker = tracker if tracker is not None else ReuseTracker()

    def anthropic_ttls(
        self, prices: ModelPrices, request: ChatRequest, body: Mapping[str, Any]
    ) -> dict[str, str]:
        """``{"stable", "history"}`` TTLs (``5m``, ``1h`` or ``none``) for one Anthropic request."""
        options = options_for(prices)
        kwargs = {
            "input_price": prices.input,
            "read_price": prices.cache_read,
            "default": prices.default_retention,
            "allow_none": True,
        }
        stable_tokens = _tokens(body.get("tools")) + _tokens(body.get("system"))
        history_tokens = stable_tokens + _tokens(body.get("messages"))
        prefix = request.prefix_key or request.request_id
        out = {}
        for kind, key, tokens in (
            ("stable", prefix, stable_tokens),
            ("history", conversation_key(prefix, body), history_tokens),
        ):
            scope = (request.model, request.tenant, kind)
            self.tracker.observe(key, scope, tokens=tokens)
            out[kind] = self.tracker.choose(key, scope, options, **kwargs).retention
        return out

    def openai_retention(self, prices: ModelPrices, request: ChatRequest) -> str | None:
        """The ``prompt_cache_retention`` for one request (None when the model offers a single retention)."""
        if len(prices.retentions) < 2:
            return None
        key = request.prefix_key or request.request_id
        scope = (request.model, request.tenant, "prompt")
        self.tracker.observe(key, scope, tokens=_tokens(request.messages))
        return self.tracker.choose(
            key,
            scope,
            options_for(prices),
            input_price=prices.input,
            read_price=prices.cache_read,
            default=prices.default_retention,
        ).retention


def attach_retention_policy(backends: Mapping[str, Any], policy: RetentionPolicy) -> None:
    """Give every upstream backend with prices its chooser: Anthropic backends with automatic breakpoints their
    ``ttl_chooser``; OpenAI-compatible ones whose config says ``prompt_cache_retention: auto`` (their
    ``retention_chooser`` left None by ``create_openai_backend`` until here) and whose model has several
    retentions."""
    for backend in backends.values():
        prices = getattr(backend, "prices", None)
        if prices is None:
            continue
        if isinstance(backend, AnthropicUpstreamBackend) and backend.auto_breakpoints:
            backend.ttl_chooser = _bind_anthropic(policy, prices)
        elif (
            isinstance(backend, OpenAIUpstreamBackend)
            and backend.retention_auto
            and len(prices.retentions) > 1
        ):
            backend.retention_chooser = _bind_openai(policy, prices)


def _bind_anthropic(
    policy: RetentionPolicy, prices: ModelPrices
) -> Callable[[ChatRequest, Any], dict[str, str]]:
    return lambda request, body: policy.anthropic_ttls(prices, request, body)


def _bind_openai(policy: RetentionPolicy, prices: ModelPrices) -> Callable[[ChatRequest], str | None]:
    return lambda request: policy.openai_retention(prices, request)
