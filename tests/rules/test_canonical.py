"""RuleSet.apply as a whole: idempotence (hypothesis), determinism, purity, preservation, segments,
bad input, and linear-time matching on a pathological pattern."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rules import Canonical, RequestShapeError, RuleSet, SegmentLevel, load_ruleset
from rules.loader import PACK_DIR
from rules.transcript import TranscriptMemory
from tests.rules.formats import DATE_ANCHORS, DATE_FORMATS, OTHER_VOLATILE, random_datetime
from tests.rules.helpers import all_text, chat, ruleset_from, write_rules

ALL_ACTIONS = """
rules:
  - id: t.replace
    match: {pattern: '(?i)acme corp'}
    action: replace
    with: 'ACME Corp'
  - id: t.round
    match: {pattern: 'Deadline: %{CLOCK}'}
    action: round
    unit: hour
  - id: t.drop
    match: {role: [system, user], pattern: '(?m)^DEBUG:[^\\n]*$'}
    action: drop
  - id: t.reorder
    match:
      role: user
      pattern: '(?s)^Question: (?P<q>[^\\n]*)\\n+Document:\\n(?P<doc>.*)$'
    action: reorder
    template: "<document>\\n{doc}\\n</document>\\n\\nQuestion: {q}"
  - id: t.normalize-user
    match: {role: user}
    action: normalize
  - id: t.hoist-any
    match: {role: any, pattern: 'NONCE-[0-9]+'}
    action: hoist
