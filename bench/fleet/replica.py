"""A stub engine replica for the fleet simulator: a real HTTP server on loopback speaking the OpenAI chat API.

Each replica owns a prefix cache of full 16-token blocks (chained hashes, ``routing_policy.block_hashes``) with
a fixed token capacity and LRU eviction (a chain's tail before its parent), and a scheduler that takes
simulated time: one prefill at a time for the uncached prompt tokens, then decode steps for every running
sequence together (continuous batching, up to ``max_batch``). The cost model is the embedded engine's, as
measured in the closing note of stop 8 (``issues stops``; SmolLM2-135M fp32 on 2 CPU threads): cold TTFT
1.145 s for a 1,083-token prompt (1.057 ms per prefilled token), decode 37.8 tok/s at batch 1 and
163.9 tok/s at batch 8 (26.5 ms and 48.8 ms per step; linear in between and beyond). ``time_scale``
multiplies every simulated duration (0.04: 25 times faster than the engine) so a bench run stays short.

``cached_tokens`` in ``usage.prompt_tokens_details`` is exactly what the cache held when the prefill was
scheduled (capped like vLLM: at least one prompt token is always computed). Cache changes are published as
vLLM-style KV event batches (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) on
``GET /v1/kv_events`` (one JSON batch per line); a new subscriber first gets ``AllBlocksCleared`` and one
``BlockStored`` with everything held, so it never needs history. With ``kv_zmq`` they are also published over
ZeroMQ in vLLM's wire format (``bench.fleet.kv_zmq``: a PUB socket and a replay ROUTER socket, each stored run
of blocks with its parent's hash and its token ids, as vLLM's ``BlockStored``); there, as with vLLM, a late
subscriber gets history only from the replay buffer.

Invariants: the cache never holds more than ``capacity_tokens // 16`` blocks; a stored block's token ids are
compared on lookup (a hash collision is a miss); ``kill`` fails every queued and running request mid-stream,
like a crashed server, and a restarted replica starts with an empty cache. Each life names itself in every chat
answer's ``x-prefixgate-instance`` header (a new random name per start), as a prefixgate replica does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.fleet.kv_zmq import ZmqKVPublisher
from bench.fleet.tokens import encode_chat
from gateway.core.headers import INSTANCE_HEADER
from gateway.transport.routing_policy import BLOCK_SIZE, block_hashes


@dataclass(frozen=True)
class EngineTiming:
    """Simulated engine costs in engine seconds (see the module docstring for their source)."""

    prefill_s_per_token: float = 1.145 / 1083
    decode_step_s_b1: float = 1 / 37.8
    decode_step_s_b8: float = 8 / 163.9
    time_scale: float = 0.04

    def decode_step_s(self, batch: int) -> float:
        """Engine seconds of one decode step for ``batch`` sequences (>= 1), linear through b1 and b8."""
        per_extra = (self.decode_step_s_b8 - self.decode_step_s_b1) / 7
        return self.decode_step_s_b1 + per_extra * (max(batch, 1) - 1)

    def request_cost_s(self, prompt_tokens: int, cached_tokens: int, max_tokens: int) -> float:
        """Engine seconds of one request served alone (prefill of the uncached part, batch-1 decode)."""
        return (prompt_tokens - cached_tokens) * self.prefill_s_per_token + max_tokens * self.decode_step_s(1)


class PrefixLRU:
    """Prefix cache of full blocks, LRU, bounded by a token capacity.

    Args:
        capacity_tokens: most tokens held (rounded down to whole blocks; >= one block).
        block_size: tokens per block.

    Raises:
        ValueError: capacity below one block.
    """

    def __init__(self, capacity_tokens: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_tokens < block_size:
            raise ValueError("capacity_tokens must hold at least one block")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[int, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self) -> list[int]:
        """Every block hash held, oldest first."""
        return list(self._blocks)

    def lookup(self, token_ids: Sequence[int], hashes: Sequence[int]) -> int:
        """Cached prompt tokens for ``token_ids`` (leading full blocks held, touched), capped at ``len - 1``."""
        n = 0
        for i, h in enumerate(hashes):
            stored = self._blocks.get(h)
            if stored is None or stored != tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]):
                break
            n += 1
        for h in reversed(hashes[:n]):  # tail first, so parents stay younger than their tails
            self._blocks.move_to_end(h)
        cached = n * self.block_size
        if cached >= len(token_ids):  # at least one token is computed (its logits give the first token)
            cached = (n - 1) * self.block_size if n else 0
        return cached

    def insert(self, token_ids: Sequence[int], hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Hold every full block of the prompt; returns ``(stored, removed)`` block hashes (new ones only)."""
        stored: list[int] = []
        for i, h in enumerate(hashes):
            if h not in self._blocks:
                self._blocks[h] = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                stored.append(h)
        for h in reversed(hashes):
            self._blocks.move_to_end(h)
        removed: list[int] = []
        while len(self._blocks) > self.capacity_blocks:
            h, _ = self._blocks.popitem(last=False)
            removed.append(h)
        stored = [h for h in stored if h in self._blocks]
        return stored, removed


