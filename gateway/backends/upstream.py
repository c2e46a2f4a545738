"""What the remote backends (``backend: openai``, ``backend: anthropic``) share: the replicas on a
prefix-affinity ring, the process's one HTTP client, timeouts and retries, the API key (never logged), and one
JSON POST with retries before the first byte (``gateway.upstream_http.open_response``).

A subclass builds the body and headers of its protocol and reads the answer (``stream_once``);
``UpstreamBackend.post`` sends it to the replica the ring picks for the request's prefix key. A non-streamed
request whose answer broke off is asked again (``UpstreamBackend.stream``): its client has seen nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from abc import abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, TypedDict

import httpx

from gateway.backends.base import Backend, ReplicaStates
from gateway.backends.kv_blocks import KVBlockHasher
from gateway.config.schema import CacheAwareConfig, KVEventsConfig, RoutingShareConfig, UpstreamModel
from gateway.core.events import BackendEvent
from gateway.core.request import ChatRequest
from gateway.transport.affinity import AffinityRing
from gateway.transport.aiohttp_transport import DirectResponse
from gateway.transport.failures import UpstreamStreamCut, retryable_cut
from gateway.transport.kv_events import KVEventFeed
from gateway.transport.kv_events_zmq import ZmqKVEventFeed
from gateway.transport.redact import redact_url
from gateway.transport.replica_instances import ReplicaInstances
from gateway.transport.retry import RetryPolicy
from gateway.transport.routing_policy import CacheAwarePolicy, make_policy, text_block_hashes
from gateway.transport.routing_share import RoutingShare
from gateway.transport.upstream_http import (
    OpenedResponse,
    SharedClient,
    Upstream,
    UpstreamClient,
    join_url,
    open_response,
)

logger = logging.getLogger(__name__)

_MAX_URLS = 1024  # parsed request URLs kept per backend (replicas x paths; more only with a changing ring)
_BODY_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""The upstream body's encoder (``json.dumps`` with arguments builds a new encoder on every call)."""


class UpstreamOptions(TypedDict, total=False):
    """The keyword arguments every ``UpstreamBackend`` subclass passes on to it (see ``UpstreamBackend``)."""

    api_key: str | None
    upstream_model: str | None
    timeout_s: float
    retries: int
    client: httpx.AsyncClient | None
    ring: AffinityRing | None
    routing: str
    routing_share: RoutingShareConfig | None
    kv_events: KVEventsConfig | None
    cache_aware: CacheAwareConfig | None
    sleep: Callable[[float], Awaitable[Any]]


