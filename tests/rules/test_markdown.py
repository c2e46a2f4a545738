"""Code-block tracking (``rules.markdown``) and whitespace normalization that leaves code and hard breaks alone."""

from __future__ import annotations

import pytest

from rules import load_ruleset
from rules.actions import normalize_text
from rules.markdown import code_ranges, fenced_code_ranges, indented_code_ranges
from rules.model import NormalizeOptions
from tests.rules.helpers import chat

DEFAULT = load_ruleset(["default"])


def _spans(text: str, ranges: list[tuple[int, int]]) -> list[str]:
    return [text[s:e] for s, e in ranges]


def test_a_fence_nested_in_a_fence_closes_in_order_and_later_rules_still_run() -> None:
    example = "```markdown\nExample:\n```python\nprint(1)\n```\n```\n"
    text = example + "Current date: 2025-03-04\nThe end."
    assert _spans(text, fenced_code_ranges(text)) == [example]
    canon = DEFAULT.apply(chat(text))
    assert canon.hoisted == ["Current date: 2025-03-04"]
    assert canon.messages[0]["content"] == example + "The end."


def test_a_longer_outer_fence_holds_shorter_inner_fences() -> None:
    block = "````markdown\n```python\nts = 1\n```\n````\n"
    text = block + "after"
    assert _spans(text, fenced_code_ranges(text)) == [block]


@pytest.mark.parametrize("indent", ["    ", "  ", "\t", "      "])
def test_indented_fences_open_and_close(indent: str) -> None:
    block = f"{indent}```python\n{indent}def f():\n{indent}    return 1\n{indent}```\n"
    text = "1. Write it:\n\n" + block + "\nCurrent date: 2025-03-04"
    assert _spans(text, fenced_code_ranges(text)) == [block]
    assert DEFAULT.apply(chat(text)).hoisted == ["Current date: 2025-03-04"]


def test_a_prompt_wrapped_whole_in_a_prose_fence_gets_its_rules() -> None:
    for opening in ("```", "```markdown", "~~~text", "````"):
        closing = opening[: len(opening) - len(opening.lstrip("`~"))]
        inner = "You are a shell assistant.\nCurrent date: 2025-03-04\nUser's name: Ann Lee\nBe careful."
        text = f"{opening}\n{inner}\n{closing}"
        assert fenced_code_ranges(text) == []
        canon = DEFAULT.apply(chat(text))
        assert canon.hoisted == ["Current date: 2025-03-04", "User's name: Ann Lee"]
        assert (
            canon.messages[0]["content"] == f"{opening}\nYou are a shell assistant.\nBe careful.\n{closing}"
        )


def test_a_prompt_wrapped_in_a_code_fence_stays_code_and_inner_code_of_a_wrapper_is_code() -> None:
    text = "```python\nts = 1\nCurrent date: 2025-03-04\n```"
    assert DEFAULT.apply(chat(text)).hoisted == []
    wrapped = "```\nIntro.\n```python\nCurrent date: 2024-01-01\n```\nCurrent date: 2025-03-04\n```"
    assert _spans(wrapped, fenced_code_ranges(wrapped)) == ["```python\nCurrent date: 2024-01-01\n```\n"]
    assert DEFAULT.apply(chat(wrapped)).hoisted == ["Current date: 2025-03-04"]


def test_an_unclosed_fence_runs_to_the_end() -> None:
    text = "a\n```\nCurrent date: 2025-03-04\n"
    assert _spans(text, fenced_code_ranges(text)) == ["```\nCurrent date: 2025-03-04\n"]
    assert DEFAULT.apply(chat(text)).hoisted == []


def test_inline_triple_backticks_are_no_fence() -> None:
    text = "Use ```a``` for code.\nCurrent date: 2025-03-04"
    assert fenced_code_ranges(text) == []
    assert DEFAULT.apply(chat(text)).hoisted == ["Current date: 2025-03-04"]


def test_indented_code_needs_a_blank_line_before_and_no_list_around() -> None:
    code = "    Current date: 2024-01-01\n\n    timestamp: 1700000000\n"
    text = "Run this:\n\n" + code + "\nThen go."
    assert _spans(text, indented_code_ranges(text)) == [code.rstrip("\n") + "\n"]
    continuation = "A paragraph\n    Current date: 2025-03-04\n"
    assert indented_code_ranges(continuation) == []
    in_list = "- item one\n\n    continued item text\n"
    assert indented_code_ranges(in_list) == []
    assert code_ranges("no code here") == []


HARD_BREAK = NormalizeOptions(skip_code=True, hard_breaks=True)


def test_whitespace_keeps_hard_breaks_and_code_blocks() -> None:
    text = (
        "Line one  \nline two   \n\n\n\nPara   \n\n```\nx = 1  \n\n\n\ny = 2\t\n```\n\n\n"
        "Intro:\n\n    code  \n\n\n    more\n\nEnd\t "
    )
    expected = (
        "Line one  \nline two\n\nPara\n\n```\nx = 1  \n\n\n\ny = 2\t\n```\n\n"
        "Intro:\n\n    code  \n\n\n    more\n\nEnd"
    )
    assert normalize_text(text, HARD_BREAK) == expected
    assert normalize_text(expected, HARD_BREAK) == expected


def test_hard_breaks_are_cut_to_two_spaces_and_tabs_are_no_hard_break() -> None:
    assert normalize_text("a     \nb", HARD_BREAK) == "a  \nb"
    assert normalize_text("a \t\nb", HARD_BREAK) == "a\nb"
    assert normalize_text("a  \n\nb", HARD_BREAK) == "a\n\nb"
    assert normalize_text("a  ", HARD_BREAK) == "a"


def test_the_default_whitespace_rule_keeps_code_and_hard_breaks_in_system_text() -> None:
    system = "Roses are red  \nviolets are blue\r\n\r\n\r\n```\nkeep  \n\n\nthis\n```\n"
    canon = DEFAULT.apply(chat(system))
    assert canon.messages[0]["content"] == "Roses are red  \nviolets are blue\n\n```\nkeep  \n\n\nthis\n```\n"
    plain = NormalizeOptions()
    assert normalize_text("a  \nb", plain) == "a\nb"  # the option is off by default


def test_a_fence_line_indented_deeper_than_its_block_allows_is_content() -> None:
    block = '```python\ndef f():\n    s = """\n    ```\n    """\n```\n'
    text = block + "Current date: 2025-03-04"
    assert _spans(text, fenced_code_ranges(text)) == [block]
    assert DEFAULT.apply(chat(text)).hoisted == ["Current date: 2025-03-04"]
