"""Differential test of the incremental ``RuleSet.apply``: byte-identical to the algorithm it replaced.

The reference (``tests/rules/reference_canonicalize.py``) canonicalizes every turn again on every request and
decodes, strips and encodes the whole transcript; ``RuleSet.apply`` now reuses what earlier requests of the
conversation gave (``history_memo``, ``TranscriptMemory.recall`` / ``remember_after``). Each side has its own
rule set and memory; every request must give the same ``to_dict`` JSON (key order of every object included), the
same ``applied`` order and history counts, the same memory counters and the same stored entries.
"""

from __future__ import annotations

import copy
import json
import random
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.rules_traces import read_trace
from rules import Canonical, RuleSet, load_ruleset
from rules.bounded_lru import BoundedLRU
from rules.history_turns import LATER_LOOKUPS
from rules.transcript import InProcessTranscriptStore, TranscriptEntry, TranscriptMemory
from rules.turn_rules import TurnRules
from tests.rules.helpers import write_rules
from tests.rules.history_traces import tool_turn
from tests.rules.reference_canonicalize import reference_apply
from tests.rules.test_history_properties import traces

TRACES = sorted((Path(__file__).resolve().parents[2] / "bench" / "corpora" / "traces").glob("*.jsonl"))
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WORDS = st.text(alphabet="abcdefgh ijk\n", min_size=0, max_size=30)

SELECTOR_RULES = """
rules:
  - id: first-user-ticket
    match: {role: user, position: first, pattern: 'T-\\d+'}
    action: hoist
  - id: last-user-date
    match: {role: [user, tool], position: last, pattern: '\\d{4}-\\d{2}-\\d{2}'}
    action: hoist
    placement: before_last_user
  - id: index-one
    match: {index: 1, pattern: 'id=\\w+'}
    action: hoist
    placement: last_user_prefix
  - id: index-minus-two
    match: {index: -2, pattern: 'x+'}
    action: replace
    with: 'x'
  - id: assistant-first
    match: {role: assistant, position: first, pattern: 'run \\d+'}
    action: drop
  - id: system-clock
    match: {role: system, pattern: '\\d\\d:\\d\\d'}
    action: hoist
    placement: system_end
  - id: tidy
    action: normalize
"""


def dump(canon: Canonical) -> str:
    """Everything the canonical request says, with every object's key order (``to_dict`` sorts ``applied``)."""
    return json.dumps(
        [canon.to_dict(), list(canon.applied.items()), vars(canon.history)], ensure_ascii=False, default=str
    )


class Pair:
    """The reference and the incremental algorithm side by side, each with its own rule set and memory."""

    def __init__(self, make: Any, memory: bool = True) -> None:
        self.old: RuleSet = make()
        self.new: RuleSet = make()
        self.stores = (InProcessTranscriptStore(), InProcessTranscriptStore())
        self.memories = tuple(TranscriptMemory(s) for s in self.stores) if memory else (None, None)
        self.requests = 0

    def send(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, scope: str = "m\0t"
    ) -> Canonical:
        """Both algorithms on one request; asserts they agree and that the input is untouched."""
        before = json.dumps([messages, tools])
        old = reference_apply(
            self.old, copy.deepcopy(messages), copy.deepcopy(tools), memory=self.memories[0], scope=scope
        )
        new = self.new.apply(messages, tools, memory=self.memories[1], scope=scope)
        assert json.dumps([messages, tools]) == before  # the caller's objects are not touched
        assert dump(new) == dump(old), self.requests
        if self.memories[0] is not None:
            assert vars(self.memories[1].stats) == vars(self.memories[0].stats)
            # the same entries under the same keys (the bytes differ: the incremental side writes an entry's
            # earlier messages as the frames it stored before, the reference one frame of all of them)
            stored = [
                [(key, TranscriptEntry.decode(value)) for key, (value, _) in s._data.items()]
                for s in self.stores
            ]
            assert stored[1] == stored[0]
            assert None not in [entry for _, entry in stored[1]]
        self.requests += 1
        return new


def default_rules(placement: str | None = None) -> Any:
    return lambda: load_ruleset(["default"], placement=placement)


@pytest.mark.parametrize("placement", [None, "last_user_prefix", "before_last_user", "system_end"])
@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_recorded_traces_give_the_same_requests(path: Path, placement: str | None) -> None:
    requests, errors = read_trace(path)
    assert requests and not errors
    with_memory, stateless = Pair(default_rules(placement)), Pair(default_rules(placement), memory=False)
    for _, messages, tools in requests:
        on = with_memory.send(messages, tools)
        stateless.send(messages, tools)
        with_memory.send(on.messages, on.tools)  # a canonical request resent: its blocks are taken out
    assert with_memory.new.history_memo.hits > 0  # the incremental path ran
    assert with_memory.memories[1].stats.hits > 0


@SETTINGS
@given(trace=traces(), data=st.data())
def test_random_conversations_give_the_same_requests(trace: tuple, data: st.DataObject) -> None:
    _, placement, requests = trace
    with_memory, stateless = Pair(default_rules(placement)), Pair(default_rules(placement), memory=False)
    for messages in requests:
        on = with_memory.send(messages)
        stateless.send(messages)
        if data.draw(st.booleans()):  # the canonical form resent, or a later request built on it
            follow = [
                *on.messages,
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more"},
            ]
            with_memory.send(data.draw(st.sampled_from([on.messages, follow])))


