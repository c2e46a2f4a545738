"""Client cache markers are invisible to the rules (``rules.cache_markers``): a conversation whose client moves
its ``cache_control`` marker to the newest message every turn (Anthropic's documented pattern, Claude Code's)
keeps its history byte-identical, with the markers exactly where the client put them."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rules import load_ruleset
from rules.cache_markers import MARKER, restore_markers, take_markers
from rules.placement import BLOCK_OPEN
from rules.transcript import TranscriptMemory

DEFAULT = load_ruleset(["default"])
EPHEMERAL = {"type": "ephemeral"}
SYSTEM = "You are the build assistant of Acme. Answer briefly and cite files.\nCurrent time: 2026-12-06 10:{minute:02d}:00"


def unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return take_markers(copy.deepcopy(messages))[0]


def marks(messages: list[dict[str, Any]]) -> list[tuple[int, int | None]]:
    """Where the markers are: (message, part) or (message, None) for a message's own."""
    out: list[tuple[int, int | None]] = []
    for i, message in enumerate(messages):
        if MARKER in message:
            out.append((i, None))
        if isinstance(message.get("content"), list):
            out += [(i, j) for j, part in enumerate(message["content"]) if MARKER in part]
    return out


def moving_marker(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request as the client sends it: its marker on the newest message's last block only."""
    sent = copy.deepcopy(history)
    newest = sent[-1]
    if isinstance(newest["content"], list):
        newest["content"][-1][MARKER] = EPHEMERAL
    else:
        newest[MARKER] = EPHEMERAL
    return sent


@pytest.mark.parametrize("with_memory", [True, False])
def test_a_moving_marker_keeps_history_byte_identical(with_memory) -> None:
    """The fresh-user trial's case: with the marker moved each turn, the first user message went from a block
    part beside the marked part to one merged part, and (the memory's key naming the marker) took the newest
    time: every turn missed the whole conversation at the provider."""
    memory = TranscriptMemory() if with_memory else None
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Why did CI fail?"}]}
    ]
    previous: list[dict[str, Any]] | None = None
    for turn in range(5):
        minute = turn if with_memory else 0  # stateless, only a value that did not change keeps the bytes
        request = [{"role": "system", "content": SYSTEM.format(minute=minute)}, *moving_marker(history)]
        canon = DEFAULT.apply(request, memory=memory, scope="s")
        assert marks(canon.messages) == [(len(canon.messages) - 1, 0)]  # the client's, and only it
        bare = unmarked(canon.messages)
        if previous is not None:
            assert bare[: len(previous)] == previous
        assert "10:00:00" in str(bare[1])  # the first turn keeps the time it was sent with
        previous = bare
        history += [
            {"role": "assistant", "content": [{"type": "text", "text": f"Answer {turn}."}]},
            {"role": "user", "content": [{"type": "text", "text": f"Follow-up {turn}?"}]},
        ]


def test_the_same_turn_is_the_same_bytes_with_or_without_a_marker() -> None:
    memory = TranscriptMemory()
    first = [
        {"role": "system", "content": SYSTEM.format(minute=0)},
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
    ]
    marked = copy.deepcopy(first)
    marked[1]["content"][0][MARKER] = EPHEMERAL
    a = DEFAULT.apply(first, memory=memory, scope="a").messages
    b = DEFAULT.apply(marked, memory=memory, scope="b").messages
    assert unmarked(b) == a and marks(b) == [(1, 0)]


def test_an_agent_loop_with_moving_tool_result_markers_reuses_its_history() -> None:
    """Tool results carry their marker on the tool message (the Anthropic face's ``tool_result``): each turn
    marks the newest result only, and the time changes every turn."""
    memory = TranscriptMemory()
    history: list[dict[str, Any]] = [{"role": "user", "content": "List the failing tests."}]
    previous: list[dict[str, Any]] | None = None
    for turn in range(4):
        request = [{"role": "system", "content": SYSTEM.format(minute=turn)}, *moving_marker(history)]
        canon = DEFAULT.apply(request, memory=memory, scope="s")
        bare = unmarked(canon.messages)
        if previous is not None:
            assert bare[: len(previous)] == previous
            assert canon.history.reused_turns == turn
        newest_marks = marks(canon.messages)
        assert len(newest_marks) == 1 and canon.messages[newest_marks[0][0]]["role"] == history[-1]["role"]
        previous = bare
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "run", "arguments": "{}"}}
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"test_{turn} failed\n" * 200},
        ]


def test_markers_never_land_on_a_block_the_rules_inserted() -> None:
    """A block of its own (beside an empty part) and a ``note`` message (``before_last_user``) are the rules';
    the client's markers stay on the client's parts."""
    note = load_ruleset(["default"], placement="before_last_user")
    request = [
        {"role": "system", "content": SYSTEM.format(minute=3)},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "", MARKER: EPHEMERAL},
                {"type": "text", "text": "go", MARKER: EPHEMERAL},
            ],
        },
    ]
    for ruleset in (DEFAULT, note):
        canon = ruleset.apply(request)
        for i, j in marks(canon.messages):
            assert j is not None and BLOCK_OPEN not in canon.messages[i]["content"][j]["text"]
        assert [canon.messages[i]["content"][j]["text"] for i, j in marks(canon.messages)] == ["", "go"]
        assert any(BLOCK_OPEN in str(m["content"]) for m in canon.messages)


def test_take_markers_copies_only_what_held_one() -> None:
    plain = {"role": "user", "content": [{"type": "text", "text": "a"}]}
    marked_part = {"type": "text", "text": "b", MARKER: EPHEMERAL}
    tool = {"role": "tool", "tool_call_id": "t", "content": "r", MARKER: {"type": "ephemeral", "ttl": "1h"}}
    messages = [plain, {"role": "user", "content": [{"type": "text", "text": "x"}, marked_part]}, tool]
    bare, markers = take_markers(messages)
    assert bare[0] is plain and bare[1]["content"][0] is messages[1]["content"][0]
    assert MARKER in marked_part and MARKER in tool  # the request is not changed
    assert markers.on_parts == {(1, 1): EPHEMERAL} and markers.on_messages == {
        2: {"type": "ephemeral", "ttl": "1h"}
    }
    assert take_markers([plain])[0] == [plain] and not take_markers([plain])[1]


def test_restore_refuses_messages_that_do_not_match_and_changes_nothing() -> None:
    request = [
        {"role": "user", "content": [{"type": "text", "text": "a", MARKER: EPHEMERAL}]},
        {"role": "assistant", "content": "b"},
    ]
    bare, markers = take_markers(request)
    for canonical in (
        [{"role": "user", "content": [{"type": "text", "text": "a"}]}],  # a message short
        [{"role": "assistant", "content": "b"}, {"role": "user", "content": "a"}],  # roles out of order
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}, request[1]],
    ):
        before = copy.deepcopy(canonical)
        assert not restore_markers(bare, canonical, markers)
        assert canonical == before
    stored_as_string = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert restore_markers(bare, stored_as_string, markers)
    assert stored_as_string[0]["content"] == [{"type": "text", "text": "a", MARKER: EPHEMERAL}]
