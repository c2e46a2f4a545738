"""History never moves: conversations resent turn after turn keep their earlier turns byte-identical, with
and without the transcript memory, for chat, agent loops, compaction, retries, edits, forks and every
placement; rules on never caches less than rules off."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rules import load_ruleset
from rules.model import PLACEMENTS
from rules.placement import turn_spans
from rules.transcript import (
    InProcessTranscriptStore,
    PrefixHasher,
    TranscriptEntry,
    TranscriptMemory,
    conversation_scope,
)
from tests.rules.helpers import all_text, ruleset_from
from tests.rules.history_traces import SYSTEM, Replay, tool_turn

DEFAULT = load_ruleset(["default"])
BIG = "\n".join(
    f"line {i}: value = compute({i}) + offset  # note {i % 7}" for i in range(1600)
)  # ~4,000 tokens


def system(line: str) -> dict:
    return {"role": "system", "content": SYSTEM.format(line=line)}


def is_prefix(shorter: list, longer: list) -> bool:
    return longer[: len(shorter)] == shorter


def test_turn_spans_cut_at_each_answered_reply() -> None:
    m = [
        system("x"),
        {"role": "user", "content": "q"},
        *tool_turn(1, ["a", "b"]),
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "next"},
        {"role": "assistant", "content": "prefill"},
    ]
    assert turn_spans(m) == [(0, 2), (2, 5), (5, 8)]
    assert turn_spans([]) == []
    assert turn_spans([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]) == [
        (0, 2)
    ]


def test_chat_with_a_constant_date_is_a_growing_prefix_without_memory() -> None:
    replay = Replay(DEFAULT)
    history = [system("Current date: 2026-12-01")]
    previous = None
    for turn in range(5):
        history.append({"role": "user", "content": f"question {turn}"})
        canon = DEFAULT.apply(history)
        replay.send(history)
        if previous is not None:
            assert is_prefix(previous.messages, canon.messages)
        assert all_text(canon.messages).count("Current date: 2026-12-01") == 1
        assert "Current date" not in canon.messages[0]["content"]
        previous = canon
        history.append({"role": "assistant", "content": f"answer {turn}"})
    for row in replay.rows[1:]:
        assert row["on"] >= row["off"] and row["stateless"] >= row["off"]


def test_agent_loop_with_a_changing_time_and_large_tool_results_reuses_everything_with_memory() -> None:
    tools = [{"type": "function", "function": {"name": "read"}}]
    replay = Replay(DEFAULT)
    history = [system("Current time: 2026-12-01 10:00:00"), {"role": "user", "content": "fix the bug"}]
    previous = None
    for turn in range(1, 7):
        history[0] = system(f"Current time: 2026-12-01 10:{turn:02d}:{turn * 7 % 60:02d}")
        canon = replay.send(copy.deepcopy(history), tools)
        value = f"Current time: 2026-12-01 10:{turn:02d}:{turn * 7 % 60:02d}"
        assert all_text(canon.messages).count(value) == 1
        if previous is not None:
            assert is_prefix(previous.messages, canon.messages)  # the whole history, old blocks included
            assert canon.history.reused_turns == len(turn_spans(history)) - 1
            newest = canon.messages[-1]
            assert newest["role"] in ("tool", "user") and newest["content"].endswith(
                value + "\n</request_context>"
            )
        previous = canon
        results = [BIG] if turn % 2 else ["small a", "small b"]  # parallel calls every other turn
        history += tool_turn(turn, results, text=None if turn % 3 else "Reading.")
    for row in replay.rows[1:]:
        assert row["on"] >= row["off"] and row["stateless"] >= row["off"]
        assert row["on"] > len(BIG) or row is replay.rows[1]
    # the big tool results sit before the newest block: re-sent every turn, never re-prefilled
    assert replay.rows[-1]["on"] >= len(replay.prompts["on"][-2]) - len("<|assistant|>")


def test_stateless_form_with_changed_values_still_beats_rules_off() -> None:
    replay = Replay(DEFAULT, memory=TranscriptMemory(InProcessTranscriptStore(max_entries=1)))
    history = [system("Current time: 2026-12-01 10:00:00"), {"role": "user", "content": "hello " * 50}]
    for turn in range(1, 5):
        history[0] = system(f"Current time: 2026-12-01 11:{turn:02d}:00")
        canon = DEFAULT.apply(history)
        replay.send(history)
        assert DEFAULT.apply(canon.messages).messages == canon.messages
        history += [
            {"role": "assistant", "content": f"reply {turn}"},
            {"role": "user", "content": f"more {turn}"},
        ]
    for row in replay.rows[1:]:
        assert row["stateless"] >= row["off"]


def test_compaction_edit_retry_and_fork_never_cache_less_than_rules_off() -> None:
    replay = Replay(DEFAULT)
    base = [system("Current date: 2026-12-01")]
    turns = [
        (
            {"role": "user", "content": f"turn {i} " + "words " * 20},
            {"role": "assistant", "content": f"answer {i} " + "text " * 20},
        )
        for i in range(5)
    ]
    history = list(base)
    for user, reply in turns:
        replay.send([*history, user])
        history += [user, reply]
    compacted = [
        *base,
        {"role": "user", "content": "Summary: we talked about five things."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "go on"},
    ]
    edited = [*history[:9], {"role": "user", "content": "turn 4, edited"}]
    canon_edit = replay.send(edited)
    assert canon_edit.history.reused_turns == 4  # the request that turn 4 answered was sent before
    assert replay.send(edited).messages == canon_edit.messages  # retried as it was
    replay.send(compacted)
    replay.send(compacted)  # retried as it was
    replay.send([*compacted[:-1], {"role": "user", "content": "go on, but shorter"}])
    fork_a = [*history[:5], {"role": "user", "content": "fork A"}]
    fork_b = [*history[:5], {"role": "user", "content": "fork B"}]
    ca, cb = replay.send(fork_a), replay.send(fork_b)
    assert ca.messages[:-1] == cb.messages[:-1]
    ca2 = replay.send(
        [*fork_a, {"role": "assistant", "content": "A!"}, {"role": "user", "content": "more A"}]
    )
    cb2 = replay.send(
        [*fork_b, {"role": "assistant", "content": "B!"}, {"role": "user", "content": "more B"}]
    )
    assert is_prefix(ca.messages, ca2.messages) and is_prefix(cb.messages, cb2.messages)
    assert ca2.history.reused_turns == cb2.history.reused_turns == 3
    for row in replay.rows:
        assert row["on"] >= row["off"] and row["stateless"] >= row["off"], replay.rows


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_keeps_history_with_constant_and_with_changing_values(placement: str) -> None:
    ruleset = load_ruleset(["default"], placement=placement)
    for changing in (False, True):
        replay = Replay(ruleset)
        history = [system("Current date: 2026-12-01"), {"role": "user", "content": "first"}]
        previous = None
        for turn in range(4):
            if changing:
                history[0] = system(f"Current time: 2026-12-01 09:{turn:02d}:00")
            canon = replay.send(copy.deepcopy(history))
            if previous is not None:
                assert is_prefix(previous.messages, canon.messages), (placement, changing, turn)
            previous = canon
            history += [{"role": "assistant", "content": f"a{turn}"}, {"role": "user", "content": f"q{turn}"}]
        for row in replay.rows[1:]:
            assert row["on"] >= row["off"], (placement, changing, replay.rows)


def test_placements_in_later_turns(tmp_path: Path) -> None:
    ruleset = ruleset_from(
        tmp_path,
        """
        rules:
          - id: ticket
            match: {role: [user, tool], pattern: 'Ticket: [0-9]+'}
            action: hoist
        """,
    )
    messages = [
        {"role": "user", "content": "Ticket: 1 hello"},
        *tool_turn(1, ["Ticket: 2 ok", "Ticket: 3 ok"]),
    ]
    canon = ruleset.apply(messages)
    assert canon.messages[0]["content"] == "<request_context>\nTicket: 1\n</request_context>\n\nhello"
    assert canon.messages[2]["content"] == "ok"
    # a turn of tool results only: the block is a user message after them, never text inside a tool's output
    assert canon.messages[3]["content"] == "ok"
    assert canon.messages[4] == {
        "role": "user",
        "content": "<request_context>\nTicket: 2\nTicket: 3\n</request_context>",
    }
    assert len(canon.messages) == 5
    assert ruleset.apply(canon.messages).messages == canon.messages
    assert canon.hoisted == ["Ticket: 1", "Ticket: 2", "Ticket: 3"]


def test_content_part_lists_and_anthropic_shaped_blocks() -> None:
    first = [
        system("Current time: 2026-12-01 08:00:00"),
        {
            "role": "user",
            "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}}],
        },
    ]
    memory = TranscriptMemory()
    c1 = DEFAULT.apply(first, memory=memory, scope="s")
    assert c1.messages[1]["content"][0]["text"].startswith("<request_context>\nCurrent time")
    # Anthropic-shaped: tool_use in the assistant message, tool_result blocks in a user message
    second = [
        system("Current time: 2026-12-01 08:05:00"),
        first[1],
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": BIG}]},
    ]
    c2 = DEFAULT.apply(second, memory=memory, scope="s")
    assert c2.messages[:2] == c1.messages
    assert c2.messages[3]["content"][0] == second[3]["content"][0]
    assert c2.messages[3]["content"][1] == {
        "type": "text",
        "text": "<request_context>\nCurrent time: 2026-12-01 08:05:00\n</request_context>",
    }
    assert DEFAULT.apply(c2.messages).messages == c2.messages


@pytest.mark.parametrize("switched", ["user", "assistant"])
def test_a_client_switching_a_message_between_a_string_and_one_text_part_keeps_its_transcript(
    switched,
) -> None:
    """A fresh-user trial: with the time changing every turn, a client that resent the earlier messages as one
    text part each (they were strings) lost the whole history for a turn (stateless: cached 38 where 128 was
    due). One plain text part and a string are one form for the memory's key and its reuse check."""
    memory = TranscriptMemory()
    first = [system("Current time: 2026-12-01 08:00:00"), {"role": "user", "content": "hi"}]
    c1 = DEFAULT.apply(first, memory=memory, scope="s")
    second = [
        system("Current time: 2026-12-01 08:05:00"),
        *first[1:],
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And now?"},
    ]
    c2 = DEFAULT.apply(second, memory=memory, scope="s")
    assert c2.history.reused_turns == 1 and c2.messages[:2] == c1.messages
    third = copy.deepcopy(second)
    for message in third:
        if message["role"] == switched:
            message["content"] = [{"type": "text", "text": message["content"]}]
    third[0] = system("Current time: 2026-12-01 08:10:00")
    third += [{"role": "assistant", "content": "Still here."}, {"role": "user", "content": "Bye."}]
    c3 = DEFAULT.apply(third, memory=memory, scope="s")
    assert c3.history.reused_turns == 2 and c3.messages[:4] == c2.messages[:4]  # history never moved
    assert "08:10:00" in all_text(c3.messages[4:])
    # a breakpoint on the part is no other form (rules.cache_markers): the history is reused, the marker kept
    with_key = copy.deepcopy(third)
    with_key[1]["content"] = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]
    c4 = DEFAULT.apply(with_key, memory=memory, scope="s")
    assert c4.history.reused_turns == 2
    assert c4.messages[1]["content"][0]["cache_control"] == {"type": "ephemeral"}
    c4.messages[1]["content"][0].pop("cache_control")
    assert c4.messages[1]["content"] == [{"type": "text", "text": all_text([c3.messages[1]])}]
    assert c4.messages[2:4] == c3.messages[2:4]


