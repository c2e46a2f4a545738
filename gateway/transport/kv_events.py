"""The exact path of cache-aware routing: follow each replica's KV event stream into the policy's exact view.

``KVEventFeed`` keeps one ``GET {base_url}{path}`` open per replica of an upstream; the replica answers with
newline-delimited JSON, one vLLM-style ``KVEventBatch`` per line (``{"ts", "events": [BlockStored |
BlockRemoved | AllBlocksCleared]}``, vLLM ``vllm/distributed/kv_events.py``; the fleet simulator's replicas
serve exactly this on ``/v1/kv_events``). Each batch goes to ``CacheAwarePolicy.apply_kv_events``.

Invariants:
- A replica's exact view is used only while its stream is open: when the stream ends or fails, the policy
  forgets what it said (``CacheAwarePolicy.kv_stream_lost``) and routes that replica on the approximate
  index until it reconnects (every ``reconnect_s``, doubled up to ``max_reconnect_s`` while it keeps failing).
  A reconnecting publisher starts with ``AllBlocksCleared`` and what it holds, so nothing is missed.
- A malformed batch (bad JSON, wrong shape, a line over ``max_line_bytes``) is counted and skipped whole; it
  never stops the feed or reaches a request. Whatever the events say, the load bound still holds
  (docs/routing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.transport.routing_policy import CacheAwarePolicy, KVEventError
from gateway.transport.upstream_http import join_url


@dataclass
class KVEventFeedStats:
    """Counters (cumulative): streams opened, batches applied, events those batches applied, batches refused
    (malformed), streams lost."""

    connects: int = 0
    batches: int = 0
    events: int = 0
    refused: int = 0
    lost: int = 0


class KVEventFeed:
    """Follow the KV event stream of every replica of one upstream.

    Args:
        policy: the upstream's ``CacheAwarePolicy`` (built with ``use_kv_events=True``).
        client: returns the HTTP client to use (the backend's shared ``httpx.AsyncClient``).
        path: appended to each replica's base URL (``/kv_events``: the stubs' ``/v1/kv_events`` under a
            ``.../v1`` base URL).
        headers: sent with each subscription (e.g. the upstream's ``Authorization``).
        reconnect_s: first wait before reconnecting a lost stream, seconds.
        max_reconnect_s: cap of the doubling wait.
        max_line_bytes: a longer line is refused (a stream cannot make the gateway parse without bound).

    Raises:
        ValueError: ``policy`` does not take KV events.
    """

    def __init__(
        self,
        policy: CacheAwarePolicy,
        client: Callable[[], httpx.AsyncClient],
        *,
        path: str = "/kv_events",
        headers: dict[str, str] | None = None,
        reconnect_s: float = 0.5,
        max_reconnect_s: float = 10.0,
        max_line_bytes: int = 4 * 2**20,
    ) -> None:
        if not policy.use_kv_events:
            raise ValueError("the policy must be built with use_kv_events=True")
        self.policy = policy
        self.path = path
        self.headers = dict(headers or {})
        self.reconnect_s = reconnect_s
        self.max_reconnect_s = max_reconnect_s
        self.max_line_bytes = max_line_bytes
        self.stats = KVEventFeedStats()
        self._client = client
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Open one stream per replica in the running loop (idempotent)."""
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._follow(r)) for r in self.policy.replicas]

    async def close(self) -> None:
        """Close every stream."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def apply_line(self, replica: str, line: str) -> bool:
        """Apply one NDJSON line of ``replica``'s stream; False (counted) when it is refused."""
        if not line.strip():
            return False
        if len(line) > self.max_line_bytes:
            self.stats.refused += 1
            return False
        try:
            applied = self.policy.apply_kv_events(replica, json.loads(line))
        except (KVEventError, ValueError, AttributeError):
            self.stats.refused += 1
            return False
        self.stats.batches += 1
        self.stats.events += applied
        return True

    def snapshot(self) -> dict[str, Any]:
        """The feed's counters for ``/admin/stats`` (``models[name]["kv_events"]``, docs/routing.md):
        ``transport`` (``"http"``) and every ``KVEventFeedStats`` counter."""
        return {"transport": "http", **dataclasses.asdict(self.stats)}

    async def _follow(self, replica: str) -> None:
        wait = self.reconnect_s
        url = join_url(replica, self.path)
        while True:
            opened = False
            try:
                async with self._client().stream(
                    "GET", url, headers=self.headers, timeout=httpx.Timeout(10.0, read=None)
                ) as response:
                    if response.status_code == 200:
                        opened = True
                        self.stats.connects += 1
                        async for line in response.aiter_lines():
                            self.apply_line(replica, line)
            except (httpx.HTTPError, OSError):
                pass
            if opened:
                self.stats.lost += 1
                wait = self.reconnect_s
            else:
                wait = min(wait * 2, self.max_reconnect_s)
            self.policy.kv_stream_lost(replica)
            await asyncio.sleep(wait)