"""


def rulesets(tmp_dir: Path) -> dict[str, RuleSet]:
    extra = write_rules(tmp_dir, ALL_ACTIONS, "all_actions.yaml")
    return {
        placement: load_ruleset(["default", str(extra)], placement=placement)
        for placement in ("last_user_prefix", "before_last_user", "system_end")
    }


@pytest.fixture(scope="module")
def all_rulesets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RuleSet]:
    return rulesets(tmp_path_factory.mktemp("rules"))


# --- request generator -------------------------------------------------------------------------------------


def _volatile_line(seed: int) -> str:
    rng = random.Random(seed)
    if rng.random() < 0.6:
        anchor = DATE_ANCHORS[rng.choice(sorted(DATE_ANCHORS))]
        form = DATE_FORMATS[rng.choice(sorted(DATE_FORMATS))]
        return anchor.format(v=form(random_datetime(rng)))
    return OTHER_VOLATILE[rng.choice(sorted(OTHER_VOLATILE))](rng)


ORDINARY_LINES = [
    "You are a helpful assistant.",
    "Version 1.2.3 costs $12.50.",
    "Knowledge cutoff: 2024-06",
    "Deadline: 13:47 sharp.",
    "DEBUG: internal flag",
    "Work for acme corp.",
    "NONCE-123 here",
    "",
    "   ",
    "```",
    "<document>inline doc</document>",
    "Question: why?",
    "Document:",
    "<request_context>",
    "</request_context>",
    "Example: Current date: 2024-01-01",
    "<documents>",
    "</document>",
    "<doc id=1>x</doc>",
    "Session ID: abc123",
]
noise = st.text(alphabet=st.sampled_from(list("ab :\n\r\t<>/`-.0123456789Cé\u0301년")), max_size=30)
line = st.one_of(st.integers(0, 10**6).map(_volatile_line), st.sampled_from(ORDINARY_LINES), noise)
text = st.lists(line, max_size=6).map("\n".join)
sep = st.sampled_from(["\n", "\r\n", "\n\n", " "])


@st.composite
def content(draw: st.DrawFn) -> str | list[dict]:
    body = draw(text)
    if draw(st.integers(0, 3)) == 0:
        parts: list[dict] = [{"type": "text", "text": draw(text)} for _ in range(draw(st.integers(1, 3)))]
        if draw(st.booleans()):
            parts.insert(
                draw(st.integers(0, len(parts))), {"type": "image_url", "image_url": {"url": "data:,x"}}
            )
        return parts
    return body


@st.composite
def chat_request(draw: st.DrawFn) -> tuple[list[dict], list[dict] | None]:
    messages: list[dict] = []
    for role in draw(st.lists(st.sampled_from(["system", "developer"]), max_size=2)):
        messages.append({"role": role, "content": draw(content())})
    for _ in range(draw(st.integers(0, 5))):
        role = draw(st.sampled_from(["user", "assistant", "user", "tool"]))
        message = {"role": role, "content": draw(content())}
        if role == "tool":
            message["tool_call_id"] = "call_1"
        messages.append(message)
    if draw(st.booleans()):
        question = draw(
            st.sampled_from(
                ["Question: who?\nDocument:\nSome text.", "<document>D</document>\n\nQ?", "plain question"]
            )
        )
        messages.append({"role": "user", "content": question + draw(sep) + draw(text)})
    tools = None
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(["b", "a", "c", "d"]), max_size=3))
        tools = [
            {
                "type": "function",
                "function": {"parameters": {"type": "object", "properties": {"z": {}, "y": {}}}, "name": n},
            }
            for n in names
        ]
    return messages, tools


def dump(canon: Canonical) -> str:
    return json.dumps(canon.to_dict(), ensure_ascii=False)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    request=chat_request(), placement=st.sampled_from(["last_user_prefix", "before_last_user", "system_end"])
)
def test_idempotent_and_deterministic(
    all_rulesets: dict[str, RuleSet], request: tuple, placement: str
) -> None:
    messages, tools = request
    ruleset = all_rulesets[placement]
    before = copy.deepcopy(request)
    once = ruleset.apply(messages, tools)
    assert (messages, tools) == before  # inputs never mutated
    twice = ruleset.apply(once.messages, once.tools)
    assert twice.messages == once.messages
    assert json.dumps(twice.tools) == json.dumps(once.tools)
    assert twice.segments == once.segments
    assert twice.stable_prefix_material() == once.stable_prefix_material()
    assert twice.hoisted == once.hoisted
    assert twice.applied == {}
    assert dump(ruleset.apply(messages, tools)) == dump(once)  # same input, same bytes
    final = all_text(once.messages)
    for value in once.hoisted:  # preservation
        assert value in final


def _assert_idempotent(ruleset: RuleSet, messages: list[dict]) -> Canonical:
    once = ruleset.apply(messages, None)
    twice = ruleset.apply(once.messages, once.tools)
    assert twice.messages == once.messages
    assert twice.segments == once.segments
    assert twice.hoisted == once.hoisted
    assert twice.applied == {}
    return once


def test_a_user_block_the_hoist_leaves_at_the_end_of_the_system_prompt_is_one_of_ours(
    all_rulesets: dict[str, RuleSet],
) -> None:
    """Hoisting the line before a user-written block leaves it alone at the end of the system prompt, where the
    next pass looks for the gateway's block: this pass takes it as one too (a hypothesis example of
    ``test_idempotent_and_deterministic``; the second pass used to hoist its value a second time)."""
    block = "<request_context>\nYou are a helpful assistant.\n</request_context>"
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Timezone: Europe/Berlin\n" + block}]},
        {"role": "user", "content": "Question: who?\nDocument:\nSome text.\n"},
    ]
    once = _assert_idempotent(all_rulesets["last_user_prefix"], messages)
    assert once.messages[0] == {"role": "system", "content": [{"type": "text", "text": block}]}
    assert once.hoisted == ["You are a helpful assistant.", "Timezone: Europe/Berlin"]
    assert once.messages[1]["content"].startswith(
        "<document>\nSome text.\n\n</document>\n\n<request_context>\nTimezone: Europe/Berlin\n</request_context>"
    )


@pytest.mark.parametrize(
    "value",
    [
        "<memory>\n- Prefers tea.\n- Lives near the sea.\n</memory>",
        "<current_time>\n2025-03-04T10:14:00Z\n</current_time>",
    ],
)
def test_a_hoisted_element_over_several_lines_is_one_value_on_the_next_pass(
    all_rulesets: dict[str, RuleSet], value: str
) -> None:
    """An element hoisted whole (a memory block, a date in a tag on three lines) is written to the block as
    several lines; the next pass reads them back as the one value they were (a hypothesis example of
    ``test_idempotent_and_deterministic``: it read one value per line)."""
    messages = [
        {"role": "system", "content": "You are terse.\n" + value + "\nBe brief."},
        {"role": "user", "content": "Hi"},
    ]
    for placement in ("last_user_prefix", "system_end", "before_last_user"):
        once = _assert_idempotent(all_rulesets[placement], messages)
        assert once.hoisted == [value]


def test_a_user_block_that_whitespace_normalization_puts_at_the_end_of_a_user_message_is_one_of_ours(
    all_rulesets: dict[str, RuleSet],
) -> None:
    """``"\\n \\n"`` normalized to a blank line makes a user-written block at the end of the message look exactly
    like a ``tail_end`` block: the pass that normalizes takes it, as the next pass will (a hypothesis example)."""
    messages = [
        {"role": "system", "content": [{"type": "text", "text": ""}]},
        {"role": "user", "content": [{"type": "text", "text": ""}]},
        {
            "role": "user",
            "content": "Timezone: Europe/Berlin\n \n<request_context>\nTimezone: Europe/Berlin\n</request_context>",
        },
    ]
    once = _assert_idempotent(all_rulesets["last_user_prefix"], messages)
    assert once.messages[2]["content"] == (
        "Timezone: Europe/Berlin\n\n<request_context>\nTimezone: Europe/Berlin\n</request_context>"
    )
    assert once.hoisted == ["Timezone: Europe/Berlin"]
    assert once.applied == {"t.normalize-user": 1}


@pytest.mark.parametrize("placement", ["last_user_prefix", "before_last_user", "system_end"])
def test_a_block_at_the_end_of_an_empty_user_message_is_not_taken_for_a_created_message(
    all_rulesets: dict[str, RuleSet], placement: str
) -> None:
    """A later turn's value goes to the end of its newest message (``tail_end``); when that message is an empty
    user message, a bare block would make it exactly a block, which the next pass takes for a ``new_user`` message
    it created, removes, and puts back after the reply (a hypothesis example at 40,000 examples)."""
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "NONCE-123 here"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q3"},
    ]
    once = _assert_idempotent(all_rulesets[placement], messages)
    assert [m["role"] for m in once.messages] == [
        "user",
        "assistant",
        "user",
        *(["user"] if placement == "before_last_user" else []),
        "assistant",
        "user",
    ]
    assert once.hoisted == ["NONCE-123"]
    if placement == "system_end":
        assert once.messages[2]["content"] == "\n\n<request_context>\nNONCE-123\n</request_context>"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=chat_request())
def test_segments_cover_the_prompt_in_order(all_rulesets: dict[str, RuleSet], request: tuple) -> None:
    canon = all_rulesets["last_user_prefix"].apply(*request)
    segments = canon.segments
    n = len(canon.messages)
    if segments:
        assert (segments[0].start_message, segments[0].start_part, segments[0].start_char) == (0, 0, 0)
    for a, b in zip(segments, segments[1:], strict=False):
        end = a.end
        assert (end.message, end.part, end.char) == (b.start_message, b.start_part, b.start_char)
    if segments and segments[-1].level == SegmentLevel.VOLATILE:
        assert segments[-1].end_message == n and segments[-1].end_part is None
    assert [s.level for s in segments].count(SegmentLevel.VOLATILE) <= 1
    assert all(s.level != SegmentLevel.VOLATILE for s in segments[:-1])


def test_preservation_of_each_value_and_nothing_else_lost() -> None:
    ruleset = load_ruleset(["default"])
    rng = random.Random(3)
    lines = [_volatile_line(rng.randrange(10**6)) for _ in range(12)]
    system = "Start.\n" + "\n".join(lines) + "\nEnd."
    canon = ruleset.apply(chat(system))
    final = all_text(canon.messages)
    assert len(canon.hoisted) == len(lines)
    for value in canon.hoisted:
        assert value in final
    # every character of the original system prompt is still in the prompt (whitespace aside)
    kept = canon.messages[0]["content"] + "".join(canon.hoisted)
    assert sorted(c for c in system if not c.isspace()) == sorted(c for c in kept if not c.isspace())


def test_multi_turn_history_stays_stable_across_turns() -> None:
    ruleset = load_ruleset(["default"])
    turn1 = [
        {"role": "system", "content": "Bot.\nCurrent time: 2025-05-14 13:17:44"},
        {"role": "user", "content": "q1"},
    ]
    turn2 = [
        {"role": "system", "content": "Bot.\nCurrent time: 2025-05-14 13:19:02"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    c1, c2 = ruleset.apply(turn1), ruleset.apply(turn2)
    assert c1.stable_prefix_material(SegmentLevel.TOOLS_SYSTEM) == c2.stable_prefix_material(
        SegmentLevel.TOOLS_SYSTEM
    )
    # stateless: the same values give the same first turn; changed values cost the first turn's block on
    assert ruleset.apply([turn1[0], *turn2[1:]]).messages[:2] == c1.messages
    assert c2.messages[0] == {"role": "system", "content": "Bot."}
    assert c2.messages[2:] == [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    # the first turn's block holds this request's value: the volatile tail starts there
    assert [s.name for s in c2.segments] == ["tools+system", "volatile"]
    assert b"13:19" not in c2.stable_prefix_material()
    # with the memory the first turn comes back exactly as sent, and the new time goes into the new turn
    memory = TranscriptMemory()
    m1 = ruleset.apply(turn1, memory=memory, scope="m")
    m2 = ruleset.apply(turn2, memory=memory, scope="m")
    assert m2.messages[:2] == m1.messages
    assert (
        m2.messages[3]["content"]
        == "q2\n\n<request_context>\nCurrent time: 2025-05-14 13:19:02\n</request_context>"
    )
    assert m2.history.reused_turns == 1


@pytest.mark.parametrize(
    "line",
    [
        "<current_time>\n{v}\n</current_time>",
        "<current_time>{v}</current_time>",
        "Current\u00a0time:\u00a0{v}",
    ],
)
def test_a_tagged_or_no_break_spaced_time_keeps_the_history_over_turns(line: str) -> None:
    ruleset = load_ruleset(["default"])
    first, second = (line.format(v=v) for v in ("2025-05-14 13:17:44", "2025-05-14 13:19:02"))
    turn1 = [{"role": "system", "content": "Bot.\n" + first}, {"role": "user", "content": "q1"}]
    turn2 = [
        {"role": "system", "content": "Bot.\n" + second},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    memory = TranscriptMemory()
    m1 = ruleset.apply(turn1, memory=memory, scope="m")
    m2 = ruleset.apply(turn2, memory=memory, scope="m")
    assert m1.messages[0] == {"role": "system", "content": "Bot."}
    assert m2.messages[:2] == m1.messages  # the first turn comes back exactly as sent
    assert m2.messages[3]["content"] == f"q2\n\n<request_context>\n{second}\n</request_context>"
    assert m2.history.reused_turns == 1


@pytest.mark.parametrize(
    ("messages", "tools", "words"),
    [
        ("not a list", None, "messages must be a list"),
        ([["role", "user"]], None, "messages[0] must be an object"),
        ([{"content": "x"}], None, "messages[0].role must be a string"),
        ([{"role": "user", "content": 5}], None, "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "text", "text": None}]}],
            None,
            "content[0].text must be a string",
        ),
        ([{"role": "user", "content": ["x"]}], None, "content[0] must be an object"),
        ([{"role": "user", "content": "x"}], {"a": 1}, "tools must be a list"),
        ([{"role": "user", "content": "x"}], ["f"], "tools[0] must be an object"),
    ],
)
def test_bad_request_shape_raises_named_error(messages: object, tools: object, words: str) -> None:
    with pytest.raises(RequestShapeError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_ruleset(["default"]).apply(messages, tools)  # type: ignore[arg-type]


def test_pathological_pattern_on_100k_prompt_returns_correct_result(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: evil-nested
            match: {pattern: '(a+)+$'}
            action: hoist
          - id: evil-pairs
            match: {pattern: '(x+x+)+y'}
            action: drop
        """,
    )
    no_match = "a" * 99_999 + "b"
    canon = ruleset.apply(chat(no_match, "x" * 100_000))
    assert canon.messages[0]["content"] == no_match
    assert canon.messages[1]["content"] == "x" * 100_000
    assert canon.applied == {}
    all_a = "a" * 100_000
    canon = ruleset.apply(chat("b" + all_a))
    assert canon.messages[0]["content"] == "b"
    assert canon.hoisted == [all_a]
    assert (
        canon.messages[1]["content"]
        == "<request_context>\n" + all_a + "\n</request_context>\n\nWhat should I do next?"
    )


