"""The gateway's validated config as typed, frozen dataclasses (what ``gateway.config.loader`` builds).

One class per backend kind (``EmbeddedModel``, ``OpenAIUpstream``, ``AnthropicUpstream``; ``ModelEntry`` is
their union), so an entry holds only the settings of its kind; ``backend`` is a class attribute giving each
class's ``backend:`` key in the YAML. The class names say "upstream" / "model" rather than "config" so that
none is confused with ``engine.model_config``'s class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from engine.api import EngineConfig
from gateway.config.price_table import ModelPrices
from gateway.core.keys import ClientKey

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
BACKEND_KINDS = ("embedded", "openai", "anthropic")


class ConfigError(ValueError):
    """A config file that cannot be used. ``str()`` reads ``<file>: <key path>: <problem>``.

    Attributes:
        source: the file (or ``<default>`` / ``<dict>``).
        key: the key path at fault, e.g. ``models[0].engine.num_blocks`` (empty for the whole file).
        problem: what was expected and what was found.
    """

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source, self.key, self.problem = source, key, problem
        where = f"{source}: {key}" if key else source
        super().__init__(f"{where}: {problem}")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP listener. ``max_body_bytes``: largest request body accepted (bytes); larger gets 413.
    ``unknown_fields``: ``refuse`` (default, as OpenAI and Anthropic answer) a request body's unknown
    top-level field with a 400 naming it, or ``ignore`` it (it is still passed on to upstreams).
    ``shutdown_grace_s``: seconds the requests in flight get to finish after SIGTERM / Ctrl-C before each one
    still running is ended with a 503 "the server is shutting down" (``gateway.service.shutdown``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 * 1024 * 1024
    unknown_fields: str = "refuse"
    shutdown_grace_s: float = 8.0


@dataclass(frozen=True)
class AdminConfig:
    """``token``: when set, ``/admin/*`` and ``/metrics`` need ``Authorization: Bearer <token>``."""

    token: str | None = None


@dataclass(frozen=True)
class RingConfig:
    """Prefix affinity over an upstream's replicas (``gateway.transport.affinity.AffinityRing``).

    Attributes:
        load_factor: ``c`` of consistent hashing with bounded loads, > 1: no replica holds more than
            ``ceil(c * (in flight + 1) / replicas)`` requests.
        vnodes: ring points per replica, >= 1.
        cooldown_s: seconds a failed replica is skipped before one probe request, > 0.
        max_cooldown_s: cap of the cool-down, which doubles on each failed probe, >= ``cooldown_s``.
    """

    load_factor: float = 1.25
    vnodes: int = 160
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0


ROUTING_POLICIES = ("round_robin", "least_load", "consistent_hash", "cache_aware")
"""Values of an upstream's ``routing:`` (``gateway.transport.routing_policy.POLICIES`` has one class each)."""


@dataclass(frozen=True)
class RoutingShareConfig:
    """Routing state shared by several gateways through Redis (``gateway.transport.routing_share``).

    Attributes:
        redis_url: a redis-py URL (``redis://127.0.0.1:6379/0``).
        interval_s: seconds between two exchanges with Redis (the staleness bound of another gateway's
            placements), > 0.
        timeout_s: connect and read timeout of each Redis call, > 0.
        retry_after_s: seconds Redis is left alone after a failed call (the local view only meanwhile), > 0.
    """

    redis_url: str = "redis://127.0.0.1:6379/0"
    interval_s: float = 0.2
    timeout_s: float = 0.05
    retry_after_s: float = 5.0


KV_EVENT_TOKENIZERS = ("cl100k_base",)
"""Tokenizers ``kv_events.tokenizer`` names (tiktoken, offline copy)."""

KV_EVENT_TRANSPORTS = ("http", "zmq")
"""How ``kv_events`` reaches the gateway: ``http`` (NDJSON on ``GET {base_url}{path}``,
``gateway.transport.kv_events``) or ``zmq`` (vLLM's ZeroMQ publisher, ``gateway.transport.kv_events_zmq``)."""


@dataclass(frozen=True)
class KVEventsConfig:
    """The replicas' KV event streams, for ``routing: cache_aware``'s exact view (``gateway.transport.kv_events``).

    The gateway hashes each request as the engine does: every message rendered with ``message_format``,
    tokenized with ``tokenizer``, chained hashes of full ``block_size`` blocks
    (``gateway.transport.routing_policy.block_hashes``). It helps only where the replicas publish those
    hashes (the fleet simulator's replicas do over HTTP), or, over ``zmq``, the token ids of the blocks they
    store (vLLM does; the gateway then maps the engine's blocks onto its own hashes: docs/routing.md).

    Attributes:
        transport: one of ``KV_EVENT_TRANSPORTS``.
        path: ``http`` only: appended to each ``base_url`` for ``GET`` (one JSON ``KVEventBatch`` per line).
        tokenizer: one of ``KV_EVENT_TOKENIZERS``.
        message_format: ``str.format`` template of one message with ``{role}`` and ``{content}``.
        block_size: tokens per block, >= 1.
        endpoints: ``zmq`` only: the PUB endpoint of each replica's engine (vLLM ``kv_events_config.endpoint``
            with its host, e.g. ``tcp://10.0.0.5:5557``), one per ``base_url`` in the same order.
        replay_endpoints: ``zmq`` only: each replica's ROUTER replay endpoint (vLLM ``replay_endpoint``), one
            per ``base_url``, or empty (gaps then resync instead of replaying).
        topic: ``zmq`` only: the publishers' topic (vLLM ``topic``, default empty).
    """

    transport: str = "http"
    path: str = "/kv_events"
    tokenizer: str = "cl100k_base"
    message_format: str = "<|{role}|>{content}\n"
    block_size: int = 16
    endpoints: tuple[str, ...] = ()
    replay_endpoints: tuple[str, ...] = ()
    topic: str = ""


@dataclass(frozen=True)
class CacheAwareConfig:
    """Settings of ``routing: cache_aware`` (``gateway.transport.routing_policy.CacheAwarePolicy``; the
    anchors' parameters and the fleet bench's measurements are in docs/routing.md).

    Attributes:
        index_blocks: block hashes the approximate index keeps per replica, >= 1: about the replica's prefix
            cache in 64-character blocks (llm-d's ``LRUCapacityPerServer``, default 31,250).
        cache_threshold: least matched share of a request's blocks to follow the match, in [0, 1] (SGLang).
        overlap_weight: weight of the blocks to prefill against pending blocks, >= 0 (Dynamo).
        balance_abs_threshold: a replica within this many requests of the least loaded one may take the
            request even over the ring's bound, >= 0 (SGLang's ``balance_abs_threshold``).
        load_weight: blocks the cost charges per request in flight on a replica, >= 0.
    """

    index_blocks: int = 31_250
    cache_threshold: float = 0.5
    overlap_weight: float = 1.0
    balance_abs_threshold: int = 3
    load_weight: float = 12.0


@dataclass(frozen=True)
class EmbeddedModel:
    """A model served by the in-process engine (``backend: embedded``).

    Attributes:
        name: the ``model`` clients send.
        path: a ``.gguf`` file, a Hugging Face folder, or ``default`` (bundled SmolLM2).
        engine: the engine's settings (``engine.api.EngineConfig``).
    """

    backend: ClassVar[str] = "embedded"

    name: str
    path: str = "default"
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass(frozen=True)
class UpstreamModel:
    """What every remote model entry has (the base of ``OpenAIUpstream`` and ``AnthropicUpstream``).

    Attributes:
        name: the ``model`` clients send.
        base_url: one URL per replica (a YAML string becomes a one-element tuple).
        api_key: the provider key (use ``env:NAME``); never logged.
        upstream_model: the provider's model name; None = ``name``.
        timeout_s: seconds per upstream attempt.
        retries: extra attempts on connection errors / 5xx / 429.
        prices: the model's cache prices (``gateway.config.price_table.ModelPrices``): the shipped table's entry
            for ``upstream_model`` (or ``name``) with the config's ``prices`` applied over it; None = unknown.
        ring: prefix-affinity settings (``RingConfig``).
        routing: replica choice, one of ``ROUTING_POLICIES`` (default ``consistent_hash``, the ring's walk).
        routing_share: share load (and the cache-aware index) with other gateways through Redis; None =
            local only.
        kv_events: follow the replicas' KV event streams (``routing: cache_aware`` only); None = the
            approximate index only.
        cache_aware: the cache-aware policy's settings (``routing: cache_aware`` only); None = defaults.
    """

    backend: ClassVar[str]

    name: str
    base_url: tuple[str, ...] = ()
    api_key: str | None = None
    upstream_model: str | None = None
    timeout_s: float = 60.0
    retries: int = 2
    prices: ModelPrices | None = None
    ring: RingConfig = field(default_factory=RingConfig)
    routing: str = "consistent_hash"
    routing_share: RoutingShareConfig | None = None
    kv_events: KVEventsConfig | None = None
    cache_aware: CacheAwareConfig | None = None


@dataclass(frozen=True)
class OpenAIUpstream(UpstreamModel):
    """An OpenAI-compatible upstream (``backend: openai``): OpenAI, vLLM, SGLang, TGI, ...

    Attributes:
        prompt_cache_key: send ``prompt_cache_key`` = the prefix key when the client set none.
        prompt_cache_retention: ``auto``: set ``prompt_cache_retention`` by the reuse the gateway observes where
            the model offers more than one retention (and the client set none); ``off``: never.
        cache_salt: the upstream accepts vLLM / SGLang's ``cache_salt`` field: send the tenant's salt in it.
    """

    backend: ClassVar[str] = "openai"

    prompt_cache_key: bool = True
    prompt_cache_retention: str = "auto"
    cache_salt: bool = False


@dataclass(frozen=True)
class AnthropicUpstream(UpstreamModel):
    """An Anthropic Messages API upstream (``backend: anthropic``).

    Attributes:
        anthropic_version: the ``anthropic-version`` header.
        auto_breakpoints: add ``cache_control`` breakpoints at the rules' segment boundaries where the client
            set none.
        min_cacheable_tokens: (model-name prefix, minimum cacheable prompt length in tokens) pairs, consulted
            before the built-in table ``gateway.protocols.anthropic.breakpoints.MIN_CACHEABLE_TOKENS`` (same
            shape); the longest matching prefix wins. YAML: a mapping.
    """

    backend: ClassVar[str] = "anthropic"

    anthropic_version: str = "2023-06-01"
    auto_breakpoints: bool = True
    min_cacheable_tokens: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class TranscriptConfig:
    """The canonical transcript memory (``rules.transcript``; docs/history-stability.md): one per gateway.

    Attributes:
        max_entries: most transcripts kept in this process (LRU).
        max_bytes: most bytes of stored transcripts in this process (zlib-compressed JSON).
        ttl_s: seconds a transcript lives after it was last stored (also the Redis entries' TTL).
        redis_url: a redis-py URL (``redis://host:6379/0``) to share the memory between gateways; None = this
            process only. Redis down or slow costs no request: the process's own store answers.
        redis_prefix: prefix of every Redis key.
        socket_timeout_s: connect and read timeout of each Redis call (seconds).
        retry_after_s: seconds Redis is left alone after a failed or slow call.
    """

    max_entries: int = 10_000
    max_bytes: int = 256 << 20
    ttl_s: float = 3600.0
    redis_url: str | None = None
    redis_prefix: str = "prefixgate:transcript:"
    socket_timeout_s: float = 0.05
    retry_after_s: float = 10.0


LEARNING_MODES = ("off", "suggest", "apply")


@dataclass(frozen=True)
class LearningConfig:
    """Learned volatile slots (``rules.learned.SlotLearner``).

    Attributes:
        mode: ``off`` (learn nothing), ``suggest`` (learn, list in ``/admin/stats``, export with
            ``prefixgate rules learned``; never rewrite), ``apply`` (learned slots are hoisted like rules).
        min_distinct: distinct values a span needs before it becomes a slot (>= 2).
    """

    mode: str = "suggest"
    min_distinct: int = 3


@dataclass(frozen=True)
class SharedPrefix:
    """One ``shared_prefixes:`` declaration: a prompt prefix cached once for every tenant.

    Attributes:
        kind: ``segment`` (value: segment level ``1`` tools+system or ``2`` documents), ``rule`` (value: a rule
            id; the tools+system segment of requests that rule rewrote), or ``content_hash`` (value: sha256 hex
            of the tools+system segment's stable material).
        value: as above, a string.
    """

    kind: str
    value: str


WARM_CONTENT_KEYS = ("system", "documents", "messages")
"""What a ``warm:`` entry prefills; each may instead be read from ``<key>_file``."""


@dataclass(frozen=True)
class WarmEntry:
    """One ``warm:`` entry: a prompt head prefilled into an embedded model's prefix cache.

    The prompt is ``messages`` (a whole OpenAI message list), or a ``system`` prompt and/or ``documents``
    (sent as the first user message after it). A ``*_file`` key names a file holding that value instead
    (``messages_file``: JSON or YAML; the others: UTF-8 text), resolved against the config's folder. The
    content is checked when the entry is warmed, not when the config loads: a bad entry is reported with its
    index and skipped, the rest warms.

    Attributes:
        model: the embedded model's name (None: the first embedded model).
        tenant: the cache salt the prefix is cached under (the ``x-prefixgate-tenant`` requests send).
        pin: keep the prefix's blocks in RAM (never evicted; the engine caps pins).
        system / documents: text, or None.
        messages: the message list as written (checked at warm time), or None.
        files: ``(content key, path)`` pairs read at warm time.
    """

    model: str | None = None
    tenant: str = ""
    pin: bool = False
    system: str | None = None
    documents: str | None = None
    messages: Any = None
    files: tuple[tuple[str, str], ...] = ()


ModelEntry = EmbeddedModel | OpenAIUpstream | AnthropicUpstream
"""One ``models:`` entry: a client-facing model and the backend kind serving it (its ``backend`` key)."""


@dataclass(frozen=True)
class GatewayConfig:
    """The whole config. ``source`` is the file it came from (``<default>`` for the built-in one);
    ``transcript`` the canonical transcript memory, ``rules_learning`` the learned volatile slots; ``warm`` the
    prompt heads prefilled at start, before the app serves (``warm_before_ready``) or in the background after."""

    server: ServerConfig = field(default_factory=ServerConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    rules: tuple[str, ...] = ("default",)
    models: tuple[ModelEntry, ...] = (EmbeddedModel(name=DEFAULT_MODEL_NAME),)
    transcript: TranscriptConfig = field(default_factory=TranscriptConfig)
    rules_learning: LearningConfig = field(default_factory=LearningConfig)
    warm: tuple[WarmEntry, ...] = ()
    warm_before_ready: bool = True
    source: str = "<default>"
    keys: tuple[ClientKey, ...] = ()
    """Client keys (``gateway.config.keys``); none: the gateway runs open."""
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    """Declared public prefixes (``gateway.config.keys.parse_shared_prefixes``)."""

    def model(self, name: str) -> ModelEntry | None:
        """The model entry called ``name``, or None."""
        return next((m for m in self.models if m.name == name), None)

    def prices(self, name: str) -> ModelPrices | None:
        """The price table of the upstream model ``name``; None for an embedded or unknown model."""
        model = self.model(name)
        return model.prices if isinstance(model, UpstreamModel) else None
