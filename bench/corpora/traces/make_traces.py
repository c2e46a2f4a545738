"""Writes the multi-turn trace corpus (``*.jsonl`` beside this file): one request body a line, each line the
whole conversation as a client resends it. All text is made up here (no published prompt text).

Run ``python -m bench.corpora.traces.make_traces`` to regenerate; the output is deterministic (seeded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
WORDS = (
    "alpha beta gamma delta render buffer index query cache block token route gateway engine "
    "scheduler prefill decode tenant replica budget window vector module handler request reply "
    "stream parser config layer kernel tensor batch stage commit branch merge review"
).split()

ASSISTANT_SYSTEM = """You are Quill, a writing and research assistant made by Northwind Labs.
Current date: {date}

Guidelines:
- Answer in the language of the user's question; keep answers short unless asked for detail.
- When you are unsure, say so and suggest how the user could check.
- Use Markdown lists for steps, and fenced code blocks for code.
- Never invent citations; when you quote, name the source the user gave you.
- Be warm but direct. Do not apologise more than once per conversation.

About the product: Quill runs inside the Northwind notebook app. Users can attach notes and ask
questions about them. Attached notes appear in the conversation as plain text.
"""

AGENT_SYSTEM = """You are Forge, an autonomous coding agent working in the user's repository.
Current time: {time}
Working directory: /home/dev/projects/orbit

Rules of work:
1. Read before you write: open the files you will change and the tests that cover them.
2. Make the smallest change that solves the task; keep the existing style.
3. After each change run the tests with the run_tests tool and read the failures carefully.
4. Never delete user data or force-push. Ask before running commands that touch the network.
5. When done, summarise what changed, file by file, and what you did not do.

Tools return their output verbatim. Large outputs are truncated at 20,000 characters.
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or one test file.",
            "parameters": {"type": "object", "properties": {"target": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "grep",
            "description": "Search the repository for a string.",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}},
                "required": ["pattern"],
            },
        },
    },
]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(sentence(rng, rng.randint(6, 14)) for _ in range(sentences))


def big_file(rng: random.Random, lines: int) -> str:
    """Made-up Python source, about 10 tokens a line."""
    out = []
    for i in range(lines):
        a, b, c = rng.choice(WORDS), rng.choice(WORDS), rng.choice(WORDS)
        kind = i % 5
        if kind == 0:
            out.append(f"def {a}_{b}_{i}({c}, limit={rng.randint(1, 999)}):")
        elif kind == 1:
            out.append(f"    {a} = {c}.{b}({rng.randint(0, 99)})")
        elif kind == 2:
            out.append(f"    if {a} > limit:  # {b} {c}")
        elif kind == 3:
            out.append(f"        raise ValueError('{a} {b} over limit')")
        else:
            out.append(f"    return {a} + {rng.randint(0, 9)}")
    return "\n".join(out)


def test_log(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        status = "PASSED" if rng.random() > 0.1 else "FAILED"
        out.append(
            f"tests/test_{rng.choice(WORDS)}.py::test_{rng.choice(WORDS)}_{i} {status} [{i * 100 // lines:3d}%]"
        )
    return "\n".join(out)


def write(name: str, bodies: list[dict[str, Any]]) -> None:
    with (HERE / f"{name}.jsonl").open("w", encoding="utf-8") as f:
        for body in bodies:
            f.write(json.dumps(body, ensure_ascii=False) + "\n")


def chat_trace(rng: random.Random) -> list[dict[str, Any]]:
    """Seven chat turns, the date the same all day (OpenAI bodies, one user turn as content parts)."""
    system = ASSISTANT_SYSTEM.format(date="Tuesday, December 1, 2026")
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    bodies = []
    for turn in range(7):
        question = f"Question {turn + 1}: {sentence(rng, 12)} {sentence(rng, 8)}"
        if turn == 3:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Attached note:"},
                        {"type": "text", "text": paragraph(rng, 12)},
                        {"type": "text", "text": question},
                    ],
                }
            )
        else:
            messages.append({"role": "user", "content": question})
        bodies.append({"model": "quill", "messages": [dict(m) for m in messages]})
        messages.append({"role": "assistant", "content": paragraph(rng, rng.randint(2, 6))})
    return bodies