def test_many_matches_on_a_long_text_are_linear(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: every-a
            match: {pattern: 'a'}
            action: drop
        """,
    )
    canon = ruleset.apply(chat("ab" * 50_000, "Go on."))
    assert canon.messages[0]["content"] == "b" * 50_000
    assert canon.applied == {"every-a": 50_000}


def test_non_converging_rule_is_cut_off_deterministically(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: grow
            match: {role: system, pattern: 'a'}
            action: replace
            with: 'aa'
        """,
    )
    first = ruleset.apply(chat("a"))
    assert first.messages[0]["content"] == "a" * 2**8
    assert first.applied == {"grow": 2**8 - 1}  # 1 + 2 + ... + 128 matches over the 8 passes
    assert ruleset.apply(chat("a")).messages == first.messages


def test_shipped_pack_files_are_all_used_by_default() -> None:
    shipped = {p.stem for p in PACK_DIR.glob("*.yaml") if not p.name.startswith("_")} - {"default"}
    default = load_ruleset(["default"])
    assert {rule_id.split(".")[0] for rule_id in default.rule_ids} == shipped


def _rendered(content) -> str:
    """A message's text as the templates join a list of text parts (one line break between parts)."""
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


@pytest.mark.parametrize("turns", [1, 2])
def test_a_message_sent_as_one_text_part_renders_as_the_same_string_after_hoisting(turns: int) -> None:
    # The trial: a first user message "Hi there" resent as [{"type": "text", "text": "Hi there"}] with a hoisted
    # date: the block became a part of its own, rendered with one more line break, and the history missed.
    ruleset = load_ruleset(["default"])
    system = {"role": "system", "content": "You are helper 4821. Current date: 2026-12-03."}
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    history = history[: 2 * turns - 1]
    as_string = ruleset.apply([system, *history])
    parts = [dict(m, content=[{"type": "text", "text": m["content"]}]) for m in history]
    as_parts = ruleset.apply([system, *parts])
    assert [_rendered(m["content"]) for m in as_parts.messages] == [
        _rendered(m["content"]) for m in as_string.messages
    ]
    assert ruleset.apply(as_parts.messages).messages == as_parts.messages  # idempotent
    # a later turn whose value changed gets its block at the end of its newest message: the same there
    first = [
        system,
        *history[:1],
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Next"},
    ]
    system2 = {"role": "system", "content": "You are helper 4821. Current date: 2026-12-04."}
    later = [system2, *first[1:], {"role": "assistant", "content": "Hi"}]
    results = []
    for last in ("Again", [{"type": "text", "text": "Again"}]):
        memory = TranscriptMemory()
        ruleset.apply(first, memory=memory)
        results.append(ruleset.apply([*later, {"role": "user", "content": last}], memory=memory).messages[-1])
    assert results[0]["content"].endswith("2026-12-04.\n</request_context>")
    assert _rendered(results[1]["content"]) == results[0]["content"]
    assert ruleset.apply([system2, *later[1:], results[1]]).messages[-1] == results[1]


