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
