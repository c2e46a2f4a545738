"""The gateway's one internal request type. Protocol differences (OpenAI, Anthropic) end when a body is
parsed into a ``ChatRequest``; rules, routing and backends see only this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.api import SamplingParams


@dataclass
class ChatRequest:
    """One client request, after parsing and validation.

    Attributes:
        model: the client-facing model name (a ``models[].name`` of the config).
        messages: chat messages in OpenAI's shape (``role`` in system/developer/user/assistant/tool,
            ``content`` a string or a list of content parts, optional ``tool_calls``/``tool_call_id``/``name``).
            Anthropic bodies are translated into this shape (their top-level ``system`` becomes a leading
            system message); the untranslated body stays in ``body``.
        tools: OpenAI-style tool schemas (``{"type": "function", "function": {...}}``) or None.
        tool_choice: passed through to upstreams; the embedded engine ignores it.
        params: sampling parameters (``engine.api.SamplingParams``).
        stream: answer as server-sent events.
        include_usage: OpenAI ``stream_options.include_usage``.
        user: OpenAI ``user`` / Anthropic ``metadata.user_id``; never logged.
        tenant: cache salt; requests of different tenants never share cached prefixes.
        protocol: the face the request came in on.
        kind: ``"chat"`` or ``"completion"`` (``/v1/completions``, then ``prompt`` is set and messages is empty).
        prompt: the raw prompt of a completion request.
        body: the original JSON body, for native passthrough to an upstream of the same protocol.
        rules_enabled: False when the client sent ``x-prefixgate-rules: off``.
        request_id: the gateway's id for logs and response ids.
        canonical: the rules' result (``rules`` package ``Canonical``), set by the gateway after canonicalization.
        prefix_key: hex prefix key (model id, tenant salt, hash of the stable segments), set by routing.
        forward_headers: client headers an upstream of the same protocol receives too, lower-case name -> value
            (the Anthropic face sets ``anthropic-beta`` here; ``gateway.protocols.anthropic.parse.FORWARDED_HEADERS`` lists them).
            Never credentials: the upstream's key comes from the config.
    """

    model: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    tenant: str = ""
    protocol: Literal["openai", "anthropic"] = "openai"
    kind: Literal["chat", "completion"] = "chat"
    prompt: str | None = None
    body: dict[str, Any] = field(default_factory=dict)
    rules_enabled: bool = True
    request_id: str = ""
    canonical: Any = None
    prefix_key: str = ""
    forward_headers: dict[str, str] = field(default_factory=dict)
