"""Reading a provider's cache token counts out of its response ``usage`` into a ``gateway.core.cache_usage.CacheUsage``.

Shapes, as documented:

- Anthropic Messages (https://platform.claude.com/docs/en/build-with-claude/prompt-caching): ``input_tokens``
  (after the last breakpoint), ``cache_read_input_tokens``, ``cache_creation_input_tokens`` and its split
  ``cache_creation: {ephemeral_5m_input_tokens, ephemeral_1h_input_tokens}``; the prompt is their sum.
- OpenAI Chat Completions / Responses (https://developers.openai.com/api/docs/guides/prompt-caching):
  ``prompt_tokens`` / ``input_tokens`` (all input), ``prompt_tokens_details`` / ``input_tokens_details`` with
  ``cached_tokens`` and, from the GPT-5.6 family on, ``cache_write_tokens`` (written with the request's
  ``prompt_cache_retention``). xAI and vLLM / SGLang answer in the same shape.
- DeepSeek (https://api-docs.deepseek.com/guides/kv_cache): ``prompt_cache_hit_tokens`` and
  ``prompt_cache_miss_tokens`` (no write premium: the miss price is the input price).
- Gemini (https://ai.google.dev/gemini-api/docs/caching): ``usageMetadata.promptTokenCount`` and
  ``cachedContentTokenCount``.

Every count must be a JSON integer >= 0 (a bool is not one); anything else raises ``UpstreamUsageError`` naming
the field, which the gateway answers with a typed 502 (the upstream, not the client, is at fault). A missing
count is 0. Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.core.cache_usage import CacheUsage


class UpstreamUsageError(ValueError):
    """An upstream ``usage`` field of the wrong type or a negative count. ``field`` is its dotted path."""

    def __init__(self, field: str, value: Any) -> None:
        shown = type(value).__name__ if not isinstance(value, int | float | str) else repr(value)[:40]
        super().__init__(f"upstream usage.{field}: expected an integer >= 0, got {shown}")
        self.field = field


def _count(raw: Mapping[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UpstreamUsageError(f"{where}{key}", value)
    return value


def _object(raw: Any, where: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise UpstreamUsageError(where, raw)
    return raw


def anthropic_cache_usage(usage: Any) -> CacheUsage:
    """``CacheUsage`` from an Anthropic ``usage`` object (retentions ``5m`` / ``1h``; creation tokens without the
    split count as ``5m``, the provider's default).

    Raises:
        UpstreamUsageError: a field of the wrong type, or a split larger than the creation total.
    """
    usage = _object(usage, "(usage)")
    plain = _count(usage, "input_tokens", "")
    read = _count(usage, "cache_read_input_tokens", "")
    created = _count(usage, "cache_creation_input_tokens", "")
    split = _object(usage.get("cache_creation"), "cache_creation")
    one_hour = _count(split, "ephemeral_1h_input_tokens", "cache_creation.")
    five_min = _count(split, "ephemeral_5m_input_tokens", "cache_creation.")
    if split and one_hour + five_min != created:
        if one_hour + five_min > created:
            raise UpstreamUsageError("cache_creation", dict(split))
        five_min = created - one_hour
    elif not split:
        five_min = created
    writes = {name: tokens for name, tokens in (("1h", one_hour), ("5m", five_min)) if tokens}
    return CacheUsage(prompt_tokens=plain + read + created, cache_read_tokens=read, cache_write_tokens=writes)


def openai_cache_usage(usage: Any, retention: str | None = None) -> CacheUsage:
    """``CacheUsage`` from an OpenAI-compatible ``usage`` (Chat Completions or Responses); writes are booked
    under ``retention`` (the ``prompt_cache_retention`` the request carried; None = the default).

    Raises:
        UpstreamUsageError: a field of the wrong type, or cached + written tokens above the prompt tokens.
    """
    usage = _object(usage, "(usage)")
    if "input_tokens" in usage and "prompt_tokens" not in usage:
        prompt = _count(usage, "input_tokens", "")
        details_key = "input_tokens_details"
    else:
        prompt = _count(usage, "prompt_tokens", "")
        details_key = "prompt_tokens_details"
    details = _object(usage.get(details_key), details_key)
    read = _count(details, "cached_tokens", f"{details_key}.")
    written = _count(details, "cache_write_tokens", f"{details_key}.")
    if read + written > prompt:
        raise UpstreamUsageError(details_key, dict(details))
    return CacheUsage(prompt, read, {retention: written} if written else {})


def deepseek_cache_usage(usage: Any) -> CacheUsage:
    """``CacheUsage`` from a DeepSeek ``usage`` (``prompt_cache_hit_tokens`` / ``prompt_cache_miss_tokens``).

    Raises:
        UpstreamUsageError: a field of the wrong type.
    """
    usage = _object(usage, "(usage)")
    hit = _count(usage, "prompt_cache_hit_tokens", "")
    miss = _count(usage, "prompt_cache_miss_tokens", "")
    prompt = _count(usage, "prompt_tokens", "") or hit + miss
    if hit > prompt:
        raise UpstreamUsageError("prompt_cache_hit_tokens", hit)
    return CacheUsage(prompt, hit, {})


def anthropic_miss_reason(body: Any) -> str | None:
    """The ``diagnostics.cache_miss_reason.type`` of an Anthropic Message (or ``message_delta`` event), bounded to
    64 characters; None when absent, pending (null) or malformed: a diagnostic only explains, it never fails a
    request (https://platform.claude.com/docs/en/build-with-claude/cache-diagnostics)."""
    diagnostics = body.get("diagnostics") if isinstance(body, Mapping) else None
    reason = diagnostics.get("cache_miss_reason") if isinstance(diagnostics, Mapping) else None
    if isinstance(reason, Mapping):
        reason = reason.get("type")
    return reason[:64] if isinstance(reason, str) and reason else None


def gemini_cache_usage(usage_metadata: Any) -> CacheUsage:
    """``CacheUsage`` from a Gemini ``usageMetadata`` (cached tokens are included in ``promptTokenCount``).

    Raises:
        UpstreamUsageError: a field of the wrong type, or more cached tokens than prompt tokens.
    """
    usage = _object(usage_metadata, "(usageMetadata)")
    prompt = _count(usage, "promptTokenCount", "")
    cached = _count(usage, "cachedContentTokenCount", "")
    if cached > prompt:
        raise UpstreamUsageError("cachedContentTokenCount", cached)
    return CacheUsage(prompt, cached, {})
