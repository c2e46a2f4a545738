"""Rate-limited warnings of a tier's failed operations.

A tier that fails, fails for every block (Redis at ``maxmemory``, a full disk): one request evicting 80 blocks
logged 80 warnings. ``FailureLog`` logs the first failure of each cause with its reason, then counts the next
ones and logs at most one summary line per ``interval_s`` (the count and the latest reason), from the next
failure or from ``flush`` (the writer thread's housekeeping) once the interval has passed. Every failure is
still counted in the tier's counters (``engine.kv_tiers.counters``); this only bounds the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Cause:
    last_line: float
    pending: int = 0
    latest: str = ""


class FailureLog:
    """Warnings of one tier's failures: the first per cause, then at most one summary per ``interval_s``.

    Args:
        logger: where the lines go (WARNING).
        tier: the tier's name, at the start of every line.
        interval_s: shortest time between two lines of one cause.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(
        self,
        logger: logging.Logger,
        tier: str,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.tier = tier
        self.interval_s = interval_s
        self.clock = clock
        self._causes: dict[str, _Cause] = {}
        self._lock = threading.Lock()

    def failed(self, cause: str, error: object) -> None:
        """One failure of ``cause`` (e.g. ``"write failed"``) for ``error`` (its reason)."""
        now = self.clock()
        with self._lock:
            state = self._causes.get(cause)
            if state is None:
                self._causes[cause] = _Cause(now)
                line = (
                    f"{self.tier} tier: {cause}: {error} (the next ones are summed up at most every "
                    f"{self.interval_s:g}s)"
                )
            else:
                state.pending += 1
                state.latest = str(error)
                line = self._summary(cause, state, now)
        if line is not None:
            self.logger.warning("%s", line)

    def flush(self) -> None:
        """Log the summary of every cause whose interval has passed with failures not yet logged."""
        now = self.clock()
        with self._lock:
            lines = [self._summary(cause, state, now) for cause, state in self._causes.items()]
        for line in lines:
            if line is not None:
                self.logger.warning("%s", line)

    def _summary(self, cause: str, state: _Cause, now: float) -> str | None:
        if state.pending == 0 or now - state.last_line < self.interval_s:
            return None
        line = (
            f"{self.tier} tier: {cause}: {state.pending} more in the last {now - state.last_line:.0f}s "
            f"(latest: {state.latest})"
        )
        state.last_line, state.pending = now, 0
        return line
