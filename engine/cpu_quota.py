"""How many CPUs this process may use: its affinity mask and its cgroup's CPU quota (docs/engine-step.md, "Threads
beyond the CPU quota").

torch's default thread count follows the affinity mask (libgomp counts the CPUs ``sched_getaffinity`` allows) but
not a cgroup's CPU quota: a container limited to 2 CPUs on a 16-core host starts 16 OpenMP threads, and the
engine's steps run hundreds of parallel regions whose threads spin at each barrier while the quota keeps the
others off the CPU. So the served engine's default ``engine.num_threads`` is the smaller of torch's count and
``available_cpus()``, and a larger count asked for explicitly is logged as a warning.

The quota is read as Linux exposes it (kernel docs, "Control Group v2", ``cpu.max``; "CFS Bandwidth Control",
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` for cgroup v1): for the process's own cgroup (``/proc/self/cgroup``)
and every ancestor, the tightest limit wins; whole CPUs are counted (``quota // period``, at least 1), since a
thread beyond them would wait on the others at every barrier. A file that is missing, unreadable or malformed
counts as no limit: this only ever lowers a default.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("prefixgate.engine")

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup filesystems are mounted (v2 at the root, v1 controllers in subdirectories)."""
PROC_CGROUP = Path("/proc/self/cgroup")
"""The process's cgroup membership (``hierarchy-id:controllers:path`` lines; v2 is ``0::path``)."""
V1_CPU_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")
"""Directory names a v1 ``cpu`` controller is mounted under, below ``CGROUP_ROOT``."""


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs a process may use.

    Attributes:
        cpus: whole CPUs, >= 1: the affinity mask's count, lowered by the tightest CPU quota.
        affinity: CPUs in the affinity mask (``os.sched_getaffinity``; ``os.cpu_count()`` where it is missing).
        quota_cpus: the tightest quota in CPUs (``quota / period``, may be fractional), or None for no quota.
        quota_file: the file that quota came from, or None.
    """

    cpus: int
    affinity: int
    quota_cpus: float | None
    quota_file: Path | None

    def describe(self) -> str:
        """A phrase naming where the count comes from, for log lines."""
        if self.quota_file is None or self.quota_cpus is None or self.cpus >= self.affinity:
            return f"{_cpus(self.cpus)} in this process's affinity mask"
        return f"a CPU quota of {_cpus(self.quota_cpus)} ({self.quota_file})"


def _cpus(n: float) -> str:
    return f"{n:g} CPU" if n == 1 else f"{n:g} CPUs"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _v2_quota(directory: Path) -> float | None:
    """CPUs of ``directory/cpu.max`` (``"max 100000"``: none; ``"200000 100000"``: 2.0), None when absent or
    malformed."""
    text = _read(directory / "cpu.max")
    if text is None:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    """CPUs of ``cpu.cfs_quota_us / cpu.cfs_period_us`` in ``directory`` (quota -1: none), None when absent or
    malformed."""
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _ancestors(base: Path, relative: str) -> list[Path]:
    """``base / relative`` and each of its parents up to ``base`` (the mount's root), deepest first; a cgroup
    namespace shows the process at ``/`` while the mount is already its own cgroup, so ``base`` is always in."""
    parts = [p for p in relative.strip("/").split("/") if p and p != ".."]
    return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[float, Path] | None:
    """The tightest CPU quota over the process's cgroup and its ancestors, v2 and v1: ``(cpus, file)``, or None
    where there is none (or nothing can be read)."""
    text = _read(proc_cgroup)
    if text is None:
        return None
    found: list[tuple[float, Path]] = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, relative = fields
        if controllers == "":  # cgroup v2's unified hierarchy
            bases, read, name = [root], _v2_quota, "cpu.max"
        elif "cpu" in controllers.split(","):
            bases, read, name = [root / m for m in V1_CPU_MOUNTS], _v1_quota, "cpu.cfs_quota_us"
        else:
            continue
        for base in bases:
            for directory in _ancestors(base, relative):
                cpus = read(directory)
                if cpus is not None:
                    found.append((cpus, directory / name))
    return min(found, key=lambda f: f[0]) if found else None


def available_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CpuBudget:
    """The CPUs this process may use (``CpuBudget``): the affinity mask's count, lowered to the whole CPUs of the
    tightest cgroup quota, at least 1. Never raises."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    quota = cgroup_quota(root, proc_cgroup)
    cpus = affinity if quota is None else max(1, min(affinity, int(quota[0])))
    return CpuBudget(
        cpus=cpus,
        affinity=affinity,
        quota_cpus=None if quota is None else quota[0],
        quota_file=None if quota is None else quota[1],
    )


def engine_threads(configured: int | None, torch_threads: int, budget: CpuBudget) -> int:
    """The served engine's thread count: ``configured`` as given (a warning when it is more than ``budget.cpus``),
    else the smaller of ``torch_threads`` (torch's default) and ``budget.cpus`` (an info line when that is fewer
    than torch's)."""
    if configured is not None:
        if configured > budget.cpus:
            logger.warning(
                "engine.num_threads %d is more than the %s this process may use (%s): threads waiting at "
                "every parallel region's barrier for ones the CPU is not running slow each step "
                '(docs/engine-step.md, "Threads beyond the CPU quota")',
                configured,
                _cpus(budget.cpus),
                budget.describe(),
            )
        return configured
    if budget.cpus < torch_threads:
        logger.info(
            "engine.num_threads: %d, not torch's %d, for %s", budget.cpus, torch_threads, budget.describe()
        )
        return budget.cpus
    return torch_threads
