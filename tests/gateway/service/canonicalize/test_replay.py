"""Replay: a recorded trace through the real canonicalizer, common prefixes on vs off, broken lines skipped."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.service.canonicalize.prompt_tokenizers import Cl100kTokenizer, SmolLM2Tokenizer
from gateway.service.canonicalize.rendered_prompt import render_canonical
from gateway.service.canonicalize.replay import main, replay, rules_canonicalizer
from rules import RuleSet, load_ruleset
from rules.learned import SlotLearner


class CharTokenizer:
    """One token per character over a plain layout: exact, easy expected numbers."""

    name = "chars"

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        text = "".join(f"[{m['role']}]{m.get('content') or ''}|" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        return [ord(c) for c in text], list(range(len(text)))


SYSTEM = "You are Nova, the assistant of ACME Corp. Answer politely.\nCurrent date: 2026-12-01\nBe brief."


def conversation(turns: int) -> list[str]:
    """The body a chat client sends on each turn: the whole history every time."""
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    lines = []
    for turn in range(turns):
        history.append({"role": "user", "content": f"Question {turn}?"})
        lines.append(json.dumps({"model": "m", "messages": list(history)}))
        history.append(
            {"role": "assistant", "content": f"Answer {turn}: refunds are possible within 30 days."}
        )
    return lines


def test_broken_lines_are_reported_by_number_and_the_rest_goes_on() -> None:
    good = conversation(2)
    lines = [
        good[0],
        "{not json",
        "",
        "[1, 2]",
        json.dumps({"model": "m", "messages": "hello"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"model": "m", "messages": [{"role": 7, "content": "hi"}]}),
        json.dumps({"model": "m", "system": "s", "messages": [{"role": "robot", "content": "x"}]}),
        good[1],
    ]
    report = replay(lines, rules_canonicalizer(RuleSet()), CharTokenizer())
    assert [r.line for r in report.requests] == [1, 9]
    assert [(b.line, b.reason.split(":")[0].split(" (")[0]) for b in report.broken] == [
        (2, "not JSON"),
        (4, "not a JSON object"),
        (5, "wrong shape"),
        (6, "wrong shape"),
        (7, "wrong shape"),
        (8, "wrong shape"),
    ]
    assert report.broken[1].reason == "not a JSON object (a list)"
    assert report.broken[4].reason == "wrong shape: messages[0].role must be a string"
    assert report.totals()["broken"] == 6
    assert "line 2: skipped: not JSON" in report.table()


def test_common_prefix_in_characters_and_tokens_rules_on_and_off() -> None:
    lines = conversation(3)
    report = replay(lines, rules_canonicalizer(load_ruleset(["default"])), CharTokenizer())
    first, second, third = report.requests
    # rules off: each turn extends the previous prompt (its "[assistant]" generation prompt included)
    off_prompt_1 = len(f"[system]{SYSTEM}|[user]Question 0?|[assistant]")
    assert (first.off.common_chars, first.off.common_tokens) == (0, 0)
    assert first.off.prompt_chars == off_prompt_1
    assert second.off.common_chars == off_prompt_1 and second.off.common_tokens == off_prompt_1
    assert third.off.common_chars == second.off.prompt_chars
    assert (first.off.cause, first.off.at) == ("cold", "system:0")
    assert second.off.cause == "cold" and second.off.at == f"history:{off_prompt_1}"
    # rules on: history never moves, so each turn extends the previous canonical prompt as a whole
    assert second.on.common_chars == first.on.prompt_chars and third.on.common_chars == second.on.prompt_chars
    assert second.on.common_chars > second.off.common_chars
    # the replay's cache holds prompts, never replies: the previous reply is new content in the history, as
    # with the rules off (the first turn's hoisted block is history there, not the start of the tail)
    assert (second.on.cause, second.on.at) == ("cold", f"history:{first.on.prompt_tokens}")
    assert (third.on.cause, third.on.at) == ("cold", f"history:{second.on.prompt_tokens}")
    totals = report.totals()
    assert totals["turns_worse_than_off"] == 0
    assert totals["common_tokens_off"] == second.off.common_tokens + third.off.common_tokens
    assert totals["causes_on"]["history_rewritten"] == 0 and totals["causes_off"]["cold"] == 3


def test_canonicalize_is_injected_with_model_and_tenant() -> None:
    calls = []
    rules = RuleSet()

    def canonicalize(messages, tools, model, tenant):
        calls.append((model, tenant, len(messages)))
        return rules.apply(messages, tools)

    body = json.loads(conversation(1)[0])
    lines = [json.dumps({"protocol": "openai", "tenant": "acme", "body": body}), conversation(1)[0]]
    report = replay(lines, canonicalize, CharTokenizer())
    assert calls == [("m", "acme", 2), ("m", "", 2)]
    # tenants are separate: the second request shares nothing with the first
    assert report.requests[1].on.common_chars == 0


def test_tools_are_a_segment_and_a_change_is_tools_changed() -> None:
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    other = {"type": "function", "function": {"name": "browse", "parameters": {"type": "object"}}}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find it."}]
    lines = [
        json.dumps({"model": "m", "messages": messages, "tools": [tool]}),
        json.dumps({"model": "m", "messages": messages, "tools": [other]}),
    ]
    report = replay(lines, rules_canonicalizer(RuleSet()), Cl100kTokenizer())
    second = report.requests[1]
    assert second.off.cause == "tools_changed" and second.off.at.startswith("tools:")
    canon = RuleSet().apply(messages, [tool])
    rendered = render_canonical(canon, Cl100kTokenizer())
    assert [s.name for s in rendered.segments] == ["tools", "system", "tail"]
    assert rendered.text.startswith("<|tools|>\n")


class ToolsFirstTokenizer(CharTokenizer):
    """The engine's generic tool format's layout: the tools first in the system message (created when there is
    none), then a blank line and the system text."""

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        if tools:
            system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
            rest = messages[1:] if system is not None else messages
            head = "[system]" + json.dumps(tools) + ("\n\n" + system if system else "") + "|"
            return head + super().render(rest, None, add_generation_prompt)
        return super().render(messages, None, add_generation_prompt)


def test_a_system_text_added_after_tools_only_system_message_is_system_changed_not_tools_changed() -> None:
    tool = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
    ask = [{"role": "user", "content": "Find it."}]
    lines = [
        json.dumps({"model": "m", "messages": ask, "tools": [tool]}),
        json.dumps(
            {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, *ask], "tools": [tool]}
        ),
    ]
    report = replay(lines, rules_canonicalizer(RuleSet()), ToolsFirstTokenizer())
    assert report.requests[1].off.cause == "system_changed"
    # the rendered prompt's tools digest: the same tools give the same digest, none give b""
    canon = RuleSet().apply(ask, [tool])
    digest = render_canonical(canon, ToolsFirstTokenizer()).tools_digest
    assert len(digest) == 16
    assert render_canonical(RuleSet().apply(list(ask), [dict(tool)]), CharTokenizer()).tools_digest == digest
    other = {"type": "function", "function": {"name": "browse", "parameters": {"type": "object"}}}
    assert render_canonical(RuleSet().apply(ask, [other]), CharTokenizer()).tools_digest != digest
    assert render_canonical(RuleSet().apply(ask, None), CharTokenizer()).tools_digest == b""


@pytest.fixture(scope="module")
def smollm2() -> SmolLM2Tokenizer:
    return SmolLM2Tokenizer()


def test_default_model_tokens_extend_turn_by_turn_with_rules_off(smollm2) -> None:
    report = replay(conversation(3), tokenizer=smollm2)
    assert report.tokenizer == "smollm2"
    first, second, third = report.requests
    # ChatML: the previous prompt, generation prompt included, is a token prefix of the next one
    assert second.off.common_tokens == first.off.prompt_tokens
    assert third.off.common_tokens == second.off.prompt_tokens
    assert second.on.common_tokens >= second.off.common_tokens  # rules on never caches less than rules off
    rendered = render_canonical(RuleSet().apply(json.loads(conversation(2)[1])["messages"]), smollm2)
    assert [s.name for s in rendered.segments] == ["system", "history", "tail"]
    assert rendered.text[: len("<|im_start|>system\n")] == "<|im_start|>system\n"


def test_cli_prints_a_table_and_a_json_line(tmp_path, capsys) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(conversation(2) + ["oops"]) + "\n", encoding="utf-8")
    assert main([str(trace), "--tokenizer", "cl100k"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    totals = json.loads(out[-1])
    assert totals["requests"] == 2 and totals["broken"] == 1 and totals["tokenizer"] == "cl100k_base"
    assert any(line.startswith("line 3: skipped: not JSON") for line in out)
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main([str(trace), "--rules", str(tmp_path / "nope.yaml")]) == 2


def test_a_miss_inside_a_learned_slot_names_it() -> None:
    template = (
        "You are the concierge of the Grand Hotel. Greet guests warmly and answer questions about the hotel.\n"
        "Weather outside today: {w} as reported by the front desk.\n"
        "Never discuss other guests or their rooms with anyone, under any circumstances at all.\n"
    )
    weather = ["sunny", "rainy", "cloudy", "windy", "foggy"]
    lines = [
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": template.format(w=w)},
                    {"role": "user", "content": "Where is breakfast served?"},
                ],
            }
        )
        for w in weather
    ]
    learner = SlotLearner()
    report = replay(lines, rules_canonicalizer(load_ruleset(["default"])), CharTokenizer(), learner)
    (slot,) = learner.slots()
    at = len("[system]" + template.split("{w}")[0])
    # before the slot is learned, the changed weather is an edit of the system prompt; once it is, the slot
    # covers the divergence and names it (volatile is never guessed from the shape of an edit)
    causes = ["cold", "system_changed", "system_changed", "volatile", "volatile"]
    assert [r.on.cause for r in report.requests] == causes
    assert [r.on.at for r in report.requests[1:]] == [f"system:{at}"] * 2 + [f"system:{at} {slot['id']}"] * 2
    assert report.totals()["learned_slots"] == 1


def test_a_repeated_first_turn_whose_only_change_is_a_hoisted_time_is_volatile() -> None:
    # The trial: `prefixgate rules replay` labelled it `history_rewritten@tail:27` (after another conversation
    # whose first question was the same); the new time is a value the rules hoisted: `volatile`, the rule named.
    def line(messages: list[dict[str, Any]]) -> str:
        return json.dumps({"model": "m", "messages": messages})

    ask = {"role": "user", "content": "Name a fruit."}
    earlier = [{"role": "system", "content": "Terse."}, ask, {"role": "assistant", "content": "Apple."}, ask]
    timed = [[{"role": "system", "content": f"Terse. Current time: 05:0{t}:1{t}"}, ask] for t in range(3)]
    report = replay([line(earlier), *(line(m) for m in timed)], tokenizer=CharTokenizer())
    for request in report.requests[2:]:
        assert request.on.cause == "volatile", request.on
        assert request.on.at.startswith("tail:") and request.on.at.endswith(" dates.current-datetime-line")
    assert report.totals()["causes_on"]["history_rewritten"] == 0


def test_a_changed_system_prompt_with_a_hoisted_time_is_system_changed_not_a_hit() -> None:
    # The trial: turns whose system prompt changed ("Variant {t}") besides its hoisted time said `miss=none`:
    # the first turn's block (this request's time: the conversation was not remembered with this system
    # prompt) started the tail, so the history was not in the target. It is now, and the change is the miss.
    history: list[dict[str, Any]] = []
    lines = []
    for t in range(3):
        system = f"You are Nova, the terse assistant of ACME Corp. Variant {t}. Current time: 05:0{t}:1{t}."
        history.append({"role": "user", "content": f"Question {t}?"})
        lines.append(
            json.dumps({"model": "m", "messages": [{"role": "system", "content": system}, *history]})
        )
        history.append({"role": "assistant", "content": f"Answer {t}: refunds are possible within 30 days."})
    report = replay(lines, tokenizer=CharTokenizer())
    for request in report.requests[1:]:
        assert request.on.cause == "system_changed", request.on
        assert request.on.stable_tokens > request.on.common_tokens  # the history was in the target


def test_rules_off_a_changed_time_is_volatile_with_the_rule_named_as_the_gateway_says() -> None:
    # The trial: replay's "miss off" said `system_changed@system:28` for a system prompt whose only change was
    # `Current time: ...`, where the gateway with `x-prefixgate-rules: off` says `miss=volatile` and names the
    # rule (a rules-off request's known volatile values are what the rules would hoist).
    lines = [
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": f"You are Nova. Current time: 09:4{t}:12. Be brief."},
                    {"role": "user", "content": "Name a fruit."},
                ],
            }
        )
        for t in range(3)
    ]
    report = replay(lines, tokenizer=CharTokenizer())
    for request in report.requests[1:]:
        assert request.off.cause == "volatile", request.off
        assert request.off.at.startswith("system:") and " dates.current-" in request.off.at  # the rule
    # without the rules' values (none given with an injected canonicalize) the same change is system_changed
    plain = replay(lines, canonicalize=rules_canonicalizer(RuleSet()), tokenizer=CharTokenizer())
    assert plain.requests[1].off.cause == "system_changed"
