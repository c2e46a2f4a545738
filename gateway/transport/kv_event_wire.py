"""vLLM's KV event wire format (ZeroMQ), decoded, and the map from an engine's block hashes to the gateway's.

Wire format (vLLM ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): each message on the PUB socket is
three frames ``[topic, sequence number (8 bytes, big-endian, from 0 per publisher life), payload]``; the payload
is a ``KVEventBatch`` encoded by ``msgspec.msgpack.Encoder``: ``ts`` (float seconds), ``events``, and in later
versions ``data_parallel_rank``. The layout changed across versions and every one is decoded here:

- array-like (early vLLM, from 0.9; SGLang): the batch is ``[ts, events(, data_parallel_rank)]`` and each
  event a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id(,
  medium, lora_name, extra_keys, group_idx, ...)]``, ``["BlockRemoved", block_hashes(, medium, group_idx)]``,
  ``["AllBlocksCleared"]`` (``omit_defaults``: trailing default fields are left out);
- map-like (later vLLM): each event a tagged map ``{"type": "BlockStored", "block_hashes": ..., ...}``, in an
  array batch at first, and in a map batch ``{"ts", "events", "data_parallel_rank"}`` in the newest.

Block hashes are ints, or bytes (sha256 digests) since vLLM made sha256 its default (``ExternalBlockHash``).

``EngineBlockMap`` turns a replica's events into the gateway's own chained block hashes
(``routing_policy.block_hashes``), the ones requests are routed on: a ``BlockStored`` carries the token ids of
its blocks and its parent's engine hash, so the gateway hashes those tokens continuing the chain of the parent
it already mapped. The engine's hash (its seed, ``PYTHONHASHSEED``, sha256 or cbor) never needs to be
reproduced. What cannot be mapped is counted and left out (never guessed): a parent the map does not hold
(stored before the subscription, or aged out), an engine block size that is not a multiple of the gateway's,
blocks of a LoRA adapter or with extra keys (multimodal inputs, ``cache_salt``: the same tokens then are other
blocks), another medium than the GPU (CPU offload tiers), another KV cache group than the first.

Invariants: ``decode_batch`` either returns a whole, well-typed batch or raises ``KVWireError`` (nothing
partial); the map holds at most ``capacity`` engine blocks (the oldest go first), so no stream grows the
gateway's memory without bound.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.transport.routing_policy import block_hashes

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineBlockMap",
    "KVWireError",
    "MapStats",
    "WireBatch",
    "decode_batch",
    "decode_seq",
]

END_SEQ = -1
"""The sequence number of the replay socket's end-of-replay message (``(-1).to_bytes(8, "big", signed=True)``)."""

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_MAX_HASH_BYTES = 64
_GPU_MEDIA = (None, "GPU")


class KVWireError(ValueError):
    """A ZeroMQ KV event message that is not vLLM's wire format (the message is counted and skipped whole)."""


EngineHash = int | bytes
"""An engine's block hash as published (vLLM's ``ExternalBlockHash``)."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks the engine now holds: ``block_hashes[i]`` covers ``token_ids[i*block_size:(i+1)*block_size]``."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks the engine evicted."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class WireBatch:
    """One decoded ``KVEventBatch``; ``unknown`` counts events of a type this gateway does not know (skipped)."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    unknown: int = 0


def decode_seq(frame: bytes) -> int:
    """The sequence number of an 8-byte big-endian frame (signed: the replay socket ends with -1).

    Raises:
        KVWireError: not 8 bytes.
    """
    if len(frame) != 8:
        raise KVWireError(f"sequence frame of {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big", signed=True)


def _hash(value: Any, where: str) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise KVWireError(f"{where}: a block hash must be an int or bytes, got {type(value).__name__}")
    if isinstance(value, bytes) and len(value) > _MAX_HASH_BYTES:
        raise KVWireError(f"{where}: a block hash of {len(value)} bytes")
    return value


def _hashes(value: Any, where: str) -> tuple[EngineHash, ...]:
    if not isinstance(value, list):
        raise KVWireError(f"{where}: block_hashes must be a list")
    return tuple(_hash(v, where) for v in value)