@st.composite
def edited_conversations(draw: st.DrawFn) -> list[list[dict[str, Any]]]:
    """Conversations over every role, with block-shaped text pasted anywhere (the hand-edited requests whose
    turns change when the blocks come out), grown and resent turn by turn."""
    block = st.sampled_from(
        ["<request_context>\n2026-01-02\n</request_context>", "<request_context>\nT-12\n</request_context>"]
    )
    text = st.one_of(
        WORDS,
        block,
        st.builds(lambda a, b: a + "\n\n" + b, WORDS, block),
        st.builds(lambda a, b: a + "\n\n" + b, block, WORDS),
        st.sampled_from(["T-7 id=abc 2026-03-04 xxx", "run 5 at 10:42", "id=q T-9", "xx 09:15"]),
    )
    role = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
    message = st.one_of(
        st.builds(lambda r, t: {"role": r, "content": t}, role, text),
        st.builds(lambda t: {"role": "user", "content": [{"type": "text", "text": t}]}, text),
        st.builds(lambda t: {"content": t, "role": "user"}, text),  # other key order
        st.just({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}),
    )
    conversation = draw(st.lists(message, min_size=1, max_size=6))
    requests = [copy.deepcopy(conversation)]
    for _ in range(draw(st.integers(1, 5))):
        conversation += [{"role": "assistant", "content": draw(text)}, *draw(st.lists(message, max_size=3))]
        requests.append(copy.deepcopy(conversation))
    return requests


