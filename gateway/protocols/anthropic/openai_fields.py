"""Which OpenAI ``/v1/chat/completions`` fields an Anthropic model can honour: the decision for every field the
OpenAI face accepts (``gateway.protocols.openai.parse.CHAT_FIELDS``), so an OpenAI-face request to
``backend: anthropic`` is either translated faithfully or refused with a 400 naming the field, never answered
with a field silently dropped. Pure data and one check, no I/O.

Invariant: ``MAPPED | IGNORED | set(REFUSED)`` covers ``CHAT_FIELDS`` exactly (``tests`` hold it to that), so a
field added to the face must be decided here. docs/upstreams.md lists the decisions and their reasons.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from gateway.core.errors import InvalidRequestError

MAPPED = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "stop", "stream", "tools", "tool_choice",
        "parallel_tool_calls", "temperature", "top_p", "top_k", "user",
        # n and logprobs / top_logprobs: n = 1 and logprobs off only (``refuse_choices_and_logprobs``)
        "n", "logprobs", "top_logprobs",
        # json_schema -> output_config.format; json_object is a 400 (``structured_outputs.anthropic_output_config``)
        "response_format",
        # the face's own business (the usage chunk is rendered by the gateway, whatever the backend)
        "stream_options",
    }
)  # fmt: skip
"""Fields the translation carries (``AnthropicUpstreamBackend._translated_body``; ``response_format`` through
``structured_outputs.anthropic_output_config``) or the gateway honours itself."""

IGNORED = frozenset(
    {"metadata", "prompt_cache_key", "safety_identifier", "prompt_cache_retention", "cache_salt"}
)
"""Fields that by OpenAI's own documentation do not change the answer, so leaving them out is harmless:
``metadata`` (tags of a stored completion), ``prompt_cache_key`` (a cache-routing hint: the gateway routes by
its own prefix key), ``safety_identifier`` (an abuse-monitoring id), ``prompt_cache_retention`` (how long
OpenAI keeps a cached prefix: the gateway chooses Anthropic's cache TTL itself), ``cache_salt`` (vLLM's cache
isolation: the face has folded it into the request's tenant; Anthropic's own cache is the organisation's)."""

REFUSED: dict[str, tuple[Any, ...]] = {
    "seed": (None,),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "web_search_options": (None,),
    "prompt_cache_options": (None,),
    "moderation": (None,),
}
"""Fields the Messages API has no equivalent for -> the values that ask for nothing (accepted: OpenAI's own
defaults); any other value is a 400 naming the field."""

ANTHROPIC_MAX_TEMPERATURE = 1.0
"""Anthropic's ``temperature`` range is [0, 1] (OpenAI's is [0, 2])."""


def check_openai_fields_for_anthropic(body: Mapping[str, Any]) -> None:
    """Refuse the OpenAI fields of ``body`` an Anthropic model cannot honour (``REFUSED`` with a value other
    than a neutral one, a ``temperature`` above 1); ``MAPPED`` and ``IGNORED`` fields pass, and so does a field
    this module does not know (only reachable with ``server.unknown_fields: ignore``, which says to ignore it).

    Raises:
        InvalidRequestError: code ``unsupported_parameter`` / ``unsupported_value``, ``param`` the field.
    """
    for name, accepted in REFUSED.items():
        if name in body and not any(_same(body[name], value) for value in accepted):
            neutral = [json.dumps(v) for v in accepted if v is not None]
            hint = f"omit it or send {' or '.join(neutral)}" if neutral else "omit it"
            raise InvalidRequestError(
                f"Unsupported parameter: '{name}' is not supported with an Anthropic upstream model (the "
                f"Messages API has no equivalent); {hint}.",
                param=name,
                code="unsupported_parameter",
            )
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        if temperature > ANTHROPIC_MAX_TEMPERATURE:
            raise InvalidRequestError(
                f"Unsupported value: 'temperature' must be <= {ANTHROPIC_MAX_TEMPERATURE:g} with an Anthropic "
                f"upstream model, but got {temperature} instead.",
                param="temperature",
                code="unsupported_value",
            )


def _same(value: Any, accepted: Any) -> bool:
    """Equal and of the same JSON kind (``false`` is not ``0``; ``0`` and ``0.0`` are both numbers)."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return type(value) is type(accepted) and value == accepted
    if isinstance(value, int | float) and isinstance(accepted, int | float):
        return value == accepted
    return type(value) is type(accepted) and value == accepted
