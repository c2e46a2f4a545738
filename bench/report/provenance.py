"""Where and when a report was measured: CPU model, cores, load, date, git commit; one line for every plot."""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path


@dataclass(frozen=True)
class Provenance:
    """The machine and the code a report was measured on.

    Attributes:
        cpu: CPU model name (``/proc/cpuinfo``'s ``model name``; ``platform.processor()`` elsewhere).
        cores: logical CPUs (``os.cpu_count``).
        load: 1-minute load average at the start (``os.getloadavg``), -1.0 where unknown.
        date: UTC date and time of the run (ISO 8601, minutes).
        commit: ``git rev-parse --short HEAD`` of the checkout (``+dirty`` with uncommitted changes), or
            ``unknown`` outside a git checkout.
    """

    cpu: str
    cores: int
    load: float
    date: str
    commit: str

    def line(self) -> str:
        """One line for a plot's subtitle: ``AMD EPYC, 2 cores (load 3.1) | 2026-12-01 18:40 UTC | abc1234``."""
        return f"{self.cpu}, {self.cores} cores (load {self.load:.1f}) | {self.date} | commit {self.commit}"

    def as_dict(self) -> dict[str, object]:
        """The fields, for the JSON lines."""
        return asdict(self)


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else ``platform.processor()`` or ``unknown CPU``."""
    try:
        for row in Path("/proc/cpuinfo").read_text().splitlines():
            if row.startswith("model name"):
                return row.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def git_commit(root: Path) -> str:
    """Short commit of the checkout at ``root``, ``+dirty`` when tracked files changed; ``unknown`` without git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def collect(root: Path) -> Provenance:
    """The provenance of a run starting now, for the checkout at ``root``."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = -1.0
    return Provenance(
        cpu=cpu_model(),
        cores=os.cpu_count() or 1,
        load=load,
        date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        commit=git_commit(root),
    )
