"""A provider's own word on why a request missed its cache, mapped onto the gateway's miss causes.

Anthropic cache diagnostics (https://platform.claude.com/docs/en/build-with-claude/cache-diagnostics): a request
that carries ``"diagnostics": {"previous_message_id": <id of the previous response, or null>}`` gets back a
``diagnostics`` object whose ``cache_miss_reason`` has a ``type`` (``model_changed``, ``system_changed``,
``tools_changed``, ``messages_changed``, ``previous_message_not_found``, ``unavailable``; null while the
comparison still runs) and ``cache_missed_input_tokens``. The comparison is about the request structure, not
about whether the cache hit. Mapping onto ``miss_explanation.MISS_CAUSES``:

==============================  ======================================================================
provider reason                 gateway cause
==============================  ======================================================================
``model_changed``               ``cold`` (another model's cache: nothing of this prefix is cached)
``system_changed``              ``system_changed``
``tools_changed``               ``tools_changed``
``messages_changed``            ``history_rewritten``
``previous_message_not_found``  none (no comparison was possible)
``unavailable``                 none
anything else (a phrase)        ``miss_explanation.map_provider_cause`` (keywords), else none
==============================  ======================================================================

Other providers document no miss reason today; a ``diagnostics`` / ``cache_miss_reason`` string anywhere in the
same place is read with ``map_provider_cause``. Malformed diagnostics are ignored (``None``), never an error:
they only explain. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.service.miss_counters import MissCounters
from gateway.service.miss_explanation import MissExplanation, map_provider_cause

ANTHROPIC_MISS_REASONS: Mapping[str, str | None] = {
    "model_changed": "cold",
    "system_changed": "system_changed",
    "tools_changed": "tools_changed",
    "messages_changed": "history_rewritten",
    "previous_message_not_found": None,
    "unavailable": None,
}


@dataclass(frozen=True)
class ProviderDiagnostic:
    """What the provider said: its ``reason`` verbatim (bounded to 64 characters), the gateway ``cause`` it maps
    to (None when it maps to none), and the input tokens it says missed the cache (None when not given)."""

    provider: str
    reason: str
    cause: str | None
    missed_tokens: int | None = None


def provider_miss_cause(reason: str | None) -> str | None:
    """The gateway's miss cause for a provider's own miss reason (an Anthropic ``cache_miss_reason.type`` or a
    phrase), or None when it names none we know."""
    if not reason:
        return None
    if reason in ANTHROPIC_MISS_REASONS:
        return ANTHROPIC_MISS_REASONS[reason]
    return map_provider_cause(reason)


def _reason_type(reason: Any) -> str | None:
    if isinstance(reason, str):
        return reason
    if isinstance(reason, Mapping) and isinstance(reason.get("type"), str):
        return reason["type"]
    return None


def anthropic_diagnostic(body: Any) -> ProviderDiagnostic | None:
    """The diagnostic of an Anthropic Messages response body (or ``message_start`` message), or None when there
    is none, it is still pending, or it is malformed."""
    if not isinstance(body, Mapping):
        return None
    diagnostics = body.get("diagnostics")
    if not isinstance(diagnostics, Mapping):
        return None
    reason = diagnostics.get("cache_miss_reason")
    kind = _reason_type(reason)
    if kind is None:
        return None
    cause = ANTHROPIC_MISS_REASONS[kind] if kind in ANTHROPIC_MISS_REASONS else map_provider_cause(kind)
    missed = reason.get("cache_missed_input_tokens") if isinstance(reason, Mapping) else None
    if isinstance(missed, bool) or not isinstance(missed, int) or missed < 0:
        missed = None
    return ProviderDiagnostic("anthropic", kind[:64], cause, missed)


def openai_diagnostic(body: Any) -> ProviderDiagnostic | None:
    """A miss reason from an OpenAI-compatible body (``diagnostics.cache_miss_reason`` as a string or an object
    with ``type``), mapped by keywords; None when absent or unknown in shape."""
    if not isinstance(body, Mapping):
        return None
    diagnostics = body.get("diagnostics")
    if not isinstance(diagnostics, Mapping):
        return None
    kind = _reason_type(diagnostics.get("cache_miss_reason"))
    if kind is None:
        return None
    return ProviderDiagnostic("openai", kind[:64], map_provider_cause(kind))


def count_provider_miss(
    counters: MissCounters, diagnostic: ProviderDiagnostic, cached: int, stable: int
) -> MissExplanation | None:
    """Fold a provider diagnostic into ``counters`` when the gateway has no local explanation of the request:
    a miss (``cached < stable``) with a mapped cause is counted with ``source="provider"`` and returned; else
    nothing is counted and None returned. (With a local explanation, pass ``diagnostic.cause`` as
    ``MissExplainer.explain(provider_cause=...)`` instead, which gives the provider's cause precedence.)"""
    if diagnostic.cause is None or cached >= stable:
        return None
    explanation = MissExplanation(
        cached=cached, stable=stable, miss=True, cause=diagnostic.cause, source="provider"
    )
    counters.add(explanation)
    return explanation
