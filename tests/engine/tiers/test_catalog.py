"""The prefix catalog: records by prefix key, filters, refresh keeps a pin, bounded with pinned records kept."""

from __future__ import annotations

import pytest

from engine.kv_tiers.catalog import PrefixCatalog, PrefixRecord, decode_record, encode_record


def rec(key: str, tenant: str = "", model: str = "m", pin: str | None = None) -> PrefixRecord:
    return PrefixRecord(key, model, tenant, "system", [b"h"], 4, 0.0, pin)


def test_select_by_key_tenant_and_model():
    cat = PrefixCatalog()
    cat.record(rec("a", "t1"))
    cat.record(rec("b", "t2"))
    cat.record(rec("c", "t1", model="other"))
    assert [r.prefix_key for r in cat.select(tenant="t1")] == ["a", "c"]
    assert [r.prefix_key for r in cat.select(model_id="m")] == ["a", "b"]
    assert [r.prefix_key for r in cat.select(prefix_key="b", tenant="t2")] == ["b"]
    assert cat.select(prefix_key="b", tenant="t1") == []
    assert len(cat.select()) == 3 and cat.get("a").num_tokens == 4
    assert cat.remove("a").prefix_key == "a" and cat.get("a") is None


def test_refresh_keeps_the_pin_and_the_bound_keeps_pinned_records():
    cat = PrefixCatalog(max_entries=2)
    cat.record(rec("p", pin="pin-1"))
    cat.record(rec("p"))  # a later request on the same prefix
    assert cat.get("p").pin_id == "pin-1"
    assert cat.record(rec("x")) == []
    evicted = cat.record(rec("y"))  # over the bound: the oldest unpinned record goes, the pinned one stays
    assert [r.prefix_key for r in evicted] == ["x"]  # returned, for the tiers to forget it too
    assert [r.prefix_key for r in cat.select()] == ["p", "y"]
    with pytest.raises(ValueError):
        PrefixCatalog(0)


def test_a_record_round_trips_through_its_tier_bytes_without_its_pin():
    rec = PrefixRecord("pk", "m@1", "acme", "documents", [b"\x01" * 32, b"\x02" * 32], 32, 1234.5, "pin-3")
    back = decode_record(encode_record(rec))
    assert back == PrefixRecord(
        "pk", "m@1", "acme", "documents", [b"\x01" * 32, b"\x02" * 32], 32, 1234.5, None
    )


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"v": 2}',
        b"PGKV" + bytes(60),  # a block entry's magic, not a record
        b'{"v":1,"prefix_key":"k","model_id":"m","tenant":"","level":"system","block_hashes":["zz"],"num_tokens":16,"last_use":1}',
        b'{"v":1,"prefix_key":"k","model_id":"m","tenant":"","level":"system","block_hashes":[],"num_tokens":true,"last_use":1}',
        b'{"v":1,"prefix_key":3,"model_id":"m","tenant":"","level":"system","block_hashes":[],"num_tokens":0,"last_use":1}',
        b'{"v":1,"prefix_key":"k","model_id":"m","tenant":"","level":"system","block_hashes":"ab","num_tokens":0,"last_use":1}',
    ],
)
def test_bytes_that_are_not_a_record_decode_to_none(data):
    assert decode_record(data) is None
