"""``rules.message_json``: the memoized texts are the encoders' texts, the memo holds only what it may, stays
bounded, and its users (the transcript keys and entries, the prefix material) give the bytes they gave
without it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rules.message_json as mj
from rules.actions import canonical_json
from rules.message_json import canonical_message_json, clear_memos, compact_message_json, memo_sizes
from rules.segments import Position, Segment, SegmentLevel, message_prefix, stable_material
from rules.transcript import (
    KEY_BYTES,
    InProcessTranscriptStore,
    PrefixHasher,
    TranscriptEntry,
    TranscriptMemory,
)

LONG = "You are a helpful assistant. " * 20  # over MEMO_MIN_CHARS


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.fixture(autouse=True)
def _empty_memos() -> None:
    clear_memos()


json_atoms = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text()
)
json_values = st.recursive(
    json_atoms,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": st.text(max_size=600)}),
    st.fixed_dictionaries({"content": st.text(max_size=600), "role": st.sampled_from(["system", "user"])}),
    st.dictionaries(st.text(max_size=5), json_values, max_size=3),
)


@settings(max_examples=300)
@given(st.lists(messages, max_size=6))
def test_the_texts_are_the_encoders_texts_first_and_second_time(values: list[dict[str, Any]]) -> None:
    for _ in range(2):
        for message in values:
            assert canonical_message_json(message) == canonical_json(message)
            assert compact_message_json(message) == _compact(message)


def test_a_long_two_string_message_is_memoized_and_equal_messages_share_the_entry() -> None:
    message = {"role": "system", "content": LONG}
    first = canonical_message_json(message)
    again = canonical_message_json({"role": "system", "content": "".join(LONG)})
    assert again is first
    assert memo_sizes() == (1, 0)
    swapped = {"content": LONG, "role": "system"}
    assert compact_message_json(swapped) == _compact(swapped) != compact_message_json(message)
    assert memo_sizes() == (1, 2)


class _Str(str):
    """A ``str`` subclass: equal to plain strings, but not what the memo keys on."""


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "short question"},
        {"role": "user", "content": [{"type": "text", "text": LONG}]},
        {"role": "user", "content": LONG, "name": "x"},
        {"role": "user", "content": None},
        {"role": _Str("user"), "content": LONG},
        {"role": "user", "content": _Str(LONG)},
    ],
)
def test_other_messages_are_encoded_each_time(message: dict[str, Any]) -> None:
    assert canonical_message_json(message) == canonical_json(message)
    assert compact_message_json(message) == _compact(message)
    assert memo_sizes() == (0, 0)


def test_the_memo_is_cleared_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mj, "MEMO_ENTRIES", 3)
    for i in range(7):
        message = {"role": "user", "content": f"{i} {LONG}"}
        assert canonical_message_json(message) == canonical_json(message)
        assert 1 <= memo_sizes()[0] <= 3
    monkeypatch.setattr(mj, "MEMO_ENTRIES", 1_000)
    monkeypatch.setattr(mj, "MEMO_CHARS", len(canonical_json({"role": "user", "content": LONG})) * 2)
    clear_memos()
    for i in range(5):
        canonical_message_json({"role": "user", "content": f"{i} {LONG}"})
        assert 1 <= memo_sizes()[0] <= 2


def _reference_material(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, end: Position
) -> bytes:
    """``stable_material``'s bytes as they were computed before the memo (one ``canonical_json`` call)."""
    return canonical_json({"messages": message_prefix(messages, end), "tools": tools}).encode("utf-8")


@pytest.mark.parametrize(
    ("end", "tools"),
    [
        (Position(0), None),
        (Position(1), None),
        (
            Position(2),
            [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": [2.5, None]}}}],
        ),
        (Position(1, 0, 5), None),
        (Position(2, 1, 3), None),
        (Position(2, 1, 0), []),
    ],
)
def test_stable_material_is_the_one_call_encoding(end: Position, tools: list[dict[str, Any]] | None) -> None:
    messages = [
        {"role": "system", "content": LONG},
        {"role": "user", "content": "<doc>é ünïcode</doc> and more"},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two three"}]},
    ]
    segments = [Segment.between(SegmentLevel.TOOLS_SYSTEM, Position(0), end)]
    for _ in range(2):  # the second time from the memo
        assert stable_material(messages, tools, segments, SegmentLevel.TOOLS_SYSTEM) == _reference_material(
            messages, tools, end
        )


def test_transcript_keys_and_entries_are_the_bytes_of_the_plain_encoders() -> None:
    messages = [
        {"role": "system", "content": LONG},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi " * 100},
        {"content": LONG, "role": "user"},
    ]
    reference = hashlib.blake2b(digest_size=KEY_BYTES, person=b"pg-transcript-1")
    for text in ("scope", "null", *(canonical_json(m) for m in messages)):
        data = text.encode("utf-8")
        reference.update(len(data).to_bytes(8, "big"))
        reference.update(data)
    for _ in range(2):
        assert PrefixHasher("scope", None).keys(messages, [len(messages)]) == [reference.digest()]
    store = InProcessTranscriptStore()
    memory = TranscriptMemory(store)
    for _ in range(2):
        memory.remember_after(b"k" * KEY_BYTES, messages, ["v"], None)
        assert store.get_many([b"k" * KEY_BYTES]) == [TranscriptEntry(messages, ["v"]).encode()]
