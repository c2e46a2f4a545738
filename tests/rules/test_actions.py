"""Each action on its own: hoist (placements, tidy removal), replace, round, drop, normalize, sort_tools,
reorder; and message selection by role, position and index."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rules import load_ruleset
from rules.actions import canonical_json, removal_range
from tests.rules.helpers import chat, ruleset_from

HOIST_SESSION = """
    rules:
      - id: session
        match:
          role: system
          pattern: '(?m)^Session: [0-9a-f]+$'
        action: hoist
    """


def test_hoist_default_places_value_in_the_first_turn_and_keeps_later_turns_raw(tmp_path: Path) -> None:
    ruleset = ruleset_from(tmp_path, HOIST_SESSION)
    messages = [
        {"role": "system", "content": "You are terse.\nSession: 0a1b2c\nAnswer in English."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "tell me more"},
    ]
    canon = ruleset.apply(messages)
    first_turn = ruleset.apply(messages[:2])
    assert canon.messages == [
        {"role": "system", "content": "You are terse.\nAnswer in English."},
        {"role": "user", "content": "<request_context>\nSession: 0a1b2c\n</request_context>\n\nhi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "tell me more"},
    ]
    assert canon.messages[:2] == first_turn.messages  # the first turn as it was sent
    assert canon.hoisted == ["Session: 0a1b2c"]
    assert canon.applied == {"session": 1}
    assert [(s.level, s.start_message, s.end_message) for s in canon.segments] == [(1, 0, 1), (4, 1, 4)]


def test_hoist_last_user_prefix_places_value_at_start_of_the_turns_last_user_message(tmp_path: Path) -> None:
    ruleset = ruleset_from(tmp_path, HOIST_SESSION, placement="last_user_prefix")
    messages = [
        {"role": "system", "content": "You are terse.\nSession: 0a1b2c\nAnswer in English."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "tell me more"},
    ]
    canon = ruleset.apply(messages)
    assert canon.messages == [
        {"role": "system", "content": "You are terse.\nAnswer in English."},
        {"role": "user", "content": "<request_context>\nSession: 0a1b2c\n</request_context>\n\nhi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "tell me more"},
    ]
    assert canon.messages[:2] == ruleset.apply(messages[:2]).messages
    assert ruleset.apply(canon.messages).messages == canon.messages


def test_hoist_before_last_user_adds_a_note_message(tmp_path: Path) -> None:
    ruleset = ruleset_from(tmp_path, HOIST_SESSION, placement="before_last_user")
    canon = ruleset.apply(chat("Be kind.\nSession: ff00"))
    assert canon.messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "<request_context>\nSession: ff00\n</request_context>"},
        {"role": "user", "content": "What should I do next?"},
    ]
    assert canon.stable_end.message == 1


def test_hoist_system_end_appends_to_system(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: session
            match: {role: system, pattern: '(?m)^Session: [0-9a-f]+$'}
            action: hoist
            placement: system_end
        """,
    )
    canon = ruleset.apply(chat("Session: ff00\nBe kind."))
    assert canon.messages[0]["content"] == "Be kind.\n\n<request_context>\nSession: ff00\n</request_context>"
    assert canon.messages[1]["content"] == "What should I do next?"
    end = canon.stable_end
    assert (end.message, end.part, end.char) == (0, 0, len("Be kind."))
    assert (
        canon.stable_prefix_material()
        == ruleset.apply(chat("Session: 1234\nBe kind.")).stable_prefix_material()
    )


def test_hoist_falls_back_when_the_place_is_missing(tmp_path: Path) -> None:
    ruleset = ruleset_from(tmp_path, HOIST_SESSION)
    only_system = ruleset.apply([{"role": "system", "content": "A\nSession: ab"}])
    assert only_system.messages == [
        {"role": "system", "content": "A\n\n<request_context>\nSession: ab\n</request_context>"}
    ]
    anywhere = ruleset_from(
        tmp_path,
        """
        rules:
          - id: s
            match: {pattern: 'Session: [0-9a-f]+'}
            action: hoist
        """,
    )
    no_user_no_system = anywhere.apply([{"role": "assistant", "content": "Session: ab then"}])
    assert no_user_no_system.messages == [
        {"role": "assistant", "content": "then"},
        {"role": "user", "content": "<request_context>\nSession: ab\n</request_context>"},
    ]
    assert anywhere.apply(no_user_no_system.messages).messages == no_user_no_system.messages