def test_memory_entries_are_checked_scoped_and_bounded() -> None:
    clock = [0.0]
    store = InProcessTranscriptStore(max_entries=3, max_bytes=10_000, ttl_s=60, clock=lambda: clock[0])
    memory = TranscriptMemory(store)
    t1 = [system("Current time: 2026-12-01 10:00:00"), {"role": "user", "content": "hi"}]
    t2 = [
        system("Current time: 2026-12-01 10:01:00"),
        t1[1],
        {"role": "assistant", "content": "hey"},
        {"role": "user", "content": "next"},
    ]
    c1 = DEFAULT.apply(t1, memory=memory, scope="tenant-a")
    assert DEFAULT.apply(t2, memory=memory, scope="tenant-b").history.reused_turns == 0  # other scope
    assert DEFAULT.apply(t2, memory=memory, scope="tenant-a").messages[:2] == c1.messages
    clock[0] = 61.0  # expired
    assert DEFAULT.apply(t2, memory=memory, scope="tenant-a").history.reused_turns == 0
    # a corrupt entry and an entry that is not this conversation's form are misses, counted
    scope = conversation_scope("tenant-a", [("tail_end", "Current time: 2026-12-01 10:00:00", True)])
    key = PrefixHasher(scope, None).keys(
        DEFAULT.apply(t1).messages[:0]
        + [
            {"role": "system", "content": "You are a helpful assistant.\nAnswer briefly."},
            {"role": "user", "content": "hi"},
        ],
        [2],
    )[0]
    for bad in (b"not zlib", TranscriptEntry([{"role": "user", "content": "other"}]).encode()):
        store.put(key, bad)
        rejected = memory.stats.rejected
        assert DEFAULT.apply(t2, memory=memory, scope="tenant-a").history.reused_turns == 0
        assert memory.stats.rejected == rejected + 1
    for i in range(20):
        store.put(bytes([i]) * 32, b"x" * 2_000)
    assert len(store) <= 3 and store.stats.bytes <= 10_000 and store.stats.evicted > 0
    store.put(b"k" * 32, b"x" * 20_000)
    assert store.stats.too_big == 1
    with pytest.raises(ValueError):
        InProcessTranscriptStore(max_entries=0)


