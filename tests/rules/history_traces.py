"""Helpers for the history tests: a plain renderer (a ChatML-like prompt, tool calls as JSON), common
prefixes, and builders of conversations as clients resend them."""

from __future__ import annotations

import json
from typing import Any

from rules import Canonical, RuleSet
from rules.transcript import TranscriptMemory

SYSTEM = "You are a helpful assistant.\n{line}\nAnswer briefly."


def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text a template would produce: every text slot, other parts and tool calls as JSON."""
    out = [json.dumps(tools, sort_keys=True)] if tools else []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if p.get("type") == "text" else json.dumps(p, sort_keys=True) for p in content
            )
        calls = json.dumps(m["tool_calls"], sort_keys=True) if m.get("tool_calls") else ""
        out.append(f"<|{m['role']}|>{content or ''}{calls}<|end|>")
    return "".join(out) + "<|assistant|>"


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cached(prompt: str, earlier: list[str]) -> int:
    """The longest common prefix of ``prompt`` with any earlier prompt (0 when none)."""
    return max((common_prefix(prompt, e) for e in earlier), default=0)


class Replay:
    """Runs a sequence of requests through a rule set three ways (off, memory, stateless) and keeps the
    rendered prompts, so each request's cached prefix can be compared."""

    def __init__(
        self, ruleset: RuleSet, memory: TranscriptMemory | None = None, scope: str = "model\0tenant"
    ):
        self.ruleset = ruleset
        self.memory = memory if memory is not None else TranscriptMemory()
        self.scope = scope
        self.prompts: dict[str, list[str]] = {"off": [], "on": [], "stateless": []}
        self.rows: list[dict[str, int]] = []
        self.canonicals: list[Canonical] = []

    def send(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Canonical:
        on = self.ruleset.apply(messages, tools, memory=self.memory, scope=self.scope)
        stateless = self.ruleset.apply(messages, tools)
        row = {}
        for way, (msgs, tls) in {
            "off": (messages, tools),
            "on": (on.messages, on.tools),
            "stateless": (stateless.messages, stateless.tools),
        }.items():
            prompt = render(msgs, tls)
            row[way] = cached(prompt, self.prompts[way])
            self.prompts[way].append(prompt)
        self.rows.append(row)
        self.canonicals.append(on)
        return on


def tool_turn(turn: int, results: list[str], text: str | None = None) -> list[dict[str, Any]]:
    """An assistant message with one tool call per result, then the results (parallel calls when > 1)."""
    ids = [f"call_{turn}_{i}" for i in range(len(results))]
    calls = [
        {"id": i, "type": "function", "function": {"name": "read", "arguments": json.dumps({"n": n})}}
        for n, i in enumerate(ids)
    ]
    return [
        {"role": "assistant", "content": text, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": i, "content": r} for i, r in zip(ids, results, strict=True)),
    ]