def test_hoist_tidies_inline_removal_and_keeps_order(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: ref
            match: {pattern: 'Ref [0-9]+\\.'}
            action: hoist
          - id: tag
            match: {pattern: '#[a-z]+'}
            action: hoist
        """,
    )
    canon = ruleset.apply(chat("Hello. Ref 12. Bye. Ref 7.\n#alpha line\n  #beta  \nEnd"))
    assert canon.messages[0]["content"] == "Hello. Bye.\nline\nEnd"
    assert canon.hoisted == ["Ref 12.", "Ref 7.", "#alpha", "#beta"]


def test_hoist_group_and_list_content(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: id
            match: {role: [system, developer], pattern: 'id=(?P<v>[0-9]+)'}
            action: hoist
            group: v
        """,
    )
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "call id=42 now"}]},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:x"}},
                {"type": "text", "text": "what is this?"},
            ],
        },
    ]
    canon = ruleset.apply(messages)
    assert canon.messages[0]["content"] == [{"type": "text", "text": "call id= now"}]
    assert canon.messages[1]["content"] == [
        {"type": "text", "text": "<request_context>\n42\n</request_context>\n\n"},
        {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "text", "text": "what is this?"},
    ]
    assert ruleset.apply(canon.messages).messages == canon.messages


def test_selection_by_role_position_and_index(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "x"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "x"},
    ]

    def dropped(match: str) -> list[str]:
        ruleset = ruleset_from(
            tmp_path,
            f"""
            rules:
              - id: r
                match: {{pattern: 'x', {match}}}
                action: replace
                with: 'y'
            """,
        )
        return [m["content"] for m in ruleset.apply(messages).messages]

    assert dropped("role: user") == ["x", "y", "x", "y"]
    assert dropped("role: user, position: first") == ["x", "y", "x", "x"]
    # positions and negative indices select as in the request each turn was the newest in: a turn's
    # "last" message stays selected in later requests, so history never changes
    assert dropped("role: [user, assistant], position: last") == ["x", "y", "x", "y"]
    assert dropped("index: 2") == ["x", "x", "y", "x"]
    assert dropped("index: -1") == ["x", "y", "x", "y"]
    assert dropped("index: -4") == ["x", "x", "x", "x"]  # message 0 was never 4th from the end of its turn
    assert dropped("index: 2, role: user") == ["x", "x", "x", "x"]
    assert dropped("role: any") == ["y", "y", "y", "y"]