def test_keys_are_stable_hashes_of_the_stable_form() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}]
    keys = PrefixHasher("m\0t", None).keys(messages, [1, 2])
    assert keys == PrefixHasher("m\0t", None).keys(messages, [1, 2])
    assert keys[1].hex() == PrefixHasher("m\0t", None).keys(messages, [2])[0].hex()
    assert len(set(keys)) == 2 and all(len(k) == 32 for k in keys)
    assert PrefixHasher("m\0u", None).keys(messages, [2]) != keys[1:]
    assert PrefixHasher("m\0t", [{"type": "function"}]).keys(messages, [2]) != keys[1:]


def test_memory_flood_of_distinct_conversations_stays_bounded() -> None:
    store = InProcessTranscriptStore(max_entries=40, max_bytes=60_000)
    memory = TranscriptMemory(store)
    for i in range(300):
        DEFAULT.apply(
            [
                system(f"Current time: 2026-12-01 10:{i % 60:02d}:00"),
                {"role": "user", "content": f"c{i} " * 30},
                {"role": "assistant", "content": "r"},
                {"role": "user", "content": "q"},
            ],
            memory=memory,
            scope=f"t{i % 7}",
        )
        assert len(store) <= 40 and store.stats.bytes <= 60_000
    # each request of a conversation the memory never saw stores itself and its history (for the next request)
    assert memory.stats.stored == 600 and store.stats.evicted >= 560


