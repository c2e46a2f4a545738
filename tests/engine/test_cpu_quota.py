"""``engine.cpu_quota``: the CPUs a process may use, from its affinity mask and its cgroup's CPU quota (v2
``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), and the served engine's default thread count.

Fake cgroup trees under ``tmp_path``: a quota on the process's cgroup, on an ancestor only, the tightest of
several, none (``max``, ``-1``), fractional quotas counted in whole CPUs (at least 1), a namespaced ``/`` path,
malformed and missing files as no limit; then ``engine_threads``' choice and its log lines, and
``AsyncEngine.from_config`` applying it to torch's thread count.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from engine import cpu_quota
from engine.cpu_quota import CpuBudget, available_cpus, cgroup_quota, engine_threads


def tree(root: Path, files: dict[str, str], membership: str) -> Path:
    """Write ``files`` (relative path -> text) under ``root`` and a ``/proc/self/cgroup`` of ``membership``."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    proc = root / "proc-self-cgroup"
    proc.write_text(membership)
    return proc


def test_v2_quota_of_the_own_cgroup(tmp_path):
    proc = tree(tmp_path, {"app/web/cpu.max": "200000 100000\n"}, "0::/app/web\n")
    assert cgroup_quota(tmp_path, proc) == (2.0, tmp_path / "app/web/cpu.max")


def test_v2_the_tightest_ancestor_wins(tmp_path):
    files = {"app/cpu.max": "150000 100000\n", "app/web/cpu.max": "max 100000\n", "cpu.max": "400000 100000"}
    proc = tree(tmp_path, files, "0::/app/web\n")
    assert cgroup_quota(tmp_path, proc) == (1.5, tmp_path / "app/cpu.max")


def test_a_namespaced_process_reads_its_own_mount(tmp_path):
    # inside a container with a cgroup namespace: "0::/" and the mount root is the container's cgroup
    proc = tree(tmp_path, {"cpu.max": "50000 100000"}, "0::/\n")
    assert cgroup_quota(tmp_path, proc) == (0.5, tmp_path / "cpu.max")


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_v1_quota_under_either_mount_name(tmp_path, mount):
    files = {
        f"{mount}/docker/abc/cpu.cfs_quota_us": "300000\n",
        f"{mount}/docker/abc/cpu.cfs_period_us": "100000\n",
    }
    proc = tree(tmp_path, files, "4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n")
    assert cgroup_quota(tmp_path, proc) == (3.0, tmp_path / mount / "docker/abc/cpu.cfs_quota_us")


@pytest.mark.parametrize(
    ("files", "membership"),
    [
        ({"cpu.max": "max 100000"}, "0::/\n"),  # v2, no limit
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, "1:cpu:/\n"),  # v1, no limit
        ({"cpu.max": "lots 100000"}, "0::/\n"),  # malformed
        ({"cpu.max": "100000"}, "0::/\n"),  # one field
        ({"cpu.max": "0 100000"}, "0::/\n"),  # no positive quota
        ({"cpu/cpu.cfs_quota_us": "200000"}, "1:cpu:/\n"),  # the period missing
        ({}, "0::/app\n"),  # no files at all
        ({"cpu.max": "100000 100000"}, "garbage line\n5:memory:/x\n"),  # no cpu controller named
    ],
)
def test_no_limit_or_an_unreadable_one_is_none(tmp_path, files, membership):
    assert cgroup_quota(tmp_path, tree(tmp_path, files, membership)) is None


def test_no_proc_file_is_none(tmp_path):
    assert cgroup_quota(tmp_path, tmp_path / "absent") is None


@pytest.mark.parametrize(("quota", "cpus"), [("50000 100000", 1), ("150000 100000", 1), ("250000 100000", 2)])
def test_whole_cpus_of_the_quota_and_at_least_one(tmp_path, monkeypatch, quota, cpus):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    budget = available_cpus(tmp_path, tree(tmp_path, {"cpu.max": quota}, "0::/\n"))
    assert (budget.cpus, budget.affinity) == (cpus, 16)
    assert "CPU quota" in budget.describe() and "cpu.max" in budget.describe()


def test_one_cpu_is_named_in_the_singular():
    budget = CpuBudget(cpus=1, affinity=8, quota_cpus=1.0, quota_file=Path("cpu.max"))
    assert budget.describe() == "a CPU quota of 1 CPU (cpu.max)"
    assert CpuBudget(cpus=1, affinity=1, quota_cpus=None, quota_file=None).describe() == (
        "1 CPU in this process's affinity mask"
    )


def test_the_affinity_mask_bounds_a_looser_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    budget = available_cpus(tmp_path, tree(tmp_path, {"cpu.max": "800000 100000"}, "0::/\n"))
    assert budget.cpus == 2 and budget.quota_cpus == 8.0
    assert budget.describe() == "2 CPUs in this process's affinity mask"


def test_this_machine_reads_without_error():
    budget = available_cpus()
    assert 1 <= budget.cpus <= budget.affinity == len(os.sched_getaffinity(0))


BUDGET_2 = CpuBudget(cpus=2, affinity=16, quota_cpus=2.0, quota_file=Path("/sys/fs/cgroup/cpu.max"))


def test_the_default_is_lowered_to_the_budget_with_a_line_saying_why(caplog):
    with caplog.at_level(logging.INFO, logger="prefixgate.engine"):
        assert engine_threads(None, 16, BUDGET_2) == 2
    assert (
        "engine.num_threads: 2, not torch's 16, for a CPU quota of 2 CPUs (/sys/fs/cgroup/cpu.max)"
        in caplog.text
    )


def test_a_default_within_the_budget_is_kept_silently(caplog):
    with caplog.at_level(logging.INFO, logger="prefixgate.engine"):
        assert engine_threads(None, 2, BUDGET_2) == 2
    assert caplog.text == ""


def test_a_configured_count_is_kept_and_one_beyond_the_budget_warned(caplog):
    with caplog.at_level(logging.INFO, logger="prefixgate.engine"):
        assert engine_threads(1, 16, BUDGET_2) == 1
        assert caplog.text == ""
        assert engine_threads(4, 16, BUDGET_2) == 4
    assert (
        "engine.num_threads 4 is more than the 2 CPUs this process may use (a CPU quota of 2 CPUs "
        "(/sys/fs/cgroup/cpu.max))" in caplog.text
    )
    assert caplog.records[-1].levelno == logging.WARNING


def test_the_served_engine_applies_the_budget_to_torch(monkeypatch):
    from engine.api import EngineConfig
    from engine.async_engine import AsyncEngine

    before = torch.get_num_threads()
    budget = CpuBudget(cpus=1, affinity=before, quota_cpus=1.0, quota_file=Path("cpu.max"))
    monkeypatch.setattr(cpu_quota, "available_cpus", lambda: budget)
    seen = {}

    def stop(*args, **kwargs):  # the load: record torch's count when it starts, then stop
        seen["threads"] = torch.get_num_threads()
        raise RuntimeError("stop here")

    monkeypatch.setattr("engine.checkpoint.load_checkpoint", stop)
    try:
        with pytest.raises(RuntimeError, match="stop here"):
            AsyncEngine.from_config(None, "default", EngineConfig())
        assert seen["threads"] == 1
    finally:
        torch.set_num_threads(before)