def test_replace_with_groups_counts_only_changes(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: swap
            match: {pattern: '(?P<last>[A-Z][a-z]+), (?P<first>[A-Z][a-z]+)'}
            action: replace
            with: '{first} {last} {{name}}'
          - id: acme
            match: {pattern: '(?i)acme corp'}
            action: replace
            with: 'ACME Corp'
        """,
    )
    canon = ruleset.apply(chat("Lovelace, Ada works at acme corp and ACME Corp."))
    assert canon.messages[0]["content"] == "Ada Lovelace {name} works at ACME Corp and ACME Corp."
    assert canon.applied == {"swap": 1, "acme": 1}


@pytest.mark.parametrize(
    ("text", "unit", "expected"),
    [
        ("Now: 13:17:44.123", "minute", "Now: 13:17:00.000"),
        ("Now: 13:17:44", "hour", "Now: 13:00:00"),
        ("Now: 2025-05-14T13:17:44Z", "day", "Now: 2025-05-14T00:00:00Z"),
        ("Now: Friday, April 24, 2026 at 1:17:44 PM", "day", "Now: Friday, April 24, 2026 at 12:00:00 AM"),
        ("Now: 1:17 p.m.", "day", "Now: 12:00 a.m."),
        ("Now: 1:17 PM", "hour", "Now: 1:00 PM"),
        ("Now: 2025년 5월 14일 오후 3시 20분", "day", "Now: 2025년 5월 14일 오전 12시 00분"),
        ("Now: 2025年5月14日 午後3時20分", "hour", "Now: 2025年5月14日 午後3時00分"),
        ("Now: 2025年5月14日 下午3点20分", "day", "Now: 2025年5月14日 上午12点00分"),
        ("Now: 2025年5月14日 15時20分", "day", "Now: 2025年5月14日 00時00分"),
        ("Now: 1715692999", "hour", "Now: 1715691600"),
        ("Now: 1715692999123", "day", "Now: 1715644800000"),
    ],
)
def test_round_truncates_in_the_original_format(tmp_path: Path, text: str, unit: str, expected: str) -> None:
    ruleset = ruleset_from(
        tmp_path,
        f"""
        rules:
          - id: round-now
            match: {{pattern: 'Now: (?:%{{DATETIME}}|%{{EPOCH}})'}}
            action: round
            unit: {unit}
        """,
    )
    canon = ruleset.apply(chat(text))
    assert canon.messages[0]["content"] == expected
    assert canon.applied == {"round-now": 1}
    assert ruleset.apply(canon.messages).applied == {}


def test_round_makes_same_hour_requests_identical(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: r
            match: {pattern: 'Current time: %{DATETIME}'}
            action: round
            unit: hour
        """,
    )
    a = ruleset.apply(chat("Current time: 2025-05-14 13:05:09 UTC"))
    b = ruleset.apply(chat("Current time: 2025-05-14 13:59:59 UTC"))
    c = ruleset.apply(chat("Current time: 2025-05-14 14:00:00 UTC"))
    assert a.stable_prefix_material() == b.stable_prefix_material() != c.stable_prefix_material()


def test_drop_removes_lines_and_counts(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: debug
            match: {pattern: '(?m)^DEBUG:.*$'}
            action: drop
        """,
    )
    canon = ruleset.apply(chat("One\nDEBUG: a\nTwo\nDEBUG: b"))
    assert canon.messages[0]["content"] == "One\nTwo"
    assert canon.applied == {"debug": 2}
    assert canon.hoisted == []


def test_normalize_all_options_and_none(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: n
            match: {role: system}
            action: normalize
        """,
    )
    text = "Cafe\u0301  \r\nline two\t\r\n\r\n\r\n\r\nthree\rfour   "
    canon = ruleset.apply(chat(text, "  keep  \r\n"))
    assert canon.messages[0]["content"] == "Caf\u00e9\nline two\n\nthree\nfour"
    assert canon.messages[1]["content"] == "  keep  \r\n"
    assert canon.applied == {"n": 1}
    off = ruleset_from(
        tmp_path,
        """
        rules:
          - id: n
            action: normalize
            line_endings: false
            trailing_spaces: false
            blank_lines: null
            unicode: false
        """,
    )
    assert off.apply(chat(text)).messages[0]["content"] == text
    two = ruleset_from(
        tmp_path,
        """
        rules:
          - id: n
            action: normalize
            blank_lines: 0
            unicode: NFKC
        """,
    )
    assert two.apply(chat("a\n\n\nb\uff21")).messages[0]["content"] == "a\nbA"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"], "type": "string"}, "city": {"type": "string"}},
                "required": ["city", "unit"],
            },
        },
    },
    {"function": {"parameters": {"properties": {}, "type": "object"}, "name": "clock"}, "type": "function"},
]


