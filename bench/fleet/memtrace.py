"""Run a module under tracemalloc and dump what grew: the soak's leak diagnosis (``SOAK_MEMTRACE_DIR``).

``python -m bench.fleet.memtrace DIR MODULE [ARGS...]`` runs ``MODULE`` as ``__main__`` with ``ARGS``; a
daemon thread starts ``tracemalloc`` (8 frames) after ``SOAK_MEMTRACE_START_S`` seconds (default 60: past
the imports and the warm-up, so only what is allocated later is traced and start-up stays fast), then writes,
every ``SOAK_MEMTRACE_EVERY_S`` seconds (default 60), ``DIR/<pid>-<n>.snap`` (``tracemalloc.Snapshot.dump``) and appends one JSON line to
``DIR/<pid>.jsonl``: seconds since start, RSS MB, traced MB, ``gc.get_count()``, and the 15 object types
with the most live instances (``gc.get_objects``). Compare two snapshots with
``Snapshot.compare_to(old, "traceback")`` to see which lines allocated the growth.
"""

from __future__ import annotations

import collections
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


def _watch(out: Path, start_s: float, every_s: float) -> None:
    t0 = time.monotonic()
    time.sleep(start_s)
    tracemalloc.start(8)
    n = 0
    while True:
        time.sleep(every_s)
        n += 1
        tracemalloc.take_snapshot().dump(str(out / f"{os.getpid()}-{n}.snap"))
        types = collections.Counter(type(o).__name__ for o in gc.get_objects())
        line = {
            "t": round(time.monotonic() - t0, 1),
            "rss_mb": round(_rss_mb(), 1),
            "traced_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 2),
            "gc_count": gc.get_count(),
            "types": types.most_common(15),
        }
        with (out / f"{os.getpid()}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


def main() -> None:
    """Entry point: see the module docstring."""
    out, module, *args = sys.argv[1:]
    Path(out).mkdir(parents=True, exist_ok=True)
    start = float(os.environ.get("SOAK_MEMTRACE_START_S", "60"))
    every = float(os.environ.get("SOAK_MEMTRACE_EVERY_S", "60"))
    threading.Thread(target=_watch, args=(Path(out), start, every), daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
