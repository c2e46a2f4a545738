"""rules.bounded_lru: entries and summed costs stay within their limits, least recently used goes first."""

import pytest

from rules.bounded_lru import BoundedLRU


def _chars(key: str, value: str) -> tuple[int, int]:
    return len(key), len(value)


def test_evicts_least_recently_used_down_to_every_limit() -> None:
    memo: BoundedLRU[str, str] = BoundedLRU(3, (10, 100), _chars)
    for key in ("ab", "cd", "ef"):
        memo.put(key, key.upper())
    assert memo.get("ab") == "AB"  # "ab" is now the most recently used: "cd" goes first
    memo.put("gh", "GH")
    assert memo.keys() == ["ef", "ab", "gh"]
    memo.put("ijklmn", "x")  # 4 entries > 3 and 2 + 2 + 2 + 6 = 12 characters > 10: "ef" goes
    assert memo.keys() == ["ab", "gh", "ijklmn"]
    assert memo.totals == (10, 5)
    memo.check()


def test_an_entry_over_a_limit_alone_is_not_kept() -> None:
    memo: BoundedLRU[str, str] = BoundedLRU(8, (5, 5), _chars)
    memo.put("ab", "c")
    memo.put("too long", "v")
    assert len(memo) == 0 and memo.totals == (0, 0)
    memo.check()


def test_first_value_stays_and_hits_and_misses_are_counted() -> None:
    memo: BoundedLRU[str, str] = BoundedLRU(4, (100, 100), _chars)
    assert memo.get("k") is None
    memo.put("k", "one")
    memo.put("k", "two")
    assert memo.get("k") == "one"
    assert (memo.hits, memo.misses, memo.totals) == (1, 1, (1, 3))


def test_negative_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="limits must be >= 0"):
        BoundedLRU(-1, (1,), _chars)
    with pytest.raises(ValueError, match="limits must be >= 0"):
        BoundedLRU(1, (-1,), _chars)


def test_get_or_compute_computes_once_and_stores_only_when_told() -> None:
    memo: BoundedLRU[str, str] = BoundedLRU(4, (100, 100), _chars)
    calls: list[str] = []

    def compute() -> str:
        calls.append("x")
        return "value"

    assert memo.get_or_compute("k", compute) == memo.get_or_compute("k", compute) == "value"
    assert memo.get_or_compute("big", compute, store=False) == "value"
    assert (len(calls), memo.keys(), memo.hits, memo.misses) == (2, ["k"], 1, 2)
