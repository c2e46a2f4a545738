"""The exact path of cache-aware routing over ZeroMQ: follow each replica's vLLM KV event publisher.

``ZmqKVEventFeed`` keeps one SUB socket per replica on the endpoint its engine publishes on (vLLM
``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
"replay_endpoint": "tcp://*:5558", "topic": ...}'``), decodes each message (``gateway.transport.kv_event_wire``:
``[topic, 8-byte big-endian sequence number, msgpack KVEventBatch]``), maps the engine's blocks onto the
gateway's own block hashes through their token ids (``EngineBlockMap``) and hands the batch to
``CacheAwarePolicy.apply_kv_events``. The HTTP feed (``gateway.transport.kv_events``) is the other transport.

Sequence numbers count from 0 in each publisher life. Per replica:

- *in sync* once the whole history of the publisher's life is known: its message 0 was received (live or
  replayed), or an ``AllBlocksCleared`` was; only then do batches reach the policy, whose exact view is
  therefore never a partial one. A subscriber that joins late asks the replay socket for everything from 0
  (vLLM keeps the last ``buffer_steps`` batches, 10,000 by default): when the buffer no longer starts at 0, the
  replica stays on the approximate index (counted in ``unsynced``) until an ``AllBlocksCleared`` (vLLM's
  ``POST /reset_prefix_cache``) or a restart.
- a gap (a sequence number past the next expected one: the PUB socket dropped messages at its high-water mark,
  or the subscription started late) is filled from the replay socket (``replay_endpoint``: a ROUTER; the
  request is the first missing sequence number as 8 bytes, the answer ``[seq, payload]`` frames ending with
  seq -1). When the replay cannot fill it (none configured, the buffer moved on, no answer within
  ``replay_timeout_s``), the stream is lost: the policy forgets the replica's exact view
  (``kv_stream_lost``) and the replica resyncs as above.
- a lost publisher (its TCP connection drops: the socket monitor's ``DISCONNECTED``, or ZMTP heartbeats
  unanswered for ``heartbeat_timeout_s``) is a lost stream too; ZeroMQ reconnects by itself, and a restarted
  publisher starts again at 0 (an empty cache).
- a malformed message (wrong frames, topic or sequence frame, not a well-typed batch) is counted in
  ``refused`` and skipped whole; a message over ``max_message_bytes`` makes ZeroMQ drop the connection (a lost
  stream). Sequence numbers below the next expected one are duplicates (a replay overlapping the live stream)
  and are skipped, except a message 0 other than the one received: the publisher restarted without the
  disconnect being seen, a lost stream.
- a stream idle for ``idle_replay_s`` asks the replay socket for anything past the last message (the tail a
  slow-joining subscription missed would otherwise wait for the next message to show as a gap).

Whatever the events say, the load bound holds (``CacheAwarePolicy``; docs/routing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.transport.kv_event_wire import (
    END_SEQ,
    SKIP_REASONS,
    EngineBlockMap,
    KVWireError,
    decode_batch,
    decode_seq,
)
from gateway.transport.routing_policy import CacheAwarePolicy, KVEventError


@dataclass
class ZmqKVEventFeedStats:
    """Counters (cumulative) over every replica.

    Attributes:
        connects: connections to a publisher made (the socket monitor's ``HANDSHAKE_SUCCEEDED``).
        batches: batches applied to the policy.
        events: events those batches applied (in the gateway's hashes, after the block map).
        unknown_events: events of a type this gateway does not know, skipped (the rest of their batch is
            applied).
        refused: messages refused as malformed (also replayed ones).
        lost: streams lost while in sync (disconnect, or a gap the replay could not fill).
        gaps: sequence gaps seen.
        replays: replay requests sent; ``replay_failures``: those unanswered or garbled.
        replayed: batches received from the replay socket.
        duplicates: messages skipped as already received.
        unsynced: well-formed batches not applied because the history before them is unknown.
    """

    connects: int = 0
    batches: int = 0
    events: int = 0
    unknown_events: int = 0
    refused: int = 0
    lost: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    replayed: int = 0
    duplicates: int = 0
    unsynced: int = 0


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


class _Follower:
    """The sequence state of one replica's stream (see the module docstring)."""

    def __init__(self, feed: ZmqKVEventFeed, replica: str, replay_endpoint: str | None) -> None:
        self.feed = feed
        self.replica = replica
        self.replay_endpoint = replay_endpoint
        self.expected: int | None = None  # next sequence number; None = nothing received in this connection
        self.synced = False
        self.up = False  # connected to the publisher now
        self.first: bytes | None = None  # digest of this life's message 0, when received
        self.map = EngineBlockMap(feed.block_size, feed.policy.exact.capacity_blocks)

    def lost(self) -> None:
        """Forget the stream's state and the replica's exact view (it resyncs from the next messages)."""
        if self.synced:
            self.feed.stats.lost += 1
        self.synced = False
        self.expected = None
        self.first = None
        self.map.clear()
        self.feed.policy.kv_stream_lost(self.replica)

    async def connected(self) -> None:
        """A (re)connection: ask for the whole history of the publisher's life when a replay socket exists."""
        self.feed.stats.connects += 1
        self.up = True
        await self.catch_up()

    async def catch_up(self) -> None:
        """Ask the replay socket for everything from the next expected message (from 0 when nothing was
        received yet): on connecting, and when the stream has been idle for ``idle_replay_s`` (a tail of
        messages the PUB socket sent before the subscription reached it is otherwise seen only at the next
        message)."""
        if self.replay_endpoint is None or not self.up:
            return
        items = await self._fetch(0 if self.expected is None else self.expected)
        if items is None:
            return
        if not items and self.expected is None:
            # Nothing published yet: the whole history is known, and the replica holds nothing.
            self.expected, self.synced = 0, True
            self.map.clear()
            self.feed.policy.apply_kv_events(
                self.replica, {"ts": 0.0, "events": [{"type": "AllBlocksCleared"}]}
            )
        for seq, payload in items:
            self.sequence(seq, payload)

    async def frames(self, frames: list[bytes]) -> None:
        """One live message ``[topic, seq, payload]``."""
        if len(frames) != 3 or frames[0] != self.feed.topic:
            self.feed.stats.refused += 1
            return
        try:
            seq = decode_seq(frames[1])
        except KVWireError:
            self.feed.stats.refused += 1
            return
        if seq < 0:
            self.feed.stats.refused += 1
            return
        start = 0 if self.expected is None else self.expected
        if seq > start and self.replay_endpoint is not None:
            if self.expected is not None:
                self.feed.stats.gaps += 1
            items = await self._fetch(start)
            for rseq, payload in items or ():
                if rseq < seq:
                    self.sequence(rseq, payload)
        elif seq > start and self.expected is not None:
            self.feed.stats.gaps += 1
        self.sequence(seq, frames[2])

    def sequence(self, seq: int, payload: bytes) -> None:
        """Apply message ``seq`` in order: duplicates skipped, an unfilled gap is a lost stream."""
        if self.expected is not None and seq < self.expected:
            if seq == 0 and self.first != _digest(payload):
                # Another message 0 than this life's: the publisher restarted unseen (no disconnect event).
                self.lost()
            else:
                self.feed.stats.duplicates += 1
                return
        if self.expected is not None and seq > self.expected:
            self.lost()
        if seq == 0:
            self.map.clear()
            self.synced = True
            self.first = _digest(payload)
        self.expected = seq + 1
        try:
            batch = decode_batch(payload)
        except KVWireError:
            self.feed.stats.refused += 1
            return
        self.feed.stats.unknown_events += batch.unknown
        translated = self.map.translate(batch)
        if not self.synced:
            events = translated["events"]
            clears = [i for i, e in enumerate(events) if e["type"] == "AllBlocksCleared"]
            if not clears:
                self.feed.stats.unsynced += 1
                return
            self.synced = True
            translated["events"] = events[clears[-1] :]
        try:
            applied = self.feed.policy.apply_kv_events(self.replica, translated)
        except KVEventError:
            self.feed.stats.refused += 1
            return
        self.feed.stats.batches += 1
        self.feed.stats.events += applied

    async def _fetch(self, start: int) -> list[tuple[int, bytes]] | None:
        """Batches ``>= start`` from the replay socket, in order; None when it does not answer in time or
        garbles its answer."""
        feed = self.feed
        assert self.replay_endpoint is not None and feed.context is not None
        feed.stats.replays += 1
        sock = feed.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, feed.max_message_bytes)
        items: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(int(feed.replay_timeout_s * 1000)):
                    feed.stats.replay_failures += 1
                    return None
                frames = await sock.recv_multipart()
                try:
                    if len(frames) != 3 or frames[0] != b"":
                        raise KVWireError("a replay answer must be ['', seq, payload]")
                    seq = decode_seq(frames[1])
                except KVWireError:
                    feed.stats.refused += 1
                    feed.stats.replay_failures += 1
                    return None
                if seq == END_SEQ:
                    return items
                if seq < start or (items and seq <= items[-1][0]) or len(items) >= feed.max_replay_batches:
                    feed.stats.replay_failures += 1
                    return None
                feed.stats.replayed += 1
                items.append((seq, frames[2]))
        finally:
            sock.close(linger=0)


class ZmqKVEventFeed:
    """Follow the ZeroMQ KV event publisher of every replica of one upstream (see the module docstring).

    Args:
        policy: the upstream's ``CacheAwarePolicy`` (built with ``use_kv_events=True``).
        endpoints: replica name (its base URL) -> the endpoint its engine publishes on (``tcp://host:port``,
            ``ipc://path``); every replica of the policy needs one.
        replay_endpoints: replica -> its ROUTER replay endpoint (replicas without one resync on gaps).
        topic: the publishers' topic (vLLM ``topic``, default ``""``); a message with another topic is refused.
        block_size: the gateway's tokens per block (``kv_events.block_size``, how requests are hashed).
        replay_timeout_s: most seconds to wait for each replay frame.
        heartbeat_s: ZMTP heartbeat interval; a publisher silent for ``3 * heartbeat_s`` is dropped as lost.
        max_message_bytes: a longer message makes ZeroMQ drop the connection (memory bound).
        max_replay_batches: most batches one replay may answer.
        idle_replay_s: after this long without a message, ask the replay socket for anything missed.

    Raises:
        ValueError: ``policy`` does not take KV events, or a replica has no endpoint.
    """

    def __init__(
        self,
        policy: CacheAwarePolicy,
        endpoints: Mapping[str, str],
        *,
        replay_endpoints: Mapping[str, str] | None = None,
        topic: str = "",
        block_size: int = 16,
        replay_timeout_s: float = 2.0,
        heartbeat_s: float = 1.0,
        max_message_bytes: int = 64 * 2**20,
        max_replay_batches: int = 100_000,
        idle_replay_s: float = 1.0,
    ) -> None:
        if not policy.use_kv_events:
            raise ValueError("the policy must be built with use_kv_events=True")
        missing = [r for r in policy.replicas if r not in endpoints]
        if missing:
            raise ValueError(f"no KV event endpoint for replica(s) {missing}")
        self.policy = policy
        self.endpoints = dict(endpoints)
        self.topic = topic.encode("utf-8")
        self.block_size = block_size
        self.replay_timeout_s = replay_timeout_s
        self.heartbeat_s = heartbeat_s
        self.max_message_bytes = max_message_bytes
        self.max_replay_batches = max_replay_batches
        self.idle_replay_s = idle_replay_s
        self.stats = ZmqKVEventFeedStats()
        replay = dict(replay_endpoints or {})
        self.followers = {r: _Follower(self, r, replay.get(r)) for r in policy.replicas}
        self.context: zmq.asyncio.Context | None = (
            None  # made by start (a feed never started holds no sockets)
        )
        self._tasks: list[asyncio.Task] = []

    def snapshot(self) -> dict[str, Any]:
        """The feed's counters for ``/admin/stats`` (``models[name]["kv_events"]``, docs/routing.md):
        ``transport`` (``"zmq"``), every ``ZmqKVEventFeedStats`` counter, ``skipped_blocks`` (engine blocks the
        block maps left out, by reason: ``orphan``, ``block_size``, ``lora``, ``extra_keys``, ``other_medium``,
        ``other_group``, ``bad_length``; summed over replicas), ``mapped_blocks`` (engine blocks mapped, summed)
        and ``replicas``: replica -> ``{"up", "synced", "next_seq", "engine_blocks"}`` (connected now, in sync,
        next expected sequence number or None, engine blocks its map holds)."""
        skipped = dict.fromkeys(SKIP_REASONS, 0)
        mapped = 0
        replicas: dict[str, dict[str, Any]] = {}
        for name, f in self.followers.items():
            counts = dataclasses.asdict(f.map.stats)
            mapped += counts["mapped"]
            for reason in SKIP_REASONS:
                skipped[reason] += counts[reason]
            replicas[name] = {
                "up": f.up,
                "synced": f.synced,
                "next_seq": f.expected,
                "engine_blocks": len(f.map),
            }
        return {
            "transport": "zmq",
            **dataclasses.asdict(self.stats),
            "mapped_blocks": mapped,
            "skipped_blocks": skipped,
            "replicas": replicas,
        }

    def start(self) -> None:
        """Subscribe to every replica's publisher in the running loop (idempotent)."""
        if not self._tasks:
            loop = asyncio.get_running_loop()
            if self.context is None:
                self.context = zmq.asyncio.Context()
            self._tasks = [loop.create_task(self._follow(f)) for f in self.followers.values()]

    async def close(self) -> None:
        """Close every subscription (each replica's exact view is forgotten) and the ZeroMQ context."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.context is not None:
            self.context.destroy(linger=0)
            self.context = None

    async def _follow(self, follower: _Follower) -> None:
        assert self.context is not None
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's PUB high-water mark
        sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sub.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000))
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(3 * self.heartbeat_s * 1000))
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(sub, zmq.POLLIN)
        try:
            sub.connect(self.endpoints[follower.replica])
            while True:
                ready = dict(await poller.poll(int(self.idle_replay_s * 1000)))
                if not ready:
                    await follower.catch_up()
                    continue
                if monitor in ready:  # a disconnect is handled before any message of the next connection
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:  # the subscription is sent now
                        await follower.connected()
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        follower.up = False
                        follower.lost()
                    continue
                if sub in ready:
                    await follower.frames(await sub.recv_multipart())
        finally:
            follower.synced = False  # closing is not a lost stream
            follower.lost()
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