def agent_trace(rng: random.Random, turns: int = 9) -> list[dict[str, Any]]:
    """An agent loop: the time changes every request, tool calls (one parallel pair) and large results."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": ""},
        {"role": "user", "content": "Task: the cache " + paragraph(rng, 3)},
    ]
    bodies = []
    minute = 0
    for turn in range(turns):
        minute += rng.randint(1, 4)
        messages[0] = {
            "role": "system",
            "content": AGENT_SYSTEM.format(time=f"2026-12-01 10:{minute:02d}:{rng.randint(0, 59):02d} UTC"),
        }
        bodies.append({"model": "forge", "tools": TOOLS, "messages": [dict(m) for m in messages]})
        calls = [("read_file", {"path": f"orbit/{rng.choice(WORDS)}.py"})]
        if turn == 3:
            calls.append(("grep", {"pattern": rng.choice(WORDS)}))
        if turn % 3 == 2:
            calls = [("run_tests", {"target": "tests/"})]
        ids = [f"call_{turn}_{i}_{rng.randrange(16**6):06x}" for i in range(len(calls))]
        messages.append(
            {
                "role": "assistant",
                "content": sentence(rng, 8) if turn % 2 else None,
                "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                    for i, (n, a) in zip(ids, calls, strict=True)
                ],
            }
        )
        for call_id, (name, _) in zip(ids, calls, strict=True):
            if name == "read_file":
                result = big_file(rng, 400 if turn in (1, 4) else 60)
            elif name == "run_tests":
                result = test_log(rng, 120)
            else:
                result = "\n".join(
                    f"orbit/{rng.choice(WORDS)}.py:{rng.randint(1, 500)}: {sentence(rng, 6)}"
                    for _ in range(15)
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return bodies


def to_anthropic(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI agent body as the same conversation in the Anthropic Messages shape."""
    out: list[dict[str, Any]] = []
    for m in body["messages"][1:]:
        if m["role"] == "assistant":
            blocks = [{"type": "text", "text": m["content"]}] if m.get("content") else []
            blocks += [
                {
                    "type": "tool_use",
                    "id": c["id"],
                    "name": c["function"]["name"],
                    "input": json.loads(c["function"]["arguments"]),
                }
                for c in m.get("tool_calls", [])
            ]
            out.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": "user", "content": m["content"]})
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in body.get("tools", [])
    ]
    return {
        "model": body["model"],
        "max_tokens": 1024,
        "system": body["messages"][0]["content"],
        "tools": tools,
        "messages": out,
    }


def compaction_trace(rng: random.Random) -> list[dict[str, Any]]:
    """Six chat turns, then the client replaces the first four turns by a summary and goes on."""
    system = ASSISTANT_SYSTEM.format(date="2026-12-01")
    history: list[dict[str, Any]] = []
    bodies = []
    for turn in range(9):
        history.append({"role": "user", "content": f"Turn {turn + 1}: {sentence(rng, 14)}"})
        bodies.append({"model": "quill", "messages": [{"role": "system", "content": system}, *history]})
        history.append({"role": "assistant", "content": paragraph(rng, 4)})
        if turn == 5:
            summary = "Summary of the conversation so far: " + paragraph(rng, 5)
            history = [
                {"role": "user", "content": summary},
                {"role": "assistant", "content": "Understood, continuing from the summary."},
                *history[8:],
            ]
    return bodies


def retry_edit_trace(rng: random.Random) -> list[dict[str, Any]]:
    """Turn 3 is sent, retried as it was (a new time), then edited; the conversation goes on from the edit."""
    history = [
        {"role": "user", "content": f"First: {sentence(rng, 10)}"},
        {"role": "assistant", "content": paragraph(rng, 3)},
        {"role": "user", "content": f"Second: {sentence(rng, 10)}"},
        {"role": "assistant", "content": paragraph(rng, 3)},
    ]
    third = {"role": "user", "content": f"Third: {sentence(rng, 10)}"}
    edited = {"role": "user", "content": f"Third, rephrased: {sentence(rng, 12)}"}
    bodies = []
    for minute, messages in enumerate(
        [
            history[:1],
            history[:3],
            [*history, third],
            [*history, third],
            [*history, edited],
            [
                *history,
                edited,
                {"role": "assistant", "content": paragraph(rng, 3)},
                {"role": "user", "content": f"Fourth: {sentence(rng, 9)}"},
            ],
        ]
    ):
        system = AGENT_SYSTEM.format(time=f"2026-12-01 15:{minute * 7:02d}:00 UTC")
        bodies.append({"model": "forge", "messages": [{"role": "system", "content": system}, *messages]})
    return bodies


def fork_trace(rng: random.Random) -> list[dict[str, Any]]:
    """Two turns, then two different third turns on the same history, each continued once."""
    system = ASSISTANT_SYSTEM.format(date="December 1, 2026")
    base = [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Start: {sentence(rng, 10)}"},
        {"role": "assistant", "content": paragraph(rng, 3)},
        {"role": "user", "content": f"Then: {sentence(rng, 10)}"},
    ]
    reply = {"role": "assistant", "content": paragraph(rng, 3)}
    a = [*base, reply, {"role": "user", "content": f"Fork A: {sentence(rng, 10)}"}]
    b = [*base, reply, {"role": "user", "content": f"Fork B: {sentence(rng, 10)}"}]
    a2 = [*a, {"role": "assistant", "content": paragraph(rng, 2)}, {"role": "user", "content": "More on A."}]
    b2 = [*b, {"role": "assistant", "content": paragraph(rng, 2)}, {"role": "user", "content": "More on B."}]
    return [{"model": "quill", "messages": m} for m in (base[:2], base, a, b, a2, b2)]


def main() -> None:
    rng = random.Random(11)
    write("chat_date", chat_trace(rng))
    write("agent_time", agent_trace(rng))
    write("agent_time_anthropic", [to_anthropic(b) for b in agent_trace(random.Random(12), turns=7)])
    write("compaction", compaction_trace(rng))
    write("retry_edit", retry_edit_trace(rng))
    write("fork", fork_trace(rng))


if __name__ == "__main__":
    main()