def test_sort_tools_canonical_output() -> None:
    ruleset = load_ruleset(["tools"])
    canon = ruleset.apply(chat("s"), TOOLS)
    assert [t["function"]["name"] for t in canon.tools] == ["clock", "weather"]
    assert canonical_json(canon.tools) == (
        '[{"function":{"name":"clock","parameters":{"properties":{},"type":"object"}},"type":"function"},'
        '{"function":{"description":"Weather for a city.","name":"weather","parameters":{"properties":'
        '{"city":{"type":"string"},"unit":{"enum":["c","f"],"type":"string"}},"required":["city","unit"],'
        '"type":"object"}},"type":"function"}]'
    )
    # key order is sorted everywhere, so any serializer (json.dumps, jinja tojson) writes the same bytes
    assert json.dumps(canon.tools) == json.dumps(canon.tools, sort_keys=True)
    # semantics: the same tools, as values
    assert sorted(canon.tools, key=lambda t: t["function"]["name"]) == sorted(
        TOOLS, key=lambda t: t["function"]["name"]
    )
    # arrays keep their order (enum, required)
    assert canon.tools[1]["function"]["parameters"]["required"] == ["city", "unit"]
    assert canon.applied == {"tools.sort": 1}
    again = ruleset.apply(canon.messages, canon.tools)
    assert again.applied == {}
    assert canonical_json(again.tools) == canonical_json(canon.tools)
    shuffled = [TOOLS[1], TOOLS[0]]
    assert ruleset.apply(chat("s"), shuffled).stable_prefix_material() == canon.stable_prefix_material()
    assert TOOLS[1]["function"]["name"] == "clock" and list(TOOLS[1]) == [
        "function",
        "type",
    ]  # input untouched


def test_sort_tools_anthropic_shape_and_no_tools() -> None:
    ruleset = load_ruleset(["tools"])
    tools = [
        {"name": "b", "input_schema": {"type": "object"}},
        {"name": "a", "input_schema": {"type": "object"}},
    ]
    assert [t["name"] for t in ruleset.apply(chat("s"), tools).tools] == ["a", "b"]
    assert ruleset.apply(chat("s"), None).tools is None
    assert ruleset.apply(chat("s"), []).tools == []


REORDER = """
    rules:
      - id: doc-first
        match:
          role: user
          pattern: '(?s)^Question: (?P<question>[^\\n]*)\\n+Document:\\n(?P<document>.*)$'
        action: reorder
        template: "<document>\\n{document}\\n</document>\\n\\nQuestion: {question}"
    """


def test_reorder_puts_the_document_first_as_level_2(tmp_path: Path) -> None:
    ruleset = ruleset_from(tmp_path, REORDER)
    one = ruleset.apply(chat("sys", "Question: who?\nDocument:\nA long text."))
    two = ruleset.apply(chat("sys", "Question: when?\n\nDocument:\nA long text."))
    assert one.messages[1]["content"] == "<document>\nA long text.\n</document>\n\nQuestion: who?"
    assert [s.level for s in one.segments] == [1, 2, 4]
    assert one.stable_prefix_material() == two.stable_prefix_material()
    assert one.stable_prefix_material(level=1) == two.stable_prefix_material(level=1)
    assert b"A long text." in one.stable_prefix_material()
    assert b"A long text." not in one.stable_prefix_material(level=1)
    assert ruleset.apply(one.messages).messages == one.messages


def test_hoist_goes_after_documents_in_the_last_user_turn(tmp_path: Path) -> None:
    ruleset = load_ruleset(["default", str(ruleset_path(tmp_path))])
    canon = ruleset.apply(
        chat(
            "Current date: 2025-05-14\nYou answer from documents.", "Question: who?\nDocument:\nA long text."
        )
    )
    # the text after the documents keeps the line breaks the reorder template gave it
    assert canon.messages[1]["content"] == (
        "<document>\nA long text.\n</document>\n\n<request_context>\n"
        "Current date: 2025-05-14\n</request_context>\n\n\n\nQuestion: who?"
    )
    document = canon.segments[1]
    assert (document.level, document.end_message, document.end_part, document.end_char) == (
        2,
        2,
        0,
        len("<document>\nA long text.\n</document>"),
    )


