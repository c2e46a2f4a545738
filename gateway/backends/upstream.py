"""What the remote backends (``backend: openai``, ``backend: anthropic``) share: the replicas on a
prefix-affinity ring, the process's one HTTP client, timeouts and retries, the API key (never logged), and one
JSON POST with retries before the first byte (``gateway.upstream_http.open_response``).

A subclass builds the body and headers of its protocol and reads the answer; ``UpstreamBackend.post`` sends it
to the replica the ring picks for the request's prefix key.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypedDict

import httpx

from gateway.backends.base import Backend, ReplicaStates
from gateway.config.schema import UpstreamModel
from gateway.transport.affinity import AffinityRing
from gateway.transport.redact import redact_url
from gateway.transport.retry import RetryPolicy
from gateway.transport.upstream_http import OpenedResponse, SharedClient, Upstream, open_response


class UpstreamOptions(TypedDict, total=False):
    """The keyword arguments every ``UpstreamBackend`` subclass passes on to it (see ``UpstreamBackend``)."""

    api_key: str | None
    upstream_model: str | None
    timeout_s: float
    retries: int
    client: httpx.AsyncClient | None
    ring: AffinityRing | None
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
        ring: replica choice (default: an ``AffinityRing`` over ``base_urls`` with its default settings).
        sleep: the backoff sleep (tests).
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
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.name = name
        self.upstream_model = upstream_model or name
        self.api_key = api_key
        self.upstream = Upstream(
            ring=ring or AffinityRing([url.rstrip("/") for url in base_urls]),
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            policy=RetryPolicy(retries=retries),
            secrets=(api_key,) if api_key else (),
        )
        self._own_client = client
        self._client: httpx.AsyncClient | None = client
        self._sleep = sleep

    async def start(self) -> None:
        """Take a reference to the shared HTTP client."""
        if self._client is None:
            self._client = SharedClient.acquire()

    async def close(self) -> None:
        """Give the shared client back (closing responses in flight is up to their streams)."""
        if self._own_client is None and self._client is not None:
            self._client = None
            await SharedClient.release()

    def replicas(self) -> ReplicaStates | None:
        """Replica health and load for ``/admin/stats``: URL without credentials or query string ->
        ``{"state", "inflight", "failures"}``."""
        return {redact_url(name): state for name, state in self.upstream.ring.snapshot().items()}

    async def post(self, key: str, path: str, headers: Mapping[str, str], body: Any) -> OpenedResponse:
        """POST ``body`` as compact JSON to ``{base_url}{path}`` of the replica the ring picks for ``key`` and
        wait for the first body byte, retrying before it (``gateway.upstream_http.open_response``).

        Raises:
            UpstreamCallError: refused (4xx), or failed on every attempt; its message is redacted.
        """
        if self._client is None:
            await self.start()
        client = self._client
        assert client is not None
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

        def build(base_url: str) -> httpx.Request:
            return client.build_request("POST", f"{base_url}{path}", headers=dict(headers), content=content)

        return await open_response(client, self.upstream, key, build, sleep=self._sleep)


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
    }
