"""engine.host_memory: freed activation buffers are reused from the heap, and the engine asks for it on CPU."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

import engine.llm_engine as llm_engine
from engine.host_memory import is_glibc, tune_host_allocator
from tests.engine.engine_helpers import make_engine

BUFFER_BYTES = 48 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): mmapped afresh when untuned
PAGE = resource.getpagesize()


def _alloc_touch_free() -> None:
    t = torch.empty(BUFFER_BYTES, dtype=torch.uint8)
    t.fill_(1)  # writes every page
    del t


@pytest.mark.skipif(not sys.platform.startswith("linux") or not is_glibc(), reason="glibc malloc only")
def test_a_freed_buffer_comes_back_without_page_faults() -> None:
    assert tune_host_allocator() is True
    assert tune_host_allocator() is True  # idempotent
    _alloc_touch_free()  # grows the heap once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _alloc_touch_free()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # a fresh mmap would fault on each of its 12,288 pages; the reused heap block faults on none of them
    assert faults < BUFFER_BYTES // PAGE // 10, faults


def test_the_engine_tunes_the_allocator_on_cpu_unless_told_not_to(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(llm_engine, "tune_host_allocator", lambda: calls.append(1) or True)
    make_engine()
    assert calls == [1]
    make_engine(tune_host_allocator=False)
    assert calls == [1]
