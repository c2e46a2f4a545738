"""Rules cost of a resent conversation: microseconds per ``RuleSet.apply`` at 0, 5, 20 and 40 earlier turns.

The request shape is bench/overhead's (``bench.overhead.run``: its system prompt, with a date the default rules
hoist, and a new passenger question each request; ``clock``: the same prompt with the current time to the
second instead, new in every request), grown into a conversation: every earlier turn is a question
and the assistant's reply, then the new question. Each measured request is what a client sends next: the
conversation so far plus a new question, through the default rules with the canonical transcript memory (what
the gateway does), after the conversation was sent turn by turn once (so the memory and the memos hold it, as
they would). Two algorithms, interleaved in one run, each with its own ``RuleSet`` and memory:

- ``before``: ``RuleSet.apply`` as it was before session 7's incremental rewrite (every turn canonicalized and
  the whole transcript decoded, stripped and encoded again on every request), kept as the reference of the
  differential test (``tests/rules/reference_canonicalize.py``);
- ``after``: ``RuleSet.apply`` now.

Both give the same output (asserted here on every measured request, as in ``tests/rules/test_incremental.py``).

``python -m bench.rules_history [--rounds N] [--requests N]`` prints a table (median over rounds of the mean per
request in a round) and a final JSON line. Run it under ``flock /work/wt/bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.overhead.run import QUESTION, SYSTEM_PROMPT
from rules import RuleSet, TranscriptMemory, load_ruleset
from tests.rules.reference_canonicalize import reference_apply

TURNS = (0, 5, 20, 40)
SCOPE = "model\0tenant"
REPLY = "Yes: bicycles travel free outside the morning and evening peaks, in the marked carriages only ({n})."


SHAPES = ("date", "clock", "agent")
"""``date``: bench/overhead's system prompt as it is (its date is the same all day); ``clock``: the same prompt
with the current time to the second instead, so its first turn is new in every request (an agent's prompt);
``agent``: the ``date`` prompt, each earlier turn a tool call and its ~4 kB result (a coding agent's loop)."""

TOOL_RESULT = "src/gateway/app.py:{n}: line of a large tool result, the file read back whole\n" * 55
"""~4 kB of tool output per ``agent`` turn."""


def conversation(turns: int, question: int, shape: str = "date") -> list[dict[str, Any]]:
    """``turns`` earlier (question, reply) turns, then new question number ``question``; ``agent``: the task,
    ``turns`` earlier (tool call, result) turns, then a new call whose result is number ``question``."""
    system = SYSTEM_PROMPT
    if shape == "clock":
        clock = f"{10 + question // 3600 % 12:02d}:{question // 60 % 60:02d}:{question % 60:02d}"
        system = system.replace("Current date: 2026-12-01.", f"Current time: 2026-12-01 {clock}.")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    if shape == "agent":  # the task, the earlier tool turns, then this request's new call and result
        messages.append({"role": "user", "content": QUESTION.format(n=0)})
        for n in [*range(turns), question]:
            call = {
                "id": f"call_{n}",
                "type": "function",
                "function": {"name": "read", "arguments": f'{{"n": {n}}}'},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": f"call_{n}", "content": TOOL_RESULT.format(n=n)})
        return messages
    for t in range(turns):
        messages.append({"role": "user", "content": QUESTION.format(n=t)})
        messages.append({"role": "assistant", "content": REPLY.format(n=t)})
    messages.append({"role": "user", "content": QUESTION.format(n=question)})
    return messages


class Side:
    """One algorithm with its own rule set and transcript memory."""

    def __init__(self, name: str, reference: bool) -> None:
        self.name = name
        self.ruleset: RuleSet = load_ruleset(["default"])
        self.memory = TranscriptMemory()
        self.reference = reference

    def apply(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The canonical request as ``to_dict`` gives it."""
        if self.reference:
            canon = reference_apply(self.ruleset, messages, None, memory=self.memory, scope=SCOPE)
        else:
            canon = self.ruleset.apply(messages, None, memory=self.memory, scope=SCOPE)
        return canon.to_dict()

    def warm(self, turns: int, shape: str) -> None:
        """Send the conversation turn by turn up to ``turns`` earlier turns."""
        for t in range(turns + 1):
            self.apply(conversation(t, t, shape))

    def timed(self, turns: int, questions: range, shape: str) -> float:
        """Mean microseconds per request over ``questions`` (each a new question after ``turns`` turns)."""
        requests = [conversation(turns, q, shape) for q in questions]
        t0 = time.perf_counter()
        for messages in requests:
            self.apply(messages)
        return (time.perf_counter() - t0) / len(requests) * 1e6


def run(rounds: int, requests: int) -> dict[str, dict[int, dict[str, float]]]:
    """Interleaved rounds; shape -> turns -> {before, after} median microseconds."""
    sides = [Side("before", True), Side("after", False)]
    for side in sides:
        for shape in SHAPES:
            for turns in TURNS:
                side.warm(turns, shape)
    for shape in SHAPES:  # the same output, request by request
        for turns in TURNS:
            for q in range(3):
                messages = conversation(turns, 10_000 + q, shape)
                outs = [json.dumps(side.apply(messages), ensure_ascii=False) for side in sides]
                assert outs[0] == outs[1], f"outputs differ at {turns} turns ({shape})"
    samples: dict[tuple[str, int, str], list[float]] = {}
    question = 20_000
    for r in range(rounds):
        for shape in SHAPES:
            for turns in TURNS:
                for side in sides if r % 2 == 0 else sides[::-1]:
                    qs = range(question, question + requests)
                    samples.setdefault((shape, turns, side.name), []).append(side.timed(turns, qs, shape))
                question += requests
    return {
        shape: {
            turns: {side.name: statistics.median(samples[(shape, turns, side.name)]) for side in sides}
            for turns in TURNS
        }
        for shape in SHAPES
    }


def main(argv: list[str] | None = None) -> None:
    """Print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args(argv)
    result = run(args.rounds, args.requests)
    print(
        f"RuleSet.apply, default rules + transcript memory, µs per request (median of {args.rounds} rounds)"
    )
    print(f"{'system prompt':>14} {'earlier turns':>14} {'before':>9} {'after':>9} {'ratio':>7}")
    for shape, rows in result.items():
        for turns, row in rows.items():
            ratio = row["before"] / row["after"]
            print(f"{shape:>14} {turns:>14} {row['before']:>9.1f} {row['after']:>9.1f} {ratio:>6.1f}x")
    out = {shape: {str(t): row for t, row in rows.items()} for shape, rows in result.items()}
    print(json.dumps({"us_per_apply": out}, sort_keys=True))


if __name__ == "__main__":
    main()
