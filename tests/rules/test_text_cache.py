"""rules.text_cache: the memo of what one rule does to one text, and RuleSet.apply with it."""

from __future__ import annotations

import copy

from rules import RuleSet, load_ruleset
from rules.text_cache import TextActionCache


def test_a_stored_result_is_returned_without_recomputing():
    cache = TextActionCache()
    calls: list[str] = []

    def compute(text: str):
        calls.append(text)
        return text.upper(), 1, (text,)

    assert cache.get(0, "abc", compute) == ("ABC", 1, ("abc",))
    assert cache.get(0, "abc", compute) == ("ABC", 1, ("abc",))
    assert cache.get(1, "abc", compute) == ("ABC", 1, ("abc",))  # another rule: its own entry
    assert calls == ["abc", "abc"] and (cache.hits, cache.misses) == (1, 2)
    cache.check()


def test_the_cache_is_bounded_by_characters_and_skips_long_texts():
    cache = TextActionCache(max_chars=20, max_text_chars=8)
    same = lambda text: (text, 0, ())  # noqa: E731 - an unchanged text is held once
    for i in range(10):
        cache.get(0, f"text-{i:03d}", same)  # 8 characters each
    assert len(cache) == 2 and cache.chars == 16
    cache.get(0, "x" * 9, same)
    assert len(cache) == 2  # longer than max_text_chars: not stored
    changed = lambda text: (text + "!", 1, ())  # noqa: E731 - a rewritten text counts too
    cache.get(1, "abcd", changed)
    assert cache.chars <= 20
    cache.check()
    few = TextActionCache(max_entries=3)
    for i in range(10):
        few.get(0, str(i), same)
    assert len(few) == 3
    few.check()


def test_the_least_recently_used_entry_goes_first():
    cache = TextActionCache(max_chars=8)
    same = lambda text: (text, 0, ())  # noqa: E731
    cache.get(0, "aaaa", same)
    cache.get(0, "bbbb", same)
    cache.get(0, "aaaa", same)  # touched: bbbb is now the oldest
    cache.get(0, "cccc", same)
    misses = cache.misses
    cache.get(0, "aaaa", same)
    assert cache.misses == misses  # still there
    cache.get(0, "bbbb", same)
    assert cache.misses == misses + 1  # evicted
    cache.check()


REQUEST = [
    {"role": "system", "content": "You are a helpful bot. Current date: 2026-12-01. Session id: 7f3a9c2e-1b4d-4e8f-9a6b-0c5d2e1f3a4b."},
    {"role": "user", "content": "Hi, it is 09:45 here. What time is it in Tokyo?"},
    {"role": "assistant", "content": "It is 18:45 in Tokyo."},
    {"role": "user", "content": "Thanks! Request 1700000000123, please."},
]  # fmt: skip


def test_a_cached_ruleset_canonicalizes_exactly_as_a_fresh_one():
    warm = load_ruleset(["default"])
    for _ in range(3):
        first = warm.apply(copy.deepcopy(REQUEST)).to_dict()
    assert warm.text_cache.hits > 0
    fresh = RuleSet(warm.rules, warm.sources)
    assert fresh.apply(copy.deepcopy(REQUEST)).to_dict() == first
    assert first["applied"]  # the request does get rewritten
    for n in range(5):  # new user texts behind the same system prompt
        other = copy.deepcopy(REQUEST)
        other[-1]["content"] = f"Question {n} at 10:0{n}, id {n}f3a9c2e-1b4d-4e8f-9a6b-0c5d2e1f3a4b"
        got = warm.apply(copy.deepcopy(other)).to_dict()
        assert got == RuleSet(warm.rules, warm.sources).apply(copy.deepcopy(other)).to_dict()
    assert warm.history_memo.hits >= 5  # new last questions: the first turn comes from the history memo
    first_turn = copy.deepcopy(REQUEST[:2])
    first_turn[1]["content"] = "Another first question at 11:15."
    got = warm.apply(copy.deepcopy(first_turn)).to_dict()
    assert got == RuleSet(warm.rules, warm.sources).apply(copy.deepcopy(first_turn)).to_dict()
    assert warm.pass_cache.hits > 0  # a new first turn: the system prompt's passes come from the pass memo
    warm.text_cache.check()
    warm.pass_cache.check()


def test_scopes_never_share_an_entry():
    """A memo hit is faster than a scan: across tenants it would be a timing side channel, so a result stored
    under one scope (model + tenant) is never returned under another."""
    cache = TextActionCache()
    calls: list[str] = []

    def compute(text: str):
        calls.append(text)
        return text.upper(), 1, ()

    cache.get(0, "secret", compute, scope="m\0tenant-a")
    cache.get(0, "secret", compute, scope="m\0tenant-b")
    assert calls == ["secret", "secret"] and cache.hits == 0
    cache.get(0, "secret", compute, scope="m\0tenant-a")
    assert cache.hits == 1 and len(calls) == 2


def _misses(rules: RuleSet) -> int:
    """Memo misses of a rule set (results computed): per rule and text, and per whole pass and text."""
    return rules.text_cache.misses + rules.pass_cache.misses


def test_ruleset_apply_keeps_each_tenants_memo_apart():
    alone = load_ruleset(["default"])
    alone.apply(copy.deepcopy(REQUEST), scope="m\0tenant-b")
    own_misses = _misses(alone)  # what a first request computes with nothing in the memo
    rules = load_ruleset(["default"])
    rules.apply(copy.deepcopy(REQUEST), scope="m\0tenant-a")
    misses = _misses(rules)
    other = rules.apply(copy.deepcopy(REQUEST), scope="m\0tenant-b")
    assert _misses(rules) - misses == own_misses  # tenant B's first request finds nothing of tenant A's
    misses = _misses(rules)
    again = rules.apply(copy.deepcopy(REQUEST), scope="m\0tenant-b")
    assert _misses(rules) - misses == 0  # its own second request finds everything
    assert other.to_dict() == again.to_dict()
    rules.text_cache.check()
    rules.pass_cache.check()


def test_the_pass_plan_memo_gives_what_planning_afresh_gives_and_stays_bounded(monkeypatch) -> None:
    from rules import turn_rules as turn_rules_module

    ruleset = load_ruleset(["default"])
    messages = [
        {"role": "system", "content": "You are a bot. Today is 2026-12-01 09:45:12."},
        {"role": "user", "content": "Session 6f1c9a2e-0b7d-4f7a-9c1e-2a4b8d0e1f3a: what now?"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And at 10:15:00?"},
    ]
    fresh = load_ruleset(["default"]).apply(messages).to_dict()
    assert ruleset.apply(messages).to_dict() == fresh
    assert ruleset.turns._plans  # the plans were kept
    assert ruleset.apply(messages).to_dict() == fresh  # and give the same result when taken from the memo
    monkeypatch.setattr(turn_rules_module, "PLAN_MEMO_ENTRIES", 2)
    for n in range(6):  # conversations of different lengths choose different messages
        ruleset.apply(
            messages[:1]
            + [{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": "a"}] * n
            + messages[1:2]
        )
        assert len(ruleset.turns._plans) <= 2