def ruleset_path(tmp_path: Path) -> Path:
    path = tmp_path / "reorder.yaml"
    path.write_text(REORDER.replace("\n    ", "\n").lstrip("\n"), encoding="utf-8")
    return path


def test_skip_code_leaves_fenced_code_alone(tmp_path: Path) -> None:
    body = """
        rules:
          - id: ts
            match: {{pattern: '(?m)^ts: [0-9]+$', skip_code: {flag}}}
            action: hoist
        """
    text = "ts: 1\n```\nts: 2\n```\n~~~~\nts: 3\n~~~~\nts: 4\n```\nts: 5"
    with_skip = ruleset_from(tmp_path, body.format(flag="true")).apply(chat(text))
    assert with_skip.hoisted == ["ts: 1", "ts: 4"]
    without = ruleset_from(tmp_path, body.format(flag="false")).apply(chat(text))
    assert without.hoisted == ["ts: 1", "ts: 2", "ts: 3", "ts: 4", "ts: 5"]


@pytest.mark.parametrize(
    ("text", "left"),
    [
        ("Current time: 10:01\n\nYou are helpful.", "You are helpful."),
        ("You are helpful.\n\nCurrent time: 10:01", "You are helpful."),
        ("Current time: 10:01\nYou are helpful.", "You are helpful."),
        ("\nCurrent time: 10:01\nYou are helpful.\n", "\nYou are helpful.\n"),  # its own blank lines stay
    ],
)
def test_a_removed_first_or_last_line_leaves_no_blank_line_at_that_end(text: str, left: str) -> None:
    ruleset = load_ruleset(["dates"])
    canon = ruleset.apply([{"role": "system", "content": text}, {"role": "user", "content": "x"}])
    assert canon.messages[0]["content"] == left


class _CountingText(str):
    """A str that counts the characters its indexing and slicing read."""

    read = 0

    def __getitem__(self, key):  # type: ignore[override]
        value = str.__getitem__(self, key)
        _CountingText.read += len(value)
        return value


def test_removal_range_reads_only_the_blanks_around_a_match() -> None:
    """A fresh-user trial's 3.4 MB one-line JSON system prompt with 64,000 hoisted members held the gateway for
    ~50 s: each match sliced its whole line. Now a match reads only the whitespace runs next to it."""
    members = ", ".join(f'"k{k}": "v", "now": "2025-03-03T10:00:00Z"' for k in range(2_000))
    text = _CountingText("Context: {" + members + "}")
    spans = [(m.start(), m.end()) for m in re.finditer(r'"now": "[^"]+"', text)]
    _CountingText.read = 0
    ranges = [removal_range(text, start, end) for start, end in spans]
    assert _CountingText.read <= 16 * len(spans)  # a few characters each (the line is ~80,000)
    assert ranges[0] == spans[0]  # ", " before it stays with the text before, "," after it too


@pytest.mark.parametrize(
    ("text", "match", "expected"),
    [
        ("a\n  Date: x  \nb", "Date: x", "a\nb"),  # a line left blank goes with its break
        ("A | Date: x", "Date: x", "A"),  # the last item takes its separator
        ("x  Date: y  z", "Date: y", "x  z"),  # two space runs that would meet: one goes
        ("x Date: y\nz", "Date: y", "x\nz"),  # a run left at a line's end goes
        ("Date: y  x", "Date: y", "x"),  # ... and at a line's start
        ("a\n- The user is in Paris.\n- b", "The user is in Paris.", "a\n- b"),  # a bare list marker goes
        ("a\n  12) X\nb", "X", "a\nb"),  # ... numbered and indented
        ("a\n* X", "X", "a"),  # ... on the last line
        ("x - y\nz", "y", "x -\nz"),  # a dash inside a line is no list marker
        ("a\n1234. X\nb", "X", "a\n1234.\nb"),  # nor four digits
    ],
)
def test_removal_range_tidies_the_text_around_a_match(text: str, match: str, expected: str) -> None:
    start = text.index(match)
    s, e = removal_range(text, start, start + len(match))
    assert text[:s] + text[e:] == expected
