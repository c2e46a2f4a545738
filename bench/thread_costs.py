"""What one streamed token costs each thread of ``prefixgate serve``, A/B over HTTP (``python -m bench.thread_costs``).

Starts one ``prefixgate serve`` per ``NAME=DIR`` checkout (``bench.serving.start_server``: the peers bench's engine
settings, the default model), then streams the same greedy ~1,070-token-context chat completion (``bench.serving``'s
b1) to each in turn, order alternating, ``--repeats`` times. Around each request it reads, for every thread of the
server, ``/proc/PID/task/TID/schedstat`` (CPU time and time runnable but waiting for a core, nanoseconds) and
``/proc/PID/task/TID/sched`` (voluntary and involuntary context switches), and prints medians per decoded token:

- the step thread (the server thread with the most CPU in the request that is not the main thread): CPU,
  run-queue wait, ``blocked`` (the request's wall time minus both: waiting for the GIL, or idle between the
  request's arrival and its first step), switches;
- the event loop (the main thread): CPU, run-queue wait, switches;
- the client (this process: httpx, one JSON parse per chunk): CPU; and the client's decode rate.

CPU and switch counts move less with other processes' load than rates do (docs/serving-path.md, "Session 10").
Linux only (``/proc``). Run it under the bench lock (``flock /work/wt/bench.lock``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.peers import STORY, system_text
from bench.serving import messages, own_cpu, start_server, stream_chat
from engine.checkpoint import default_model_path


@dataclass(frozen=True)
class ThreadSched:
    """One thread's scheduler counters (``/proc/PID/task/TID/schedstat`` and ``sched``).

    Attributes:
        cpu_s: seconds on a CPU.
        runq_s: seconds runnable but waiting for a CPU.
        voluntary: context switches the thread asked for (it blocked).
        involuntary: context switches forced on it (preempted).
    """

    cpu_s: float
    runq_s: float
    voluntary: int
    involuntary: int

    def __sub__(self, other: ThreadSched) -> ThreadSched:
        return ThreadSched(
            self.cpu_s - other.cpu_s,
            self.runq_s - other.runq_s,
            self.voluntary - other.voluntary,
            self.involuntary - other.involuntary,
        )


ZERO = ThreadSched(0.0, 0.0, 0, 0)


def read_threads(pid: int) -> dict[int, ThreadSched]:
    """``ThreadSched`` of every thread of process ``pid`` (thread id -> counters); threads that end while they
    are read are left out.

    Raises:
        FileNotFoundError: no process ``pid``.
    """
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            cpu_ns, runq_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
            fields = {}
            for line in (task / "sched").read_text().splitlines():
                name, sep, value = line.partition(":")
                if sep:
                    fields[name.strip()] = value.strip()
            out[int(task.name)] = ThreadSched(
                cpu_ns / 1e9,
                runq_ns / 1e9,
                int(fields["nr_voluntary_switches"]),
                int(fields["nr_involuntary_switches"]),
            )
        except (OSError, KeyError, ValueError):
            continue
    return out


def per_token(
    pid: int,
    before: dict[int, ThreadSched],
    after: dict[int, ThreadSched],
    wall_s: float,
    client_cpu_s: float,
    tokens: int,
) -> dict[str, float]:
    """The figures of one request, per decoded token (milliseconds, or counts): see the module docstring.

    Raises:
        ValueError: ``tokens`` < 1, or no thread but the main one.
    """
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    diff = {tid: after[tid] - before.get(tid, ZERO) for tid in after}
    others = [tid for tid in diff if tid != pid]
    if not others:
        raise ValueError(f"process {pid} has no thread besides its main one")
    step = diff[max(others, key=lambda tid: diff[tid].cpu_s)]
    loop = diff.get(pid, ZERO)
    ms = 1e3 / tokens
    return {
        "step_cpu_ms": step.cpu_s * ms,
        "step_runq_ms": step.runq_s * ms,
        "step_blocked_ms": (wall_s - step.cpu_s - step.runq_s) * ms,
        "step_voluntary": step.voluntary / tokens,
        "step_involuntary": step.involuntary / tokens,
        "loop_cpu_ms": loop.cpu_s * ms,
        "loop_runq_ms": loop.runq_s * ms,
        "loop_voluntary": loop.voluntary / tokens,
        "loop_involuntary": loop.involuntary / tokens,
        "client_cpu_ms": client_cpu_s * ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--server", action="append", required=True, metavar="NAME=DIR", help="a checkout to serve"
    )
    ap.add_argument("--new", type=int, default=256, help="max_tokens of each request")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="prefixgate-thread-costs-"))
    gguf = default_model_path()
    servers = {}
    for spec in args.server:
        name, root = spec.split("=", 1)
        servers[name] = start_server(name, Path(root), gguf, args.threads, workdir)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    try:
        for s in servers.values():
            s.wait_ready()
        chat = messages(system_text(590, "serving"), STORY[0])
        for s in servers.values():  # warm-up: the system prompt cached in each
            stream_chat(s.url, chat, args.new, [], [])
        for i in range(args.repeats):
            for name in list(servers) if i % 2 == 0 else list(reversed(servers)):
                s = servers[name]
                events: list[float] = []
                before, c0, t0 = read_threads(s.proc.pid), own_cpu(), time.perf_counter()
                stream_chat(s.url, chat, args.new, events, [])
                wall, client = time.perf_counter() - t0, own_cpu() - c0
                row = per_token(s.proc.pid, before, read_threads(s.proc.pid), wall, client, len(events))
                row["rate_tok_s"] = (len(events) - 1) / (events[-1] - events[0])
                row["load"] = os.getloadavg()[0]
                rows[name].append(row)
    finally:
        for s in servers.values():
            s.stop()
    names = list(rows)
    print(f"per decoded token, median of {args.repeats} (ms, or counts)")
    print(f"{'':>18}" + "".join(f"{n:>12}" for n in names) + (f"{'ratio':>10}" if len(names) == 2 else ""))
    for key in rows[names[0]][0]:
        values = [statistics.median(r[key] for r in rows[n]) for n in names]
        ratio = f"{values[1] / values[0]:10.3f}" if len(values) == 2 and values[0] else ""
        print(f"{key:>18}" + "".join(f"{v:12.3f}" for v in values) + ratio)


if __name__ == "__main__":
    main()
