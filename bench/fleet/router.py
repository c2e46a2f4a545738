"""The bench's routing front end: one routing policy, an httpx client, failover before the first byte.

Stands in for a gateway process in ``python -m bench.fleet``: it tokenizes like the replicas do (so its block
hashes are theirs), asks its ``RoutingPolicy`` for a replica, streams the chat completion from it and reports
TTFT, cached tokens and the replica. A connection error, timeout or 5xx before the first byte marks the replica
down (the ring's cool-down) and tries the next one; a failure after the first byte fails the request (its
tokens may already be with the client). With ``kv_events`` it keeps one NDJSON stream per replica open and
feeds the batches to ``CacheAwarePolicy.apply_kv_events``, reconnecting after a replica restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from bench.fleet.tokens import encode_chat, render_chat
from engine.api import SamplingParams
from gateway.backends.openai_upstream import OpenAIUpstreamBackend
from gateway.config.schema import RoutingShareConfig
from gateway.core.events import Delta, Finish
from gateway.core.request import ChatRequest
from gateway.transport.affinity import AffinityRing
from gateway.transport.failures import UpstreamCallError, UpstreamStreamCut
from gateway.transport.routing_policy import (
    CacheAwarePolicy,
    KVEventError,
    NoReplicaAvailable,
    RouteRequest,
    block_hashes,
    make_policy,
    text_block_hashes,
)


@dataclass
class Outcome:
    """One request's result. Times are real seconds."""

    ok: bool
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    content: str = ""
    attempts: int = 0
    error: str = ""


class BenchRouter:
    """One routing front end over the fleet's replica URLs.

    Args:
        urls: replica base URLs (``http://127.0.0.1:PORT/v1``).
        policy: ``round_robin`` | ``least_load`` | ``consistent_hash`` | ``cache_aware`` | ``cache_aware_kv``
            (cache-aware with exact KV events).
        client: shared ``httpx.AsyncClient``.
        load_factor: the ring's bound ``c``.
        cooldown_s: the ring's first cool-down.
    """

    def __init__(
        self,
        urls: list[str],
        policy: str,
        client: httpx.AsyncClient,
        *,
        load_factor: float = 1.25,
        cooldown_s: float = 0.5,
    ) -> None:
        self.kv_events = policy == "cache_aware_kv"
        ring = AffinityRing(
            urls, load_factor=load_factor, cooldown_s=cooldown_s, max_cooldown_s=4 * cooldown_s
        )
        options = {"use_kv_events": True} if self.kv_events else {}
        self.policy = make_policy("cache_aware" if self.kv_events else policy, ring, **options)
        self.client = client
        self.failovers = 0
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Open the KV event streams (``cache_aware_kv`` only)."""
        if self.kv_events:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._follow_events(url)) for url in self.policy.replicas]

    async def close(self) -> None:
        """Stop the KV event streams."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _follow_events(self, url: str) -> None:
        policy = self.policy
        assert isinstance(policy, CacheAwarePolicy)
        while True:
            try:
                async with self.client.stream(
                    "GET", f"{url}/kv_events", timeout=httpx.Timeout(5, read=None)
                ) as r:
                    async for line in r.aiter_lines():
                        if line:
                            with contextlib.suppress(KVEventError, ValueError):
                                policy.apply_kv_events(url, json.loads(line))
            except (httpx.HTTPError, OSError):
                pass
            await asyncio.sleep(0.2)

    def route_request(self, messages: list[dict]) -> RouteRequest:
        """Prefix key (the system message) and block hashes (tokens with KV events, else 64-char text blocks)."""
        key = str(messages[0]["content"]) if messages and messages[0]["role"] == "system" else ""
        if self.kv_events:
            blocks = block_hashes(encode_chat(messages))
        elif isinstance(self.policy, CacheAwarePolicy):
            blocks = text_block_hashes(render_chat(messages))
        else:
            blocks = []
        return RouteRequest(key=key[:2048], blocks=tuple(blocks))

    async def complete(self, messages: list[dict], max_tokens: int) -> Outcome:
        """Send one streamed chat completion through the policy; never raises for a replica's fault."""
        route = self.route_request(messages)
        body = {"model": "stub", "messages": messages, "max_tokens": max_tokens, "stream": True}
        tried: set[str] = set()
        start = time.monotonic()
        while True:
            try:
                lease = self.policy.acquire(route, exclude=tried)
            except NoReplicaAvailable as exc:
                return Outcome(False, attempts=len(tried), error=f"no replica: {exc}")
            replica = lease.replica
            try:
                outcome = await self._stream(replica, body, start, getattr(lease, "prefill_done", None))
                self.policy.report_success(replica)
                outcome.attempts = len(tried) + 1
                return outcome
            except _BeforeFirstByte:
                self.policy.report_failure(replica)
                self.policy.replica_restarted(replica)  # it may come back empty
                tried.add(replica)
                self.failovers += 1
            except _AfterFirstByte as exc:
                self.policy.report_failure(replica)
                self.policy.replica_restarted(replica)
                return Outcome(False, attempts=len(tried) + 1, replica=replica, error=str(exc))
            finally:
                lease.release()

    async def _stream(
        self, replica: str, body: dict, start: float, on_first: Callable[[], None] | None
    ) -> Outcome:
        ttft = None
        parts: list[str] = []
        usage: dict | None = None
        try:
            async with self.client.stream("POST", f"{replica}/chat/completions", json=body) as r:
                if r.status_code >= 500:
                    await r.aread()
                    raise _BeforeFirstByte(f"HTTP {r.status_code}")
                if r.status_code != 200:
                    await r.aread()
                    raise _AfterFirstByte(f"HTTP {r.status_code}: {r.text[:200]}")
                try:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            break
                        obj = json.loads(data)
                        for choice in obj.get("choices") or []:
                            content = choice.get("delta", {}).get("content")
                            if content:
                                if ttft is None:
                                    ttft = time.monotonic() - start
                                    if on_first is not None:
                                        on_first()
                                parts.append(content)
                        if obj.get("usage"):
                            usage = obj["usage"]
                except (httpx.HTTPError, OSError, ValueError) as exc:
                    if ttft is None:
                        raise _BeforeFirstByte(str(exc)) from exc
                    raise _AfterFirstByte(f"cut mid-stream: {type(exc).__name__}") from exc
        except (httpx.TransportError, OSError) as exc:
            if ttft is None:
                raise _BeforeFirstByte(str(exc)) from exc
            raise _AfterFirstByte(f"cut mid-stream: {type(exc).__name__}") from exc
        if usage is None or ttft is None:
            raise _AfterFirstByte("stream ended without usage")
        return Outcome(
            True,
            ttft_s=ttft,
            prompt_tokens=int(usage["prompt_tokens"]),
            cached_tokens=int(usage["prompt_tokens_details"]["cached_tokens"]),
            replica=replica,
            content="".join(parts),
        )


