"""bench.thread_costs: the /proc scheduler counters of a process's threads, and the per-token figures."""

from __future__ import annotations

import os
import threading

import pytest

from bench.thread_costs import ThreadSched, per_token, read_threads


def test_read_threads_sees_this_process_and_a_thread_it_starts():
    started, stop = threading.Event(), threading.Event()

    def wait() -> None:
        started.set()
        stop.wait()

    worker = threading.Thread(target=wait)
    worker.start()
    started.wait()
    try:
        threads = read_threads(os.getpid())
        assert os.getpid() in threads and worker.native_id in threads
        assert threads[os.getpid()].cpu_s > 0
    finally:
        stop.set()
        worker.join()
    with pytest.raises(FileNotFoundError):
        read_threads(2**22 + 1)  # above the kernel's largest pid


def test_per_token_takes_the_busiest_other_thread_as_the_step_thread():
    before = {
        10: ThreadSched(1.0, 0.5, 5, 1),
        11: ThreadSched(2.0, 1.0, 10, 0),
        12: ThreadSched(0.0, 0.0, 0, 0),
    }
    after = {
        10: ThreadSched(1.2, 0.7, 45, 3),
        11: ThreadSched(3.0, 1.5, 20, 20),
        12: ThreadSched(0.1, 0.0, 1, 0),
    }
    row = per_token(10, before, after, wall_s=2.0, client_cpu_s=0.1, tokens=10)
    assert row["step_cpu_ms"] == pytest.approx(100.0)  # thread 11: 1.0 s over 10 tokens
    assert row["step_runq_ms"] == pytest.approx(50.0)
    assert row["step_blocked_ms"] == pytest.approx(50.0)  # 2.0 - 1.0 - 0.5 s
    assert (row["step_voluntary"], row["step_involuntary"]) == (1.0, 2.0)
    assert row["loop_cpu_ms"] == pytest.approx(20.0) and row["loop_voluntary"] == 4.0
    assert row["client_cpu_ms"] == pytest.approx(10.0)


def test_per_token_refuses_no_tokens_and_a_lone_main_thread():
    one = {10: ThreadSched(1.0, 0.0, 0, 0)}
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        per_token(10, one, one, 1.0, 0.0, 0)
    with pytest.raises(ValueError, match="no thread besides its main one"):
        per_token(10, one, one, 1.0, 0.0, 5)
