"""Tests of ``rules.segments``: segment levels, segment boundaries (documents, history, volatile tail) and the
stable prefix material."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rules import SegmentLevel, load_ruleset
from rules.segments import (
    _DOC_OPEN,
    LEVEL_NAMES,
    Position,
    Segment,
    document_end,
    document_end_in_text,
    may_open_document,
    stable_material,
)


def test_segment_levels_are_the_numbers_1_to_4_in_prompt_order() -> None:
    assert [int(level) for level in SegmentLevel] == [1, 2, 3, 4]
    assert SegmentLevel.TOOLS_SYSTEM < SegmentLevel.DOCUMENTS < SegmentLevel.HISTORY < SegmentLevel.VOLATILE
    assert SegmentLevel.HISTORY == 3 and SegmentLevel(4) is SegmentLevel.VOLATILE
    assert [LEVEL_NAMES[level] for level in SegmentLevel] == [
        "tools+system",
        "documents",
        "history",
        "volatile",
    ]
    with pytest.raises(ValueError):
        SegmentLevel(5)


def test_segments_carry_their_level_and_serialize_it_as_a_plain_number() -> None:
    canon = load_ruleset([]).apply([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])
    assert [type(s.level) for s in canon.segments] == [SegmentLevel, SegmentLevel]
    dumped = canon.to_dict()["segments"]
    assert [d["level"] for d in dumped] == [1, 4] and all(type(d["level"]) is int for d in dumped)
    assert json.loads(json.dumps(dumped))[0] == {**dumped[0], "level": 1}
    segment = Segment.between(SegmentLevel.HISTORY, Position(0), Position(1))
    assert (segment.level, segment.name) == (SegmentLevel.HISTORY, "history")


def test_stable_material_accepts_a_level_or_its_number() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q"},
    ]
    segments = load_ruleset([]).apply(messages).segments
    system_only = stable_material(messages, None, segments, SegmentLevel.TOOLS_SYSTEM)
    assert system_only == stable_material(messages, None, segments, 1)
    assert b'"A"' not in system_only and b'"A"' in stable_material(messages, None, segments)
    assert b'"Q"' not in stable_material(messages, None, segments, SegmentLevel.VOLATILE)


def test_segments_for_single_turn_rag_and_tools_only() -> None:
    ruleset = load_ruleset(["default"])
    canon = ruleset.apply(
        [{"role": "user", "content": "<document>Doc</document>\nQ?"}],
        [{"type": "function", "function": {"name": "f"}}],
    )
    assert [(s.level, s.start_message, s.end_message, s.end_part, s.end_char) for s in canon.segments] == [
        (SegmentLevel.TOOLS_SYSTEM, 0, 0, None, None),
        (SegmentLevel.DOCUMENTS, 0, 1, 0, len("<document>Doc</document>")),
        (SegmentLevel.VOLATILE, 0, 1, None, None),
    ]
    assert json.loads(canon.stable_prefix_material()) == {
        "messages": [{"content": "<document>Doc</document>", "role": "user"}],
        "tools": [{"function": {"name": "f"}, "type": "function"}],
    }
    everything_stable = ruleset.apply(
        [{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]
    )
    assert [s.level for s in everything_stable.segments] == [SegmentLevel.TOOLS_SYSTEM, SegmentLevel.HISTORY]
    assert everything_stable.stable_end.message == 2


def test_list_content_documents_and_block(tmp_path: Path) -> None:
    ruleset = load_ruleset(["default"])
    messages = [
        {"role": "system", "content": "S\nCurrent date: 2025-05-14"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<documents><document>A</document>"},
                {"type": "text", "text": "<document>B</document></documents>"},
                {"type": "text", "text": "Which is longer?"},
            ],
        },
    ]
    canon = ruleset.apply(messages)
    # the block goes into the question's text part, as it would into a string content
    assert canon.messages[1]["content"][2:] == [
        {
            "type": "text",
            "text": "<request_context>\nCurrent date: 2025-05-14\n</request_context>\n\nWhich is longer?",
        }
    ]
    docs = canon.segments[1]
    assert (docs.level, docs.end_message, docs.end_part, docs.end_char) == (SegmentLevel.DOCUMENTS, 2, 2, 0)
    material = json.loads(canon.stable_prefix_material())
    assert len(material["messages"][1]["content"]) == 2
    assert ruleset.apply(canon.messages).messages == canon.messages


_TAG_ALPHABET = "<>/ dDoOcCuUmMeEnNtTsSſKk\u212a\u0130x\n"
"""Characters of the document tags, their case variants (long s, Kelvin sign, dotted I: RE2 folds some of them)
and a few others."""


@given(st.text(alphabet=_TAG_ALPHABET, max_size=40))
def test_the_document_prefilter_never_hides_an_opening_tag(text: str) -> None:
    # may_open_document stands in front of _DOC_OPEN's search: False must mean RE2 finds nothing
    if _DOC_OPEN.search(text) is not None:
        assert may_open_document(text)
    if not may_open_document(text):
        assert document_end_in_text(text) == 0
        assert document_end({"role": "user", "content": [{"type": "text", "text": text}]}) is None


def test_the_document_prefilter_passes_every_tag_spelling() -> None:
    for tag in ("<doc>", "<DOC>", "<Document>", "<documents id=1>", "<dOcUmEnTs>"):
        text = f"before {tag}body</doc> after"
        assert may_open_document(text) and _DOC_OPEN.search(text) is not None
        assert document_end_in_text(text) == len(f"before {tag}body</doc>")
    assert not may_open_document("no tags <request_context> here </docs>")
    assert document_end_in_text("no tags <request_context> here </doc>") == 0


def test_a_block_an_earlier_turn_holds_is_history_in_the_turn_segments() -> None:
    # Stateless (no transcript memory, or a conversation it does not hold): the first turn's block holds this
    # request's time, so the prefix key's segments end the stable prefix before it; the turns' segments, which
    # the miss explanation takes, keep it in the history the cache could have served.
    ruleset = load_ruleset(["default"])
    system = {"role": "system", "content": "You are terse. Current time: 05:01:11"}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    canon = ruleset.apply([system, *turns, {"role": "user", "content": "Bye"}])
    assert canon.messages[1]["content"].startswith("<request_context>\nCurrent time: 05:01:11")
    assert [s.name for s in canon.segments] == ["tools+system", "volatile"]
    assert canon.stable_end == Position(1)
    assert canon.turn_segments is not None
    assert [s.name for s in canon.turn_segments] == ["tools+system", "history", "volatile"]
    assert canon.turn_stable_end == Position(3)
    single = ruleset.apply([system, turns[0]])  # one turn: its block starts its tail either way
    assert single.turn_segments is None and single.turn_stable_end == single.stable_end == Position(1)


def test_an_agent_turn_of_tool_results_is_the_volatile_tail_and_the_reply_that_called_is_history() -> None:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(3)
    ]
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": calls[:1]},
        {"role": "tool", "tool_call_id": "c0", "content": "r0"},
        {"role": "assistant", "content": None, "tool_calls": calls[1:]},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
    ]
    canon = load_ruleset(["default"]).apply(messages)
    assert [(s.level, s.start_message, s.end_message) for s in canon.segments] == [
        (SegmentLevel.TOOLS_SYSTEM, 0, 1),
        (SegmentLevel.HISTORY, 1, 5),
        (SegmentLevel.VOLATILE, 5, 7),
    ]
    # a user message after the tool results is the newest input again
    asked = load_ruleset(["default"]).apply(messages + [{"role": "user", "content": "and?"}])
    assert [(s.level, s.start_message) for s in asked.segments][-1] == (SegmentLevel.VOLATILE, 7)
