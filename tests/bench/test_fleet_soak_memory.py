"""The soak's RSS measures (``bench.fleet.soak``: slope, second half, quarters) and the leak diagnosis'
native counters (``bench.fleet.memtrace``)."""

from __future__ import annotations

import gc

import pytest

from bench.fleet.memtrace import _mallinfo_mb, _smaps_mb
from bench.fleet.soak import _by_quarter, _slope_per_min


def test_slope_is_mb_per_minute_and_a_plateau_shows_in_the_second_half_and_the_quarters():
    rising = [(t, 500.0 + 0.1 * t) for t in range(0, 600, 2)]  # 0.1 MB/s = 6 MB/min
    assert _slope_per_min(rising) == pytest.approx(6.0)
    assert _slope_per_min(rising[:2]) == 0.0  # fewer than 3 samples
    # A cache filling up: 6 MB/min for the first half, then flat.
    plateau = [(t, 500.0 + 0.1 * min(t, 300)) for t in range(0, 600, 2)]
    second_half = [s for s in plateau if s[0] >= 300]
    assert _slope_per_min(second_half) == pytest.approx(0.0)
    assert _slope_per_min([s for s in plateau if s[0] >= 150]) > 1.0  # the overall warm slope hides it
    assert _by_quarter(plateau, 600) == [507.4, 522.4, 530.0, 530.0]
    assert _by_quarter([(10.0, 1.0), (460.0, 3.0)], 600) == [1.0, 3.0]  # empty quarters left out


def test_native_counters_see_a_large_malloc_and_split_rss_by_mapping():
    # The counters are the whole process's: in one pytest process after the engine tests, a cyclic collection
    # set off by the allocation below could free earlier tests' large buffers between the two reads.
    gc.collect()
    gc.disable()
    try:
        before = _mallinfo_mb()
        assert set(before) == {"arena", "in_use", "free", "mmapped"}
        block = bytearray(64 << 20)  # over glibc's largest mmap threshold (32 MiB): its own mapping, unless
        after = _mallinfo_mb()  # the heap's top chunk already has 64 MiB free (earlier tests' freed buffers)
    finally:
        gc.enable()
    grown = after["mmapped"] - before["mmapped"] + after["in_use"] - before["in_use"]
    assert grown >= 63.0
    del block
    smaps = _smaps_mb()
    assert set(smaps) == {"heap", "anon", "file"} and smaps["file"] > 0  # the interpreter's own binary