def _optional(value: Any, kind: type | tuple[type, ...], where: str, name: str) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise KVWireError(f"{where}: {name} has the wrong type ({type(value).__name__})")
    return value


def _fields(raw: Any, names: tuple[str, ...], required: int, where: str) -> dict[str, Any]:
    """An event's fields by name, from a tagged array (positional after the tag) or a tagged map."""
    if isinstance(raw, list):
        values = raw[1:]
        if len(values) < required:
            raise KVWireError(f"{where}: {len(values)} fields, expected at least {required}")
        return dict(zip(names, values, strict=False))
    out = {name: raw.get(name) for name in names}
    missing = [name for name in names[:required] if name not in raw]
    if missing:
        raise KVWireError(f"{where}: missing {', '.join(missing)}")
    return out


def _event(raw: Any, where: str) -> KVEvent | None:
    if isinstance(raw, list) and raw:
        tag = raw[0]
    elif isinstance(raw, dict):
        tag = raw.get("type")
    else:
        raise KVWireError(f"{where}: an event must be a tagged array or map")
    if not isinstance(tag, str):
        raise KVWireError(f"{where}: the event tag must be a string")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, 1, where)
        return BlockRemoved(
            _hashes(f["block_hashes"], where),
            _optional(f.get("medium"), str, where, "medium"),
            _optional(f.get("group_idx"), int, where, "group_idx"),
        )
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS, 4, where)
        token_ids = f["token_ids"]
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in token_ids
        ):
            raise KVWireError(f"{where}: token_ids must be a list of ints in [0, 2**32)")
        block_size = f["block_size"]
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise KVWireError(f"{where}: block_size must be an int >= 1")
        parent = f["parent_block_hash"]
        extra = _optional(f.get("extra_keys"), list, where, "extra_keys")
        return BlockStored(
            _hashes(f["block_hashes"], where),
            None if parent is None else _hash(parent, where),
            tuple(token_ids),
            block_size,
            _optional(f.get("lora_id"), int, where, "lora_id"),
            _optional(f.get("medium"), str, where, "medium"),
            _optional(f.get("lora_name"), str, where, "lora_name"),
            None if extra is None else tuple(extra),
            _optional(f.get("group_idx"), int, where, "group_idx"),
        )
    return None  # a newer event type: skipped, counted in WireBatch.unknown


