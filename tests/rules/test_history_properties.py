"""Properties of history canonicalization on random traces: rules on (with and without the transcript
memory) never caches less than rules off, canonicalization is idempotent, every current hoisted value is
in the prompt exactly once, and the memory stays bounded."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rules import load_ruleset
from rules.transcript import InProcessTranscriptStore, TranscriptMemory
from tests.rules.helpers import all_text
from tests.rules.history_traces import SYSTEM, Replay, tool_turn

RULESETS = {p: load_ruleset(["default"], placement=p) for p in ("tail_end", "last_user_prefix", "system_end")}
WORDS = st.text(alphabet="abcdefgh ijk\n", min_size=1, max_size=40)
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def system_for(kind: str, step: int) -> dict[str, Any]:
    if kind == "none":
        line = "Be kind."
    elif kind == "date":
        line = "Current date: 2026-12-01"
    else:
        line = f"Current time: 2026-12-01 {10 + step // 60:02d}:{step % 60:02d}:00"
        if kind == "both":
            line = "Current date: 2026-12-01\n" + line.replace("Current time", "Local time")
    return {"role": "system", "content": SYSTEM.format(line=line)}


def current_values(kind: str, step: int) -> list[str]:
    content = system_for(kind, step)["content"]
    return [line for line in content.split("\n") if line.startswith(("Current", "Local"))]


@st.composite
def traces(draw: st.DrawFn) -> tuple[str, str, list[list[dict[str, Any]]]]:
    """(system kind, placement, requests): a conversation grown by random events, each request the whole
    conversation as a client resends it."""
    kind = draw(st.sampled_from(["none", "date", "time", "both"]))
    placement = draw(st.sampled_from(sorted(RULESETS)))
    history: list[dict[str, Any]] = [{"role": "user", "content": draw(WORDS)}]
    saved: list[list[dict[str, Any]]] = []
    requests = []
    for step in range(draw(st.integers(2, 7))):
        requests.append([system_for(kind, step), *copy.deepcopy(history)])
        saved.append(copy.deepcopy(history))
        event = draw(st.sampled_from(["chat", "tools", "parts", "retry", "edit", "compact", "fork"]))
        if event == "chat":
            history += [
                {"role": "assistant", "content": draw(WORDS)},
                {"role": "user", "content": draw(WORDS)},
            ]
        elif event == "tools":
            results = draw(st.lists(WORDS, min_size=1, max_size=3))
            history += tool_turn(step, results, text=draw(st.one_of(st.none(), WORDS)))
        elif event == "parts":
            history += [
                {"role": "assistant", "content": draw(WORDS)},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": t} for t in draw(st.lists(WORDS, min_size=1, max_size=3))
                    ],
                },
            ]
        elif event == "edit" and history[-1]["role"] == "user":
            history[-1] = {"role": "user", "content": draw(WORDS)}
        elif event == "compact":
            history = [
                {"role": "user", "content": "Summary: " + draw(WORDS)},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": draw(WORDS)},
            ]
        elif event == "fork":
            history = copy.deepcopy(saved[draw(st.integers(0, len(saved) - 1))])
            if history[-1]["role"] == "user":
                history[-1] = {"role": "user", "content": draw(WORDS)}
            else:
                history.append({"role": "user", "content": draw(WORDS)})
        # "retry": the same history again
    return kind, placement, requests


@SETTINGS
@given(trace=traces())
def test_rules_on_never_caches_less_than_rules_off(trace: tuple) -> None:
    kind, placement, requests = trace
    ruleset = RULESETS[placement]
    replay = Replay(ruleset)
    for step, messages in enumerate(requests):
        on = replay.send(messages)
        row = replay.rows[-1]
        assert row["on"] >= row["off"], (step, replay.rows)
        assert row["stateless"] >= row["off"], (step, replay.rows)
        stateless = ruleset.apply(messages)
        # idempotent, with and without the memory's old blocks in the history
        assert ruleset.apply(stateless.messages).messages == stateless.messages
        assert ruleset.apply(on.messages).messages == on.messages
        # every value the system prompt holds now is in the prompt exactly once, none left in the system
        for value in current_values(kind, step):
            assert all_text(stateless.messages).count(value) == 1, (value, stateless.messages)
            assert all_text(on.messages).count(value) == 1, (value, on.messages)
            assert value not in str(on.messages[0]["content"]).split("<request_context>")[0]


@SETTINGS
@given(n=st.integers(50, 150), max_entries=st.integers(1, 30), max_bytes=st.integers(500, 20_000))
def test_memory_is_bounded_under_a_flood_of_conversations(n: int, max_entries: int, max_bytes: int) -> None:
    store = InProcessTranscriptStore(max_entries=max_entries, max_bytes=max_bytes)
    memory = TranscriptMemory(store)
    ruleset = RULESETS["tail_end"]
    for i in range(n):
        ruleset.apply(
            [
                system_for("time", i),
                {"role": "user", "content": f"conversation {i} " * (i % 9 + 1)},
                {"role": "assistant", "content": "r"},
                {"role": "user", "content": "q"},
            ],
            memory=memory,
            scope=f"tenant{i % 5}",
        )
        assert len(store) <= max_entries
        assert store.stats.bytes <= max_bytes
    # each request of a conversation the memory never saw stores itself and its history (for the next request)
    assert memory.stats.stored == 2 * n
    assert store.stats.puts + store.stats.too_big == 2 * n