def test_a_block_goes_into_its_own_part_beside_a_part_with_other_keys_or_no_text() -> None:
    ruleset = load_ruleset(["default"])
    system = {"role": "system", "content": "You are helper 4821. Current date: 2026-12-03."}
    for first in (
        {"type": "text", "text": "Hi", "citations": None},
        {"type": "text", "text": ""},
    ):
        user = {"role": "user", "content": [first, {"type": "text", "text": "there"}]}
        canon = ruleset.apply([system, user])
        content = canon.messages[1]["content"]
        assert content[0]["text"].startswith("<request_context>\n") and content[1:] == user["content"]
        assert ruleset.apply(canon.messages).messages == canon.messages


def test_a_block_merges_into_a_marked_part_as_into_the_same_part_unmarked() -> None:
    """A cache marker is not prompt text (``rules.cache_markers``): the part keeps it, the block goes where it
    goes in the unmarked part, so the bytes do not depend on where the client put its marker."""
    ruleset = load_ruleset(["default"])
    system = {"role": "system", "content": "You are helper 4821. Current date: 2026-12-03."}
    marker = {"type": "ephemeral", "ttl": "1h"}
    marked = {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": marker}]}
    plain = {"role": "user", "content": [{"type": "text", "text": "Hi"}]}
    with_marker = ruleset.apply([system, marked]).messages
    without = ruleset.apply([system, plain]).messages
    assert with_marker[1]["content"] == [{**without[1]["content"][0], "cache_control": marker}]
    assert ruleset.apply(with_marker).messages == with_marker


def test_a_clients_literal_block_tag_before_ours_is_not_read_as_one_block(all_rulesets) -> None:
    """Found by ``test_idempotent_and_deterministic`` (a client's unterminated ``<request_context>`` before a
    value hoisted to the message's end): applying the rules again read the client's tag as the opening of a
    block reaching to ours, and took the client's text for hoisted values (``['here', '', '<request_context>',
    'NONCE-123']``). A block never holds its own opening tag."""
    messages = [
        {"role": "system", "content": [{"type": "text", "text": ""}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
        {"role": "user", "content": "<request_context>\nNONCE-123 here"},
    ]
    once = all_rulesets["system_end"].apply(messages, None)
    twice = all_rulesets["system_end"].apply(once.messages, None)
    assert once.hoisted == twice.hoisted == ["NONCE-123"] and twice.messages == once.messages


def test_a_request_whose_turns_merge_when_its_blocks_come_out_keeps_the_system_prompts_block(
    all_rulesets: dict[str, RuleSet],
) -> None:
    """Found by the property test above: system messages, then tool results answered by no user message. The
    first pass put the tool text's value into a user message of its own at the end; taken out again, that
    message's turn merged with the one before, and the system prompt's block, merged into the last turn, where
    a system_end block has no place, was dropped: the session id was lost."""
    uuid_line = "Session ID: 82e2e662-f728-44fa-8248-5e3a0a5d2f34"
    messages = [
        {"role": "system", "content": [{"type": "text", "text": ""}]},
        {"role": "system", "content": [{"type": "text", "text": uuid_line}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
        {"role": "tool", "content": [{"type": "text", "text": "NONCE-123 here"}], "tool_call_id": "call_1"},
        {"role": "assistant", "content": ""},
    ]
    for ruleset in all_rulesets.values():
        once = ruleset.apply(messages)
        twice = ruleset.apply(once.messages)
        assert twice.messages == once.messages
        assert uuid_line in all_text(twice.messages)
