"""Miss counters: by cause, missed tokens by cause, by segment."""

from __future__ import annotations

from gateway.service.miss_counters import MissCounters
from gateway.service.miss_explanation import MissExplanation


def test_counters_by_cause() -> None:
    counters = MissCounters()
    counters.add(MissExplanation(112, 112, False))
    counters.add(MissExplanation(32, 112, True, "volatile", "system", 40, None, None, "local"))
    counters.add(MissExplanation(0, 112, True, "cold", "tools", 0, None, None, "local"))
    counters.add(MissExplanation(32, 112, True, "volatile", "system", 41, None, None, "local"))
    snap = counters.snapshot()
    assert (snap["requests"], snap["hits"], snap["misses"]) == (4, 1, 3)
    assert snap["by_cause"] == {
        "volatile": 2,
        "tools_changed": 0,
        "system_changed": 0,
        "history_rewritten": 0,
        "reply_cut": 0,
        "evicted": 0,
        "other_replica": 0,
        "cold": 1,
        "below_minimum": 0,
    }
    assert snap["missed_tokens_by_cause"]["volatile"] == 160 and snap["missed_tokens_by_cause"]["cold"] == 112
    assert snap["by_segment"] == {"tools": 1, "system": 2, "documents": 0, "history": 0, "tail": 0}
