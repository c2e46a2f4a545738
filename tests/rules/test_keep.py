"""Stable contexts that look volatile stay where they are: the keep pack (examples, schedules, format specs,
cutoffs, modes, mail headers, dialogue lines), code blocks, and sentence boundaries that know abbreviations
and decimals. Also the ``keep`` action itself: load order, groups, roles."""

from __future__ import annotations

from pathlib import Path

import pytest

from rules import load_ruleset
from tests.rules.helpers import chat, ruleset_from

DEFAULT = load_ruleset(["default"])
HEAD = "You are a helpful assistant.\n"
TAIL = "\nBe brief."

KEPT = {
    "e.g.-sentence": "Ask which day they mean, e.g. Today is Monday, May 13, 2024. Then answer.",
    "for-example": "For example, the current date is 2024-01-01 in the test data.",
    "example-label": "Example: Current date: 2024-01-01",
    "example-bullets": "Accepted formats, for example:\n- Current date: 2024-01-15\n- Current time: 13:45",
    "examples-heading": "## Examples\nCurrent date: 2024-06-01\nUser location: Paris, France",
    "example-tags": "<example>\nUser: What time is it?\nThe current time is 3:45 PM.\n</example>",
    "example-output-tags": "<example_output>\nToday is Tuesday.\n</example_output>",
    "quoted-sentence": 'Never reply "Today\'s date is Monday, May 13, 2024." without checking.',
    "user-condition": 'If the user writes "the current time is 09:00", do not correct them.',
    "schedule": "Session: 10:00-11:30 Opening keynote",
    "schedule-12h": "Working hours: 9:00 AM - 5:30 PM, Monday to Friday.",
    "schedule-no-minutes": "Support is available 9 AM to 5 PM Eastern.",
    "date-range": "Sale period: 2025-03-01 to 2025-03-31.",
    "format-spec": "Each event has these fields:\ntimestamp: 1700000000\nid: evt_12345",
    "format-spec-output": "The output must look like this:\nCurrent date: YYYY-MM-DD\nTimestamp: 1715692800",
    "zone-sentence-value": "Time zone: All times in this document are UTC.",
    "plan-mode": "The user is in Plan Mode.",
    "editor-view": "The user is currently in the Editor view; suggest inline edits.",
    "cutoff": "Knowledge cutoff: 2024-06",
    "cutoff-sentence": "You were trained on data up to October 2023.",
    "mail-headers": "From: ann@example.com\nDate: Tue, 4 Mar 2025 09:05:07 +0100\nSubject: Report",
    "dialogue": "Q: What's today's date?\nA: Today is March 4, 2025.",
    "memory-instructions": "## Memory\nDo not store memories about the user.",
    "indented-code": "Run this:\n\n    Current date: 2024-01-01\n    timestamp: 1700000000\n\nThen restart.",
    "fenced-code": "```\nCurrent date: 2025-05-14\n```",
    "nested-fence": "```markdown\nExample:\n```python\nnow = 1\n```\nCurrent date: 2024-01-01\n```",
    "indented-fence": "1. Install:\n\n    ```bash\n    Current date: 2024-01-01\n    ```",
    "decimal-coordinates-no-user": "Latitude -23.55 and longitude -46.63 are São Paulo.",
    "release-date": "Released on May 13, 2024 as v1.0; v2.0 followed on 09th August, 2025.",
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_stable_context_is_left_alone(name: str) -> None:
    system = HEAD + KEPT[name] + TAIL
    canon = DEFAULT.apply(chat(system))
    assert canon.hoisted == []
    assert canon.messages[0]["content"] == system


def test_a_volatile_line_next_to_kept_context_is_still_hoisted() -> None:
    system = (
        HEAD + "Examples:\n- Current date: 2024-01-15\n\nCurrent date: 2025-03-04\n"
        "Session: 10:00-11:30 Opening keynote\nThe user is in Plan Mode." + TAIL
    )
    canon = DEFAULT.apply(chat(system))
    assert canon.hoisted == ["Current date: 2025-03-04"]
    assert canon.messages[0]["content"] == system.replace("Current date: 2025-03-04\n", "")


@pytest.mark.parametrize(
    "text, hoisted, left",
    [
        ("The user's location is -23.55, -46.63. Next.", "The user's location is -23.55, -46.63.", "Next."),
        (
            "The user's location is 52.5200, 13.4050! Next.",
            "The user's location is 52.5200, 13.4050!",
            "Next.",
        ),
        ("The user is located in St. Louis, MO. Next.", "The user is located in St. Louis, MO.", "Next."),
        ("The user is located in Washington, D.C. Next.", "The user is located in Washington, D.C.", "Next."),
        (
            "Very important: The user's timezone is Europe/Berlin. Next.",
            "Very important: The user's timezone is Europe/Berlin.",
            "Next.",
        ),
        ("Note: today is 2025-03-04. Next.", "Note: today is 2025-03-04.", "Next."),
        ("Say hi. The current time is 9 a.m. Next.", "The current time is 9 a.m.", "Say hi. Next."),
    ],
)
def test_sentence_boundaries_know_decimals_abbreviations_and_colons(
    text: str, hoisted: str, left: str
) -> None:
    canon = DEFAULT.apply(chat(HEAD + text + TAIL))
    assert canon.hoisted == [hoisted]
    assert canon.messages[0]["content"] == HEAD + left + TAIL


def test_an_abbreviation_starts_no_sentence() -> None:
    for text in (
        "Answer questions, i.e. Today is Monday, May 13, 2024 is an example.",
        "Dates in the U.S. Today is written as May 13, 2024 there.",
    ):
        canon = DEFAULT.apply(chat(HEAD + text + TAIL))
        assert canon.hoisted == []


KEEP_FILE = """
    rules:
      - id: strip-ts
        match: {{role: system, pattern: '(?m)^ts: [0-9]+$'}}
        action: hoist
      - id: keep-example
        match: {{role: {role}, pattern: '(?s)<ex>.*?</ex>'}}
        action: keep
    """


def test_keep_protects_matches_of_rules_loaded_before_it(tmp_path: Path) -> None:
    ruleset = ruleset_from(tmp_path, KEEP_FILE.format(role="system"))
    canon = ruleset.apply(chat("ts: 1\n<ex>\nts: 2\n</ex>\nts: 3"))
    assert canon.hoisted == ["ts: 1", "ts: 3"]
    assert canon.messages[0]["content"] == "<ex>\nts: 2\n</ex>"
    assert "keep-example" not in canon.applied


def test_keep_for_system_text_does_not_protect_a_rule_that_also_acts_on_user_text(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: strip-ts
            match: {pattern: '(?m)^ts: [0-9]+$'}
            action: drop
          - id: keep-example
            match: {role: system, pattern: '(?s)<ex>.*?</ex>'}
            action: keep
        """,
    )
    canon = ruleset.apply(chat("<ex>\nts: 2\n</ex>", "<ex>\nts: 5\n</ex>"))
    assert canon.messages[0]["content"] == "<ex>\n</ex>"
    assert canon.messages[1]["content"] == "<ex>\n</ex>"


def test_keep_group_narrows_what_is_protected(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: strip-ts
            match: {role: system, pattern: 'ts: [0-9]+'}
            action: hoist
          - id: keep-after-colon
            match: {role: system, pattern: 'sample: (?P<value>ts: [0-9]+)'}
            action: keep
            group: value
        """,
    )
    canon = ruleset.apply(chat("a ts: 1 b sample: ts: 2"))
    assert canon.hoisted == ["ts: 1"]


def test_keep_needs_a_pattern(tmp_path: Path) -> None:
    from rules import RuleError

    with pytest.raises(RuleError, match="needs a 'match' with a 'pattern'"):
        ruleset_from(
            tmp_path,
            """
            rules:
              - id: k
                action: keep
            """,
        )


def test_a_match_rejected_for_a_kept_range_does_not_hide_the_volatile_sentence_after_it() -> None:
    canon = DEFAULT.apply(chat(HEAD + "Knowledge cutoff: 2024-06 | Current date: 2025-03-04" + TAIL))
    assert canon.hoisted == ["Current date: 2025-03-04"]
    assert canon.messages[0]["content"] == HEAD + "Knowledge cutoff: 2024-06" + TAIL


def test_items_of_a_separated_line_are_hoisted_with_their_separator() -> None:
    for date, locale in (("2025-03-04", "en-GB"), ("2026-06-15", "de-DE")):
        line = f"Knowledge cutoff: 2024-06 | Current date: {date} | Locale: {locale} | Plan: Pro"
        canon = DEFAULT.apply(chat(HEAD + line + TAIL))
        assert canon.hoisted == [f"Current date: {date}", f"Locale: {locale}"]
        assert canon.messages[0]["content"] == HEAD + "Knowledge cutoff: 2024-06 | Plan: Pro" + TAIL
    last = DEFAULT.apply(chat(HEAD + "Plan: Pro · Timezone: Europe/Berlin" + TAIL))
    assert last.hoisted == ["Timezone: Europe/Berlin"]
    assert last.messages[0]["content"] == HEAD + "Plan: Pro" + TAIL
