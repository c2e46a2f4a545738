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
        cpu: CPU model name with its family, model and widest vector instructions (``cpu_model``), so records
            from different machine kinds behind one model name (a VM's ``AMD EPYC``) stay apart.
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


_EXTRAS = (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("amx_tile", "AMX"))


def vector_isa(flags: set[str]) -> str:
    """The widest x86 vector instruction set in ``flags`` (``/proc/cpuinfo`` names): ``AVX-512`` with its
    VNNI / BF16 / AMX extensions in parentheses, ``AVX2``, or ``no AVX2``."""
    if "avx512f" in flags:
        extras = [name for flag, name in _EXTRAS if flag in flags]
        return "AVX-512" + (f" ({', '.join(extras)})" if extras else "")
    return "AVX2" if "avx2" in flags else "no AVX2"


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name, family, model and vector instructions from ``/proc/cpuinfo``'s first processor
    (``cpuinfo``: that file's text, read when None), e.g. ``AMD EPYC (family 25 model 1, AVX2)``; else
    ``platform.processor()`` or ``unknown CPU``."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for row in cpuinfo.splitlines():
        if not row.strip():
            break  # the first processor only
        key, sep, value = row.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name")
    if not name:
        return platform.processor() or "unknown CPU"
    parts = []
    if "cpu family" in fields and "model" in fields:
        parts.append(f"family {fields['cpu family']} model {fields['model']}")
    if "flags" in fields:
        parts.append(vector_isa(set(fields["flags"].split())))
    return f"{name} ({', '.join(parts)})" if parts else name


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
