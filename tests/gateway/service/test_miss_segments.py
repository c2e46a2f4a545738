"""gateway.service.miss_segments: the segment holding an offset, the segments a divergence names, segments that
do not tile the prompt refused by name, and re-convergence after an edit."""

from __future__ import annotations

from array import array

import pytest

from gateway.service.miss_explanation import MissExplainError, PromptSegment
from gateway.service.miss_segments import (
    divergence_segments,
    rejoins,
    segment_at,
    segment_end,
    validated_segments,
)

SEGS = (
    PromptSegment("tools", 0, 4),
    PromptSegment("system", 4, 10),
    PromptSegment("history", 10, 10),  # empty: never holds a token
    PromptSegment("tail", 10, 14),
)


def test_segment_at_and_end() -> None:
    assert [segment_at(SEGS, i) for i in (0, 3, 4, 9, 10, 13)] == ["tools"] * 2 + ["system"] * 2 + [
        "tail"
    ] * 2
    assert segment_at(SEGS, 14) == "tail" and segment_at((), 0) == "tail"
    assert segment_end(SEGS, 5) == 10 and segment_end(SEGS, 10) == 14
    assert segment_end(SEGS, 99) == 99  # past every segment: the offset itself


def test_validated_segments_tile_the_prompt() -> None:
    assert validated_segments(iter(SEGS), 14) == SEGS
    assert validated_segments((), 5) == ()
    with pytest.raises(
        MissExplainError, match=r"segments\[1\] must start where the previous one ended \(4\)"
    ):
        validated_segments((PromptSegment("tools", 0, 4), PromptSegment("system", 5, 9)), 9)
    with pytest.raises(MissExplainError, match=r"segments\[0\] must be a PromptSegment named one of"):
        validated_segments((PromptSegment("preamble", 0, 4),), 4)
    with pytest.raises(MissExplainError, match="must cover the prompt's 15 tokens"):
        validated_segments(SEGS, 15)


def test_divergence_segments_leave_out_tools_when_the_tools_are_the_same() -> None:
    old = (PromptSegment("tools", 0, 6), PromptSegment("tail", 6, 9))
    assert divergence_segments(SEGS, old, 5, same_tools=False) == {"system", "tools"}
    assert divergence_segments(SEGS, old, 5, same_tools=True) == {"system"}
    # both prompts say tools at the divergence: the segment the new prompt's tools lead into names it
    assert divergence_segments(SEGS, old, 2, same_tools=True) == {"system"}
    assert divergence_segments(SEGS, old, 2, same_tools=False) == {"tools"}


def test_rejoins_after_an_edit_inside_the_segment_only() -> None:
    shared = list(range(100, 140))
    old = array("I", [1, 2, 3, 7, *shared])
    new = array("I", [1, 2, 3, 8, 9, *shared])  # one token edited into two, the same text after it
    segs_old = (PromptSegment("system", 0, len(old)),)
    segs_new = (PromptSegment("system", 0, len(new)),)
    assert rejoins(new, old, 3, segs_new, segs_old, max_edit_tokens=8)
    assert not rejoins(new, old, 3, segs_new, segs_old, max_edit_tokens=0)  # the edit is longer than allowed
    # the same tokens after the divergence, but in the next segment (a new system prompt, the same question)
    split_new = (PromptSegment("system", 0, 5), PromptSegment("tail", 5, len(new)))
    split_old = (PromptSegment("system", 0, 4), PromptSegment("tail", 4, len(old)))
    assert not rejoins(new, old, 3, split_new, split_old, max_edit_tokens=8)


def test_a_system_prompt_edited_at_its_end_rejoins_in_the_conversation_after_it() -> None:
    # The trial: "You are a terse assistant. Request id: req-0abc0" then "... req-1abc1" (the id at the end of the
    # system prompt, inside the first cache unit), the conversation resent after it, said "miss=cold".
    system = [1, 2, 3, 4]
    turn = list(range(100, 120))  # the first user message (its hoisted block included) and the answer
    old = array("I", [*system, 7, *turn])
    new = array("I", [*system, 8, *turn, 200, 201])
    segs_old = (PromptSegment("system", 0, 5), PromptSegment("tail", 5, 15), PromptSegment("history", 15, 25))
    segs_new = (PromptSegment("system", 0, 5), PromptSegment("history", 5, 25), PromptSegment("tail", 25, 27))
    assert rejoins(new, old, 4, segs_new, segs_old, max_edit_tokens=8)
    # a first turn (no history in the new prompt): a new system prompt, the same question, never an edit
    first_new = (PromptSegment("system", 0, 5), PromptSegment("tail", 5, len(new)))
    assert not rejoins(new, old, 4, first_new, segs_old, max_edit_tokens=8)
    # nor does a conversation whose history merely shares a few template tokens with the earlier prompt
    other = array("I", [*system, 8, *turn[:6], *range(300, 314), 200, 201])
    assert not rejoins(other, old, 4, segs_new, segs_old, max_edit_tokens=8)
    # a whole new system prompt before the same conversation: a new prompt, not an edit of its end
    long_old = array("I", [*system, *range(500, 530), *turn])
    long_new = array("I", [*system, *range(600, 630), *turn, 200, 201])
    segs_long_old = (
        PromptSegment("system", 0, 34),
        PromptSegment("tail", 34, 44),
        PromptSegment("history", 44, 54),
    )
    segs_long_new = (
        PromptSegment("system", 0, 34),
        PromptSegment("history", 34, 54),
        PromptSegment("tail", 54, 56),
    )
    assert not rejoins(long_new, long_old, 4, segs_long_new, segs_long_old, max_edit_tokens=64)
