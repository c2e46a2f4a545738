"""Which threads own OpenMP worker teams (issue 12; docs/engine-step.md, "One OpenMP team per process").

libgomp, the OpenMP runtime torch and the native kernels share, keeps a team of worker threads for each thread
that ever ran a parallel region on more than one thread, for as long as that thread lives. Once a process
holds more such workers than it has CPUs, libgomp stops spinning between regions ("throttled" waiting): every
parallel region then wakes its workers through a futex, tens of microseconds in a VM, and a decode step runs
hundreds of regions. Measured on a 2-core AMD EPYC (Zen 4): a 1,536 x 576 int4 GEMV on two threads took 37 us
from a thread that owned the only team and 109-123 us once the main thread also owned one (it had loaded the
model); the served engine decoded 8 streams at 153-171 tokens/s against 104-128.

So, in a served process, only the engine's step thread runs multi-threaded regions:

- ``in_passing_thread`` runs start-up work (loading the checkpoint, packing weights, the kernels' self-checks)
  in a thread that ends when it returns, and its workers end with it;
- ``serial_torch_thread`` makes the other threads that call torch (KV tier prefetch and write-back, the grammar
  mask worker) run its ops on one thread, so they never start a team.

Invariant: nothing here changes a result; thread counts only decide who computes what (the kernels' outputs do
not depend on them: ``engine.step_threads``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

_DEFAULT_THREADS = torch.get_num_threads()
"""Torch's intra-op thread count when this module was first imported, before any engine ran a step."""


def default_threads() -> int:
    """Torch's own thread count for this process: its count when this module was first imported (by
    ``engine.async_engine`` or ``engine.constrained``, before any engine is built).

    Not the live count (``torch.get_num_threads``): the step thread of an engine sets that step by step
    (``engine.model_runner.use_threads``; a thread with no OpenMP team of its own writes libgomp's process-wide
    value), so an engine built after another had run (a second model, a benchmark's next arm) took the count of
    that engine's last step. Measured (2-core AMD EPYC, SmolLM2): the second engine of a process ran on 1 of
    the 2 threads and served the same five requests in 1.6 s against 1.0 s."""
    return _DEFAULT_THREADS


def in_passing_thread(fn: Callable[[], T], name: str = "prefixgate-load") -> T:
    """Run ``fn()`` in a new thread, wait for it and return its value (or raise its exception here).

    The thread's OpenMP workers (started by torch's or a native kernel's parallel regions inside ``fn``) end
    with it, so the calling thread, and the process, hold no team afterwards. The new thread starts with
    torch's process-wide thread count (``torch.set_num_threads`` sets it).

    Raises:
        BaseException: whatever ``fn`` raised, unchanged.
    """
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def serial_torch_thread() -> None:
    """Make the calling thread run torch's CPU ops on one thread (no OpenMP team of its own).

    torch initializes a thread's count from its process-wide value on the thread's first parallel op, and the
    step thread changes that value step by step (``engine.model_runner.use_threads``); reading the count first
    does that initialization now, so the 1 set next is the one this thread keeps.
    """
    torch.get_num_threads()
    torch.set_num_threads(1)
