"""Run a module under tracemalloc and dump what grew: the soak's leak diagnosis (``SOAK_MEMTRACE_DIR``).

``python -m bench.fleet.memtrace DIR MODULE [ARGS...]`` runs ``MODULE`` as ``__main__`` with ``ARGS``; a
daemon thread starts ``tracemalloc`` (``SOAK_MEMTRACE_FRAMES`` frames, default 8; 0: no tracemalloc and no
snapshots, only the native and object counts below, so the RSS curve is not tracemalloc's own) after
``SOAK_MEMTRACE_START_S`` seconds (default 60: past the imports and the warm-up, so only what is allocated
later is traced and start-up stays fast), then writes, every ``SOAK_MEMTRACE_EVERY_S`` seconds (default 60),
``DIR/<pid>-<n>.snap`` (``tracemalloc.Snapshot.dump``) and appends one JSON line to ``DIR/<pid>.jsonl``:
seconds since start, RSS MB, traced MB, ``gc.get_count()``, the live objects counted by ``gc.get_objects``
(containers only: ``str``, ``bytes`` and numbers are not tracked), the 15 object types with the most live
instances, the native side (glibc's ``mallinfo2``: MB in use and free in the malloc arenas and in mmapped
chunks; ``/proc/self/smaps``: RSS of the main heap, of anonymous mappings (thread arenas, pymalloc arenas,
large mmaps) and of files; thread and file descriptor counts) and the 8 source lines whose traced memory
grew most since the first snapshot. Compare two snapshots with ``Snapshot.compare_to(old, "traceback")``
to see the full tracebacks.

Native attribution: with ``SOAK_MEMTRACE_MEMRAY_S=W`` (and ``memray`` importable, e.g. ``pip install
--target DIR memray`` with DIR on ``PYTHONPATH``) a memray ``Tracker`` with native stacks records from the
start time for ``W`` seconds into ``DIR/<pid>.memray`` (aggregated format); what it allocated and still
held at the end (``FileReader.get_leaked_allocation_records``, ``memray flamegraph --leaks``) is the
growth, C++ frames included (this is how the soak's growth was found to be oneDNN primitives:
docs/routing.md). gdb-based attaching (``heaptrack -p``, ``memray attach``) fails on this machine's
kernel ("Couldn't write extended state status"), hence the in-process tracker.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import runpy
import sys
import threading
import time
import tracemalloc
from pathlib import Path


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33; every field a ``size_t``, bytes or counts)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost",
        )
    ]  # fmt: skip


def _mallinfo_mb() -> dict[str, float]:
    """glibc malloc in MB: ``arena`` (sbrk'd and arena heaps), ``in_use`` (``uordblks``), ``free``
    (``fordblks``: held by malloc, not given back), ``mmapped`` (``hblkhd``); empty where not glibc >= 2.33."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return {}
    fn.restype = _MallInfo2
    m = fn()
    return {
        k: round(v / 2**20, 1)
        for k, v in (("arena", m.arena), ("in_use", m.uordblks), ("free", m.fordblks), ("mmapped", m.hblkhd))
    }


def _smaps_mb() -> dict[str, float]:
    """RSS in MB of the ``[heap]`` mapping, of anonymous mappings (glibc's thread arenas, large mallocs,
    thread stacks) and of file-backed mappings (``/proc/self/smaps``)."""
    out = {"heap": 0.0, "anon": 0.0, "file": 0.0}
    kind = "anon"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(
                ":"
            ):  # a mapping's header: "start-end perms off dev inode [path]"
                parts = line.split()
                path = parts[5] if len(parts) > 5 else ""
                kind = "heap" if path == "[heap]" else ("file" if path.startswith("/") else "anon")
            elif head == "Rss:":
                out[kind] += int(line.split()[1]) / 1024
    return {k: round(v, 1) for k, v in out.items()}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _watch(out: Path, start_s: float, every_s: float, frames: int) -> None:
    t0 = time.monotonic()
    time.sleep(start_s)
    if frames > 0:
        tracemalloc.start(frames)
    n = 0
    first: tracemalloc.Snapshot | None = None
    while True:
        time.sleep(every_s)
        n += 1
        snap = tracemalloc.take_snapshot() if frames > 0 else None
        if snap is not None:
            snap.dump(str(out / f"{os.getpid()}-{n}.snap"))
        objects = gc.get_objects()
        types = collections.Counter(type(o).__name__ for o in objects)
        grew = []
        if snap is None:
            pass
        elif first is not None:
            for stat in snap.compare_to(first, "lineno")[:8]:
                frame = stat.traceback[0]
                grew.append(
                    [f"{frame.filename}:{frame.lineno}", round(stat.size_diff / 2**20, 3), stat.count_diff]
                )
        else:
            first = snap
        line = {
            "t": round(time.monotonic() - t0, 1),
            "rss_mb": round(_rss_mb(), 1),
            "traced_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
            "malloc_mb": _mallinfo_mb(),
            "smaps_mb": _smaps_mb(),
            "threads": _status("Threads"),
            "fds": len(os.listdir("/proc/self/fd")),
            "gc_count": gc.get_count(),
            "objects": len(objects),
            "types": types.most_common(15),
            "grew_since_first": grew,
        }
        del objects
        with (out / f"{os.getpid()}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


def _memray_window(out: Path, start_s: float, window_s: float) -> None:
    """Track native and Python allocations with memray (``native_traces``, aggregated format) from
    ``start_s`` to ``start_s + window_s`` seconds after start; what was allocated in the window and is still
    live at its end (the growth) is then ``memray flamegraph --leaks DIR/<pid>.memray`` or ``memray
    summary``."""
    import memray  # optional: only with SOAK_MEMTRACE_MEMRAY_S (pip install memray, anywhere on PYTHONPATH)

    time.sleep(start_s)
    tracker = memray.Tracker(
        str(out / f"{os.getpid()}.memray"),
        native_traces=True,
        file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS,
    )
    with tracker:
        time.sleep(window_s)


def main() -> None:
    """Entry point: see the module docstring."""
    out, module, *args = sys.argv[1:]
    Path(out).mkdir(parents=True, exist_ok=True)
    start = float(os.environ.get("SOAK_MEMTRACE_START_S", "60"))
    every = float(os.environ.get("SOAK_MEMTRACE_EVERY_S", "60"))
    frames = int(os.environ.get("SOAK_MEMTRACE_FRAMES", "8"))
    threading.Thread(target=_watch, args=(Path(out), start, every, frames), daemon=True).start()
    window = float(os.environ.get("SOAK_MEMTRACE_MEMRAY_S", "0"))
    if window > 0:
        threading.Thread(target=_memray_window, args=(Path(out), start, window), daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
