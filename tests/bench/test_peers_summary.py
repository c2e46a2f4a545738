"""bench.peers' one figure per workload: W4 is the mean of every turn (the issue's definition), the rest the
median of their runs."""

from __future__ import annotations

from bench.peers import summary


def test_w4_is_the_mean_of_every_turn_cold_round_included():
    turns = [0.5] * 4 + [0.125] * 8  # a cold round of the four prompts, then two warm ones
    assert summary("w4_alternating", turns) == 0.25  # not a warm turn's 0.125


def test_other_workloads_take_the_median():
    assert summary("w1_cold_ttft", [3.0, 1.0, 2.0, 100.0]) == 2.5
    assert summary("w3_decode_b1", [140.0, 150.0, 10.0]) == 140.0