class UpstreamBackend(Backend):
    """Base of the remote backends: replica choice, the shared client, retries and the key.

    Args:
        name: the client-facing model name.
        base_urls: one base URL per replica (a trailing slash is dropped); the subclass appends its path.
        api_key: the provider key; never logged or put in errors (``Upstream.secrets``).
        upstream_model: the provider's model name (default ``name``).
        timeout_s: connect (at most 10 s) and read timeout per attempt, seconds (read = most seconds between
            two bytes, the first included).
        retries: extra attempts before the first byte.
        client: an ``httpx.AsyncClient`` to use instead of the process's shared one (tests).
        ring: the replicas (default: an ``AffinityRing`` over ``base_urls`` with its default settings).
        routing: the replica choice over the ring, one of ``ROUTING_POLICIES`` (default ``consistent_hash``:
            the ring's own walk from the prefix key).
        routing_share: share load (and the cache-aware index) with other gateways through Redis.
        kv_events: follow the replicas' KV event streams into the cache-aware index's exact view, and hash
            requests as their engine does (``cache_aware`` only).
        cache_aware: the cache-aware policy's settings (``cache_aware`` only; None = its defaults).
        sleep: the backoff sleep (tests).

    Raises:
        ValueError: an unknown ``routing``, or ``kv_events`` or ``cache_aware`` with another policy than
            ``cache_aware``, or ``kv_events`` over ``zmq`` without one endpoint per replica.
    """

    def __init__(
        self,
        name: str,
        base_urls: Sequence[str],
        *,
        api_key: str | None = None,
        upstream_model: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        client: httpx.AsyncClient | None = None,
        ring: AffinityRing | None = None,
        routing: str = "consistent_hash",
        routing_share: RoutingShareConfig | None = None,
        kv_events: KVEventsConfig | None = None,
        cache_aware: CacheAwareConfig | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.name = name
        self.upstream_model = upstream_model or name
        self.api_key = api_key
        ring = ring or AffinityRing([url.rstrip("/") for url in base_urls])
        if kv_events is not None and routing != "cache_aware":
            raise ValueError(f"kv_events needs routing: cache_aware, not {routing!r}")
        if cache_aware is not None and routing != "cache_aware":
            raise ValueError(f"cache_aware settings need routing: cache_aware, not {routing!r}")
        options: dict[str, Any] = {"use_kv_events": True} if kv_events is not None else {}
        if cache_aware is not None:
            options.update(
                index_capacity_blocks=cache_aware.index_blocks,
                cache_threshold=cache_aware.cache_threshold,
                overlap_weight=cache_aware.overlap_weight,
                balance_abs_threshold=cache_aware.balance_abs_threshold,
                load_weight=cache_aware.load_weight,
            )
        policy = make_policy(routing, ring, **options)
        self.kv_hasher = KVBlockHasher(kv_events) if kv_events is not None else None
        self.tenant_isolated = False
        """The upstream keeps tenants' caches apart (an OpenAI-compatible one sent ``cache_salt``): the
        cache-aware index then salts a request's blocks with its tenant too (``routing_blocks``), since another
        tenant's blocks there are no hit for it."""
        self.kv_feed: KVEventFeed | ZmqKVEventFeed | None = None
        if kv_events is not None and kv_events.transport == "zmq":
            assert isinstance(policy, CacheAwarePolicy)
            if len(kv_events.endpoints) != len(ring.replicas) or len(kv_events.replay_endpoints) not in (
                0,
                len(ring.replicas),
            ):
                raise ValueError("kv_events over zmq needs one endpoint (and replay endpoint) per replica")
            self.kv_feed = ZmqKVEventFeed(
                policy,
                dict(zip(ring.replicas, kv_events.endpoints, strict=True)),
                replay_endpoints=dict(zip(ring.replicas, kv_events.replay_endpoints, strict=False)),
                topic=kv_events.topic,
                block_size=kv_events.block_size,
            )
        elif kv_events is not None:
            assert isinstance(policy, CacheAwarePolicy)
            self.kv_feed = KVEventFeed(
                policy,
                self._http_client,
                path=kv_events.path,
                headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            )
        self.instances = ReplicaInstances()
        """The instance names each replica answered with (``x-prefixgate-instance``): a new one is a restart."""
        self.routing_share: RoutingShare | None = None
        if routing_share is not None:
            self.routing_share = RoutingShare(
                policy,
                self.upstream_model,
                instances=self.instances,
                url=routing_share.redis_url,
                interval_s=routing_share.interval_s,
                timeout_s=routing_share.timeout_s,
                retry_after_s=routing_share.retry_after_s,
            )
        self.upstream = Upstream(
            ring=ring,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            policy=RetryPolicy(retries=retries),
            secrets=(api_key,) if api_key else (),
            routing=policy,
        )
        self._own_client = client
        self._urls: dict[str, httpx.URL] = {}
        self._client: httpx.AsyncClient | None = client
        self._sleep = sleep

    async def start(self) -> None:
        """Take a reference to the shared HTTP client."""
        if self._client is None:
            self._client = SharedClient.acquire()
        if self.routing_share is not None:
            self.routing_share.start()
        if self.kv_feed is not None:
            self.kv_feed.start()

    def _http_client(self) -> httpx.AsyncClient:
        assert self._client is not None, "start() takes the client first"
        return self._client

    async def close(self) -> None:
        """Give the shared client back (closing responses in flight is up to their streams)."""
        if self.kv_feed is not None:
            await self.kv_feed.close()
        if self.routing_share is not None:
            await self.routing_share.close()
        if self._own_client is None and self._client is not None:
            self._client = None
            await SharedClient.release()

    def stream(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """The answer's events (``stream_once``). A non-streamed request whose upstream stream broke off before
        its end (``retryable_cut``) is asked again, on the replica the ring picks then, up to the retry
        policy's ``retries`` times after the backoff: its client has seen nothing yet, so nothing can be
        duplicated (found by a trial: a replica killed mid-answer was a 502 though two were up). A streamed
        request's cut is never retried: its client has the first part.

        Raises:
            what ``stream_once`` raises; for a non-streamed request, the last cut once retries are spent.
        """
        if request.stream:
            return self.stream_once(request)
        return self._unseen_retried(request)

    @abstractmethod
    def stream_once(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        """One upstream call's events: ``Delta`` events then one ``Finish`` (the subclass's protocol).

        Raises:
            UpstreamCallError: failed before the first byte (after ``post``'s retries), or refused.
            UpstreamStreamCut: broke off after the first byte.
        """

    async def _unseen_retried(self, request: ChatRequest) -> AsyncIterator[BackendEvent]:
        attempt = 0
        while True:
            events: list[BackendEvent] = []
            try:
                async with aclosing(self.stream_once(request)) as answer:
                    async for event in answer:
                        events.append(event)
            except UpstreamStreamCut as cut:
                if not retryable_cut(cut) or attempt >= self.upstream.policy.retries:
                    raise
                logger.warning(
                    "%s: an unseen answer broke off (%s); asking again (retry %d of %d)",
                    self.name,
                    cut.message,
                    attempt + 1,
                    self.upstream.policy.retries,
                )
                await self._sleep(self.upstream.policy.delay(attempt))
                attempt += 1
                continue
            for event in events:
                yield event
            return

    def replicas(self) -> ReplicaStates | None:
        """Replica health and load for ``/admin/stats``: URL without credentials or query string ->
        ``{"state", "inflight", "failures", "requests", "away", "restarts"}`` (``restarts``: answers that named
        an instance new to the URL, ``gateway.transport.replica_instances``)."""
        restarts = self.instances.restarts
        return {
            redact_url(name): {**state, "restarts": restarts.get(name, 0)}
            for name, state in self.upstream.ring.snapshot().items()
        }

    def routing_share_stats(self) -> dict[str, Any] | None:
        """The Redis routing share's counters (``RoutingShareStats.snapshot``); None without ``routing_share``."""
        if self.routing_share is None:
            return None
        return self.routing_share.stats.snapshot(self.routing_share.up)

    def kv_events(self) -> dict[str, Any] | None:
        """The KV event feed's counters (``ZmqKVEventFeed.snapshot`` / ``KVEventFeed.snapshot``), replicas
        named by their URL without credentials or query string; None without ``kv_events``."""
        if self.kv_feed is None:
            return None
        doc = self.kv_feed.snapshot()
        if "replicas" in doc:
            doc["replicas"] = {redact_url(name): state for name, state in doc["replicas"].items()}
        return doc

    def _url(self, text: str) -> httpx.URL:
        """``text`` parsed as an ``httpx.URL``, once per replica and path (a parsed URL is immutable; parsing
        it again was ~3 % of the gateway's CPU per request, docs/overhead.md).

        Raises:
            httpx.InvalidURL: ``text`` is not a URL (not stored; the attempt reports it).
        """
        url = self._urls.get(text)
        if url is None:
            url = httpx.URL(text)
            if len(self._urls) < _MAX_URLS:
                self._urls[text] = url
        return url

    async def post(
        self, key: str, path: str, headers: Mapping[str, str], body: Any, tenant: str = ""
    ) -> OpenedResponse:
        """POST ``body`` as compact JSON to ``{base_url}{path}`` of the replica the ring picks for ``key`` and
        wait for the first body byte, retrying before it (``gateway.upstream_http.open_response``). ``tenant``:
        the request's, salting its cache-aware blocks where the upstream isolates tenants (``tenant_isolated``).

        Raises:
            UpstreamCallError: refused (4xx), or failed on every attempt; its message is redacted.
        """
        if self._client is None:
            await self.start()
        client = self._client
        assert client is not None
        content = _BODY_JSON.encode(
            body
        ).encode()  # json.dumps(body, ensure_ascii=False, compact), one encoder

        def build(base_url: str) -> httpx.Request:
            url = self._url(join_url(base_url, path))
            return client.build_request("POST", url, headers=dict(headers), content=content)

        direct = None
        if isinstance(client, UpstreamClient):

            async def direct(
                base_url: str, timeout: dict[str, Any]
            ) -> DirectResponse | httpx.Response | None:
                return await client.send_direct(
                    self._url(join_url(base_url, path)), headers, content, timeout
                )

        routing = self.upstream.routing
        blocks: tuple[int, ...] = ()
        if routing is not None and routing.wants_blocks:
            hasher = self.kv_hasher
            salt = (
                f"{self.upstream_model}\x00{tenant}"
                if tenant and self.tenant_isolated
                else self.upstream_model
            )
            blocks = hasher(body) if hasher is not None else routing_blocks(body, salt)
        opened = await open_response(
            client, self.upstream, key, build, sleep=self._sleep, blocks=blocks, send_direct=direct
        )
        instance = self.instances.observe(opened.replica, opened.response.headers)
        if instance is not None and routing is not None:
            logger.info(
                "%s: replica %s answered as a new instance (restarted): forgetting the prefixes the routing "
                "index credited to it",
                self.name,
                redact_url(opened.replica),
            )
            routing.replica_renewed(opened.replica, blocks, instance)
        return opened


ROUTED_FIELDS = ("tools", "system", "messages", "prompt")
"""Body fields that make up the prompt prefix, in the order an engine's chat template puts them."""


def error_body(data: Any) -> dict[str, Any] | None:
    """The error object of an upstream answer that is an error, whatever status it came with (some servers
    answer 200, or send it as a stream chunk): Anthropic's ``{"type": "error", "error": {...}}``, OpenAI's
    ``{"error": {...}}`` (or ``{"error": "text"}``), vLLM's ``{"object": "error", "message": ...}``. Always has a
    ``type`` (``api_error`` when the upstream named none) and a string ``message``; None for anything else."""
    if not isinstance(data, Mapping):
        return None
    raw = data.get("error")
    if isinstance(raw, Mapping):
        error = dict(raw)
    elif isinstance(raw, str):
        error = {"message": raw}
    elif data.get("object") == "error" or (data.get("type") == "error" and raw is None):
        error = {k: v for k, v in data.items() if k not in ("object",)}
        if error.get("type") == "error":
            error.pop("type")
    else:
        return None
    if not isinstance(error.get("type"), str) or not error["type"]:
        error["type"] = "api_error"
    error["message"] = str(error.get("message", ""))
    return error


def routing_blocks(body: Any, salt: str) -> tuple[int, ...]:
    """Chained hashes of 64-character blocks of the prompt part of an upstream body (cache-aware routing).

    The text is the compact JSON of ``tools``, ``system``, then each message of ``messages`` (or
    ``prompt``), concatenated: a conversation resent with one more turn has the same leading text, so the
    same leading blocks (llm-d's approximate prefix scorer hashes characters the same way). ``salt`` (the
    upstream model, and the tenant where the upstream isolates tenants) keeps models (and tenants) apart.
    """
    if not isinstance(body, Mapping):
        return ()
    parts: list[str] = []
    for name in ROUTED_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        items = value if name == "messages" and isinstance(value, list) else [value]
        parts.extend(
            json.dumps(item, ensure_ascii=False, separators=(",", ":"), sort_keys=True) for item in items
        )
    return tuple(text_block_hashes("".join(parts), salt=salt))


def upstream_settings(model: UpstreamModel) -> dict[str, Any]:
    """The ``UpstreamBackend`` arguments of a config model entry, its ring built from ``model.ring``."""
    ring = model.ring
    return {
        "name": model.name,
        "base_urls": model.base_url,
        "api_key": model.api_key,
        "upstream_model": model.upstream_model,
        "timeout_s": model.timeout_s,
        "retries": model.retries,
        "ring": AffinityRing(
            list(model.base_url),
            vnodes=ring.vnodes,
            load_factor=ring.load_factor,
            cooldown_s=ring.cooldown_s,
            max_cooldown_s=ring.max_cooldown_s,
        ),
        "routing": model.routing,
        "routing_share": model.routing_share,
        "kv_events": model.kv_events,
        "cache_aware": model.cache_aware,
    }