def decode_batch(payload: bytes) -> WireBatch:
    """Decode one ``KVEventBatch`` payload (either layout; see the module docstring).

    Raises:
        KVWireError: not msgpack, or not a batch of well-typed events (nothing of it is returned).
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise KVWireError(f"not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) in (2, 3):
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) == 3 else None
    elif isinstance(raw, dict) and "ts" in raw and "events" in raw:
        ts, events, rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise KVWireError("a batch must be [ts, events(, data_parallel_rank)] or a map with ts and events")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVWireError("ts must be a number")
    if not isinstance(events, list):
        raise KVWireError("events must be a list")
    rank = _optional(rank, int, "batch", "data_parallel_rank")
    decoded: list[KVEvent] = []
    unknown = 0
    for i, raw_event in enumerate(events):
        event = _event(raw_event, f"events[{i}]")
        if event is None:
            unknown += 1
        else:
            decoded.append(event)
    return WireBatch(float(ts), tuple(decoded), rank, unknown)


@dataclass
class MapStats:
    """Counters (cumulative) of ``EngineBlockMap``: engine blocks mapped, and left out by reason."""

    mapped: int = 0
    orphan: int = 0
    block_size: int = 0
    lora: int = 0
    extra_keys: int = 0
    other_medium: int = 0
    other_group: int = 0
    bad_length: int = 0

    def skip(self, reason: str, blocks: int) -> None:
        """Count ``blocks`` engine blocks left out for ``reason`` (one of ``SKIP_REASONS``)."""
        setattr(self, reason, getattr(self, reason) + blocks)


SKIP_REASONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MapStats) if f.name != "mapped")
"""Why ``EngineBlockMap`` leaves an engine block out: its parent is unknown (``orphan``), its size is not a
multiple of the gateway's (``block_size``), it belongs to an adapter (``lora``) or hashes more than its tokens
(``extra_keys``), it is not on the GPU (``other_medium``) or not in KV cache group 0 (``other_group``), its
token count does not match its size (``bad_length``)."""


class EngineBlockMap:
    """One replica's map from its engine's block hashes to the gateway's chained block hashes.

    Args:
        block_size: the gateway's tokens per block (``kv_events.block_size``); an engine block of ``k`` times
            that many tokens maps to ``k`` gateway blocks.
        capacity: most engine blocks kept (the oldest are forgotten first; their children then cannot be
            mapped).

    Raises:
        ValueError: ``block_size`` or ``capacity`` below 1.
    """

    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be >= 1")
        self.block_size = block_size
        self.capacity = capacity
        self.stats = MapStats()
        self._map: OrderedDict[EngineHash, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def clear(self) -> None:
        """Forget every engine block (the engine cleared its cache, or the stream was lost)."""
        self._map.clear()

    def gateway_hashes(self, engine_hash: EngineHash) -> tuple[int, ...]:
        """The gateway's hashes of ``engine_hash`` (``()`` when it is not mapped)."""
        return self._map.get(engine_hash, ())

    def translate(self, batch: WireBatch) -> dict[str, Any]:
        """Apply ``batch`` to the map; returns it in the gateway's hashes, as ``CacheAwarePolicy.apply_kv_events``
        takes it (``{"ts", "events": [{"type", "block_hashes", "parent_block_hash"}]}``)."""
        events: list[dict[str, Any]] = []
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.clear()
                events.append({"type": "AllBlocksCleared"})
            elif isinstance(event, BlockRemoved):
                removed = self._removed(event)
                if removed:
                    events.append({"type": "BlockRemoved", "block_hashes": removed})
            else:
                stored, parent = self._stored(event)
                if stored:
                    events.append(
                        {"type": "BlockStored", "block_hashes": stored, "parent_block_hash": parent}
                    )
        return {"ts": batch.ts, "events": events}

    def _removed(self, event: BlockRemoved) -> list[int]:
        if event.medium not in _GPU_MEDIA:
            self.stats.skip("other_medium", len(event.block_hashes))
            return []
        if event.group_idx not in (None, 0):
            self.stats.skip("other_group", len(event.block_hashes))
            return []
        out: list[int] = []
        for h in event.block_hashes:
            out.extend(self._map.pop(h, ()))
        return out

    def _stored(self, event: BlockStored) -> tuple[list[int], int | None]:
        n = len(event.block_hashes)
        reason = None
        if event.medium not in _GPU_MEDIA:
            reason = "other_medium"
        elif event.group_idx not in (None, 0):
            reason = "other_group"
        elif event.lora_id is not None or event.lora_name is not None:
            reason = "lora"
        elif event.block_size % self.block_size:
            reason = "block_size"
        elif len(event.token_ids) != n * event.block_size:
            reason = "bad_length"
        elif event.parent_block_hash is not None and event.parent_block_hash not in self._map:
            reason = "orphan"
        if reason is not None:
            self.stats.skip(reason, n)
            return [], None
        parent = None
        if event.parent_block_hash is not None:
            self._map.move_to_end(event.parent_block_hash)  # a parent in use stays younger than its children
            parent = self._map[event.parent_block_hash][-1]
        first_parent = parent
        per = event.block_size // self.block_size
        out: list[int] = []
        for i, engine_hash in enumerate(event.block_hashes):
            if event.extra_keys is not None and i < len(event.extra_keys) and event.extra_keys[i] is not None:
                # This block (and so every later one, chained to it) hashes more than its tokens.
                self.stats.skip("extra_keys", n - i)
                break
            tokens: Sequence[int] = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
            mine = tuple(block_hashes(tokens, self.block_size, parent=parent))
            assert len(mine) == per
            self._map[engine_hash] = mine
            self._map.move_to_end(engine_hash)
            out.extend(mine)
            parent = mine[-1]
            self.stats.mapped += 1
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)
        return out, first_parent
