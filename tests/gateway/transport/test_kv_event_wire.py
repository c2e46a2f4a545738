"""vLLM's ZeroMQ KV event payloads, decoded in each layout vLLM has used, and the map from an engine's block
hashes onto the gateway's: messages are built with msgspec structs laid out as vLLM's own
(``vllm/distributed/kv_events.py`` of each vintage), encoded by ``msgspec.msgpack`` as vLLM's publisher does."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest

from gateway.transport.kv_event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockMap,
    KVWireError,
    decode_batch,
    decode_seq,
)
from gateway.transport.routing_policy import block_hashes

# vLLM 0.9: everything array-like, int hashes.


class V09Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V09Stored(V09Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class V09Removed(V09Event, tag="BlockRemoved"):
    block_hashes: list[int]


class V09Cleared(V09Event, tag="AllBlocksCleared"):
    pass


class V09Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[V09Stored | V09Removed | V09Cleared]


# Later vLLM (as TensorRT-LLM's vLLM-compatible publisher mirrors it): array-like batch with data_parallel_rank, tagged-map events, int | bytes hashes, medium.


class V11Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V11Stored(V11Event, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class V11Removed(V11Event, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class V11Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[V11Stored | V11Removed]
    data_parallel_rank: int | None = None


# vLLM main: map-like batch and events, lora_name, extra_keys, group_idx.


class MainEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MainStored(MainEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class MainRemoved(MainEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class MainCleared(MainEvent, tag="AllBlocksCleared"):
    pass


class MainBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[MainStored | MainRemoved | MainCleared]
    data_parallel_rank: int | None = None


ENCODER = msgspec.msgpack.Encoder()
TOKENS = list(range(100, 164))  # 4 blocks of 16


def sha(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_vllm_0_9_array_layout_decodes():
    payload = ENCODER.encode(
        V09Batch(1.5, [V09Stored([11, 12], None, TOKENS[:32], 16, None), V09Removed([7]), V09Cleared()])
    )
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # really a tagged array
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.data_parallel_rank is None and batch.unknown == 0
    assert batch.events == (
        BlockStored((11, 12), None, tuple(TOKENS[:32]), 16),
        BlockRemoved((7,)),
        AllBlocksCleared(),
    )


def test_vllm_0_11_array_batch_with_map_events_and_bytes_hashes_decodes():
    payload = ENCODER.encode(
        V11Batch(
            2.0, [V11Stored([sha(1)], sha(0), TOKENS[:16], 16, None, "GPU"), V11Removed([sha(1)], "GPU")], 3
        )
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == 3
    assert batch.events == (
        BlockStored((sha(1),), sha(0), tuple(TOKENS[:16]), 16, medium="GPU"),
        BlockRemoved((sha(1),), medium="GPU"),
    )


def test_vllm_main_map_layout_decodes_with_its_newer_fields():
    stored = MainStored([sha(1), sha(2)], None, TOKENS[:32], 16, None, "GPU", None, [None, ("mm", "x")], 0)
    payload = ENCODER.encode(MainBatch(3.0, [stored, MainRemoved([sha(2)], "CPU", 1), MainCleared()], 0))
    assert isinstance(msgspec.msgpack.decode(payload), dict)
    batch = decode_batch(payload)
    assert batch.events[0] == BlockStored(
        (sha(1), sha(2)),
        None,
        tuple(TOKENS[:32]),
        16,
        medium="GPU",
        extra_keys=(None, ["mm", "x"]),
        group_idx=0,
    )
    assert batch.events[1:] == (BlockRemoved((sha(2),), "CPU", 1), AllBlocksCleared())


def test_an_unknown_event_type_is_skipped_and_counted():
    payload = msgspec.msgpack.encode([1.0, [["BlockTouched", [1]], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert (batch.events, batch.unknown) == ((AllBlocksCleared(),), 1)


@pytest.mark.parametrize(
    "raw",
    [
        [1.0],
        {"events": []},
        ["x", []],
        [True, []],
        [1.0, {}],
        [1.0, [42]],
        [1.0, [[7, [1]]]],
        [1.0, [["BlockStored", [1], None, [1] * 16]]],  # too few fields
        [1.0, [["BlockStored", [True], None, [1] * 16, 16, None]]],  # a bool is not a hash
        [1.0, [["BlockStored", [1.5], None, [1] * 16, 16, None]]],
        [1.0, [["BlockStored", [b"x" * 65], None, [1] * 16, 16, None]]],
        [1.0, [["BlockStored", [1], None, [-1] * 16, 16, None]]],
        [1.0, [["BlockStored", [1], None, [1] * 16, 0, None]]],
        [1.0, [["BlockStored", [1], None, "tokens", 16, None]]],
        [1.0, [["BlockStored", [1], None, [1] * 16, 16, "lora"]]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1] * 16, "block_size": 16}]],
        [1.0, [["BlockRemoved", 5]]],
        [1.0, [], "rank"],
    ],
)
def test_malformed_payloads_are_refused_whole(raw):
    with pytest.raises(KVWireError):
        decode_batch(msgspec.msgpack.encode(raw))


def test_garbage_bytes_and_bad_sequence_frames_are_refused():
    with pytest.raises(KVWireError):
        decode_batch(b"\xc1\xff garbage")
    assert decode_seq((5).to_bytes(8, "big")) == 5
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(KVWireError):
        decode_seq(b"\x00" * 4)


def test_stored_blocks_map_onto_the_gateways_chain_through_their_tokens():
    m = EngineBlockMap(block_size=16, capacity=100)
    mine = block_hashes(TOKENS)
    first = m.translate(
        decode_batch(
            ENCODER.encode(
                MainBatch(1.0, [MainStored([sha(1), sha(2)], None, TOKENS[:32], 16, None, None, None)])
            )
        )
    )
    assert first["events"] == [{"type": "BlockStored", "block_hashes": mine[:2], "parent_block_hash": None}]
    # A later batch continues the chain from a parent stored earlier (only its engine hash is sent).
    later = m.translate(
        decode_batch(ENCODER.encode(V09Batch(2.0, [V09Stored([3, 4], sha(2), TOKENS[32:], 16, None)])))
    )
    assert later["events"][0]["block_hashes"] == mine[2:]
    assert m.gateway_hashes(4) == (mine[3],)
    removed = m.translate(decode_batch(ENCODER.encode(V09Batch(3.0, [V09Removed([3, 99])]))))
    assert removed["events"] == [{"type": "BlockRemoved", "block_hashes": [mine[2]]}]
    assert len(m) == 3 and m.stats.mapped == 4
    m.translate(decode_batch(ENCODER.encode(V09Batch(4.0, [V09Cleared()]))))
    assert len(m) == 0


def test_a_larger_engine_block_is_several_gateway_blocks():
    m = EngineBlockMap(block_size=16, capacity=100)
    out = m.translate(
        decode_batch(ENCODER.encode(V09Batch(1.0, [V09Stored([1, 2], None, TOKENS, 32, None)])))
    )
    assert out["events"][0]["block_hashes"] == block_hashes(TOKENS)
    assert m.gateway_hashes(2) == tuple(block_hashes(TOKENS)[2:])


@pytest.mark.parametrize(
    ("stored", "reason"),
    [
        (MainStored([1], 999, TOKENS[:16], 16, None, None, None), "orphan"),
        (MainStored([1], None, TOKENS[:24], 24, None, None, None), "block_size"),
        (MainStored([1], None, TOKENS[:16], 16, 3, None, None), "lora"),
        (MainStored([1], None, TOKENS[:16], 16, None, None, "adapter"), "lora"),
        (MainStored([1], None, TOKENS[:16], 16, None, "CPU", None), "other_medium"),
        (MainStored([1], None, TOKENS[:16], 16, None, None, None, None, 1), "other_group"),
        (MainStored([1, 2], None, TOKENS[:16], 16, None, None, None), "bad_length"),
    ],
)
def test_blocks_the_gateway_cannot_map_are_counted_and_left_out(stored, reason):
    m = EngineBlockMap(block_size=16, capacity=100)
    out = m.translate(decode_batch(ENCODER.encode(MainBatch(1.0, [stored]))))
    assert out["events"] == [] and len(m) == 0
    assert getattr(m.stats, reason) == len(stored.block_hashes)


def test_blocks_with_extra_keys_end_the_mappable_chain():
    m = EngineBlockMap(block_size=16, capacity=100)
    stored = MainStored([1, 2, 3], None, TOKENS[:48], 16, None, None, None, [None, ("salt",), None])
    out = m.translate(decode_batch(ENCODER.encode(MainBatch(1.0, [stored]))))
    assert out["events"][0]["block_hashes"] == block_hashes(TOKENS)[:1]
    assert (m.stats.mapped, m.stats.extra_keys) == (1, 2)


def test_the_map_is_bounded():
    m = EngineBlockMap(block_size=16, capacity=3)
    tokens = list(range(16 * 10))
    m.translate(
        decode_batch(ENCODER.encode(V09Batch(1.0, [V09Stored(list(range(10)), None, tokens, 16, None)])))
    )
    assert len(m) == 3 and m.gateway_hashes(9) == (block_hashes(tokens)[9],) and m.gateway_hashes(0) == ()