class ReplicaKilled(Exception):
    """The replica was killed while the request was queued or running."""


@dataclass
class _Sequence:
    token_ids: list[int]
    hashes: list[int]
    max_tokens: int
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: int = 0
    enqueued: float = 0.0


class SimEngine:
    """The replica's scheduler over simulated time: FIFO prefill one at a time, batched decode.

    Args:
        capacity_tokens: prefix cache capacity.
        timing: cost model.
        max_batch: most sequences decoding at once.
    """

    def __init__(self, capacity_tokens: int, timing: EngineTiming, max_batch: int = 8) -> None:
        self.cache = PrefixLRU(capacity_tokens)
        self.timing = timing
        self.max_batch = max_batch
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self._wake = asyncio.Event()
        self._subscribers: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None
        self.residence_s = 0.0  # sum over finished requests of (finish - enqueue), real seconds
        self.busy_s = 0.0  # real seconds spent prefilling or decoding
        self._busy_until = 0.0
        self.dead = False
        self.served = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.zmq_publisher: ZmqKVPublisher | None = None  # also publish over ZeroMQ (vLLM's wire format)

    def start(self) -> None:
        """Start the step loop (in the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def kill(self) -> None:
        """Stop the loop and fail every queued and running sequence; later submissions are refused."""
        self.dead = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for seq in list(self.waiting) + self.running:
            seq.out.put_nowait(ReplicaKilled("replica killed"))
        self.waiting.clear()
        self.running.clear()
        for q in self._subscribers:
            q.put_nowait(None)

    def submit(self, token_ids: list[int], max_tokens: int) -> _Sequence:
        """Queue a request; its ``out`` queue yields ``("first", cached)``, ``("token", i)``..., ``("done", n)``.

        Raises:
            ReplicaKilled: the engine was killed.
        """
        if self.dead:
            raise ReplicaKilled("replica killed")
        seq = _Sequence(token_ids, block_hashes(token_ids), max_tokens, enqueued=time.monotonic())
        self.waiting.append(seq)
        self._wake.set()
        return seq

    def subscribe(self) -> asyncio.Queue:
        """A KV event queue, primed with ``AllBlocksCleared`` and the blocks held now."""
        q: asyncio.Queue = asyncio.Queue(maxsize=10_000)
        q.put_nowait(self._batch([{"type": "AllBlocksCleared"}]))
        held = self.cache.hashes()
        if held:
            q.put_nowait(
                self._batch([{"type": "BlockStored", "block_hashes": held, "parent_block_hash": None}])
            )
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        """Stop publishing to ``q``."""
        self._subscribers.discard(q)

    @staticmethod
    def _batch(events: list[dict]) -> dict:
        return {"ts": time.time(), "events": events}

    def _publish_zmq(self, seq: _Sequence, stored: list[int], removed: list[int]) -> None:
        """vLLM's events for one prefill: a ``BlockStored`` per contiguous run of new blocks (its parent, its
        token ids), then a ``BlockRemoved``."""
        publisher = self.zmq_publisher
        if publisher is None or not (stored or removed):
            return
        new = set(stored)
        events: list[dict] = []
        run: list[int] = []
        for i, h in enumerate([*seq.hashes, None]):
            if h is not None and h in new:
                run.append(i)
                continue
            if run:
                events.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [seq.hashes[j] for j in run],
                        "parent_block_hash": seq.hashes[run[0] - 1] if run[0] > 0 else None,
                        "token_ids": seq.token_ids[run[0] * BLOCK_SIZE : (run[-1] + 1) * BLOCK_SIZE],
                        "block_size": BLOCK_SIZE,
                    }
                )
                run = []
        if removed:
            events.append({"type": "BlockRemoved", "block_hashes": removed})
        publisher.publish(events)

    def _publish(self, stored: list[int], removed: list[int], parent: int | None) -> None:
        events: list[dict] = []
        if stored:
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": stored,
                    "parent_block_hash": parent,
                    "block_size": BLOCK_SIZE,
                    "lora_id": None,
                }
            )
        if removed:
            events.append({"type": "BlockRemoved", "block_hashes": removed})
        if not events:
            return
        batch = self._batch(events)
        for q in list(self._subscribers):
            if q.full():  # a subscriber that does not read is dropped, never blocks the engine
                self._subscribers.discard(q)
                continue
            q.put_nowait(batch)

    async def _sleep(self, engine_s: float) -> None:
        # Self-correcting: while busy, the engine's own clock advances by exact durations and each sleep
        # ends at that clock, so event-loop lag on one step is made up on the next instead of piling up.
        now = time.monotonic()
        if self._busy_until < now - 0.05:  # idle since: the engine clock restarts at now
            self._busy_until = now
        duration = engine_s * self.timing.time_scale
        self._busy_until += duration
        self.busy_s += duration
        await asyncio.sleep(max(0.0, self._busy_until - now))

    async def _loop(self) -> None:
        while True:
            if self.waiting and len(self.running) < self.max_batch:
                seq = self.waiting.popleft()
                cached = self.cache.lookup(seq.token_ids, seq.hashes)
                await self._sleep((len(seq.token_ids) - cached) * self.timing.prefill_s_per_token)
                stored, removed = self.cache.insert(seq.token_ids, seq.hashes)
                self._publish_zmq(seq, stored, removed)
                first_new = seq.hashes.index(stored[0]) if stored else 0
                self._publish(stored, removed, seq.hashes[first_new - 1] if first_new > 0 else None)
                self.prompt_tokens += len(seq.token_ids)
                self.cached_tokens += cached
                # The prefill's last logits give the first token.
                seq.out.put_nowait(("first", cached))
                seq.generated = 1
                seq.out.put_nowait(("token", 1))
                if seq.max_tokens <= 1:
                    self._finish(seq, time.monotonic())
                else:
                    self.running.append(seq)
            elif self.running:
                await self._sleep(self.timing.decode_step_s(len(self.running)))
                now = time.monotonic()
                for seq in list(self.running):
                    seq.generated += 1
                    seq.out.put_nowait(("token", seq.generated))
                    if seq.generated >= seq.max_tokens:
                        self.running.remove(seq)
                        self._finish(seq, now)
            else:
                self._wake.clear()
                await self._wake.wait()

    def _finish(self, seq: _Sequence, now: float) -> None:
        seq.out.put_nowait(("done", seq.generated))
        self.residence_s += now - seq.enqueued
        self.served += 1


def _word(seed: int, i: int) -> str:
    return f" w{(seed * 2654435761 + i * 40503) % 997}"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


class StubReplica:
    """One replica: ``SimEngine`` behind a uvicorn server on ``127.0.0.1:port``.

    Args:
        name: label in responses and stats.
        capacity_tokens: prefix cache capacity.
        timing: cost model.
        port: fixed port (0: a free one, reserved now and kept across restarts).
        kv_zmq: also publish KV events over ZeroMQ (``bench.fleet.kv_zmq.ZmqKVPublisher``, free ports kept
            across restarts, a replay socket, ``kv_zmq_layout`` ``map`` or ``array``).
    """

    def __init__(
        self,
        name: str,
        capacity_tokens: int,
        timing: EngineTiming,
        port: int = 0,
        *,
        kv_zmq: bool = False,
        kv_zmq_layout: str = "map",
    ) -> None:
        self.name = name
        self.kv_publisher = ZmqKVPublisher(layout=kv_zmq_layout) if kv_zmq else None
        self.capacity_tokens = capacity_tokens
        self.timing = timing
        # The port is reserved from the start (bound, not listening: connections are refused, as to a replica
        # that is down), so a replica that joins later already has its URL; a restart binds it again.
        self._reserved: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._reserved.bind(("127.0.0.1", port))
        self.port = self._reserved.getsockname()[1]
        self.engine: SimEngine | None = None
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task | None = None
        self.history: list[dict] = []  # stats of each previous life (restarts)
        self.instance = ""
        """This life's name (``x-prefixgate-instance`` of its answers; new at each ``start``)."""

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def up(self) -> bool:
        """Serving now."""
        return self._server is not None

    def app(self) -> Starlette:
        """The Starlette app: chat completions, KV events, health."""
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/kv_events", self._kv_events, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    async def start(self) -> None:
        """Start serving (a fresh, empty cache)."""
        if self._server is not None:
            return
        self.engine = SimEngine(self.capacity_tokens, self.timing)
        self.instance = secrets.token_hex(6)
        if self.kv_publisher is not None:
            await self.kv_publisher.start()
            self.engine.zmq_publisher = self.kv_publisher
        self.engine.start()
        config = uvicorn.Config(self.app(), log_level="critical", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        sock, self._reserved = self._reserved, None
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        for attempt in range(50):  # a restart takes its old port back (another process may hold it briefly)
            try:
                if sock.getsockname()[1] != self.port:
                    sock.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if attempt == 49:
                    sock.close()
                    raise
                await asyncio.sleep(0.1)
        self.port = sock.getsockname()[1]
        self._serve_task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            await asyncio.sleep(0.005)

    async def kill(self) -> None:
        """Crash: fail everything in flight mid-stream, stop accepting connections, lose the cache."""
        if self._server is None or self.engine is None:
            if self._reserved is not None and self.engine is None:  # never started: free the reserved port
                self._reserved.close()
                self._reserved = None
            return
        for conn in list(
            self._server.server_state.connections
        ):  # reset every open connection, as a crash does
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        await self.engine.kill()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
        self.history.append(self.stats())
        self._server.should_exit = True
        self._server.force_exit = True
        task, self._server = self._serve_task, None
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, timeout=5)

    def stats(self) -> dict:
        """This life's counters (real seconds)."""
        e = self.engine
        assert e is not None
        return {
            "served": e.served,
            "residence_s": e.residence_s,
            "busy_s": e.busy_s,
            "prompt_tokens": e.prompt_tokens,
            "cached_tokens": e.cached_tokens,
        }

    def totals(self) -> dict:
        """Counters summed over every life."""
        lives = self.history + ([self.stats()] if self.engine is not None and self.up else [])
        return {k: sum(life[k] for life in lives) for k in ("served", "residence_s", "busy_s")}

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "replica": self.name})

    async def _kv_events(self, request: Request) -> Response:
        engine = self.engine
        assert engine is not None
        q = engine.subscribe()

        async def lines() -> AsyncIterator[bytes]:
            try:
                while True:
                    batch = await q.get()
                    if batch is None:
                        return
                    yield (json.dumps(batch) + "\n").encode()
            finally:
                engine.unsubscribe(q)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def _chat(self, request: Request) -> Response:
        engine = self.engine
        if engine is None:
            return _error(503, "replica is down", "server_error")
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return _error(400, "body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "'messages' must be a non-empty list")
        messages = body["messages"]
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                return _error(400, "each message needs a string 'role' and string 'content'")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 4096:
            return _error(400, "'max_tokens' must be an integer in [1, 4096]")
        token_ids = encode_chat(messages)
        try:
            seq = engine.submit(token_ids, max_tokens)
        except ReplicaKilled:
            return _error(503, "replica is down", "server_error")
        model = str(body.get("model", "stub"))
        seed = seq.hashes[-1] if seq.hashes else len(token_ids)
        created = int(time.time())
        rid = f"chatcmpl-{self.name}-{id(seq):x}"

        def usage(cached: int, completion: int) -> dict:
            return {
                "prompt_tokens": len(token_ids),
                "completion_tokens": completion,
                "total_tokens": len(token_ids) + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }

        if not body.get("stream"):
            text, cached = [], 0
            while True:
                item = await seq.out.get()
                if isinstance(item, Exception):
                    return _error(503, "replica failed", "server_error")
                kind, value = item
                if kind == "first":
                    cached = value
                elif kind == "token":
                    text.append(_word(seed, value))
                else:
                    break
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(text)},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": usage(cached, len(text)),
                    "x_replica": self.name,
                },
                headers={INSTANCE_HEADER: self.instance},
            )

        async def events() -> AsyncIterator[bytes]:
            cached = 0

            def chunk(delta: dict, finish: str | None = None, use: dict | None = None) -> bytes:
                obj = {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if use is None else [],
                }
                if use is not None:
                    obj["usage"] = use
                    obj["x_replica"] = self.name
                return f"data: {json.dumps(obj)}\n\n".encode()

            while True:
                item = await seq.out.get()
                if isinstance(item, Exception):
                    raise item  # the connection is cut mid-stream, as a crashed server would
                kind, value = item
                if kind == "first":
                    cached = value
                elif kind == "token":
                    delta = {"content": _word(seed, value)}
                    if value == 1:
                        delta["role"] = "assistant"
                    yield chunk(delta)
                else:
                    yield chunk({}, "length")
                    yield chunk({}, use=usage(cached, value))
                    yield b"data: [DONE]\n\n"
                    return

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={INSTANCE_HEADER: self.instance}
        )
