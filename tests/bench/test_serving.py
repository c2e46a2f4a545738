"""bench.serving's decode window: only events while every stream is decoding count."""

from __future__ import annotations

from bench.serving import Run


def test_one_stream_counts_the_events_after_its_first():
    run = Run(events=[[1.0, 1.5, 2.0, 3.0]], texts=["abcd"], wall_s=3.0, own_cpu_s=0.0)
    assert run.decode_rate() == 3 / 2.0


def test_several_streams_count_only_inside_the_shared_window():
    # window: the last first event (2.0) to the first last event (4.0); events at 3.0, 4.0, 3.5, 4.0 count
    run = Run(events=[[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.5, 4.0]], texts=["", ""], wall_s=5.0, own_cpu_s=0.0)
    assert run.decode_rate() == 4 / 2.0
