"""The gateway's one internal request type. Protocol differences (OpenAI, Anthropic) end when a body is
parsed into a ``ChatRequest``; rules, routing and backends see only this.

Invariants: at most one of ``openai_body`` / ``anthropic_body`` is set (the client's own body, for passthrough
to an upstream of its protocol); what a backend needs to know of the client's protocol travels in typed
fields (``parallel_tool_calls``, ``sampling_given``), never in a protocol name. ``canonical`` is typed by the
``CanonicalPrompt`` protocol below, which ``rules.Canonical`` satisfies, so this layer does not import
``rules`` (``tests/test_layers.py`` holds it to that).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engine.api import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p")
"""Body fields whose absence leaves the choice to the provider (``ChatRequest.sampling_given``)."""


class Segment(Protocol):
    """One segment of the canonical prompt as the gateway reads it (``rules.segments.Segment``).

    ``level``: 1 tools+system, 2 documents, 3 history, 4 volatile tail; ``end_message``: exclusive index into
    the canonical messages; ``end_part`` / ``end_char``: where in message ``end_message - 1`` it stops
    (exclusive; None = at its end)."""

    @property
    def level(self) -> int: ...

    @property
    def end_message(self) -> int: ...

    @property
    def end_part(self) -> int | None: ...

    @property
    def end_char(self) -> int | None: ...


class CanonicalPrompt(Protocol):
    """The rules' result for one request as the gateway reads it (``rules.canonicalize.Canonical``)."""

    @property
    def segments(self) -> Sequence[Segment]: ...

    @property
    def applied(self) -> Mapping[str, int]: ...

    def stable_prefix_material(self, level: int = 3) -> bytes:
        """Canonical bytes of the stable segments up to ``level`` (hashed into the prefix key)."""
        ...


def given_sampling(body: Mapping[str, Any]) -> frozenset[str]:
    """The ``SAMPLING_FIELDS`` a client body sets to a value (not absent, not null)."""
    return frozenset(name for name in SAMPLING_FIELDS if body.get(name) is not None)


def nucleus_zero_as_greedy(params: SamplingParams) -> SamplingParams:
    """``top_p: 0`` (both protocols accept [0, 1]) as the engine runs it: the nucleus of mass -> 0 is the single
    most likely token, so greedy decoding (``top_p`` 1, ``temperature`` 0); other params unchanged. The engine
    itself takes ``top_p`` in (0, 1] only."""
    if params.top_p != 0.0:
        return params
    return SamplingParams(**{**params.__dict__, "top_p": 1.0, "temperature": 0.0})


@dataclass
class ChatRequest:
    """One client request, after parsing and validation.

    Attributes:
        model: the client-facing model name (a ``models[].name`` of the config).
        messages: chat messages in OpenAI's shape (``role`` in system/developer/user/assistant/tool,
            ``content`` a string or a list of content parts, optional
            ``tool_calls``/``tool_call_id``/``name``). Anthropic bodies are translated into this shape (their
            top-level ``system`` becomes a leading system message); the untranslated body stays in
            ``anthropic_body``.
        tools: OpenAI-style tool schemas (``{"type": "function", "function": {...}}``) or None.
        tool_choice: OpenAI ``tool_choice``, the JSON value as the client sent it (the OpenAI face passes it
            on unchecked, as OpenAI-compatible servers judge it), passed to upstreams; the embedded backend
            checks it and turns it into a ``tool_calls`` constraint (``gateway.backends.embedded``).
        parallel_tool_calls: False when the client asked for at most one tool call per turn (OpenAI
            ``parallel_tool_calls: false``, Anthropic ``tool_choice.disable_parallel_tool_use: true``), True
            when it asked for parallel calls (OpenAI), None when it did not say.
        params: sampling parameters (``engine.api.SamplingParams``).
        stream: answer as server-sent events.
        include_usage: OpenAI ``stream_options.include_usage``.
        user: OpenAI ``user`` / Anthropic ``metadata.user_id``; never logged.
        tenant: cache salt; requests of different tenants never share cached prefixes. With client keys
            configured it is the key's tenant (``gateway.http.auth``).
        cache_salt: vLLM's / SGLang's ``cache_salt`` body field (OpenAI face), "" when absent: it narrows the
            tenant (``<tenant>/<cache_salt>``, ``gateway.http.auth.authorize``), never leaves it, so a front
            gateway's ``cache_salt: true`` isolates its tenants on prefixgate replicas as on vLLM.
        client_key: the name of the client key that authenticated the request ("" when the gateway is open).
        shared_prefix_messages: how many leading canonical messages (with the tools) form a declared public
            prefix (``shared_prefixes:``), cached under the shared salt; 0 = none.
        shared_salt: the salt of that public prefix (names the matching declaration); "" when none.
        kind: ``"chat"`` or ``"completion"`` (``/v1/completions``, then ``prompt`` is set and messages is
            empty).
        prompt: the raw prompt of a completion request.
        openai_body: the client's JSON body when it came in on the OpenAI face (passthrough to an
            OpenAI-compatible upstream; the embedded engine checks its parameters), else None.
        anthropic_body: the client's JSON body when it came in on the Anthropic face (passthrough to an
            Anthropic upstream), else None.
        sampling_given: the ``SAMPLING_FIELDS`` the client set; an upstream of the other protocol receives
            only these (the providers' defaults differ), see ``given_sampling``.
        rules_enabled: False when the client sent ``x-prefixgate-rules: off``.
        continue_final_message: the last message is an assistant prefill to continue (Anthropic: a final
            assistant turn), not a closed turn.
        request_id: the gateway's id for logs and response ids.
        canonical: the rules' result (a ``CanonicalPrompt``), set by ``gateway.service.canonicalize``.
        prefix_key: hex prefix key (model id, tenant salt, hash of the stable segments), set by routing.
        level_ends: ``(end token, level)`` of the canonical segments in the model's tokens, set by the pipeline
            for backends that tag cached blocks with levels (``Backend.wants_level_ends``); None otherwise.
        forward_headers: client headers an upstream of the same protocol receives too, lower-case name ->
            value (the Anthropic face sets ``anthropic-beta`` here;
            ``gateway.protocols.anthropic.parse.FORWARDED_HEADERS`` lists them).
            Never credentials: the upstream's key comes from the config.
        upstream_request_id: the id the upstream gave its answer (OpenAI ``x-request-id``, Anthropic
            ``request-id``), set by an upstream backend once the answer opened; logged and sent back as
            ``x-prefixgate-upstream-request-id`` so a provider ticket can name it. None for the engine.
        replica: the upstream replica answering (its base URL without credentials or query string), set with
            ``upstream_request_id``; the miss explanation tells a prefix cached on another replica from an
            eviction by it. None for the engine.
    """

    model: str
    messages: list[dict[str, Any]]
    params: SamplingParams
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    tenant: str = ""
    cache_salt: str = ""
    client_key: str = ""
    shared_prefix_messages: int = 0
    shared_salt: str = ""
    kind: Literal["chat", "completion"] = "chat"
    prompt: str | None = None
    openai_body: dict[str, Any] | None = None
    anthropic_body: dict[str, Any] | None = None
    sampling_given: frozenset[str] = frozenset()
    rules_enabled: bool = True
    continue_final_message: bool = False
    request_id: str = ""
    canonical: CanonicalPrompt | None = None
    prefix_key: str = ""
    level_ends: list[tuple[int, str]] | None = None
    forward_headers: dict[str, str] = field(default_factory=dict)
    upstream_request_id: str | None = None
    replica: str | None = None
