"""The stub replicas' KV event publisher over ZeroMQ, in vLLM's wire format (``vllm/distributed/kv_events.py``).

A PUB socket sends ``[topic, sequence number as 8 bytes big-endian, msgpack KVEventBatch]`` per batch, the
sequence counting from 0 in each life of the publisher; a ROUTER socket answers a replay request (the first
wanted sequence number as 8 bytes) with ``[seq, payload]`` for every buffered batch from there, then
``[-1, b""]``. Batches are encoded by ``msgspec.msgpack`` from structs laid out as vLLM's: ``layout="map"``
(vLLM's current one: the batch and each event tagged maps) or ``layout="array"`` (early vLLM: the batch
``[ts, events, data_parallel_rank]`` and each event a tagged array). The gateway's subscriber is
``gateway.transport.kv_events_zmq``.

Invariants: publishing never blocks (the PUB socket drops at its high-water mark, which subscribers see as a
gap and replay); the replay buffer keeps the last ``buffer_steps`` batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

LAYOUTS = ("map", "array")


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(_MapEvent, tag="BlockStored"):
    """vLLM's ``BlockStored`` (map layout)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved`` (map layout)."""

    block_hashes: list[int]
    medium: str | None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared`` (map layout)."""


class ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    """Early vLLM's ``BlockStored`` (array layout)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    """Early vLLM's ``BlockRemoved`` (array layout)."""

    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    """Early vLLM's ``AllBlocksCleared`` (array layout)."""


class MapBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch`` (map layout)."""

    ts: float
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]
    data_parallel_rank: int | None = None


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Early vLLM's ``KVEventBatch`` (array layout)."""

    ts: float
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


class ZmqKVPublisher:
    """PUB + ROUTER replay sockets on loopback publishing one replica's KV events.

    Args:
        port: PUB port (0: a free one, kept across ``close``/``start``).
        replay_port: ROUTER port (0: a free one; None: no replay socket).
        topic: the topic frame.
        buffer_steps: batches kept for replay (vLLM's default 10,000).
        layout: one of ``LAYOUTS``.

    Raises:
        ValueError: an unknown ``layout``.
    """

    def __init__(
        self,
        port: int = 0,
        replay_port: int | None = 0,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        layout: str = "map",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        self.port = port
        self.replay_port = replay_port
        self.topic = topic.encode("utf-8")
        self.layout = layout
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.published = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    @property
    def endpoint(self) -> str:
        """``tcp://127.0.0.1:PORT`` of the PUB socket."""
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        """``tcp://127.0.0.1:PORT`` of the ROUTER socket (None without one)."""
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    async def start(self) -> None:
        """Bind the sockets (a new life: sequence numbers and the buffer start empty)."""
        self._ctx = zmq.asyncio.Context()
        self.buffer.clear()
        self.published = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.port = await self._bind(self._pub, self.port)
        if self.replay_port is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_port = await self._bind(self._router, self.replay_port)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    @staticmethod
    async def _bind(sock: zmq.asyncio.Socket, port: int) -> int:
        if port == 0:
            return sock.bind_to_random_port("tcp://127.0.0.1")
        for attempt in range(50):  # a restart takes its old port back
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                return port
            except zmq.ZMQError:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.1)
        raise AssertionError("unreachable")

    def batch(self, events: list[dict]) -> bytes:
        """The msgpack payload of ``events`` (dicts shaped like the HTTP feed's, plus ``token_ids`` and
        ``block_size`` on ``BlockStored``) in this publisher's layout."""
        array = self.layout == "array"
        out: list = []
        for e in events:
            if e["type"] == "BlockStored":
                fields = (
                    e["block_hashes"],
                    e["parent_block_hash"],
                    e["token_ids"],
                    e["block_size"],
                    None,
                    "GPU",
                )
                out.append(ArrayBlockStored(*fields) if array else MapBlockStored(*fields, None))
            elif e["type"] == "BlockRemoved":
                out.append((ArrayBlockRemoved if array else MapBlockRemoved)(e["block_hashes"], "GPU"))
            else:
                out.append(ArrayAllBlocksCleared() if array else MapAllBlocksCleared())
        batch = (ArrayBatch if array else MapBatch)(time.time(), out, 0)
        return self._encoder.encode(batch)

    def publish(self, events: list[dict]) -> int:
        """Send one batch (never blocks) and buffer it for replay; returns its sequence number.

        Raises:
            RuntimeError: not started.
        """
        if self._pub is None:
            raise RuntimeError("publisher not started")
        seq = self.published
        self.published += 1
        payload = self.batch(events)
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        self.buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # vLLM logs and ignores a bad request
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        """Close the sockets (subscribers see the connection drop); the ports are kept for ``start``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