def test_a_growing_conversation_reads_one_entry_per_request() -> None:
    class Counting(InProcessTranscriptStore):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[int] = []

        def get_many(self, keys):  # type: ignore[no-untyped-def]
            self.batches.append(len(keys))
            return super().get_many(keys)

    store = Counting()
    memory = TranscriptMemory(store)
    history = [system("Current time: 2026-12-01 10:00:00"), {"role": "user", "content": "go"}]
    for turn in range(1, 8):
        history[0] = system(f"Current time: 2026-12-01 10:{turn:02d}:00")
        assert (
            DEFAULT.apply(copy.deepcopy(history), memory=memory, scope="s").history.reused_turns == turn - 1
        )
        history += tool_turn(turn, [f"out {turn}"])
    assert store.batches == [1] * 6  # the first request has no earlier one to look up


def test_a_changed_value_in_a_later_system_message_reaches_the_newest_turn() -> None:
    """The trial: a second system message mid-conversation (``Current time: 10:00``) changed on a later turn;
    with the memory the reused history kept the old value and the new one appeared nowhere (the model read
    10:00 as current). The new value now goes into the newest turn's block, as a changed first system
    prompt's does; without a change nothing is repeated."""
    memory = TranscriptMemory(InProcessTranscriptStore())
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    DEFAULT.apply(copy.deepcopy(first), memory=memory, scope="s")
    reminder = {"role": "system", "content": "Reminder: be brief.\nCurrent time: 10:00"}
    second = [
        *first,
        {"role": "assistant", "content": "Hello."},
        reminder,
        {"role": "user", "content": "Time?"},
    ]
    DEFAULT.apply(copy.deepcopy(second), memory=memory, scope="s")
    late = "Current time: Saturday, December 5, 2026 at 11:45:30 PM"
    third = [
        *second,
        {"role": "assistant", "content": "It is 10:00."},
        {"role": "user", "content": "And now?"},
    ]
    third[3] = {"role": "system", "content": f"Reminder: be brief.\n{late}"}
    canon = DEFAULT.apply(copy.deepcopy(third), memory=memory, scope="s")
    assert canon.history.reused_turns >= 2  # the history is reused verbatim, old value included
    text = all_text(canon.messages)
    assert "11:45:30" in text and text.rindex("11:45:30") > text.rindex("And now?") - 200
    assert "11:45:30" in all_text(canon.messages[-1:])  # in the newest turn
    same = [*third, {"role": "assistant", "content": "Late."}, {"role": "user", "content": "Thanks."}]
    again = DEFAULT.apply(copy.deepcopy(same), memory=memory, scope="s")
    assert all_text(again.messages).count("11:45:30") == 1  # still current: not repeated


def test_a_few_shot_prompt_with_a_changing_time_keeps_its_examples_cached() -> None:
    examples = []
    for k in range(4):
        examples += [
            {"role": "user", "content": f"Review #{k}: " + "fine product " * 20},
            {"role": "assistant", "content": "positive" if k % 2 == 0 else "negative"},
        ]

    def request(second: int, review: str) -> list[dict]:
        return [
            system(f"Classify reviews.\nCurrent time: 2026-12-05 10:00:{second:02d}"),
            *examples,
            {"role": "user", "content": review},
        ]

    memory = TranscriptMemory(InProcessTranscriptStore())
    first = DEFAULT.apply(request(1, "Broke after a day."), memory=memory, scope="s")
    second = DEFAULT.apply(request(2, "Works great."), memory=memory, scope="s")
    shared = 1 + len(examples)  # the system prompt and every example
    assert second.messages[:shared] == first.messages[:shared]
    assert second.history.reused_turns == 4
    assert "10:00:02" in second.messages[-1]["content"] and "10:00:01" in all_text(second.messages[:2])
    # without the memory each request says its own time in the first example's block
    stateless = DEFAULT.apply(request(2, "Works great."))
    assert "10:00:02" in all_text(stateless.messages[:2])