@SETTINGS
@given(requests=edited_conversations(), placement=st.sampled_from([None, "before_last_user", "system_end"]))
def test_hand_edited_and_odd_conversations_give_the_same_requests(
    requests: list[list[dict[str, Any]]], placement: str | None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = write_rules(tmp_path_factory.mktemp("rules"), SELECTOR_RULES)
    makers = [default_rules(placement), lambda: load_ruleset([str(path)], placement=placement)]
    for make in makers:
        with_memory, stateless = Pair(make), Pair(make, memory=False)
        for messages in requests:
            with_memory.send(messages)
            stateless.send(messages)
            with_memory.send(messages, scope="other")


def test_a_long_agent_conversation_reuses_its_turns_and_keeps_the_memos_bounded() -> None:
    rng = random.Random(7)
    pair = Pair(default_rules())
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    system = "You are Forge. Current time: 2026-12-01 10:{:02d}:00"
    for step in range(30):
        pair.send([{"role": "system", "content": system.format(step)}, *history])
        if rng.random() < 0.5:
            history += tool_turn(step, [f"result {step} {rng.random()}"], text=None)
        else:
            history += [
                {"role": "assistant", "content": f"step {step}"},
                {"role": "user", "content": "go on"},
            ]
    memo = pair.new.history_memo
    # the system prompt's time changes every request, so its first turn is new each time; the later turns of
    # every request from the third on are found (the second has no later turns before its new one)
    assert memo.hits == 28
    assert pair.memories[1].recalled.hits == 29
    memo.check()  # the bounds hold
    pair.memories[1].recalled.check()


@pytest.mark.parametrize("clock", [False, True])
def test_each_request_of_a_long_conversation_canonicalizes_only_its_new_turns(
    clock: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a request that went on from an earlier request's later turns must store its own under a key the next
    # request finds: each request from the third on runs the rules on its new turn alone (and on the first
    # turn when the system prompt's clock moved), however long the conversation
    turns_run: list[int] = []
    real_turn = TurnRules.run

    def counting_turn(self: TurnRules, *args: Any, **kwargs: Any) -> Any:
        turns_run[-1] += 1
        return real_turn(self, *args, **kwargs)

    monkeypatch.setattr(TurnRules, "run", counting_turn)
    pair = Pair(default_rules())
    history: list[dict[str, Any]] = [{"role": "user", "content": "Question 0?"}]
    for step in range(25):
        system = f"You are Atlas. Current time: 2026-12-01 10:{step if clock else 0:02d}:00."
        turns_run.append(0)
        pair.send([{"role": "system", "content": system}, *history])
        history += [
            {"role": "assistant", "content": f"Answer {step}."},
            {"role": "user", "content": f"Question {step + 1}?"},
        ]
    # the reference side runs its own turns (not through TurnRules.run); these are the incremental side's
    assert turns_run[:2] == [1, 2]
    assert turns_run[2:] == [2 if clock else 1] * 23


def test_outputs_share_nothing_with_the_memos() -> None:
    ruleset, memory = load_ruleset(["default"]), TranscriptMemory()
    first = [
        {"role": "system", "content": "Current date: 2026-12-01"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    second = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    a = ruleset.apply(first, memory=memory, scope="s")
    expected = json.dumps(ruleset.apply(second, memory=memory, scope="s").to_dict())
    for canon in (a, ruleset.apply(second, memory=memory, scope="s")):
        for message in canon.messages:  # a caller scribbling over its result
            message["role"] = "tool"
            if isinstance(message.get("content"), list):
                message["content"][0]["text"] = "changed"
            message["content"] = "changed"
    assert json.dumps(ruleset.apply(second, memory=memory, scope="s").to_dict()) == expected


def test_threads_sharing_a_rule_set_and_a_memory_get_the_same_requests() -> None:
    ruleset, memory = load_ruleset(["default"]), TranscriptMemory()
    system = {"role": "system", "content": "Current date: 2026-12-01. Be brief."}

    def conversation(n: int) -> list[list[dict[str, Any]]]:
        history: list[dict[str, Any]] = [{"role": "user", "content": f"q0 of {n % 3}"}]
        requests = []
        for t in range(6):
            requests.append([system, *copy.deepcopy(history)])
            history += [{"role": "assistant", "content": f"a{t}"}, {"role": "user", "content": f"q{t + 1}"}]
        return requests

    def expected(n: int) -> list[str]:
        pair = Pair(default_rules())
        return [dump(pair.send(m, scope=f"s{n % 3}")) for m in conversation(n)]

    want = {n: expected(n) for n in range(3)}
    got: dict[int, list[str]] = {}

    def run(n: int) -> None:
        got[n] = [dump(ruleset.apply(m, memory=memory, scope=f"s{n % 3}")) for m in conversation(n)]

    threads = [threading.Thread(target=run, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for n in range(12):  # a conversation sent twice at once is the same conversation resent: same prompts
        assert [json.loads(x)[0]["messages"] for x in got[n]] == [
            json.loads(x)[0]["messages"] for x in want[n % 3]
        ]


def test_rule_sets_sharing_one_history_memo_keep_their_own_results(tmp_path: Path) -> None:
    """A learned rule set shares its base's ``history_memo`` (one bound for all): the same conversation through
    two rule sets that rewrite it differently gives each what a rule set with its own memo gives."""
    path = write_rules(
        tmp_path, "rules:\n  - id: x-out\n    match: {pattern: 'xx+'}\n    action: replace\n    with: 'x'\n"
    )
    base = load_ruleset(["default"])
    shared = RuleSet(
        base.rules + load_ruleset([str(path)]).rules, base.sources, history_memo=base.history_memo
    )
    alone = RuleSet(base.rules + load_ruleset([str(path)]).rules, base.sources)
    turns: list[dict[str, Any]] = [{"role": "system", "content": "Be brief. xxxx"}]
    for i in range(4):
        turns.append({"role": "user", "content": f"question {i} xxx"})
        for ruleset in (base, shared):
            ruleset.apply(copy.deepcopy(turns), scope="s")
        assert dump(shared.apply(copy.deepcopy(turns), scope="s")) == dump(
            alone.apply(copy.deepcopy(turns), scope="s")
        )
        assert "xxx" in json.dumps(base.apply(copy.deepcopy(turns), scope="s").messages)
        turns.append({"role": "assistant", "content": f"answer {i} xx"})
    assert shared.history_memo is base.history_memo and base.history_memo.hits > 0


def test_a_request_of_many_turns_looks_up_a_bounded_number_of_earlier_forms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # each lookup's key holds the later turns' messages, so trying every earlier length made a request of n
    # turns cost O(n^2) on the event loop (50,000 alternating messages took 48 s): at most LATER_LOOKUPS
    later_sizes: list[int] = []
    real_get = BoundedLRU.get

    def counting_get(self: BoundedLRU, key: Any) -> Any:
        if isinstance(key, tuple) and key[:1] == ("later",):
            later_sizes.append(len(key[-1]))
        return real_get(self, key)

    monkeypatch.setattr(BoundedLRU, "get", counting_get)
    pair = Pair(default_rules())
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}"} for i in range(2 * 200 + 1)
    ]
    pair.send(messages)
    assert len(later_sizes) == LATER_LOOKUPS
    assert later_sizes == sorted(later_sizes, reverse=True)  # the longest earlier forms first


def test_a_request_whose_earlier_form_is_further_back_than_the_lookups_goes_the_full_way() -> None:
    # 40 turns added at once: the earlier request's form is not looked up, and the answer is the reference's
    pair = Pair(default_rules())
    history: list[dict[str, Any]] = [{"role": "system", "content": "You are Atlas. Today is 2026-12-01."}]
    for step in range(4):
        history += [
            {"role": "user", "content": f"Question {step}?"},
            {"role": "assistant", "content": "Yes."},
        ]
    pair.send([*history, {"role": "user", "content": "Go on?"}])
    hits = pair.new.history_memo.hits
    for step in range(LATER_LOOKUPS + 24):
        history += [{"role": "user", "content": f"Later {step}?"}, {"role": "assistant", "content": "No."}]
    pair.send([*history, {"role": "user", "content": "And now?"}])
    assert pair.new.history_memo.hits == hits + 1  # the first turn only
    history += [{"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Done."}]
    pair.send([*history, {"role": "user", "content": "Last?"}])
    assert pair.new.history_memo.hits == hits + 3  # the first turn and the previous request's later turns
