"""What a backend yields for one request: ``Delta`` events, then exactly one ``Finish`` with ``BackendUsage``.
The protocol renderers turn these into OpenAI or Anthropic JSON/SSE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Delta:
    """Generated text, and/or tool-call fragments in OpenAI's streaming shape (``choices[].delta.tool_calls``)."""

    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class BackendUsage:
    """Token counts as the backend reports them.

    Attributes:
        prompt_tokens: all input tokens (cached ones included).
        completion_tokens: generated tokens.
        cached_tokens: input tokens served from a prefix cache (ours or the provider's).
        cache_creation_tokens: input tokens written to a provider cache (Anthropic), else 0.
        counted_by: how the counts were made (``"engine"``, ``"upstream"``, ``"tiktoken:cl100k_base"``, ...).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cache_creation_tokens: int = 0
    counted_by: str = "engine"


@dataclass(frozen=True)
class Finish:
    """The last event: OpenAI-style finish reason (stop, length, tool_calls, content_filter) and usage."""

    finish_reason: str
    usage: BackendUsage
    ttft_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


BackendEvent = Delta | Finish
