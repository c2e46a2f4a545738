"""The transcript entry's stored form (``rules.transcript_entry``): framed version 2, version 1 still read,
broken bytes refused, and a conversation's entries compressed from their new messages only."""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest

from rules import load_ruleset
from rules.transcript import InProcessTranscriptStore, TranscriptMemory
from rules.transcript_entry import ENTRY_MAGIC, TranscriptEntry, decode_entry, frame, framed

MESSAGES = [
    {"role": "system", "content": "You are Atlas. Ünïcode kept: “quotes”."},
    {"content": "key order kept", "role": "user"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
]


def test_an_entry_decodes_to_itself_with_its_message_frames() -> None:
    entry = TranscriptEntry(MESSAGES, ["2026-12-01"])
    data = entry.encode()
    assert data.startswith(ENTRY_MAGIC)
    found = decode_entry(data)
    assert found is not None and found.entry == entry
    assert [list(m) for m in found.entry.messages] == [list(m) for m in MESSAGES]  # key order
    start, end = found.message_frames
    assert data[start:end] == frame(json.dumps(MESSAGES, separators=(",", ":"), ensure_ascii=False)[1:-1])
    assert TranscriptEntry.decode(TranscriptEntry([], []).encode()) == TranscriptEntry([], [])


def test_any_framing_of_the_same_messages_decodes_to_the_same_entry() -> None:
    pieces = [json.dumps(m, separators=(",", ":"), ensure_ascii=False) for m in MESSAGES]
    frames = frame(pieces[0]) + frame("," + pieces[1]) + frame("," + pieces[2])
    data, at = framed(["v"], frames)
    assert data[at[0] : at[1]] == frames
    assert TranscriptEntry.decode(data) == TranscriptEntry(MESSAGES, ["v"])


def test_a_version_1_entry_written_by_an_older_gateway_is_still_read() -> None:
    body = {"v": 1, "messages": MESSAGES, "present": ["x"]}
    data = zlib.compress(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(), 1)
    found = decode_entry(data)
    assert found is not None and found.entry == TranscriptEntry(MESSAGES, ["x"])
    assert found.message_frames is None


def _bad_entries() -> list[bytes]:
    good = TranscriptEntry(MESSAGES, ["v"]).encode()
    head_len = int.from_bytes(good[4:8], "big")
    return [
        b"",
        b"not zlib",
        ENTRY_MAGIC,  # no frames
        ENTRY_MAGIC + frame('{"v":2,"present":[],"messages":[]}'),  # one frame: no head and tail
        good[:-3],  # the last frame cut short
        good[:6],  # a length cut short
        good[: 8 + head_len] + (10**6).to_bytes(4, "big") + good[8 + head_len + 4 :],  # a length past the end
        good[:8] + bytes([good[8] ^ 0xFF]) + good[9:],  # a frame that is not zlib
        ENTRY_MAGIC
        + (5).to_bytes(4, "big")
        + zlib.compress(b"{", 1)[:5],  # a frame that is not a whole stream
        ENTRY_MAGIC + frame('{"v":1,"present":[],"messages":[') + frame("]}"),  # version 1 framed
        framed([], frame('"not a message"'))[0],
        zlib.compress(json.dumps({"v": 2, "messages": [], "present": []}).encode()),  # version 2 unframed
        zlib.compress(b'{"v":1,"messages":[],"present":[1]}'),
    ]


@pytest.mark.parametrize("data", _bad_entries())
def test_bytes_that_are_not_an_entry_are_refused_without_raising(data: bytes) -> None:
    assert decode_entry(data) is None
    assert TranscriptEntry.decode(data) is None


def _conversation(turns: int, tool_result: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are Forge, a coding agent."},
        {"role": "user", "content": "Fix the failing test."},
    ]
    for t in range(turns):
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": f"c{t}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": f"c{t}", "content": f"{tool_result} #{t}"},
        ]
    return messages


def test_a_resent_conversation_compresses_only_its_new_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    compressed: list[int] = []
    real = zlib.compress

    def counting(data: bytes, level: int = -1) -> bytes:
        compressed.append(len(data))
        return real(data, level)

    monkeypatch.setattr("rules.transcript_entry.zlib.compress", counting)
    ruleset = load_ruleset(["default"])
    store = InProcessTranscriptStore()
    memory = TranscriptMemory(store)
    result = "line of a large tool result\n" * 150  # ~4 kB per turn
    previous: bytes | None = None
    for turns in range(12):
        compressed.clear()
        ruleset.apply(_conversation(turns, result), memory=memory, scope="m\0t")
        values = [value for value, _ in store._data.values()]
        data = values[-1]
        found = decode_entry(data)
        assert found is not None and found.message_frames is not None
        if previous is not None:
            # the previous entry's message frames, byte for byte, then one frame of this request's new messages
            before = decode_entry(previous)
            assert before is not None and before.message_frames is not None
            old_frames = previous[before.message_frames[0] : before.message_frames[1]]
            assert data[found.message_frames[0] :].startswith(old_frames)
            # zlib ran on the head and the new turn (one tool call and its ~4 kB result); the tail is fixed
            assert len(compressed) == 2 and max(compressed) < len(result) + 400
        previous = data
    # and another process (no memo of decoded entries) goes on from the stored bytes the same way
    other = TranscriptMemory(store)
    compressed.clear()
    out = ruleset.apply(_conversation(12, result), memory=other, scope="m\0t")
    assert out.history.reused_turns > 0
    assert len(compressed) == 2 and max(compressed) < len(result) + 400


def test_history_memo_keys_tell_every_two_different_messages_apart() -> None:
    from rules.history_memo import raw_items

    messages = [
        {"role": "user", "content": "x"},
        {"content": "x", "role": "user"},  # another key order: another message as sent
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
        {"role": "tool", "tool_call_id": "c2", "content": "x"},
        {"role": "user", "content": 1},
        {"role": "user", "content": 1.0},
        {"role": "user", "content": True},
        {"role": "user", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
    ]
    keys = raw_items(messages)
    assert keys is not None and len(set(keys)) == len(messages)
    # all-string messages are keyed by their items (no JSON encoding of a large tool result per request)
    assert keys[2] == (("role", "tool"), ("tool_call_id", "c1"), ("content", "x"))
    assert raw_items([{"role": "user", "content": {1, 2}}]) is None  # not JSON data
