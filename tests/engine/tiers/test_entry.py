"""Tier entries: a round trip gives the same KV bytes; every kind of mismatch is refused with its cause."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_tiers.entry import BlockMeta, EntryRejected, decode_entry, encode_entry, entry_meta


def block(layout, seed: int = 0) -> tuple[BlockMeta, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    meta = BlockMeta(bytes([seed]) * 32, b"\x07" * 32, (5, 6, 7, 8), ("tiny-model@abc", "tenant-a"))
    return meta, torch.randn(layout.block_shape, generator=g)


def rejected(layout, meta, data) -> str:
    with pytest.raises(EntryRejected) as e:
        decode_entry(layout, meta, data)
    return e.value.cause


def test_round_trip_is_bit_exact(layout):
    meta, kv = block(layout)
    data = encode_entry(layout, meta, kv)
    out = decode_entry(layout, meta, data)
    assert out.dtype == torch.float32 and tuple(out.shape) == layout.block_shape
    assert torch.equal(out, kv)
    first = dataclasses.replace(meta, parent_hash=None)
    assert torch.equal(decode_entry(layout, first, encode_entry(layout, first, kv)), kv)


def test_bfloat16_round_trip(layout):
    lay = dataclasses.replace(layout, kv_dtype="bfloat16")
    meta, kv = block(lay)
    kv = kv.to(torch.bfloat16)
    assert torch.equal(decode_entry(lay, meta, encode_entry(lay, meta, kv)), kv)


def test_truncated_and_corrupt_entries_are_refused(layout):
    meta, kv = block(layout)
    data = encode_entry(layout, meta, kv)
    for cut in (0, 10, 100, len(data) // 2, len(data) - 1):
        assert rejected(layout, meta, data[:cut]) == "truncated"
    assert rejected(layout, meta, data + b"x") == "truncated"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01  # inside the KV payload
    assert rejected(layout, meta, bytes(flipped)) == "corrupt"
    assert rejected(layout, meta, b"XXXX" + data[4:]) == "format"


def test_other_format_and_other_model_are_refused(layout):
    meta, kv = block(layout)
    data = encode_entry(layout, meta, kv)
    assert rejected(dataclasses.replace(layout, kv_dtype="float16"), meta, data) == "format"
    assert rejected(dataclasses.replace(layout, layout_version=2), meta, data) == "format"
    assert rejected(dataclasses.replace(layout, num_kv_heads=1, head_dim=16), meta, data) == "format"
    assert rejected(dataclasses.replace(layout, model_id="other@def"), meta, data) == "model"
    assert rejected(dataclasses.replace(layout, weight_format="float32/Q4_1Weight"), meta, data) == "model"


def test_another_block_under_the_key_is_a_collision(layout):
    meta, kv = block(layout)
    data = encode_entry(layout, meta, kv)
    for other in (
        dataclasses.replace(meta, token_ids=(5, 6, 7, 9)),
        dataclasses.replace(meta, parent_hash=b"\x08" * 32),
        dataclasses.replace(meta, parent_hash=None),
        dataclasses.replace(meta, extra_keys=("tiny-model@abc", "tenant-b")),
        dataclasses.replace(meta, block_hash=b"\x09" * 32),
    ):
        assert rejected(layout, other, data) == "collision"


def test_keys_differ_by_model_layout_and_hash(layout):
    h = b"\x01" * 32
    keys = {
        layout.tier_key(h),
        layout.tier_key(b"\x02" * 32),
        dataclasses.replace(layout, model_id="other").tier_key(h),
        dataclasses.replace(layout, block_size=8).tier_key(h),
        dataclasses.replace(layout, kv_dtype="bfloat16").tier_key(h),
    }
    assert len(keys) == 5
    assert layout.tier_key(h) == dataclasses.replace(layout).tier_key(h)


def test_encode_checks_its_input(layout):
    meta, kv = block(layout)
    with pytest.raises(ValueError, match="is not"):
        encode_entry(layout, meta, kv[:1])
    with pytest.raises(ValueError, match="tokens"):
        encode_entry(layout, dataclasses.replace(meta, token_ids=(1, 2)), kv)


def test_entry_meta_reads_the_claimed_identity(layout):
    meta, kv = block(layout)
    assert entry_meta(encode_entry(layout, meta, kv)) == meta
    first = dataclasses.replace(meta, parent_hash=None, extra_keys=("m", "", 3, None, b"x", (1.5, True)))
    assert entry_meta(encode_entry(layout, first, kv)) == first
    assert entry_meta(b"nope") is None and entry_meta(encode_entry(layout, meta, kv)[:70]) is None
