"""engine.bounded_memo: entries and the summed key size stay within their bounds, least recently used goes first,
and ``put`` reports what it evicted so a caller's per-scope counts stay in step."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.bounded_memo import BoundedMemo


def _chars(key: tuple[str, str]) -> int:
    return len(key[1])


def test_capacity_in_entries_evicts_least_recently_used() -> None:
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(3, 1_000, _chars)
    for i, text in enumerate(("ab", "cd", "ef")):
        assert memo.put(("s", text), i) == []
    assert memo.get(("s", "ab")) == 0  # now the most recently used: "cd" goes first
    assert memo.put(("s", "gh"), 3) == [("s", "cd")]
    assert list(memo) == [("s", "ef"), ("s", "ab"), ("s", "gh")]
    assert len(memo) == 3 and memo.size == 6 and ("s", "cd") not in memo
    memo.check()


def test_capacity_in_size_evicts_until_the_sum_fits() -> None:
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(100, 10, _chars)
    for text in ("aaaa", "bbb", "cc"):
        memo.put(("s", text), 1)
    assert memo.size == 9
    assert memo.put(("s", "dddddd"), 1) == [("s", "aaaa"), ("s", "bbb")]  # 15 -> 11 -> 8
    assert list(memo) == [("s", "cc"), ("s", "dddddd")] and memo.size == 8
    memo.check()


def test_an_entry_over_the_size_bound_alone_is_evicted_by_its_own_put() -> None:
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(8, 5, _chars)
    memo.put(("s", "ab"), 1)
    assert memo.put(("s", "too long"), 2) == [("s", "ab"), ("s", "too long")]
    assert len(memo) == 0 and memo.size == 0
    memo.check()


def test_zero_entries_holds_nothing() -> None:
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(0, 100, _chars)
    assert memo.put(("s", "a"), 1) == [("s", "a")]
    assert len(memo) == 0 and memo.get(("s", "a")) is None


def test_get_misses_do_not_reorder_and_hits_do() -> None:
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(2, 100, _chars)
    memo.put(("s", "a"), 1)
    memo.put(("s", "b"), 2)
    assert memo.get(("s", "zz")) is None
    assert list(memo) == [("s", "a"), ("s", "b")]
    assert memo.get(("s", "a")) == 1
    assert list(memo) == [("s", "b"), ("s", "a")]


def test_put_of_a_held_key_keeps_it_unless_replace() -> None:
    memo: BoundedMemo[tuple[str, str], str] = BoundedMemo(3, 100, _chars)
    memo.put(("s", "a"), "first")
    memo.put(("s", "b"), "b")
    assert memo.put(("s", "a"), "second") is None  # held: nothing stored, nothing moved, nothing evicted
    assert list(memo) == [("s", "a"), ("s", "b")] and memo.get(("s", "b")) == "b"
    assert memo.get(("s", "a")) == "first"
    memo.get(("s", "b"))
    assert memo.put(("s", "a"), "third", replace=True) is None  # replaced and made the most recently used
    assert list(memo) == [("s", "b"), ("s", "a")]
    assert memo.get(("s", "a")) == "third" and memo.size == 2
    memo.check()


def test_pop_and_clear_keep_the_size() -> None:
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(4, 100, _chars)
    memo.put(("s", "abc"), 1)
    memo.put(("t", "de"), 2)
    assert memo.pop(("s", "abc")) == 1 and memo.size == 2
    assert memo.pop(("s", "abc")) is None and memo.size == 2
    memo.check()
    memo.clear()
    assert len(memo) == 0 and memo.size == 0 and list(memo) == []
    memo.check()


def test_evicted_keys_keep_a_callers_scope_counts_in_step() -> None:
    """The way ``engine.served_turns`` counts the turns held per scope: +1 per new key, -1 per evicted key."""
    memo: BoundedMemo[tuple[str, str], int] = BoundedMemo(3, 12, _chars)
    per_scope: Counter[str] = Counter()
    puts = [
        ("a", "xx"),
        ("b", "yyy"),
        ("a", "zzzz"),
        ("c", "w"),
        ("a", "xx"),
        ("b", "vvvvvvvvvv"),
        ("c", "u" * 20),
    ]
    for key in puts:
        evicted = memo.put(key, 0)
        if evicted is None:
            continue
        per_scope[key[0]] += 1
        for scope, _ in evicted:
            per_scope[scope] -= 1
        memo.check()
        held = Counter(scope for scope, _ in memo)
        assert +per_scope == held  # the counts equal the turns held in each scope
    assert ("c", "u" * 20) not in memo and per_scope["c"] == 0


@pytest.mark.parametrize("bounds", [(-1, 10), (10, -1)])
def test_negative_bounds_are_refused(bounds: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="bounds must be >= 0"):
        BoundedMemo(*bounds, _chars)


def test_a_none_value_is_refused() -> None:
    memo: BoundedMemo[tuple[str, str], int | None] = BoundedMemo(4, 100, _chars)
    with pytest.raises(ValueError, match="must not be None"):
        memo.put(("s", "a"), None)
    assert len(memo) == 0 and memo.size == 0
