"""The write-back queue: blocks evicted from the RAM pool are written down by one background thread.

The step thread only copies the evicted block's KV out of the pool (it is about to be overwritten) and
offers it here. ``offer`` never waits: when the queue holds ``capacity`` blocks the new one is dropped and
counted (``writeback.dropped``); a dropped block is simply not in the tiers (a later miss recomputes it).
Serialization, checksums and every tier write run on the writer thread. A handler that raises is counted
(``writeback.errors``) and the thread goes on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.kv_tiers.counters import TierCounters
from engine.openmp_threads import serial_torch_thread

log = logging.getLogger(__name__)

T = TypeVar("T")
_STOP = object()


class WriteBackQueue(Generic[T]):
    """A bounded queue drained by one daemon thread that calls ``handler(item)`` for each item.

    Args:
        capacity: most items waiting (>= 1).
        handler: called on the writer thread, one item at a time.
        counters: where ``writeback.queued`` / ``writeback.dropped`` / ``writeback.errors`` are counted.
        idle: housekeeping called on the writer thread when a burst of items is done (the queue empty after
            one) and every ``idle_s`` seconds without items; its failures are counted as ``writeback.errors``.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(
        self,
        capacity: int,
        handler: Callable[[T], None],
        counters: TierCounters,
        idle: Callable[[], None] | None = None,
        idle_s: float = 5.0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"write-back capacity must be >= 1, got {capacity}")
        self._q: queue.Queue = queue.Queue(capacity)
        self._handler = handler
        self._idle = idle
        self.idle_s = idle_s
        self.counters = counters
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-writeback", daemon=True)
        self._thread.start()

    def offer(self, item: T) -> bool:
        """Queue ``item`` without waiting. Returns False (counted as dropped) when full or closed."""
        if self._closed:
            self.counters.add("writeback.dropped")
            return False
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.counters.add("writeback.dropped")
            return False
        self.counters.add("writeback.queued")
        return True

    def full(self) -> bool:
        """True when an ``offer`` now would be dropped."""
        return self._closed or self._q.full()

    def depth(self) -> int:
        """Items waiting now."""
        return self._q.qsize()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued item is handled. Returns False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._q.all_tasks_done:
            while self._q.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._q.all_tasks_done.wait(left)
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Handle what is queued, then stop the thread (later offers are dropped)."""
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        serial_torch_thread()  # its copies never start an OpenMP team (engine.openmp_threads)
        while True:
            try:
                item = self._q.get(timeout=None if self._idle is None else self.idle_s)
            except queue.Empty:
                self._housekeep()
                continue
            try:
                if item is _STOP:
                    return
                self._handler(item)
            except Exception:  # the writer must outlive any one bad write
                self.counters.add("writeback.errors")
                log.exception("write-back failed")
            finally:
                self._q.task_done()
            if self._q.empty():
                self._housekeep()

    def _housekeep(self) -> None:
        if self._idle is None:
            return
        try:
            self._idle()
        except Exception:  # as a write: counted, the thread goes on
            self.counters.add("writeback.errors")
            log.exception("write-back housekeeping failed")