class _BeforeFirstByte(Exception):
    """Nothing reached the client yet: safe to try another replica."""


class _AfterFirstByte(Exception):
    """Tokens reached the client: the request fails."""


class BackendRouter:
    """A gateway's own upstream path as a bench front end: ``OpenAIUpstreamBackend`` with a routing policy.

    The real code a prefixgate process runs for ``backend: openai`` with ``routing:`` (replica choice, retries
    before the first byte, cool-downs, the cache-aware index on 64-character blocks of the request JSON, and
    ``routing_share`` through Redis), minus the HTTP face and the rules, which are the same for every policy.

    Args:
        urls: replica base URLs.
        policy: one of ``ROUTING_POLICIES``.
        client: shared ``httpx.AsyncClient``.
        model: upstream model name (also the Redis key space of ``routing_share``).
        share: Redis sharing of the cache-aware index, or None.
        load_factor: the ring's bound ``c``.
        cooldown_s: the ring's first cool-down.
    """

    def __init__(
        self,
        urls: list[str],
        policy: str,
        client: httpx.AsyncClient,
        *,
        model: str = "stub",
        share: RoutingShareConfig | None = None,
        load_factor: float = 1.25,
        cooldown_s: float = 0.5,
    ) -> None:
        ring = AffinityRing(
            urls, load_factor=load_factor, cooldown_s=cooldown_s, max_cooldown_s=4 * cooldown_s
        )
        self.backend = OpenAIUpstreamBackend(
            model, urls, client=client, ring=ring, retries=2, routing=policy, routing_share=share
        )
        self.policy = self.backend.upstream.routing
        self.model = model

    def start(self) -> None:
        """Start the Redis exchange (``routing_share`` only)."""
        if self.backend.routing_share is not None:
            self.backend.routing_share.start()

    async def close(self) -> None:
        """Stop the Redis exchange."""
        await self.backend.close()

    async def complete(self, messages: list[dict], max_tokens: int) -> Outcome:
        """One streamed request through the backend; never raises for a replica's fault."""
        key = hashlib.blake2b(str(messages[0]["content"]).encode(), digest_size=16).hexdigest()
        request = ChatRequest(
            model=self.model,
            messages=messages,
            params=SamplingParams(max_tokens=max_tokens),
            stream=True,
            include_usage=True,
            openai_body={"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": True},
            prefix_key=key,
            request_id=f"bench-{id(messages):x}",
        )
        start = time.monotonic()
        ttft = None
        parts: list[str] = []
        try:
            async for event in self.backend.stream(request):
                if isinstance(event, Delta) and event.text:
                    if ttft is None:
                        ttft = time.monotonic() - start
                    parts.append(event.text)
                elif isinstance(event, Finish):
                    if ttft is None:
                        return Outcome(False, error="no content")
                    return Outcome(
                        True,
                        ttft_s=ttft,
                        prompt_tokens=event.usage.prompt_tokens,
                        cached_tokens=event.usage.cached_tokens,
                        replica=event.replica or "",
                        content="".join(parts),
                    )
        except (UpstreamCallError, UpstreamStreamCut) as exc:
            return Outcome(False, error=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # counted as an error of the run, never a crash of the bench
            return Outcome(False, error=f"unexpected {type(exc).__name__}: {exc}")
        return Outcome(False, error="stream ended without finish")
